"""The only module that talks to encoders: planned calls in, handles or a typed error out.

Each call catches its own failure and turns it into an :class:`~epd_middleware.errors.EncoderError`
that names the encoder; one failed call cancels its siblings, since the request cannot be answered
without it. Failover and health-aware selection slot in here (``EncoderPool``, ``_call_once``) without
touching the request path.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import httpx
import msgspec

from .errors import (
    EncoderBadReply,
    EncoderError,
    EncoderStatusError,
    EncoderTimeout,
    EncoderUnavailable,
)
from .handles import Handle, ItemKey, match_reply
from .plan import EncoderCall
from .protocol import EC_TRANSFER_PARAMS

__all__ = ["EncoderPool", "call_encoders"]

logger = logging.getLogger("epd_middleware")

_decode_reply = msgspec.json.Decoder().decode
_JSON = "application/json"
_MAX_DETAIL = 300


class EncoderPool:
    """The encoders and the round-robin cursor that spreads items over them across requests."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = tuple(urls)
        self._next = 0

    def reserve(self, count: int) -> int:
        """Claim ``count`` consecutive slots of the cursor and return the first.

        No await between the read and the write, so concurrent requests on one event loop never get the
        same slots. Each API-server process has its own pool and cursor.
        """
        start = self._next
        self._next = (start + count) % len(self.urls)
        return start


async def call_encoders(
    client: httpx.AsyncClient,
    calls: Sequence[EncoderCall],
    bodies: Sequence[bytes],
    *,
    headers: Sequence[Mapping[str, str]],
    call_timeout: float,
) -> dict[ItemKey, Handle]:
    """Run every call concurrently; the handles of all items in call order, or the first failure raised."""
    results: list[dict[ItemKey, Handle]] = [{} for _ in calls]
    failures: list[EncoderError] = []

    async def run(index: int, scope: anyio.CancelScope) -> None:
        try:
            results[index] = await _call_once(
                client, calls[index], bodies[index], headers[index], call_timeout
            )
        except EncoderError as exc:
            logger.warning("encoder call failed: %s", exc.message)
            failures.append(exc)
            scope.cancel()

    async with anyio.create_task_group() as group:
        for index in range(len(calls)):
            group.start_soon(run, index, group.cancel_scope)
    if failures:
        raise failures[0]
    # Completion order varies from run to run; the engine's body should not.
    return {key: handle for result in results for key, handle in result.items()}


async def _call_once(
    client: httpx.AsyncClient,
    call: EncoderCall,
    body: bytes,
    headers: Mapping[str, str],
    call_timeout: float,
) -> dict[ItemKey, Handle]:
    url = f"{call.encoder}/v1/chat/completions"
    try:
        with anyio.fail_after(call_timeout):
            response = await client.post(url, content=body, headers={"content-type": _JSON, **headers})
    except (TimeoutError, httpx.TimeoutException):
        raise EncoderTimeout(call.encoder, f"no answer within {call_timeout:g} s") from None
    except httpx.TransportError as exc:
        raise EncoderUnavailable(call.encoder, _transport_reason(exc)) from None
    if response.status_code != 200:
        raise EncoderStatusError(call.encoder, response.status_code, _error_detail(response.content))
    try:
        reply = _decode_reply(response.content)
    except msgspec.DecodeError:
        raise EncoderBadReply(call.encoder, "the answer is not JSON") from None
    if not isinstance(reply, dict):
        raise EncoderBadReply(call.encoder, "the answer is not a JSON object")
    return match_reply(call, reply.get(EC_TRANSFER_PARAMS))


def _transport_reason(exc: httpx.TransportError) -> str:
    if isinstance(exc, httpx.ConnectError):
        return "connection failed"
    if isinstance(exc, httpx.RemoteProtocolError):
        return "connection closed before a complete answer"
    return type(exc).__name__


def _error_detail(content: bytes) -> str:
    """The encoder's own error message when it sent an OpenAI-style body, cut short."""
    try:
        reply: Any = _decode_reply(content)
        message = reply["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return ""
    return str(message)[:_MAX_DETAIL]
