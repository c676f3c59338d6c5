"""Blame by evidence, not by status (issue 29, item 1): shared encoders belong to every client, so one
client's bad media, bad key or odd requests never take them from everyone. Each test names the attack;
the ASGI-level ones failed on the code before (a status counted against the server: 3 such requests
emptied a pool, and everyone got 503 "every encoder is failing").

The fake encoders answer bad media as vLLM 0.32 does (tests/fakes.py ``media_failure``): 501 "Only base64
data URLs are supported for now." and 500 "Cannot connect to host ...", on every server alike.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from epd_middleware._blame import Ledger
from epd_middleware.errors import (
    UpstreamBadReply,
    UpstreamRejected,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
    VllmError,
)

from .fakes import (
    NOT_BASE64,
    TEST_MODELS,
    FakeEncoders,
    FakeEngine,
    app_with_encoder_handler,
    build_app,
    chat_body,
    encoder_reply,
    image,
    is_canary,
    models_answer,
    reported_entries,
)
from .test_middleware import E0, E1, E2, png, post
from .test_resilience import _middleware

pytestmark = pytest.mark.anyio

NOT_BASE64_PART = {"type": "image_url", "image_url": {"url": "data:image/png,not-base64-at-all"}}
UNRESOLVABLE = {"type": "image_url", "image_url": {"url": "http://images.nope.invalid/cat.png"}}


def vllm_encoder(chat: Any) -> Any:
    """An encoder as vLLM serves one: /health, /v1/models, and its chat completions answered by
    ``chat`` (a client's call, or the middleware's canary)."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models_answer(TEST_MODELS))
        return chat(request)  # type: ignore[no-any-return]

    return handler


def encoded(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    return httpx.Response(
        200, json=encoder_reply(body, reported_entries(body), request.headers.get("x-request-id"))
    )


def statuses(app: Any) -> dict[str, dict[str, Any]]:
    pool = _middleware(app).pipeline.encoders
    return pool.snapshot(anyio.current_time())


def healthy(app: Any) -> list[str]:
    return [url for url, state in statuses(app).items() if state["healthy"]]


# --- a client's bad media --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("part", "status", "said", "cost"),
    [
        (NOT_BASE64_PART, 501, NOT_BASE64, 1),
        # Two: one server failing to fetch a URL may be that server's own DNS or egress down
        # (tests/test_third_attack.py), so the failure is judged the request's once a second agrees.
        (UNRESOLVABLE, 500, "Cannot connect to host images.nope.invalid:80", 2),
    ],
)
async def test_a_client_repeating_media_no_server_can_load_ejects_no_encoder(
    part: dict[str, Any], status: int, said: str, cost: int
) -> None:
    """Before: each such request failed over across 3 encoders and counted a failure on each; 3 requests
    emptied the pool, the attacker got 502 and every other user 503 for a cool-down up to 60 s."""
    encoders, engine = FakeEncoders([E0, E1, E2]), FakeEngine()
    app, _ = build_app(encoders, engine)
    middleware = app.build_middleware_stack()
    for attack in range(12):
        calls = len(encoders.calls)
        response = await post(middleware, chat_body(part))
        # vLLM's own answer, as a single instance gives it, after one call (two for a fetch).
        assert response.status_code == status
        error = response.json()["error"]
        assert said in error["message"]
        assert error["code"] == status
        assert len(encoders.calls) == calls + cost
        honest = await post(middleware, chat_body(image(png(attack))))
        assert honest.status_code == 200
    assert healthy(middleware) == [E0, E1, E2]
    assert all(state["consecutive_failures"] == 0 for state in statuses(middleware).values())
    assert engine.received
    assert all("not-base64" not in record.body.decode() for record in engine.received)


