"""Media on routes the middleware does not intercept, on a server whose engine cannot encode it.

A Mooncake consumer's engine waits for a push of every multimodal item it has not cached, whether or not
anyone was asked to push it (:attr:`~epd_middleware.host.Host.local_encoding_blocker`). Media sent to one
of vLLM's other routes that run the engine on it (embeddings, pooling, scoring, Cohere's API, audio
transcription, the structured decisions API, the token-in generate route, realtime audio over a
websocket, a surface this deployment does not intercept) would wait the whole push wait there and fail
with a bare 500, holding a place in the engine meanwhile. Such a request is refused at once, in OpenAI's
shape, with the reason and its request id; a request without media passes untouched.

Which routes: the one the running app's router takes the request to (its POST routes, mounts and
websockets, matched as the router matches them: path parameters, mounts, routes added since start),
less those known to hand the engine no media (:data:`~._protocol.NO_MEDIA_ROUTES`), so a route the next
vLLM adds is guarded without a change here; where the app's routes cannot be read, vLLM 0.32's media
routes (:data:`~._protocol.MEDIA_ROUTES`, :data:`~._protocol.MEDIA_WEBSOCKETS`). A body is read as vLLM
reads it (``json.loads`` of the bytes: UTF-8, -16 or -32, told by a BOM or the zero bytes of its first
characters).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from starlette.routing import BaseRoute, Match, Mount, Route, WebSocketRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._answers import answer
from ._asgi import first_header, replay, route_path
from ._logs import request_id_of, request_scope
from ._metrics import Stats
from ._protocol import MEDIA_KEYS, MEDIA_ROUTES, MEDIA_WEBSOCKETS, NO_MEDIA_ROUTES
from .config import EPDConfig
from .errors import BodyTooLarge, EPDError
from .host import Host

__all__ = ["MediaNotServedHere", "RawMediaGuard", "carries_media", "refusal"]

_DATA_MEDIA = ("data:image", "data:audio", "data:video")
# Far deeper than any request these routes take; a body nested deeper is walked no further (vLLM refuses
# it anyway).
_MAX_DEPTH = 64
_UTF8 = frozenset({"utf-8", "utf-8-sig"})
# Close code of a websocket refused for a policy (RFC 6455): where the server cannot answer it in HTTP.
_POLICY_VIOLATION = 1008
_HTTP_RESPONSE = "websocket.http.response"


class MediaNotServedHere(EPDError):
    """Media on a route whose engine here cannot encode it."""

    status = 501


class RawMediaGuard:
    """Refuses media on a Mooncake consumer's routes that the middleware does not intercept. One per
    middleware; the routes are read from the app once it shows them (its first request)."""

    __slots__ = ("_config", "_intercepted", "_stats")

    def __init__(self, config: EPDConfig, intercepted: Iterable[str], stats: Stats) -> None:
        self._config = config
        self._intercepted = frozenset(intercepted)
        self._stats = stats

    def guards(self, scope: Scope) -> bool:
        """Whether ``scope`` (HTTP or a websocket) is a request to a route of the app that may hand the
        engine media: the route the app's own router would take it to (matched as it matches, so a
        path parameter, a mount, a route added since start all count), a POST route but one known to
        take no media, a mount, a websocket; by vLLM 0.32's list where the app shows no routes."""
        path, websocket = route_path(scope), scope["type"] == "websocket"
        if path in self._intercepted or (not websocket and scope["method"] != "POST"):
            return False
        routes = getattr(scope.get("app"), "routes", None)
        if not isinstance(routes, list) or not routes:
            return path in (MEDIA_WEBSOCKETS if websocket else MEDIA_ROUTES - self._intercepted)
        for route in routes:
            if not isinstance(route, BaseRoute) or route.matches(scope)[0] is not Match.FULL:
                continue
            if isinstance(route, Mount):
                return True  # another app under a prefix: what it runs is not known here
            if websocket:
                return isinstance(route, WebSocketRoute)
            return isinstance(route, Route) and getattr(route, "path", None) not in NO_MEDIA_ROUTES
        return False

    async def __call__(self, app: ASGIApp, scope: Scope, receive: Receive, send: Send, host: Host) -> None:
        """Refuse the request where it carries media (a websocket always: its media comes later, in
        messages no one here reads), else pass it on as it came."""
        request_id = request_id_of(scope["headers"])
        blocker = host.local_encoding_blocker
        assert blocker is not None
        with request_scope(request_id):
            if scope["type"] == "websocket":
                await self._refuse_websocket(scope, receive, send, blocker, request_id, host)
                return
            body = await self._read_body(receive, send, request_id, host)
            if body is None:
                return
            refused = refusal(
                route_path(scope), first_header(scope["headers"], b"content-type"), body, blocker
            )
            if refused is None:
                await app(scope, replay(body, receive), send)
                return
            self._stats.request("media_refused_elsewhere")
            await self._answer(send, refused, request_id, host)

    async def _read_body(self, receive: Receive, send: Send, request_id: str, host: Host) -> bytes | None:
        """The whole body; None when the caller left or it passed the limit (answered 413)."""
        chunks: list[bytes] = []
        size, limit = 0, self._config.max_body_bytes
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._answer(send, BodyTooLarge(limit), request_id, host)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _refuse_websocket(
        self, scope: Scope, receive: Receive, send: Send, blocker: str, request_id: str, host: Host
    ) -> None:
        """A websocket that streams media to the engine (vLLM's realtime audio): refused before it is
        accepted, in HTTP where the server can answer so (the ASGI websocket HTTP response extension),
        else closed with 1008, which servers answer 403."""
        if (await receive())["type"] != "websocket.connect":
            return
        self._stats.request("media_refused_elsewhere")
        refused = MediaNotServedHere(_refused(route_path(scope), blocker))
        if _HTTP_RESPONSE in scope.get("extensions", {}):
            await self._answer(send, refused, request_id, host, websocket=True)
            return
        await answer(
            _closing(send, refused.message),
            refused,
            request_id=request_id,
            id_header=False,
            expose=False,
            retry_after=self._config.retry_after,
        )

    async def _answer(
        self, send: Send, error: EPDError, request_id: str, host: Host, *, websocket: bool = False
    ) -> None:
        await answer(
            _as_websocket_http(send) if websocket else send,
            error,
            request_id=request_id,
            id_header=host.request_id_headers,
            expose=self._config.expose_upstream_addresses,
            retry_after=self._config.retry_after,
        )


