"""Who is at fault when a call to an encoder or a prefill server fails: the server, or the request.

Shared encoders belong to every client, so a failure counts against a server (towards its ejection) only
where the evidence says the server is at fault. A status alone does not: vLLM answers 500 when the image
host a client named does not resolve, and 501 to a data URL that is not base64, on every server alike.
One request's failed calls are judged together, in a :class:`Ledger`:

- **The request is at fault** where vLLM's answer says so or several servers agree:
  - a rejection (400, 404, 413, 422 ...: the server's own words about the request);
  - 501: vLLM answers it only for a ``NotImplementedError`` (``entrypoints/serve/exception_handling/
    error_response.py``), which request content raises (``multimodal/media/connector.py``
    ``_load_data_url``: "Only base64 data URLs are supported for now.");
  - a 5xx whose message names a host of the request's own media, on two servers: their fetches of it
    failed (aiohttp's "Cannot connect to host H:P ...", "Connection timeout to host URL", "500,
    message=..., url=URL"; vLLM passes those on as 500, ``multimodal/media/connector.py``
    ``_wrap_media_fetch_error``). On one server alone it is not enough: a server whose own DNS or
    egress is down says the same of every URL. So the first such failure counts against nobody
    (``media``) and the call is tried on another server; the same failure there is the request's, a
    success there was the first server's trouble; with no other server to try, the request's;
  - 401 or 403 to the client's own key (``forward_authorization``);
  - the same failure (status and vLLM's message, or a timeout) on a second server, which proves healthy
    on its own (its ``/health`` and a canary encode of a tiny built-in image, :mod:`._canary`; a proof
    is good for a while): two servers broken the same way are not mistaken for a bad request.
  The client then gets vLLM's own answer (status, message, type), the call goes to no further server,
  and the failure the first server was counted for is taken back.
- **Nobody** where nothing was sent (this process's own slots on the server stayed taken).
- **The server** otherwise, but a request costs at most one server one failure (``capped`` after that):
  however its failures look, one client's request cannot count against the whole pool.

Even then a server leaves the pool only once ejection is confirmed independently of the requests
(:func:`._probes.confirm_failing`: its ``/health`` and a canary encode of a tiny built-in image).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import urlsplit

from ._rawjson import Raw, raw_text
from .errors import (
    RequestTimedOut,
    UpstreamError,
    UpstreamRejected,
    UpstreamStatusError,
    UpstreamTimeout,
    VllmError,
)

if TYPE_CHECKING:
    from ._surfaces import MediaPart

__all__ = ["BLAMES", "Ledger", "Verdict"]

# Every verdict a failed call can get, as metrics and the status page count them. ``retracted``: a
# failure first counted against a server, taken back once the same request failed the same way on another.
# ``media``: a fetch of the request's own media failed on one server, counted against nobody, tried on
# another. (``suspect`` is a verdict on the way, never counted: :meth:`Ledger.settle` turns it into one of
# these.)
BLAMES = ("server", "request", "credentials", "capped", "none", "retracted", "media")

# vLLM answers 501 only for a NotImplementedError, raised by what the request asks for.
_NOT_IMPLEMENTED = 501
# Statuses vLLM's AuthenticationMiddleware (and a proxy in front of it) gives to a key it refuses.
_CREDENTIAL_STATUSES = frozenset({401, 403})
# A URL's scheme and authority sit in its first bytes; a long one is cut to this before it is parsed.
_URL_HEAD = 2048


class Verdict(NamedTuple):
    """Who is at fault for one failed call (one of :data:`BLAMES`), and the error that stands for it:
    the failure itself, or the request's own answer when the request is at fault (never retried).
    ``retract``: the server whose failure was counted for this request and is now taken back."""

    blame: str
    error: UpstreamError
    retract: str | None = None


class _Failed(NamedTuple):
    role: str
    server: str
    # What makes two failures "the same": status and vLLM's message, or a timeout; None: not comparable
    # (a refused connection or a bad answer is never the request's doing).
    signature: tuple[object, ...] | None
    counted: bool


class Ledger:
    """One request's failed calls, judged together across its encoder and prefill calls. Made per
    request; every call of it runs on one event loop, so it needs no lock."""

    __slots__ = ("_failed", "_hosts", "_media", "credentials_forwarded")

    def __init__(self, media: Sequence[MediaPart] = (), *, credentials_forwarded: bool = False) -> None:
        self._media = media
        self._hosts: frozenset[str] | None = None
        self._failed: list[_Failed] = []
        # The calls carry the client's own Authorization header (forward_authorization).
        self.credentials_forwarded = credentials_forwarded

    def judge(self, server: str, failure: UpstreamError) -> Verdict:
        """The verdict on ``failure`` of a call to ``server``. ``suspect``: this request failed the
        same way on another server; whether that makes it the request's fault is for :meth:`settle`
        to say, once the server is known to be healthy or not on its own."""
        if not failure.retryable:
            return Verdict("request", failure)
        if not failure.blames_server:
            return Verdict("none", failure)
        at_fault = self._request_at_fault(failure)
        if at_fault is not None:
            return at_fault
        signature = _signature(failure)
        again = signature is not None and any(
            earlier.role == failure.role and earlier.server != server and earlier.signature == signature
            for earlier in self._failed
        )
        if self._fetch_failed(failure):
            if again:  # two servers could not fetch it, naming the request's own host
                return Verdict("request", self.final(failure))
            self._failed.append(_Failed(failure.role, server, signature, False))
            return Verdict("media", failure)
        if again:
            return Verdict("suspect", failure)
        return self._count(server, failure, signature)

    def final(self, failure: UpstreamError) -> UpstreamError:
        """The error a call answers with when no server is left to try after ``failure``: the request's
        own answer where it is a failed fetch of the request's media (no other server said otherwise),
        else ``failure`` itself."""
        if isinstance(failure, UpstreamStatusError) and self._fetch_failed(failure):
            return _rejected(failure, failure.detail, "the request's own media could not be fetched")
        return failure

    def settle(self, server: str, failure: UpstreamError, *, server_healthy: bool) -> Verdict:
        """The verdict on a ``suspect`` failure: the request's, where ``server`` is healthy on its own
        (the failure the earlier server was counted for is then taken back); else the server's."""
        signature = _signature(failure)
        if not server_healthy:
            return self._count(server, failure, signature)
        retract = None
        for index, earlier in enumerate(self._failed):
            if earlier.role == failure.role and earlier.signature == signature and earlier.counted:
                retract = earlier.server
                self._failed[index] = earlier._replace(counted=False)
        self._failed.append(_Failed(failure.role, server, signature, False))
        servers = len({entry.server for entry in self._failed if entry.signature == signature})
        return Verdict("request", _same_failure(failure, servers), retract)

    def _count(self, server: str, failure: UpstreamError, signature: tuple[object, ...] | None) -> Verdict:
        counted = not any(entry.counted for entry in self._failed)
        self._failed.append(_Failed(failure.role, server, signature, counted))
        return Verdict("server" if counted else "capped", failure)

    def _request_at_fault(self, failure: UpstreamError) -> Verdict | None:
        if not isinstance(failure, UpstreamStatusError):
            return None
        status, detail = failure.status_code, failure.detail
        if status in _CREDENTIAL_STATUSES and self.credentials_forwarded:
            said = detail or VllmError("the client's API key was refused")
            return Verdict("credentials", _rejected(failure, said, "the client's own key, forwarded"))
        if status == _NOT_IMPLEMENTED:
            return Verdict("request", _rejected(failure, detail, "vLLM's answer to what it cannot do"))
        return None

    def _fetch_failed(self, failure: UpstreamError) -> bool:
        """Whether ``failure`` is a server error whose vLLM message names a host of the request's media:
        that server's fetch of it failed."""
        if not isinstance(failure, UpstreamStatusError) or failure.status_code < 500:
            return False
        detail = failure.detail
        return detail is not None and self._names_own_media(detail.message)

    def _names_own_media(self, message: str) -> bool:
        """Whether vLLM's error message names a host of this request's media (aiohttp's messages name
        the host or the URL it failed to fetch)."""
        if self._hosts is None:
            self._hosts = _media_hosts(self._media)
        if not self._hosts:
            return False
        said = message.lower()
        return any(f"host {host}:" in said or f"://{host}" in said for host in self._hosts)


