"""Small ASGI pieces the middleware and the exchange share: header lookups, the route path, JSON answers,
a replayed body."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
from starlette.types import Message, Receive, Scope, Send

from .errors import EPDError

__all__ = ["first_header", "replay", "route_path", "send_error", "send_json"]

_JSON = b"application/json"
_encode = msgspec.json.Encoder().encode


def first_header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of header ``name`` (lower-case, as ASGI gives names), or None."""
    for key, value in headers:
        if key == name:
            return value
    return None


def route_path(scope: Scope) -> str:
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    if root_path and path.startswith(root_path):
        return path[len(root_path) :]
    return path


async def send_error(
    send: Send, error: EPDError, body: bytes | None = None, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    """``error`` answered, its body in OpenAI's shape unless ``body`` is given (another surface's), with
    ``extra`` headers besides its own."""
    headers = error.headers() + extra if extra else error.headers()
    await _send_body(send, error.status, error.body() if body is None else body, headers)


async def send_json(send: Send, status: int, payload: object) -> None:
    await _send_body(send, status, _encode(payload), [])


async def _send_body(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]]) -> None:
    headers = [(b"content-type", _JSON), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the whole body as one message, then the real receive (disconnects)."""
    replayed = False

    async def replayed_receive() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed_receive
