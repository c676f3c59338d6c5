"""The endpoint plugin without vLLM: configuration at attach time, the EC-consumer check, placement
inside an authentication middleware added after it (as vLLM does)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from epd_middleware.host import Host
from epd_middleware.vllm_plugin import EPDPlugin, check_server, plugin

from .fakes import FakeEngine, chat_body, image

pytestmark = pytest.mark.anyio


def test_factory_reads_nothing_and_attach_fails_clearly_without_encoders(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("EPD_ENCODERS", raising=False)
    instance = plugin()  # vLLM swallows factory errors, so the factory must not raise
    assert instance.name == "epd"
    assert instance.required_tasks == ("generate",)
    with pytest.raises(ValueError, match=r"EPD_ENCODERS is not set.*EPD_PREFILL"):
        instance.attach_router(Starlette())


def ec(**fields: Any) -> SimpleNamespace:
    return SimpleNamespace(vllm_config=SimpleNamespace(ec_transfer_config=SimpleNamespace(**fields)))


async def test_init_state_accepts_an_ec_consumer_only() -> None:
    instance = EPDPlugin()
    await instance.init_state(
        None, ec(ec_connector="ECExampleConnector", ec_role="ec_consumer", is_ec_consumer=True), None
    )
    with pytest.raises(RuntimeError, match=r"'ec_producer'.*not on an encoder"):
        await instance.init_state(
            None, ec(ec_connector="X", ec_role="ec_producer", is_ec_consumer=False), None
        )
    with pytest.raises(RuntimeError, match="no --ec-transfer-config"):
        check_server(Host.of_vllm(SimpleNamespace(ec_transfer_config=None)))
    with pytest.raises(RuntimeError, match="no vllm_config"):
        check_server(None)


async def test_init_state_warns_when_pd_does_not_trust_request_options(
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = ec(ec_connector="ECExampleConnector", ec_role="ec_consumer", is_ec_consumer=True)
    await EPDPlugin().init_state(None, state, SimpleNamespace(trust_request_mm_kwargs=True))
    assert "trust-request-mm-kwargs" not in caplog.text
    await EPDPlugin().init_state(None, state, SimpleNamespace(trust_request_mm_kwargs=False))
    assert "--trust-request-mm-kwargs" in caplog.text


class RequireKey:
    """Stands for vLLM's AuthenticationMiddleware."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (b"authorization", b"Bearer k") not in scope["headers"]:
            await JSONResponse({"error": "unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def test_attached_middleware_sits_inside_later_middleware(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[httpx.Request] = []

    def encoder(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        body = json.loads(request.content)
        uuid = body["messages"][0]["content"][0]["uuid"]
        return httpx.Response(
            200, json={"ec_transfer_params": {uuid: {"metadata": {"image_grid_thw": [1, 2, 2]}}}}
        )

    monkeypatch.setenv("EPD_ENCODERS", "http://enc-0:8001")
    engine = FakeEngine()
    app = engine.app()
    EPDPlugin().attach_router(app)
    app.add_middleware(RequireKey)  # vLLM adds its auth after the plugins
    mounted = app.user_middleware[-1]
    mounted.kwargs["http_client"] = httpx.AsyncClient(transport=httpx.MockTransport(encoder))

    body = json.dumps(chat_body(image("AAAA"))).encode()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        denied = await client.post(
            "http://pd/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        allowed = await client.post(
            "http://pd/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json", "authorization": "Bearer k"},
        )
    assert denied.status_code == 401
    assert allowed.status_code == 200
    assert len(calls) == 1, "only the authenticated request may reach an encoder"


def test_with_prefill_the_server_must_be_a_kv_consumer() -> None:
    from epd_middleware import EPDConfig

    consumer = SimpleNamespace(ec_connector="ECExampleConnector", ec_role="ec_consumer", is_ec_consumer=True)
    with_prefill = EPDConfig(encoders=("http://e:1",), prefill=("http://p:1",))
    decoder = SimpleNamespace(
        ec_transfer_config=consumer, kv_transfer_config=SimpleNamespace(kv_role="kv_consumer")
    )
    check_server(Host.of_vllm(decoder), with_prefill)
    for kv in (None, SimpleNamespace(kv_role="kv_producer")):
        with pytest.raises(RuntimeError, match=r"EPD_PREFILL is set.*kv_consumer"):
            check_server(
                Host.of_vllm(SimpleNamespace(ec_transfer_config=consumer, kv_transfer_config=kv)),
                with_prefill,
            )
    # P/D without encoders needs no EC connector at all.
    check_server(
        Host.of_vllm(
            SimpleNamespace(ec_transfer_config=None, kv_transfer_config=SimpleNamespace(kv_role="kv_both"))
        ),
        EPDConfig(prefill=("http://p:1",)),
    )
    # Encoders without prefill need no KV connector.
    check_server(
        Host.of_vllm(SimpleNamespace(ec_transfer_config=consumer)), EPDConfig(encoders=("http://e:1",))
    )