async def test_a_non_base64_data_url_gets_vllms_error_type_and_no_address() -> None:
    encoders, engine = FakeEncoders([E0, E1]), FakeEngine()
    app, _ = build_app(encoders, engine)
    response = await post(app, chat_body(NOT_BASE64_PART))
    assert response.status_code == 501
    error = response.json()["error"]
    assert error == {"message": NOT_BASE64, "type": "NotImplementedError", "param": None, "code": 501}
    assert "enc-" not in response.text
    assert engine.received == []


async def test_under_the_local_policy_a_request_at_fault_is_answered_not_left_to_the_engine() -> None:
    """PD would fail the same way (vLLM reads the same URL): the client gets vLLM's answer at once."""
    encoders, engine = FakeEncoders([E0, E1]), FakeEngine()
    app, _ = build_app(encoders, engine, on_encoder_failure="local")
    response = await post(app, chat_body(NOT_BASE64_PART))
    assert response.status_code == 501
    assert engine.received == []
    assert len(encoders.calls) == 1


async def test_the_same_failure_on_a_second_healthy_encoder_is_the_requests_fault() -> None:
    """A failure vLLM gives for this request's content, whatever its words: the second encoder fails it
    the same way but encodes the canary, so the request is at fault and the first one's count is taken
    back."""
    poison = png(99)

    def chat(request: httpx.Request) -> httpx.Response:
        if poison in request.content.decode():
            return httpx.Response(500, json={"error": {"message": "cannot identify image file", "code": 500}})
        return encoded(request)

    app, _engine = app_with_encoder_handler(vllm_encoder(chat), encoders=[E0, E1, E2])
    middleware = app.build_middleware_stack()
    for _ in range(5):
        response = await post(middleware, chat_body(image(poison)))
        assert response.status_code == 500
        assert response.json()["error"]["message"] == "cannot identify image file"
    assert healthy(middleware) == [E0, E1, E2]
    states = statuses(middleware)
    assert all(state["consecutive_failures"] == 0 for state in states.values())
    blamed = sum(state["failures_by_blame"].get("request", 0) for state in states.values())
    retracted = sum(state["failures_by_blame"].get("retracted", 0) for state in states.values())
    assert (blamed, retracted) == (5, 5)
    assert (await post(middleware, chat_body(image(png(1))))).status_code == 200


async def test_two_encoders_broken_the_same_way_are_not_taken_for_a_bad_request() -> None:
    """The same failure on two servers is the request's only where the second proves healthy alone:
    two encoders that fail the canary too are the servers' fault, and the third one serves."""
    encoders, engine = FakeEncoders([E0, E1, E2], mode={E0: "500", E1: "500"}), FakeEngine()
    app, _ = build_app(encoders, engine, eject_after=1)
    middleware = app.build_middleware_stack()
    for seed in range(4):
        assert (await post(middleware, chat_body(image(png(seed))))).status_code == 200
    assert healthy(middleware) == [E2]
    counters = _middleware(middleware).pipeline.counters
    assert counters["encoder_failures_blamed_request"] == 0
    assert counters["encoder_ejections_ejected"] == 2


