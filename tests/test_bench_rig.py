"""The perf rig's checked relay (benchmarks.servers): the floor of an in-engine design that does the
checks no design may drop. It must do them, and before it relays anything, or the floor it measures is
not that of a design that checks."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from benchmarks import servers
from benchmarks.perf import chat_request, noise_png
from epd_middleware import _rawjson
from epd_middleware._http import ConnectFailed

pytestmark = pytest.mark.anyio

# Nothing listens here: a relay that got as far as calling the encoder fails to connect.
NOWHERE = "http://127.0.0.1:9"


def receive_of(body: bytes) -> Any:
    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


async def send(message: dict[str, Any]) -> None:
    pass


SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}


def test_the_long_strings_of_a_body_are_found_wherever_they_are() -> None:
    body = chat_request([noise_png(20_000, 1), noise_png(20_000, 2)])
    raws = list(servers._raws(_rawjson.decode(body)))
    assert len(raws) == 2
    assert all(
        isinstance(raw, msgspec.Raw) and bytes(raw).startswith(b'"data:image/png;base64,') for raw in raws
    )


async def test_a_body_the_checks_refuse_never_reaches_the_encoder() -> None:
    body = chat_request([noise_png(20_000, 1)])
    start = body.index(b"base64,") + 100
    broken = body[:start] + b"\x01" + body[start + 1 :]  # a raw control character inside the long string
    with pytest.raises(msgspec.DecodeError):
        await servers.relay(NOWHERE, checked=True)(SCOPE, receive_of(broken), send)


async def test_a_sound_body_is_checked_then_relayed() -> None:
    body = chat_request([noise_png(20_000, 1)])
    with pytest.raises(ConnectFailed):  # past the checks: the call to the encoder is what fails
        await servers.relay(NOWHERE, checked=True)(SCOPE, receive_of(body), send)