def _refused(path: str, blocker: str) -> str:
    return (
        f"{path} cannot take media on this server: {blocker}. Send images, audio and video through "
        "the routes whose media goes to the encoders (chat completions, Messages, Responses)"
    )


def _as_websocket_http(send: Send) -> Send:
    """``send`` for an HTTP answer to a websocket handshake (the ASGI extension's message types)."""

    async def sending(message: Message) -> None:
        await send({**message, "type": message["type"].replace("http.response", _HTTP_RESPONSE, 1)})

    return sending


def _closing(send: Send, reason: str) -> Send:
    """``send`` that closes the websocket instead of answering (the reason within its 123 bytes)."""

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            cut = reason.encode()[:123].decode("utf-8", "ignore")
            await send({"type": "websocket.close", "code": _POLICY_VIOLATION, "reason": cut})

    return sending


def refusal(path: str, content_type: bytes | None, body: bytes, blocker: str) -> MediaNotServedHere | None:
    """Why the request to ``path`` is refused on a server that cannot encode media (``blocker`` says
    why), or None when it carries none. A multipart body is an upload (audio transcription): media."""
    kind = (content_type or b"").lower().split(b";", 1)[0].strip()
    if kind == b"multipart/form-data" or carries_media(body):
        return MediaNotServedHere(_refused(path, blocker))
    return None


def carries_media(body: bytes) -> bool:
    """Whether a JSON body holds media: a data URL of an image, audio or video anywhere, or a value under
    a key that takes media (a content part, a reference, Cohere's ``images``, the decisions API's
    ``audio`` and ``videos``). A body that is not JSON holds none the engine would read."""
    utf8 = json.detect_encoding(body[:4]) in _UTF8
    if utf8 and not (_DATA.search(body) or b"\\u" in body or any(token in body for token in _KEY_TOKENS)):
        return False  # the byte scan sees a UTF-8 body's text; another encoding is always parsed
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
