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


class _RunnerConfig:
    """A vLLM configuration whose ``use_v2_model_runner`` is a property, as in vLLM (it may raise)."""

    def __init__(self, ec: object, uses_v2: bool | Exception | None) -> None:
        self.ec_transfer_config = ec
        self._uses_v2 = uses_v2

    @property
    def use_v2_model_runner(self) -> bool | None:
        if isinstance(self._uses_v2, Exception):
            raise self._uses_v2
        return self._uses_v2


def mooncake(role: str = "ec_consumer", **extra: Any) -> SimpleNamespace:
    return SimpleNamespace(
        ec_connector="ECMooncakeConnector",
        ec_role=role,
        is_ec_consumer=role in ("ec_consumer", "ec_both"),
        ec_ip="127.0.0.1",
        ec_port=15000,
        ec_connector_extra_config=extra,
    )


def test_mooncake_consumer_on_the_v1_runner_is_a_known_problem_named_at_start_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from epd_middleware import EPDConfig

    host = Host.of_vllm(_RunnerConfig(mooncake(), False), None, EPDConfig(encoders=("http://e:1",)))
    assert host.model_runner == "v1"
    assert host.push_wait_s == 60
    [problem] = host.known_problems
    assert "ECMooncakeConnector on the V1 model runner" in problem
    assert "idle server never loads a pushed embedding" in problem
    for words in ("(60 s)", "HTTP 500", "Model Runner V2"):
        assert words in problem
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert any("V1 model runner" in line for line in warnings)


def test_no_known_problem_on_v2_with_another_connector_or_for_a_producer() -> None:
    example = SimpleNamespace(ec_connector="ECExampleConnector", ec_role="ec_consumer", is_ec_consumer=True)
    cases = [
        (_RunnerConfig(mooncake(), True), "v2"),
        (_RunnerConfig(example, False), "v1"),
        (_RunnerConfig(mooncake("ec_producer"), False), "v1"),
        # A configuration vLLM itself refuses (HiSparse with VLLM_USE_V2_MODEL_RUNNER=0) says nothing.
        (_RunnerConfig(mooncake(), ValueError("HiSparse requires Model Runner V2")), None),
        (SimpleNamespace(ec_transfer_config=mooncake()), None),  # not a vLLM that says
    ]
    for config, runner in cases:
        host = Host.of_vllm(config)
        assert host.model_runner == runner
        assert host.known_problems == []


def test_the_push_wait_is_read_from_the_consumer_s_extra_config() -> None:
    assert Host.of_vllm(_RunnerConfig(mooncake(push_wait_timeout_s=2.5), True)).push_wait_s == 2.5
    assert Host.of_vllm(_RunnerConfig(mooncake(push_wait_timeout_s="7"), True)).push_wait_s == 7
    assert Host.of_vllm(_RunnerConfig(mooncake("ec_producer"), True)).push_wait_s is None
    for bad in ("soon", 0, -1, float("inf")):
        assert Host.of_vllm(_RunnerConfig(mooncake(push_wait_timeout_s=bad), True)).push_wait_s is None
    example = SimpleNamespace(ec_connector="ECExampleConnector", ec_role="ec_consumer", is_ec_consumer=True)
    assert Host.of_vllm(_RunnerConfig(example, True)).push_wait_s is None
