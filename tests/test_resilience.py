"""Failover, health, fallback, engine retry, backpressure, embedding checks, security: fakes over ASGI."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import pytest

from epd_middleware import EPDConfig, EPDMiddleware, Host
from epd_middleware._probes import probe
from epd_middleware.host import MooncakeConsumers
from epd_middleware.transport import HttpxTransport

from .fakes import (
    FakeEncoders,
    FakeEngine,
    app_with_encoder_handler,
    audio,
    build_app,
    chat_body,
    image,
    scripted_receive,
)
from .test_middleware import http_scope, media_parts, png, post

pytestmark = pytest.mark.anyio

E0, E1, E2 = "http://enc-0:8001", "http://enc-1:8001", "http://enc-2:8001"
FAILURES = [
    "500",
    "refuse",
    "hang",
    "garbage",
    "not_object",
    "drop_connection",
    "bad_indices",
    "unmatched",
    "wrong_modality",
    "bad_modality",
]


@pytest.mark.parametrize("mode", FAILURES)
async def test_a_failed_call_fails_over_to_another_encoder(mode: str) -> None:
    encoders, engine = FakeEncoders([E0, E1], mode={E1: mode}), FakeEngine()
    app, _ = build_app(encoders, engine, encoder_timeout=0.2)
    with anyio.fail_after(10):
        response = await post(app, chat_body(image(png(1)), image(png(2))))
    assert response.status_code == 200, response.text
    assert [part["type"] for part in media_parts(engine.received[0].json)] == ["image_embeds"] * 2
    # The call planned for enc-1 went to enc-1 first, then to enc-0.
    assert [call.encoder for call in encoders.calls].count(E1) == 1
    assert [call.encoder for call in encoders.calls].count(E0) == 2


@pytest.mark.parametrize("status", [401, 403, 408, 429])
async def test_statuses_about_the_encoder_fail_over(status: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "enc-1":
            return httpx.Response(status, json={"error": {"message": "no", "code": status}})
        body = json.loads(request.content)
        uuid = body["messages"][0]["content"][0]["uuid"]
        return httpx.Response(200, json={"ec_transfer_params": {uuid: {"metadata": {"g": [1]}}}})

    app, _ = app_with_encoder_handler(handler, encoders=[E1, E0])
    assert (await post(app, chat_body(image(png(1))))).status_code == 200


@pytest.mark.parametrize("status", [400, 404, 413, 422])
async def test_request_errors_reach_the_client_and_are_not_retried(status: int) -> None:
    calls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(str(request.url.host))
        return httpx.Response(
            status, json={"error": {"message": "The model `x` does not exist.", "code": status}}
        )

    app, engine = app_with_encoder_handler(handler, encoders=[E0, E1])
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == status
    # vLLM's own answer, as a single instance gives it: no server named (issue 29, items 1 and 15).
    assert response.json()["error"]["message"] == "The model `x` does not exist."
    assert E0 not in response.text
    assert len(calls) == 1
    assert engine.received == []


async def test_server_error_details_stay_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    encoders, engine = FakeEncoders([E0], mode={E0: "500"}), FakeEngine()
    app, _ = build_app(encoders, engine, max_attempts=1)
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == 502
    assert "EngineCore died" not in response.text
    assert "EngineCore died" in caplog.text
    assert png(1) not in response.text


async def test_consecutive_failures_eject_an_encoder_and_cooldown_grows() -> None:
    encoders, engine = FakeEncoders([E0, E1], mode={E1: "500"}), FakeEngine()
    app, _ = build_app(encoders, engine, eject_after=2, eject_cooldown=0.3, max_eject_cooldown=0.6)
    middleware = app.build_middleware_stack()
    for seed in range(6):
        assert (await post(middleware, chat_body(image(png(seed))))).status_code == 200
    pool = _pool(middleware)
    assert [call.encoder for call in encoders.calls].count(E1) == 2  # then ejected: skipped
    snapshot = pool.snapshot(anyio.current_time())
    assert snapshot[E1]["healthy"] is False
    assert 0 < snapshot[E1]["ejected_for_s"] <= 0.3

    await anyio.sleep(0.35)  # cool-down over: E1 gets a trial call, fails, is ejected for twice as long
    for seed in range(10, 14):
        assert (await post(middleware, chat_body(image(png(seed))))).status_code == 200
    assert [call.encoder for call in encoders.calls].count(E1) == 3
    assert 0.3 < pool.snapshot(anyio.current_time())[E1]["ejected_for_s"] <= 0.6

    encoders.mode[E1] = "ok"  # E1 recovers. Its canary failed, and /health cannot tell: a probe keeps it out
    await probe(pool, HttpxTransport(encoders.client()), {})
    assert pool.snapshot(anyio.current_time())[E1]["healthy"] is False
    await anyio.sleep(0.65)  # until its cool-down ends: its trial call succeeds, and it is back
    for seed in range(20, 24):
        assert (await post(middleware, chat_body(image(png(seed))))).status_code == 200
    assert pool.snapshot(anyio.current_time())[E1]["healthy"] is True
    assert [call.encoder for call in encoders.calls].count(E1) >= 4


def _pool(stack: Any) -> Any:
    return _middleware(stack).pipeline.encoders


async def test_health_probes_run_from_the_lifespan() -> None:
    encoders, engine = FakeEncoders([E0, E1], mode={E1: "refuse"}), FakeEngine()
    middleware = EPDMiddleware(
        engine.app(),
        encoders=[E0, E1],
        http_client=encoders.client(),
        health_check_interval=0.02,
        eject_after=2,
    )
    shutdown = anyio.Event()
    sent: list[str] = []

    async def receive() -> dict[str, Any]:
        if not sent:
            return {"type": "lifespan.startup"}
        await shutdown.wait()
        return {"type": "lifespan.shutdown"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message["type"])

    async with anyio.create_task_group() as group:
        group.start_soon(
            middleware, {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send
        )
        with anyio.fail_after(5):
            while middleware.pipeline.encoders.snapshot(anyio.current_time())[E1]["healthy"]:  # noqa: ASYNC110 (polling health the probe changes)
                await anyio.sleep(0.01)
        encoders.mode[E1] = "ok"
        with anyio.fail_after(5):
            while not middleware.pipeline.encoders.snapshot(anyio.current_time())[E1]["healthy"]:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        shutdown.set()
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


async def test_all_encoders_failing_with_local_fallback_sends_the_original_media() -> None:
    encoders, engine = FakeEncoders([E0, E1], mode={E0: "500", E1: "refuse"}), FakeEngine()
    app, _ = build_app(encoders, engine, on_encoder_failure="local")
    middleware = app.build_middleware_stack()
    body = chat_body(image(png(1)), image(png(2)))
    for _ in range(5):  # the later ones find every encoder ejected and skip the calls
        response = await post(middleware, body)
        assert response.status_code == 200
    for record in engine.received:
        parts = media_parts(record.json)
        assert [part["type"] for part in parts] == ["image_url", "image_url"]
        assert [part["image_url"] for part in parts] == [
            image(png(1))["image_url"],
            image(png(2))["image_url"],
        ]
        assert "ec_transfer_params" not in record.json
    counters = _middleware(middleware).pipeline.counters
    assert counters["fallback"] == 5
    assert counters["fallback_items"] == 10


def _middleware(stack: Any) -> EPDMiddleware:
    layer = stack
    while not isinstance(layer, EPDMiddleware):
        layer = layer.app
    return layer


async def test_local_fallback_is_per_modality_and_keeps_what_did_encode() -> None:
    # enc-0 encodes images, enc-1 (the audio's encoder) fails: audio falls back, images are rewritten.
    encoders, engine = FakeEncoders([E0, E1], mode={E1: "500"}), FakeEngine()
    from .fakes import audio

    app, _ = build_app(encoders, engine, on_encoder_failure="local", max_attempts=1)
    body = chat_body(image(png(1)), audio(png(2)))
    assert (await post(app, body)).status_code == 200
    parts = media_parts(engine.received[0].json)
    assert parts[0]["type"] == "image_embeds"
    assert parts[1]["type"] == "input_audio"
    assert parts[1]["uuid"]
    assert list(engine.received[0].json["ec_transfer_params"]) == [parts[0]["uuid"]]


async def test_all_encoders_ejected_with_error_policy_is_503_with_retry_after() -> None:
    encoders, engine = FakeEncoders([E0], mode={E0: "500"}), FakeEngine()
    app, _ = build_app(encoders, engine, eject_after=1, eject_cooldown=30, retry_after=7)
    middleware = app.build_middleware_stack()
    assert (await post(middleware, chat_body(image(png(1))))).status_code == 502
    response = await post(middleware, chat_body(image(png(2))))
    assert response.status_code == 503
    assert response.headers["retry-after"] == "30"  # the encoder's cool-down, above retry_after (7 s)
    assert len(encoders.calls) == 1
    assert engine.received == []


async def test_encode_deadline_bounds_the_whole_request() -> None:
    encoders, engine = FakeEncoders([E0, E1, E2], mode={E0: "hang", E1: "hang", E2: "hang"}), FakeEngine()
    app, _ = build_app(encoders, engine, encoder_timeout=10, encode_deadline=0.3)
    start = anyio.current_time()
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == 504
    assert "deadline" in response.json()["error"]["message"]
    assert anyio.current_time() - start < 2
    assert len(encoders.calls) == 1  # no other encoder tried once the deadline passed


async def test_encode_deadline_under_local_policy_leaves_every_call_to_the_engine_and_blames_no_encoder() -> (
    None
):
    """Two calls in flight on two hanging encoders when the request's deadline passes: both items go to
    the engine as sent, quickly, and neither encoder counts a failure (the deadline is the request's)."""
    encoders, engine = FakeEncoders([E0, E1], mode={E0: "hang", E1: "hang"}), FakeEngine()
    app, _ = build_app(
        encoders,
        engine,
        encoder_timeout=10,
        encode_deadline=0.3,
        max_batch_size=1,
        on_encoder_failure="local",
        eject_after=1,
    )
    middleware = app.build_middleware_stack()
    start = anyio.current_time()
    response = await post(middleware, chat_body(image(png(1)), image(png(2))))
    assert response.status_code == 200
    assert anyio.current_time() - start < 2
    assert sorted(call.encoder for call in encoders.calls) == [E0, E1]
    parts = media_parts(engine.received[0].json)
    assert [part["type"] for part in parts] == ["image_url", "image_url"]
    counters = _middleware(middleware).pipeline.counters
    assert counters["fallback_items"] == 2
    assert not any(name.startswith("encoder_calls_") for name in counters), counters
    snapshot = _pool(middleware).snapshot(anyio.current_time())
    assert snapshot[E0]["healthy"] is True
    assert snapshot[E1]["healthy"] is True


async def test_engine_500_before_the_first_byte_is_retried_once() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine(fail_next=1)
    app, _ = build_app(encoders, engine)
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == 200
    assert len(engine.received) == 2
    assert len(encoders.calls) == 2  # encoded again

    engine.fail_next = 2  # fails twice: the second 500 reaches the client
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "InternalServerError"


def _push_host(wait: float, *, push: bool = True) -> Host:
    """A Mooncake consumer on the V1 runner whose engine waits ``wait`` seconds for a pushed embedding."""
    return Host(
        ec_connector="ECMooncakeConnector",
        ec_consumer=True,
        model_runner="v1",
        push_wait_s=wait,
        push=MooncakeConsumers({0: "tcp://127.0.0.1:15000"}, pin=False) if push else None,
    )


async def test_an_engine_500_after_the_whole_push_wait_is_passed_on_not_retried(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What vLLM answers when a pushed embedding never loaded: a second run would wait as long again."""
    encoders, engine = FakeEncoders([E0]), FakeEngine(fail_next=1, fail_after=0.3)
    app, _ = build_app(encoders, engine, host=_push_host(0.2))
    middleware = app.build_middleware_stack()
    response = await post(middleware, chat_body(image(png(1))))
    assert response.status_code == 500
    assert response.json()["error"]["type"] == "InternalServerError"  # the engine's own answer
    assert len(engine.received) == 1
    assert len(encoders.calls) == 1
    counters = _middleware(middleware).pipeline.counters
    assert counters["engine_retries_skipped_after_push_wait"] == 1
    assert counters["engine_retries"] == 0
    [line] = [r.getMessage() for r in caplog.records if "push wait" in r.getMessage()]
    assert "not running it again" in line
    assert "V1 model runner" in line


async def test_a_late_engine_500_of_a_request_nothing_was_pushed_for_is_retried() -> None:
    """Text only, or no push target: the push wait says nothing about such a 500."""
    encoders, engine = FakeEncoders([E0]), FakeEngine(fail_next=2, fail_after=0.3)
    app, _ = build_app(encoders, engine, host=_push_host(0.2, push=False))
    middleware = app.build_middleware_stack()
    assert (await post(middleware, chat_body(image(png(1))))).status_code == 500
    assert len(engine.received) == 2
    assert _middleware(middleware).pipeline.counters["engine_retries_skipped_after_push_wait"] == 0


async def test_an_engine_500_before_the_push_wait_is_retried_as_any_other() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine(fail_next=1, fail_after=0.05)
    app, _ = build_app(encoders, engine, host=_push_host(5))
    middleware = app.build_middleware_stack()
    response = await post(middleware, chat_body(image(png(1))))
    assert response.status_code == 200
    assert len(engine.received) == 2
    counters = _middleware(middleware).pipeline.counters
    assert counters["engine_retries"] == 1
    assert counters["engine_retries_skipped_after_push_wait"] == 0


async def test_no_engine_retry_when_disabled() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine(fail_next=1)
    app, _ = build_app(encoders, engine, engine_retries=0)
    assert (await post(app, chat_body(image(png(1))))).status_code == 500
    assert len(engine.received) == 1


async def test_no_engine_retry_after_the_first_byte() -> None:
    """A response whose first byte went out is never replaced, whatever follows."""
    runs = 0

    async def engine(scope: Any, receive: Any, send: Any) -> None:
        nonlocal runs
        if scope["type"] != "http":
            return
        runs += 1
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: partial\n\n", "more_body": True})
        raise RuntimeError("engine died mid-stream")

    encoders = FakeEncoders([E0])
    middleware = EPDMiddleware(engine, encoders=[E0], http_client=encoders.client())
    sent: list[dict[str, Any]] = []
    body = json.dumps(chat_body(image(png(1)))).encode()
    receive = scripted_receive(body)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with pytest.raises(RuntimeError, match="mid-stream"):
        await middleware(http_scope(body), receive, send)
    assert runs == 1
    assert sent[0]["status"] == 200


async def test_requests_past_the_pending_bound_get_503() -> None:
    encoders, engine = FakeEncoders([E0], mode={E0: "hang"}), FakeEngine()
    encoders.started = anyio.Event()
    app, _ = build_app(encoders, engine, max_pending_requests=1, retry_after=3)
    middleware = app.build_middleware_stack()
    async with anyio.create_task_group() as group:
        group.start_soon(post, middleware, chat_body(image(png(1))))
        await encoders.started.wait()
        response = await post(middleware, chat_body(image(png(2))))
        group.cancel_scope.cancel()
    assert response.status_code == 503
    assert response.headers["retry-after"] == "3"
    assert len(encoders.calls) == 1


async def test_calls_in_flight_per_encoder_are_bounded() -> None:
    encoders, engine = FakeEncoders([E0], delay=0.02), FakeEngine()
    app, _ = build_app(encoders, engine, max_inflight_per_encoder=2, max_batch_size=1)
    middleware = app.build_middleware_stack()
    async with anyio.create_task_group() as group:
        for seed in range(4):
            group.start_soon(post, middleware, chat_body(*(image(png(seed * 10 + i)) for i in range(3))))
    assert len(engine.received) == 4
    assert encoders.peak_in_flight[E0] == 2


async def test_missing_embedding_fails_over_instead_of_reaching_the_engine(tmp_path: Path) -> None:
    encoders = FakeEncoders([E0, E1], storage=tmp_path, skip_store={E1})
    engine = FakeEngine()
    app, _ = build_app(encoders, engine, ec_storage_path=str(tmp_path))
    for seed in range(4):
        assert (await post(app, chat_body(image(png(seed))))).status_code == 200
    for record in engine.received:
        for mm_hash in record.json["ec_transfer_params"]:
            assert (tmp_path / mm_hash / "encoder_cache.safetensors").exists()
    assert E1 in [call.encoder for call in encoders.calls]


async def test_missing_embedding_with_no_encoder_left_is_an_error_not_a_reference(tmp_path: Path) -> None:
    encoders = FakeEncoders([E0], storage=tmp_path, skip_store={E0})
    engine = FakeEngine()
    app, _ = build_app(encoders, engine, ec_storage_path=str(tmp_path))
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == 502
    assert "not in the shared storage" in response.json()["error"]["message"]
    assert engine.received == []


async def test_storage_path_is_read_from_the_vllm_server_config(tmp_path: Path) -> None:
    encoders = FakeEncoders([E0], storage=tmp_path / "elsewhere", skip_store=set())
    engine = FakeEngine()
    app, _ = build_app(encoders, engine)
    app.state.vllm_config = SimpleNamespace(
        ec_transfer_config=SimpleNamespace(
            ec_connector="ECExampleConnector",
            ec_connector_extra_config={"shared_storage_path": str(tmp_path)},
        )
    )
    # The encoder stores elsewhere, so the PD's connector would not find the embedding: refused.
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == 502
    assert engine.received == []


async def test_no_check_when_turned_off(tmp_path: Path) -> None:
    encoders = FakeEncoders([E0], storage=tmp_path, skip_store={E0})
    engine = FakeEngine()
    app, _ = build_app(encoders, engine, ec_storage_path=str(tmp_path), check_embeddings=False)
    assert (await post(app, chat_body(image(png(1))))).status_code == 200


async def test_api_key_is_checked_before_encoder_work() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, api_keys=["k1", "k2"])
    body = chat_body(image(png(1)))
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "k1"}):
        response = await post(app, body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == 401
    assert encoders.calls == []
    assert (await post(app, body, headers={"authorization": "Bearer k2"})).status_code == 200


def test_vllm_api_key_is_checked_besides_the_middleware_s_own_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """VLLM_API_KEY is vLLM's key, which the host adds (outside vLLM too): api_keys holds only the
    middleware's own (issue 29, item 7: before, it stood in for VLLM_API_KEY, and an empty EPD_API_KEYS
    dropped vLLM's key)."""
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    config = EPDConfig.from_env({"EPD_ENCODERS": E0, "VLLM_API_KEY": "secret"})
    assert config.api_keys == ()
    assert Host.outside(config).api_keys == ("secret",)
    both = EPDConfig.from_env({"EPD_ENCODERS": E0, "VLLM_API_KEY": "secret", "EPD_API_KEYS": "a,b"})
    assert both.api_keys == ("a", "b")
    assert Host.outside(both).api_keys == ("a", "b", "secret")
    assert "secret" not in repr(Host.outside(both))


async def test_encoder_auth_and_the_clients_authorization() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, encoder_api_key="enc-key")
    await post(app, chat_body(image(png(1))), headers={"authorization": "Bearer client-key"})
    assert encoders.calls[-1].headers["authorization"] == "Bearer enc-key"

    encoders2, engine2 = FakeEncoders([E0]), FakeEngine()
    app2, _ = build_app(encoders2, engine2)
    await post(app2, chat_body(image(png(1))), headers={"authorization": "Bearer client-key"})
    assert "authorization" not in encoders2.calls[-1].headers

    encoders3, engine3 = FakeEncoders([E0]), FakeEngine()
    app3, _ = build_app(encoders3, engine3, forward_authorization=True)
    await post(app3, chat_body(image(png(1))), headers={"authorization": "Bearer client-key"})
    assert encoders3.calls[-1].headers["authorization"] == "Bearer client-key"


async def test_too_many_media_items_is_400_before_any_encoder_call() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, max_media_items=3)
    response = await post(app, chat_body(*(image(png(i)) for i in range(4))))
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    assert encoders.calls == []
    assert (await post(app, chat_body(*(image(png(i)) for i in range(3))))).status_code == 200