def _signature(failure: UpstreamError) -> tuple[object, ...] | None:
    if isinstance(failure, UpstreamStatusError):
        detail = failure.detail
        return ("status", failure.status_code, detail.message if detail is not None else None)
    if isinstance(failure, UpstreamTimeout):
        return ("timeout",)
    return None


def _rejected(failure: UpstreamStatusError, detail: VllmError | None, evidence: str) -> UpstreamRejected:
    return UpstreamRejected(failure.server, failure.status_code, detail, role=failure.role, evidence=evidence)


def _same_failure(failure: UpstreamError, servers: int) -> UpstreamError:
    evidence = f"the same failure on {servers} {failure.role}s"
    if isinstance(failure, UpstreamStatusError):
        return _rejected(failure, failure.detail, evidence)
    timed_out = RequestTimedOut(
        failure.server, f"{failure.reason}, on {servers} {failure.role}s for this request", role=failure.role
    )
    timed_out.message = (
        f"this request timed out on {servers} {failure.role}s ({failure.reason} on each): its media may "
        "not be readable in time; it is not tried on more"
    )
    return timed_out


def _media_hosts(media: Sequence[MediaPart]) -> frozenset[str]:
    """The hosts of the request's http(s) media URLs, lower-case."""
    hosts = set()
    for part in media:
        url = part.url
        if url is None:
            continue
        if isinstance(url, Raw):
            url = bytes(raw_text(url)[:_URL_HEAD]).decode("utf-8", "replace")
        head = url[:_URL_HEAD]
        if head[:4].lower() != "http":
            continue
        try:
            host = urlsplit(head).hostname
        except ValueError:
            continue
        if host:
            hosts.add(host.lower())
    return frozenset(hosts)
