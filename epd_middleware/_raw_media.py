"""Media on routes the middleware does not intercept, on a server whose engine cannot encode it.

A Mooncake consumer's engine waits for a push of every multimodal item it has not cached, whether or not
anyone was asked to push it (:attr:`~epd_middleware.host.Host.local_encoding_blocker`). Media sent to one
of vLLM's other routes that run the engine on it (embeddings, pooling, scoring, Cohere's API, audio
transcription, a surface this deployment does not intercept) would wait the whole push wait there and
fail with a bare 500, holding a place in the engine meanwhile. Such a request is refused at once, in
OpenAI's shape, with the reason; a request without media passes untouched.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ._protocol import MEDIA_KEYS
from .errors import EPDError

__all__ = ["MediaNotServedHere", "carries_media", "refusal"]

_DATA_MEDIA = ("data:image", "data:audio", "data:video")
# Far deeper than any request these routes take; a body nested deeper is walked no further (vLLM refuses
# it anyway).
_MAX_DEPTH = 64


class MediaNotServedHere(EPDError):
    """Media on a route whose engine here cannot encode it."""

    status = 501


def refusal(path: str, content_type: bytes | None, body: bytes, blocker: str) -> MediaNotServedHere | None:
    """Why the request to ``path`` is refused on a server that cannot encode media (``blocker`` says
    why), or None when it carries none. A multipart body is an upload (audio transcription): media."""
    kind = (content_type or b"").lower().split(b";", 1)[0].strip()
    if kind == b"multipart/form-data" or carries_media(body):
        return MediaNotServedHere(
            f"{path} cannot take media on this server: {blocker}. Send images, audio and video through "
            "the routes whose media goes to the encoders (chat completions, Messages, Responses)"
        )
    return None


def carries_media(body: bytes) -> bool:
    """Whether a JSON body holds media: a data URL of an image, audio or video anywhere, or a value under
    a key that takes media (a content part, a reference, Cohere's ``images``). A body that is not JSON
    holds none the engine would read."""
    if not (_DATA.search(body) or b"\\u" in body or any(token in body for token in _KEY_TOKENS)):
        return False
    try:
        value: Any = json.loads(body)
    except (ValueError, RecursionError):
        return False
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, str):
            if node[:10].lower().startswith(_DATA_MEDIA):
                return True
        elif depth < _MAX_DEPTH and isinstance(node, dict):
            for key, item in node.items():
                if key in MEDIA_KEYS and item is not None:
                    return True
                stack.append((item, depth + 1))
        elif depth < _MAX_DEPTH and isinstance(node, list):
            stack.extend((item, depth + 1) for item in node)
    return False


_KEY_TOKENS = tuple(f'"{key}"'.encode() for key in MEDIA_KEYS)
# vLLM takes the scheme in any case (``url[:5].lower() == "data:"``).
_DATA = re.compile(rb"(?i)data:")