async def test_a_client_key_the_encoders_refuse_is_the_clients_fault() -> None:
    """With forward_authorization the encoders judge the client's key. Before: their 401 counted against
    them, and 5 requests with a bad key gave every good key 503. One encoder's refusal is tried on
    another (its key list may lag, issue 35): two refusals, on two encoders, are the client's."""

    def chat(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer good":
            return httpx.Response(401, json={"error": "Unauthorized"})
        return encoded(request)

    app, _ = app_with_encoder_handler(vllm_encoder(chat), encoders=[E0, E1], forward_authorization=True)
    middleware = app.build_middleware_stack()
    for seed in range(8):
        bad = await post(middleware, chat_body(image(png(seed))), headers={"authorization": "Bearer bad"})
        assert bad.status_code == 401
        good = await post(middleware, chat_body(image(png(seed))), headers={"authorization": "Bearer good"})
        assert good.status_code == 200
    assert healthy(middleware) == [E0, E1]
    counters = _middleware(middleware).pipeline.counters
    assert counters["encoder_failures_blamed_credentials"] == 16
    assert counters["encoder_failures_blamed_server"] == 0


# --- however its failures look, a request costs one server at most --------------------------------------


async def test_one_request_failing_differently_everywhere_counts_against_one_encoder_only() -> None:
    said = iter(range(1000))

    def chat(request: httpx.Request) -> httpx.Response:
        if is_canary(json.loads(request.content)) or png(7) not in request.content.decode():
            return encoded(request)
        return httpx.Response(500, json={"error": {"message": f"odd {next(said)}", "code": 500}})

    app, _ = app_with_encoder_handler(vllm_encoder(chat), encoders=[E0, E1, E2], eject_after=2)
    middleware = app.build_middleware_stack()
    for _ in range(6):
        assert (await post(middleware, chat_body(image(png(7))))).status_code == 502
    states = statuses(middleware)
    counted = sum(state["failures_by_blame"].get("server", 0) for state in states.values())
    capped = sum(state["failures_by_blame"].get("capped", 0) for state in states.values())
    assert (counted, capped) == (6, 12)
    # Each reached eject_after in turn, and each time the canary showed it healthy: nobody ejected.
    assert healthy(middleware) == [E0, E1, E2]
    assert sum(state["ejections_averted"] for state in states.values()) == 3


async def test_an_encoder_that_fails_its_calls_and_the_canary_is_ejected() -> None:
    encoders, engine = FakeEncoders([E0, E1], mode={E1: "500"}), FakeEngine()
    app, _ = build_app(encoders, engine, eject_after=2)
    middleware = app.build_middleware_stack()
    for seed in range(4):
        assert (await post(middleware, chat_body(image(png(seed))))).status_code == 200
    assert healthy(middleware) == [E0]
    assert [call.encoder for call in encoders.canaries] == [E1]
    counters = _middleware(middleware).pipeline.counters
    assert counters["encoder_ejections_ejected"] == 1


async def test_an_encoder_that_answers_health_but_not_the_canary_is_ejected(tmp_path: Path) -> None:
    """Its /health says 200, but it never stores an embedding where PD looks: the canary's is missing
    too, so it goes."""
    encoders = FakeEncoders([E0, E1], storage=tmp_path, skip_store={E1})
    app, _ = build_app(encoders, FakeEngine(), eject_after=1, ec_storage_path=str(tmp_path))
    middleware = app.build_middleware_stack()
    assert (await post(middleware, chat_body(image(png(1)), image(png(2))))).status_code == 200
    assert healthy(middleware) == [E0]
    assert [call.encoder for call in encoders.canaries] == [E1]


# --- what the operator sees --------------------------------------------------------------------------


async def test_failures_by_blame_are_on_the_status_page_and_in_the_metrics() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    encoders, engine = FakeEncoders([E0, E1], mode={E1: "refuse"}), FakeEngine()
    app, _ = build_app(encoders, engine)
    middleware = app.build_middleware_stack()
    await post(middleware, chat_body(NOT_BASE64_PART))
    await post(middleware, chat_body(image(png(1)), image(png(2))))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=middleware)) as client:
        page = (await client.get("http://pd/epd/status")).json()
    blamed = {url: state["failures_by_blame"] for url, state in page["encoders"].items()}
    assert blamed[E1].get("server") == 1
    assert sum(state.get("request", 0) for state in blamed.values()) == 1
    assert page["counters"]["encoder_failures_blamed_request"] == 1
    sample = prometheus_client.REGISTRY.get_sample_value(
        "epd_encoder_failures_total", {"encoder": E1, "blame": "server"}
    )
    assert sample is not None
    assert sample >= 1


async def test_a_request_at_fault_is_logged_with_the_server_for_the_operator(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "epd_middleware")
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    await post(app, chat_body(NOT_BASE64_PART))
    # One line, at INFO whatever the status: the client's mistake, not an operator's (the log's volume
    # under a stream of bad requests is one line each).
    [line] = [record for record in caplog.records if f"encoder {E0} answered HTTP 501" in record.getMessage()]
    assert line.levelno == logging.INFO
    assert "answered 501 NotImplementedError" in line.getMessage()


