"""The perf rig's floors (benchmarks.servers). The checked relay: the floor of an in-engine design that
does the checks no design may drop; it must do them, and before it relays anything, or the floor it
measures is not that of a design that checks. The rewrite floor: every step of the middleware's work and
nothing around them; it must hand the engine the very body the direct floor sends, or it measures other
work."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from benchmarks import servers
from benchmarks.perf import _UUID_KEY, Case, Rig, chat_request, noise_png, prepare_direct
from epd_middleware import _rawjson
from epd_middleware._http import ConnectFailed, HTTPClient

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


async def test_the_rewrite_floor_hands_the_engine_what_the_direct_floor_sends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = Rig()
    try:
        encoder = rig.start("encoder")
        await rig.wait(encoder)
        case = Case("2 images", chat_request([noise_png(20_000, 1), noise_png(20_000, 2)]))
        client = HTTPClient(connect_timeout=5)
        await prepare_direct(case, encoder, client)
        await client.aclose()
        seen: list[bytes] = []

        async def engine(scope: Any, receive: Any, send: Any) -> None:
            seen.append((await receive())["body"])

        monkeypatch.setattr(servers, "engine", engine)
        await servers.rewriter(encoder, _UUID_KEY)(SCOPE, receive_of(case.body), send)
    finally:
        rig.stop()
    assert seen == [case.engine_body]
    assert b"ec_transfer_params" in seen[0]
    assert b"base64" not in seen[0]  # both images went by reference
