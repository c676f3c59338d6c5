"""A request and a server that is shutting down: answered, never aborted in silence.

On SIGTERM vLLM drains its engine (``--shutdown-timeout``): what the engine holds runs to its end, and
every request added from then on is aborted at once, answered 200 with ``finish_reason: "abort"`` and no
output (``v1/engine/core.py`` ``_reject_add_in_shutdown``). A request still in the middleware's encode
stage then is one the engine would never run, and its client would read an empty answer as the model's.
So the middleware answers such a request 503 with Retry-After, before its encoder calls where the
shutdown is already known and after them where it began meanwhile, and a JSON answer the engine began
while it stops is held to its end: an abort in it is replaced by the same 503 (the engine may have
stopped between the middleware's look and its own). A gateway or client then runs it on another server.

Streamed answers pass as they come: holding a stream would hold its tokens, and a stream the engine
aborted has already sent its first event. vLLM answers a request added during the drain the same way
whether the middleware is there or not; the middleware only sees the ones it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec
from starlette.types import Message, Send

from ._asgi import first_header
from .errors import ShuttingDown
from .host import Host

__all__ = ["AbortWatch", "refusal"]

_JSON = b"application/json"


def refusal(host: Host, retry_after: int) -> ShuttingDown | None:
    """The answer to a request that must not reach the engine because the server shuts down."""
    return ShuttingDown(retry_after) if host.shutting_down() else None


class AbortWatch:
    """Between the engine app and the client: a JSON answer the engine starts while the server shuts
    down is held to its last byte, and kept back (``aborted``) where it is an abort."""

    __slots__ = ("_aborted_answer", "_held", "_host", "_send", "aborted")

    def __init__(self, send: Send, host: Host, aborted_answer: Callable[[Mapping[str, Any]], bool]) -> None:
        self._send = send
        self._host = host
        self._aborted_answer = aborted_answer  # the surface's test of an answer (Surface.aborted)
        self._held: list[Message] | None = None
        self.aborted = False

    async def send(self, message: Message) -> None:
        held = self._held
        if held is None:
            if message["type"] == "http.response.start" and self._holds(message):
                self._held = [message]
                return
            await self._send(message)
            return
        held.append(message)
        if message["type"] != "http.response.body" or message.get("more_body", False):
            return
        self._held = None
        body = b"".join(part.get("body", b"") for part in held[1:])
        if _answer_of(body, self._aborted_answer):
            self.aborted = True
            return
        for part in held:
            await self._send(part)

    def _holds(self, start: Message) -> bool:
        if start.get("status") != 200:
            return False
        content_type = first_header(start.get("headers", ()), b"content-type") or b""
        return content_type.startswith(_JSON) and self._host.shutting_down()


def _answer_of(body: bytes, aborted: Callable[[Mapping[str, Any]], bool]) -> bool:
    try:
        answer = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return False
    return isinstance(answer, Mapping) and aborted(answer)
