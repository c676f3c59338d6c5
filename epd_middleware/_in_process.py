"""Requests of the middleware's own to the app it wraps, in this process (the equivalence probe's).

The request is an ASGI scope made here and handed to the wrapped app directly: it never passes through
the middleware's own ``__call__`` (nothing in it is intercepted or rewritten again), and no client can
send it, since no header or path reaches this code. What vLLM checks of every request it still checks:
the app's own API-key middleware sits inside, so the request carries one of vLLM's keys where it has
some. The answer is read into memory, bounded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import anyio
from starlette.types import ASGIApp, Message, Scope

from ._protocol import REQUEST_ID_HEADER

__all__ = ["AppReply", "ask_app"]

# A probe's answer is a few tokens with their logprobs: a few kilobytes. More is not read.
_MAX_REPLY_BYTES = 1 << 20
# What a request's scope takes over from the server's lifespan scope: the app (vLLM's handlers read
# ``request.app.state``), the lifespan state as servers copy it into each request, the extensions.
_FROM_LIFESPAN = ("app", "extensions")


class AppReply(NamedTuple):
    """The wrapped app's answer: its status and body (cut at 1 MiB)."""

    status: int
    body: bytes


async def ask_app(
    app: ASGIApp,
    lifespan_scope: Scope,
    path: str,
    body: bytes,
    request_id: str,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> AppReply:
    """POST ``body`` (JSON) to ``path`` of ``app`` in this process, as a request of the server whose
    lifespan scope is ``lifespan_scope``."""
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (REQUEST_ID_HEADER, request_id.encode()),
            *headers,
        ],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        **{key: lifespan_scope[key] for key in _FROM_LIFESPAN if key in lifespan_scope},
    }
    if isinstance(lifespan_scope.get("state"), dict):
        scope["state"] = dict(lifespan_scope["state"])
    done = anyio.Event()
    sent_body = False
    status = 0
    chunks: list[bytes] = []
    size = 0

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # as a server: the disconnect comes once the response is complete
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, size
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body":
            chunk = message.get("body", b"")
            if chunk and size < _MAX_REPLY_BYTES:
                chunks.append(chunk[: _MAX_REPLY_BYTES - size])
                size += len(chunks[-1])
            if not message.get("more_body", False):
                done.set()

    try:
        await app(scope, receive, send)
    finally:
        done.set()
    return AppReply(status, b"".join(chunks))
