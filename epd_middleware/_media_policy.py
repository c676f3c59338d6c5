"""The PD server's own media policy (``--allowed-media-domains``, ``--allowed-local-media-path``), applied
before any encoder call.

Encoders fetch the media URLs they are sent, and the engine then sees only a reference: vLLM's own checks
on the PD server never run for media the middleware encodes remotely. So the middleware applies them
itself, to the letter of vLLM 0.32's ``MediaConnector.load_from_url`` (``multimodal/media/connector.py``),
and refuses what the PD server would refuse, with vLLM's message. urllib3's ``parse_url`` is the parser
vLLM uses: the same URL must name the same host here and there. Encoders need the same flags for media
they fetch on a request that reaches them otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.request import url2pathname

import anyio.to_thread

from ._rawjson import Raw, raw_text, text_of

__all__ = ["MediaPolicy"]


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    """``allowed_domains``: hosts an http(s) URL may name (empty: any). ``local_root``: the resolved
    directory file:// URLs must lie under (None: no local files)."""

    allowed_domains: tuple[str, ...] = ()
    local_root: Path | None = None

    async def refusal(self, url: str | Raw) -> str | None:
        """vLLM's message refusing ``url`` on this server, or None when it would load it."""
        if isinstance(url, Raw):
            if bytes(raw_text(url)[:5]).lower() == b"data:":
                return None  # a long data URL stays undecoded
            url = str(text_of(url))
        if url[:5].lower() == "data:":
            return None
        from urllib3.util import parse_url  # vLLM's parser; imported where a policy applies

        try:
            spec = parse_url(url)
        except ValueError as exc:  # LocationParseError: vLLM lets it out as a 400 too
            return str(exc)
        if spec.scheme and spec.scheme.startswith("http"):
            if self.allowed_domains and spec.hostname not in self.allowed_domains:
                return (
                    f"The URL must be from one of the allowed domains: {list(self.allowed_domains)}. "
                    f"Input URL domain: {spec.hostname}"
                )
            return None
        if spec.scheme == "file":
            if self.local_root is None:
                return "Cannot load local files without `--allowed-local-media-path`."
            path = Path(url2pathname((spec.netloc or "") + (spec.path or "")))
            try:
                # resolve() follows symlinks on the file system (a shared one may be slow): off the loop.
                resolved = await anyio.to_thread.run_sync(path.resolve)
            except ValueError as exc:
                # "embedded null byte" (%00 in the URL): vLLM's own resolve() raises it, answered 400.
                return str(exc)
            if self.local_root not in resolved.parents:
                # vLLM names the directory and then masks it (sanitize_message): it is not named here.
                return f"The file path {path} must be a subpath of `--allowed-local-media-path`."
            return None
        return "The URL must be either a HTTP, data or file URL."
