"""Encoders and prefill servers are used only once they serve this server's model (GET /v1/models), on
asyncio and trio with fakes: a server serving another model or not answering is left unused (logged,
shown, exported), start-up fails on a mismatch only with strict_startup, a server is checked again when
it comes back, and the expectation comes from vLLM, expected_model, or the first answered request."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import pytest

from epd_middleware import EPDMiddleware, StartupFailed
from epd_middleware._compat import Expectation
from epd_middleware._probes import probe
from epd_middleware.host import Host

from .fakes import MODEL, FakeEncoders, FakeEngine, FakePrefill, chat_body, image, upstream_client
from .test_middleware import png, post

pytestmark = pytest.mark.anyio

E0, E1 = "http://127.0.0.70:8001", "http://127.0.0.71:8001"
P0 = "http://127.0.0.72:8100"


def app_with(encoders: FakeEncoders, **options: Any) -> EPDMiddleware:
    options.setdefault("encoder_selection", "round_robin")
    return EPDMiddleware(
        FakeEngine().app(),
        encoders=encoders.urls,
        http_client=upstream_client(encoders),
        health_check_interval=0,
        **options,
    )


async def status_of(app: Any) -> dict[str, Any]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        result: dict[str, Any] = (await client.get("http://pd/epd/status")).json()
    return result


def vllm_app(model: str = "/models/tiny", served: list[str] | None = None) -> Any:
    """What the middleware sees of a vLLM server: app.state.vllm_config.model_config."""
    model_config = SimpleNamespace(model=model, served_model_name=served or [MODEL])
    return SimpleNamespace(state=SimpleNamespace(vllm_config=SimpleNamespace(model_config=model_config)))


async def lifespan(app: EPDMiddleware, scope_app: Any = None) -> list[dict[str, Any]]:
    """Run the lifespan's start-up, then shut it down; what the server was told."""
    sent: list[dict[str, Any]] = []
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "app": scope_app}
    with anyio.fail_after(5):
        try:
            await app(scope, receive, send)
        except StartupFailed:  # a failed start ends the lifespan, after telling the server
            assert sent[-1]["type"] == "lifespan.startup.failed"
    return sent


def test_expectation_of_a_vllm_server() -> None:
    config = vllm_app("/models/x", ["a", "b"]).state.vllm_config
    assert Host.of_vllm(config).expectation == Expectation(frozenset({"a", "b"}), "/models/x")
    unnamed = SimpleNamespace(model_config=SimpleNamespace(model="/models/x", served_model_name=None))
    assert Host.of_vllm(unnamed).expectation == Expectation(frozenset({"/models/x"}), "/models/x")


async def test_a_server_of_another_model_is_not_used(caplog: pytest.LogCaptureFixture) -> None:
    encoders = FakeEncoders([E0, E1], served={E1: ["another-model"]})
    app = app_with(encoders, expected_model=MODEL)
    with caplog.at_level(logging.WARNING, logger="epd_middleware"):
        for seed in range(4):
            assert (await post(app, chat_body(image(png(seed))))).status_code == 200
    assert {call.encoder for call in encoders.calls} == {E0}
    assert f"encoder {E1} is not used: it serves another-model (another-model)" in caplog.text
    assert caplog.text.count("is not used") == 1  # logged once, not per request
    model = (await status_of(app))["encoders"][E1]["model"]
    assert model == {"state": "mismatch", "served": "another-model (another-model)", "aliases_mapped": []}


async def test_every_encoder_of_another_model_means_no_encoder() -> None:
    encoders = FakeEncoders([E0], served={E0: ["another-model"]})
    app = app_with(encoders, expected_model=MODEL)
    # The first call finds out (502 naming the encoder and what it serves); later ones know (503).
    first = await post(app, chat_body(image(png(1))))
    assert first.status_code == 502
    message = first.json()["error"]["message"]
    assert "an encoder failed: not used: another-model" in message
    assert E0 not in message  # the deployment's addresses are the operator's (issue 29, item 15)
    response = await post(app, chat_body(image(png(2))))
    assert response.status_code == 503
    local = app_with(encoders, expected_model=MODEL, on_encoder_failure="local")
    assert (await post(local, chat_body(image(png(1))))).status_code == 200
    assert encoders.calls == []


async def test_an_unreachable_server_is_left_out_and_taken_back_once_it_answers() -> None:
    encoders = FakeEncoders([E0, E1], mode={E1: "refuse"})
    app = app_with(encoders, expected_model=MODEL)
    for seed in range(3):
        assert (await post(app, chat_body(image(png(seed))))).status_code == 200
    assert {call.encoder for call in encoders.calls} == {E0}
    assert (await status_of(app))["encoders"][E1]["model"]["state"] == "unreachable"
    encoders.mode[E1] = "ok"
    await probe(app.pipeline.encoders, encoders_transport(encoders), {})  # what the lifespan's probe does
    for seed in range(3, 7):
        assert (await post(app, chat_body(image(png(seed))))).status_code == 200
    assert E1 in {call.encoder for call in encoders.calls}


