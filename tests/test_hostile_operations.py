"""What an outside tester found in keys, configuration errors, metrics and ``check`` (issue 29, items 7,
12, 13, 14), on asyncio and trio with fakes. Each test names the hole it closes; each failed against the
code before the fix."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from epd_middleware import EPDConfig, EPDMiddleware, HttpxTransport
from epd_middleware.cli import pd_status
from epd_middleware.vllm_plugin import EPDPlugin

from .fakes import FakeEncoders, FakeEngine, chat_body, image
from .test_middleware import E0, png

pytestmark = pytest.mark.anyio


async def post(app: Any, body: Any, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        return await client.post(
            "http://pd/v1/chat/completions",
            content=json.dumps(body).encode(),
            headers={"content-type": "application/json", **headers},
        )


async def get(app: Any, path: str, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        return await client.get(f"http://pd{path}", headers=headers)


# --- item 7: vLLM's own key is always enforced ------------------------------------------------------


def as_vllm_sets_it(app: Starlette, api_key: Any = None) -> None:
    """What vLLM puts on the app's state before it serves (its configuration and command line)."""
    consumer = SimpleNamespace(ec_connector="ECExampleConnector", ec_role="ec_consumer", is_ec_consumer=True)
    app.state.vllm_config = SimpleNamespace(ec_transfer_config=consumer)
    app.state.args = SimpleNamespace(api_key=api_key)


def key_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str | None]) -> None:
    monkeypatch.setenv("EPD_ENCODERS", E0)
    monkeypatch.setenv("EPD_HEALTH_CHECK_INTERVAL", "0")
    monkeypatch.setenv("EPD_CHECK_MODELS", "false")
    monkeypatch.setenv("EPD_CHECK_EMBEDDINGS", "false")
    for name in ("EPD_API_KEYS", "VLLM_API_KEY"):
        value = env.get(name)
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


# (environment, vLLM's --api-key, a key vLLM refuses, the key vLLM takes)
KEY_CASES = [
    pytest.param({"EPD_API_KEYS": "", "VLLM_API_KEY": "k"}, None, None, "k", id="empty-EPD_API_KEYS"),
    pytest.param({"EPD_API_KEYS": " , ,", "VLLM_API_KEY": "k"}, None, None, "k", id="only-empty-keys"),
    pytest.param({"EPD_API_KEYS": "extra", "VLLM_API_KEY": "k"}, None, None, "k", id="extra-and-env-key"),
    # vLLM's --api-key takes precedence over VLLM_API_KEY: the environment's key opens nothing there.
    pytest.param({"VLLM_API_KEY": "env"}, ["cli"], "env", "cli", id="cli-key-over-env-key"),
]


@pytest.mark.parametrize(("env", "cli_key", "refused_key", "vllm_key"), KEY_CASES)
async def test_with_middleware_vllm_s_own_key_guards_the_encoders(
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str | None],
    cli_key: Any,
    refused_key: str | None,
    vllm_key: str,
) -> None:
    """Before: EPD_API_KEYS set but empty (or only commas) was read as "these are all the keys", so
    VLLM_API_KEY was dropped: with ``--middleware`` (outside vLLM's key check) a request without any key
    drove the encoders. And with ``--api-key`` the environment's VLLM_API_KEY, which vLLM ignores then,
    still opened the encoder path."""
    key_env(monkeypatch, env)
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = engine.app()
    as_vllm_sets_it(app, cli_key)
    app.add_middleware(EPDMiddleware, http_client=encoders.client())  # configured from EPD_*, as vLLM does
    body = chat_body(image(png(1)))
    refused: list[dict[str, str]] = [{}, {"authorization": "Bearer "}]
    if refused_key is not None:
        refused.append({"authorization": f"Bearer {refused_key}"})
    for headers in refused:
        assert (await post(app, body, **headers)).status_code == 401, headers
    assert encoders.calls == []
    assert (await post(app, body, authorization=f"Bearer {vllm_key}")).status_code == 200
    if env.get("EPD_API_KEYS") == "extra":
        assert (await post(app, body, authorization="Bearer extra")).status_code == 200


@pytest.mark.parametrize(("env", "cli_key", "refused_key", "vllm_key"), KEY_CASES)
async def test_with_the_plugin_vllm_s_own_key_guards_the_status_page(
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str | None],
    cli_key: Any,
    refused_key: str | None,
    vllm_key: str,
) -> None:
    """Before: with the plugin, EPD_API_KEYS set but empty and the key in VLLM_API_KEY left /epd/status
    open to anyone (vLLM's own check covers /v1/* only)."""
    key_env(monkeypatch, env)
    engine = FakeEngine()
    app = engine.app()
    as_vllm_sets_it(app, cli_key)
    EPDPlugin().attach_router(app)
    refused: list[dict[str, str]] = [{}, {"authorization": "Bearer "}]
    if refused_key is not None:
        refused.append({"authorization": f"Bearer {refused_key}"})
    for headers in refused:
        assert (await get(app, "/epd/status", **headers)).status_code == 401, headers
    assert (await get(app, "/epd/status", authorization=f"Bearer {vllm_key}")).status_code == 200


async def test_an_empty_string_is_never_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``api_keys=[""]`` made the empty string a key: "Authorization: Bearer " (nothing after the
    space) passed, and inside vLLM the key in VLLM_API_KEY was not required at all."""
    key_env(monkeypatch, {"VLLM_API_KEY": "k"})
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = engine.app()
    as_vllm_sets_it(app)
    app.add_middleware(
        EPDMiddleware,
        encoders=[E0],
        api_keys=["", ""],
        health_check_interval=0,
        check_models=False,
        check_embeddings=False,
        http_client=encoders.client(),
    )
    body = chat_body(image(png(1)))
    assert (await post(app, body, authorization="Bearer ")).status_code == 401
    assert (await post(app, body)).status_code == 401
    assert encoders.calls == []
    assert (await post(app, body, authorization="Bearer k")).status_code == 200


async def test_check_pd_sends_vllm_s_key_without_keys_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``EPDConfig.api_keys`` no longer stands in for VLLM_API_KEY: ``check --pd`` still opens the status
    page with it."""
    monkeypatch.setenv("VLLM_API_KEY", "k")
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"model_runner": "v2", "known_problems": []})

    transport = HttpxTransport(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    assert (await pd_status(EPDConfig(encoders=[E0]), transport, "http://pd:8000"))[1] is None
    assert seen[0].headers["authorization"] == "Bearer k"
    await pd_status(EPDConfig(encoders=[E0], api_keys=["own"]), transport, "http://pd:8000")
    assert seen[1].headers["authorization"] == "Bearer own"
