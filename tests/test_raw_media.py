"""No media past the Mooncake-consumer refusal (issue 35, item 3), and every answer of the middleware's own
complete (item 6). A Mooncake consumer's engine waits for a push of every item it has not cached: media
sent to a route the middleware does not intercept would hold a place in the engine for the whole push
wait and fail with a bare 500. The routes are read from the running app, so the next route vLLM adds is
guarded too; the body is read as vLLM reads it."""

from __future__ import annotations

import json
import logging
from typing import Any

import anyio
import pytest
from starlette.routing import WebSocketRoute

from epd_middleware import EPDMiddleware

from .fakes import FakeEncoders, FakeEngine, build_app, chat_body, image
from .test_handoff import mooncake_consumer
from .test_hostile_clients import post, recording_route
from .test_middleware import E0, png

pytestmark = pytest.mark.anyio

IMAGE_URL = "data:image/png;base64,AAAA"


def consumer_app(engine: FakeEngine, *paths: str, **host: Any) -> Any:
    """A Mooncake consumer's app serving ``paths`` besides the fake engine's own, with the middleware."""
    app = engine.app()
    for path in paths:
        app.router.routes.append(recording_route(engine, path))
    consumer = mooncake_consumer()
    for name, value in host.items():
        setattr(consumer, name, value)
    app.add_middleware(EPDMiddleware, encoders=[E0], host=consumer, health_check_interval=0)
    return app


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "images": [IMAGE_URL], "questions": [{"id": "q", "question": "?"}]},
        {"model": "m", "audio": ["https://media.example/a.wav"], "questions": []},
        {"model": "m", "videos": ["https://media.example/v.mp4"], "questions": []},
    ],
)
async def test_the_structured_decisions_api_is_guarded(body: dict[str, Any]) -> None:
    """``/v1/systemone`` is registered on every vLLM 0.32 API server and fetches ``images``, ``audio`` and
    ``videos``. Before: not among the guarded routes, its media reached the waiting engine."""
    engine = FakeEngine()
    response = await post(consumer_app(engine, "/v1/systemone"), body, "/v1/systemone")
    assert response.status_code == 501, response.text
    assert engine.received == []


async def test_without_routes_to_read_vllms_own_list_is_guarded() -> None:
    """A server whose app shows no routes (not Starlette's): vLLM 0.32's media routes, systemone among
    them."""
    received: list[bytes] = []

    async def bare(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        received.append(message.get("body", b""))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    app = EPDMiddleware(bare, encoders=[E0], host=mooncake_consumer(), health_check_interval=0)
    refused = await post(app, {"model": "m", "images": [IMAGE_URL]}, "/v1/systemone")
    assert refused.status_code == 501
    assert (await post(app, {"model": "m", "prompt": "hi"}, "/v1/completions")).status_code == 200
    assert len(received) == 1


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "utf-32-be"])
async def test_a_body_in_another_encoding_vllm_reads_is_read_as_vllm_reads_it(encoding: str) -> None:
    """vLLM's ``json.loads`` takes UTF-16 and UTF-32 (a BOM, or the zero bytes of the first characters);
    the byte prefilter saw no ``data:`` in such a body, and passed its media on."""
    engine = FakeEngine()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": [image(png(1))]}]})
    response = await post(consumer_app(engine, "/v1/embeddings"), body.encode(encoding), "/v1/embeddings")
    assert response.status_code == 501
    assert engine.received == []
    text = json.dumps({"model": "m", "input": ["no media here"]}).encode(encoding)
    assert (await post(consumer_app(engine, "/v1/embeddings"), text, "/v1/embeddings")).status_code == 200


async def test_a_route_the_next_vllm_adds_is_guarded_and_one_known_to_take_no_media_is_not() -> None:
    engine = FakeEngine()
    app = consumer_app(engine, "/v1/future/multimodal", "/tokenize")
    media = {"model": "m", "messages": [{"role": "user", "content": [image(png(1))]}]}
    assert (await post(app, media, "/v1/future/multimodal")).status_code == 501
    # /tokenize renders the chat on the API server; the engine never waits for its media.
    assert (await post(app, media, "/tokenize")).status_code == 200
    assert len(engine.received) == 1