# --- the ledger itself, below the ASGI layer -----------------------------------------------------------


def status_failure(status: int, message: str | None, server: str = E0) -> UpstreamStatusError:
    return UpstreamStatusError(server, status, VllmError(message) if message is not None else None)


class _Media:
    def __init__(self, url: str) -> None:
        self.url = url


def test_vllms_answers_for_bad_input_are_the_requests_fault() -> None:
    ledger = Ledger([_Media("https://cdn.example.com/a.png")])  # type: ignore[list-item]
    blame, error, *_ = ledger.judge(E0, status_failure(501, NOT_BASE64))
    assert (blame, type(error), error.status, error.message) == ("request", UpstreamRejected, 501, NOT_BASE64)
    # A failed fetch of the request's own media: nobody's on one server, the request's on a second.
    for message in (
        "Cannot connect to host cdn.example.com:443 ssl:default",
        "Connection timeout to host https://CDN.example.com/a.png",
        "500, message='x', url='https://cdn.example.com/a.png'",
    ):
        ledger = Ledger([_Media("https://cdn.example.com/a.png")])  # type: ignore[list-item]
        blame, error, *_ = ledger.judge(E0, status_failure(500, message))
        assert (blame, error.retryable) == ("media", True)
        assert ledger.final(error).status == 500
        assert not ledger.final(error).retryable
        blame, error, *_ = ledger.judge(E1, status_failure(500, message, E1))
        assert (blame, error.status, error.message, error.retryable) == ("request", 500, message, False)


def test_a_500_naming_another_host_or_nothing_is_not_the_requests_fault() -> None:
    for message in ("Cannot connect to host other.example.com:443", "EngineCore died", None):
        ledger = Ledger([_Media("https://cdn.example.com/a.png")])  # type: ignore[list-item]
        assert ledger.judge(E0, status_failure(500, message)).blame == "server"


def test_401_is_the_clients_fault_only_when_its_own_key_was_forwarded() -> None:
    assert Ledger(credentials_forwarded=True).judge(E0, status_failure(401, None)).blame == "credentials"
    assert Ledger().judge(E0, status_failure(401, None)).blame == "server"  # the operator's key


def test_a_request_counts_against_one_server_and_the_same_failure_elsewhere_is_suspect() -> None:
    ledger = Ledger()
    assert ledger.judge(E0, UpstreamUnavailable(E0, "connection failed")).blame == "server"
    assert ledger.judge(E1, UpstreamBadReply(E1, "not JSON")).blame == "capped"
    first = status_failure(500, "boom", E2)
    assert ledger.judge(E2, first).blame == "capped"
    same = status_failure(500, "boom", "http://enc-3:8001")
    assert ledger.judge("http://enc-3:8001", same).blame == "suspect"
    blame, error, retract, *_ = ledger.settle("http://enc-3:8001", same, server_healthy=True)
    assert (blame, error.status, error.message, retract) == ("request", 500, "boom", None)

    timeouts = Ledger()
    assert timeouts.judge(E0, UpstreamTimeout(E0, "no answer within 1 s")).blame == "server"
    assert timeouts.judge(E1, UpstreamTimeout(E1, "no answer within 1 s")).blame == "suspect"
    blame, error, retract, *_ = timeouts.settle(
        E1, UpstreamTimeout(E1, "no answer within 1 s"), server_healthy=True
    )
    assert (blame, error.status, retract, error.retryable) == ("request", 504, E0, False)
    assert "timed out on 2 encoders" in error.message
    assert E0 not in error.message

    broken = Ledger()
    broken.judge(E0, status_failure(500, "EngineCore died"))
    assert broken.judge(E1, status_failure(500, "EngineCore died", E1)).blame == "suspect"
    assert (
        broken.settle(E1, status_failure(500, "EngineCore died", E1), server_healthy=False).blame == "capped"
    )
