"""Hostile encoder framing through the whole middleware, with the built-in HTTP client on real loopback
sockets, on asyncio and trio: every request either gets its own handles or a clean 502/504 naming the
encoder, later requests are never affected, and nothing hangs past the call's timeout."""

from __future__ import annotations

import logging
from typing import Any

import anyio
import httpx
import pytest

from epd_middleware import EPDMiddleware
from epd_middleware._http import _framing

from .fakes import FakeEngine, chat_body, image
from .raw_upstream import MODES, raw_upstream
from .test_middleware import media_parts, png, post

pytestmark = pytest.mark.anyio

TIMEOUT = 0.5
# Modes where the server leaves bytes behind (or closes) after an answer: the connection must not carry
# the next request, so the test gives the stray bytes time to arrive before it sends one.
NOT_REUSABLE = {
    "answer then stray answer",
    "answer then stray bytes",
    "stray answer while idle",
    "connection close",
    "close-delimited HTTP/1.0",
}
EXPECTED = {**MODES, "answer before the body is read": "error"}


def own_handles(response: httpx.Response, engine: FakeEngine, received: int) -> None:
    """200, and the engine got this request's handles: each part's uuid is the hash it is stored under."""
    assert response.status_code == 200, response.text
    assert len(engine.received) == received
    body = engine.received[-1].json
    parts = media_parts(body)
    assert [part["type"] for part in parts] == ["image_embeds"]
    assert set(body["ec_transfer_params"]) == {part["uuid"] for part in parts}
    assert parts[0]["image_embeds"] == {"image_grid_thw": [1, 4, 4]}


def clean_error(response: httpx.Response, url: str) -> None:
    assert response.status_code in (502, 504), response.text
    error = response.json()["error"]
    assert error["code"] == response.status_code
    assert error["message"].startswith("an encoder failed: ")
    assert url not in error["message"]  # the log names it (issue 29, item 15)


def middleware_app(engine: FakeEngine, encoders: list[str], **options: Any) -> EPDMiddleware:
    return EPDMiddleware(
        engine.app(),
        encoders=encoders,
        encoder_timeout=TIMEOUT,
        eject_after=1000,
        health_check_interval=0,
        **options,
    )


@pytest.mark.parametrize("mode", list(MODES))
async def test_every_request_gets_its_own_handles_or_a_clean_error(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mode == "body over the limit":
        monkeypatch.setattr(_framing, "MAX_BODY", 4000)
    engine = FakeEngine()
    async with raw_upstream(mode) as upstream:
        app = middleware_app(engine, [upstream.url], max_attempts=1)
        for number in range(4):
            with anyio.fail_after(TIMEOUT + 2):
                response = await post(app, chat_body(image(png(number))))
            if EXPECTED[mode] == "ok":
                own_handles(response, engine, number + 1)
            else:
                clean_error(response, upstream.url)
                assert engine.received == []
            if mode in NOT_REUSABLE:
                await anyio.sleep(0.1)
        # The server behaves again: nothing of what it did before reaches the next requests.
        upstream.mode = "ok"
        before = len(engine.received)
        for number in range(4, 7):
            with anyio.fail_after(TIMEOUT + 2):
                response = await post(app, chat_body(image(png(number))))
            own_handles(response, engine, before + number - 3)
    assert upstream.requests >= 7
    if mode in ("ok", "100 continue first", "two 1xx first", "chunked", "chunk extensions and trailers"):
        assert upstream.connections == 1  # kept alive throughout
    if mode in NOT_REUSABLE:
        assert upstream.connections == 5  # one per hostile exchange, then one kept alive


async def test_another_requests_answer_fails_over_and_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    engine = FakeEngine()
    async with raw_upstream("another request's answer") as bad, raw_upstream("ok") as good:
        app = middleware_app(engine, [bad.url, good.url], max_attempts=2, encoder_selection="round_robin")
        with caplog.at_level(logging.WARNING, logger="epd_middleware"):
            for number in range(4):
                own_handles(await post(app, chat_body(image(png(number)))), engine, number + 1)
    foreign = app.pipeline.counters["encoder_foreign_answers"]
    assert foreign == bad.requests >= 2  # round-robin sent half the calls there first
    assert f"encoder {bad.url} answered request" in caplog.text
    assert "chatcmpl-someone-else-enc0" in caplog.text
    # The bad answers' connections were never reused: each call there opened a new one.
    assert bad.connections == bad.requests


async def test_answers_of_a_server_without_vllm_ids_are_not_refused_for_that() -> None:
    engine = FakeEngine()
    async with raw_upstream("ok") as upstream:
        app = middleware_app(engine, [upstream.url])
        original = upstream._exchange

        async def without_request_id(stream: Any, reader: Any) -> bool:
            return await original(stream, _NoRequestId(reader))

        upstream._exchange = without_request_id  # type: ignore[method-assign]
        own_handles(await post(app, chat_body(image(png(1)))), engine, 1)


class _NoRequestId:
    """A reader that hides the x-request-id header from the server: it answers without an id."""

    def __init__(self, reader: Any) -> None:
        self._reader = reader

    async def receive_until(self, delimiter: bytes, max_bytes: int) -> bytes:
        head: bytes = await self._reader.receive_until(delimiter, max_bytes)
        return b"\r\n".join(line for line in head.split(b"\r\n") if not line.startswith(b"x-request-id"))

    async def receive_exactly(self, size: int) -> bytes:
        data: bytes = await self._reader.receive_exactly(size)
        return data