def encoders_transport(encoders: FakeEncoders) -> Any:
    from epd_middleware.transport import HttpxTransport

    return HttpxTransport(encoders.client())


async def test_a_server_back_from_ejection_is_checked_again() -> None:
    encoders = FakeEncoders([E0, E1])
    app = app_with(
        encoders, expected_model=MODEL, eject_after=1, eject_cooldown=0.05, max_eject_cooldown=0.05
    )
    encoders.mode[E1] = "500"
    for seed in range(2):
        await post(app, chat_body(image(png(seed))))
    assert not app.pipeline.encoders.snapshot(anyio.current_time())[E1]["healthy"]
    encoders.mode[E1] = "ok"
    encoders.served[E1] = ["replaced-by-another-model"]  # it came back as another server
    await anyio.sleep(0.1)
    for seed in range(2, 8):
        assert (await post(app, chat_body(image(png(seed))))).status_code == 200
    model = app.pipeline.encoders.snapshot(anyio.current_time())[E1]["model"]
    assert model["state"] == "mismatch"
    assert [call.encoder for call in encoders.calls].count(E1) <= 2  # the trial call, at most


async def test_inside_vllm_the_servers_own_model_and_path_are_expected() -> None:
    encoders = FakeEncoders([E0, E1], roots={E0: "/models/tiny", E1: "/elsewhere/tiny"})
    app = app_with(encoders)
    sent = await lifespan(app, vllm_app("/models/tiny"))
    assert sent[0]["type"] == "lifespan.startup.complete"
    snapshot = app.pipeline.encoders.snapshot(anyio.current_time())
    assert snapshot[E0]["model"]["state"] == "ok"
    assert snapshot[E1]["model"]["state"] == "mismatch"  # the same name, another model path
    assert "(/elsewhere/tiny)" in snapshot[E1]["model"]["served"]


@pytest.mark.parametrize("strict", [True, False])
async def test_strict_startup_fails_on_a_mismatch_only(strict: bool) -> None:
    encoders = FakeEncoders([E0, E1], served={E1: ["another-model"]})
    app = app_with(encoders, expected_model=MODEL, strict_startup=strict)
    sent = await lifespan(app)
    if strict:
        assert sent[0]["type"] == "lifespan.startup.failed"
        assert f"encoder {E1} serves another-model" in sent[0]["message"]
    else:
        assert sent[0]["type"] == "lifespan.startup.complete"
    down = FakeEncoders([E0, E1], mode={E1: "refuse"})
    sent = await lifespan(app_with(down, expected_model=MODEL, strict_startup=True))
    assert sent[0]["type"] == "lifespan.startup.complete"  # not answering yet never fails a start


async def test_without_vllm_or_expected_model_the_first_answered_model_is_expected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    encoders = FakeEncoders([E0, E1], served={E1: ["another-model"]})
    app = app_with(encoders)
    with caplog.at_level(logging.INFO, logger="epd_middleware"):
        for seed in range(2):
            assert (await post(app, chat_body(image(png(seed))))).status_code == 200
        assert app.pipeline.expectation == Expectation(frozenset({MODEL}))
        for seed in range(2, 6):
            assert (await post(app, chat_body(image(png(seed))))).status_code == 200
    assert "this server serves 'tiny-qwen2-vl'" in caplog.text
    later = [call.encoder for call in encoders.calls[2:]]
    assert later == [E0] * 4  # once the model is known, E1 is checked and left out


async def test_the_check_can_be_turned_off() -> None:
    encoders = FakeEncoders([E0, E1], served={E1: ["another-model"]})
    app = app_with(encoders, expected_model=MODEL, check_models=False)
    for seed in range(4):
        await post(app, chat_body(image(png(seed))))
    assert {call.encoder for call in encoders.calls} == {E0, E1}


async def test_prefill_servers_and_scheduled_encoders_are_checked_too() -> None:
    encoders = FakeEncoders([E0, E1], served={E1: ["another-model"]})
    prefill = FakePrefill([P0])
    app = EPDMiddleware(
        FakeEngine().app(),
        encoders=[E0],
        prefill=[P0],
        scheduler="llm-d",
        scheduler_allow=["127.0.0.0/24"],
        expected_model=MODEL,
        http_client=upstream_client(encoders, prefill),
        health_check_interval=0,
    )
    headers = {"x-encoder-hosts-ports": E1.removeprefix("http://")}
    assert (await post(app, chat_body(image(png(1))), headers=headers)).status_code == 200
    assert [call.encoder for call in encoders.calls] == [E0]  # the named one serves another model
    snapshot = (await status_of(app))["prefill"][P0]
    assert snapshot["model"]["state"] == "ok"