async def test_text_only_requests_pass_without_touching_the_encoders_even_when_all_are_down() -> None:
    encoders, engine = FakeEncoders([E0], mode={E0: "refuse"}), FakeEngine()
    app, _ = build_app(encoders, engine)
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    assert (await post(app, raw)).status_code == 200
    assert engine.received[0].body == raw


@pytest.mark.parametrize("mode", ["wrong_modality", "bad_modality"])
async def test_an_entry_whose_modality_contradicts_its_item_is_a_bad_answer(mode: str) -> None:
    """vLLM 0.33 names each entry's modality: one that is not the item's would make PD reference an
    embedding of another kind."""
    encoders, engine = FakeEncoders([E0], mode={E0: mode}, version="0.33"), FakeEngine()
    app, _ = build_app(encoders, engine, on_encoder_failure="error")
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert message.startswith("an encoder failed: ")
    assert E0 not in message  # the log names it (issue 29, item 15)
    assert "reports modality" in message
    assert "'image'" in message
    assert engine.received == []


async def test_answers_of_either_vllm_version_give_the_engine_the_same_request_but_the_entry() -> None:
    bodies = {}
    for version in ("0.32", "0.33"):
        encoders, engine = FakeEncoders([E0], version=version), FakeEngine()
        app, _ = build_app(encoders, engine)
        body = chat_body(image(png(1)), audio(png(2)), image(png(3)))
        assert (await post(app, body)).status_code == 200
        bodies[version] = engine.received[0].json
    newer = bodies["0.33"]
    entries = newer.pop("ec_transfer_params")
    assert sorted(entry.pop("modality") for entry in entries.values()) == ["audio", "image", "image"]
    assert {**newer, "ec_transfer_params": entries} == bodies["0.32"]