def realtime_app(engine: FakeEngine) -> Any:
    app = consumer_app(engine)
    accepted: list[bool] = []

    async def realtime(websocket: Any) -> None:
        await websocket.accept()
        accepted.append(True)
        await websocket.close()

    app.router.routes.append(WebSocketRoute("/v1/realtime", realtime))
    app.state.accepted = accepted
    return app


async def drive_websocket(app: Any, extensions: dict[str, Any]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    messages = [{"type": "websocket.connect"}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await anyio.sleep_forever()
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "websocket",
        "path": "/v1/realtime",
        "raw_path": b"/v1/realtime",
        "root_path": "",
        "scheme": "ws",
        "query_string": b"",
        "headers": [(b"host", b"pd"), (b"x-request-id", b"rt-1")],
        "client": ("127.0.0.1", 5000),
        "server": ("pd", 80),
        "subprotocols": [],
        "extensions": extensions,
        "asgi": {"version": "3.0", "spec_version": "2.4"},
    }
    with anyio.fail_after(5):
        await app(scope, receive, send)
    return sent


async def test_the_realtime_websocket_is_refused_before_it_is_accepted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM's ``/v1/realtime`` streams audio to the engine in ``input_audio_buffer.append`` events, which
    nothing here reads: on a Mooncake consumer it is refused at the handshake, in HTTP (501, OpenAI's
    shape) where the server takes the ASGI websocket HTTP response extension, else closed with 1008."""
    caplog.set_level(logging.INFO, "epd_middleware")
    engine = FakeEngine()
    app = realtime_app(engine)
    sent = await drive_websocket(app, {"websocket.http.response": {}})
    assert sent[0]["type"] == "websocket.http.response.start"
    assert sent[0]["status"] == 501
    assert "cannot take media on this server" in json.loads(sent[1]["body"])["error"]["message"]
    sent = await drive_websocket(app, {})
    assert [message["type"] for message in sent] == ["websocket.close"]
    assert sent[0]["code"] == 1008
    assert app.state.accepted == []
    assert "request rt-1: answered 501" in caplog.text


async def test_the_501_on_a_route_not_intercepted_carries_its_request_id_and_leaves_its_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: no X-Request-Id (where vLLM's --enable-request-id-headers puts one on every answer) and
    no line in the log: the refusal could not be found from the client's side."""
    caplog.set_level(logging.INFO, "epd_middleware")
    engine = FakeEngine()
    app = consumer_app(engine, "/v1/embeddings", request_id_headers=True)
    media = {"model": "m", "messages": [{"role": "user", "content": [image(png(1))]}]}
    response = await post(app, media, "/v1/embeddings", **{"x-request-id": "client-7"})
    assert response.status_code == 501
    assert response.headers["x-request-id"] == "client-7"
    assert (
        "request client-7: answered 501 NotImplementedError: /v1/embeddings cannot take media" in caplog.text
    )
    generated = await post(app, media, "/v1/embeddings")
    assert generated.headers["x-request-id"]
    assert f"request {generated.headers['x-request-id']}: answered 501" in caplog.text


async def test_the_busy_encoder_503_says_when_to_come_back() -> None:
    """Every slot this process may use on the only encoder stays taken (here by a call of the test's
    own): 503 "slot(s) stayed taken", and before without Retry-After, which every other 503 of the
    middleware carries."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, max_inflight_per_encoder=1, encoder_timeout=0.1, retry_after=7)
    middleware = app.build_middleware_stack()
    layer = middleware
    while not isinstance(layer, EPDMiddleware):
        layer = layer.app
    capacity, held, done = layer.pipeline.encoders.record(E0).capacity, anyio.Event(), anyio.Event()

    async def hold_the_slot() -> None:  # a task of its own: a slot belongs to the task that took it
        assert capacity.take_now()
        held.set()
        await done.wait()
        capacity.release()

    async with anyio.create_task_group() as group:
        group.start_soon(hold_the_slot)
        await held.wait()
        busy = await post(middleware, chat_body(image(png(1))))
        done.set()
    assert busy.status_code == 503
    assert "stayed taken" in busy.json()["error"]["message"]
    assert busy.headers["retry-after"] == "7"
    assert encoders.calls == []
