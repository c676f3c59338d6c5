"""Blame in both directions (issue 35, item 1). Issue 29 stopped one client's bad requests from counting
against the shared encoders; its two holes, one each way:

- a client's key that a gateway throttles (429) or refuses is that client's, and the canary that proves a
  server carried it: 9 throttled requests ejected 3 encoders, and the next good key got 503;
- a server whose answers look like the client's fault (501 to everything, 404 to a model alias it lacks,
  a 400 of its own, a key list not rolled out) was never blamed, and every request it got failed.

A "client fault" answer is trusted only while it is the client's: a server whose share of them is high is
doubted (its canary decides, and where its share stands out from the others', a second server's call),
and a server proven wrong is counted, ejected as usual and seen in ``blame="unmasked"``.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx
import pytest

from epd_middleware import EPDMiddleware
from epd_middleware._compat import Expectation
from epd_middleware.host import Host

from .fakes import (
    MODEL,
    TEST_MODELS,
    TEST_UUID_KEY,
    FakeEngine,
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

ALIAS = "tiny-qwen2-vl-chat"


def encoded(body: dict[str, Any], request: httpx.Request) -> httpx.Response:
    return httpx.Response(
        200, json=encoder_reply(body, reported_entries(body), request.headers.get("x-request-id"))
    )


def vllm_error(status: int, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "Error", "code": status}})


class Fleet:
    """Encoders as vLLM serves them (/health, /v1/models, chat completions), each answering its chat
    completions by ``answer(server, body, request)`` (None: encoded as a healthy vLLM would). Records who
    was called with what."""

    def __init__(self, answer: Any = None, served: dict[str, list[str]] | None = None) -> None:
        self.answer = answer or (lambda server, body, request: None)
        self.served = served or {}
        self.calls: Counter[str] = Counter()
        self.canaries: list[tuple[str, str | None, str]] = []  # server, its Authorization, its model

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        server = f"{request.url.scheme}://{request.url.netloc.decode()}"
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models_answer(self.served.get(server, TEST_MODELS)))
        body = json.loads(request.content)
        if is_canary(body):
            self.canaries.append((server, request.headers.get("authorization"), body["model"]))
        else:
            self.calls[server] += 1
        if body["model"] not in self.served.get(server, TEST_MODELS):
            return vllm_error(404, f"The model `{body['model']}` does not exist.")
        said = self.answer(server, body, request)
        return said if said is not None else encoded(body, request)


def middleware_of(fleet: Fleet, encoders: list[str], **options: Any) -> tuple[Any, FakeEngine]:
    engine = FakeEngine()
    options.setdefault("encoder_selection", "round_robin")
    options.setdefault("uuid_key", TEST_UUID_KEY)
    app = EPDMiddleware(
        engine.app(),
        encoders=encoders,
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(fleet)),
        **options,
    )
    return app, engine


def pool_of(app: Any) -> Any:
    return _middleware(app).pipeline.encoders


def healthy(app: Any) -> list[str]:
    import anyio

    return [url for url, state in pool_of(app).snapshot(anyio.current_time()).items() if state["healthy"]]


def counters(app: Any) -> Counter[str]:
    return _middleware(app).pipeline.stats.counters  # type: ignore[no-any-return]


# --- a client's key is the client's: never proof against a server ----------------------------------------


async def test_a_throttled_client_key_ejects_no_encoder_and_gets_its_429() -> None:
    """A gateway in front of the encoders answers 429 to one key over its quota. Before: the canary that
    confirms an ejection carried that key, failed with 429 too, and 9 requests with it ejected all 3
    encoders; the next good key got 503."""

    def answer(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        if request.headers.get("authorization") == "Bearer over-quota":
            return vllm_error(429, "Rate limit exceeded for this key")
        if request.headers.get("authorization") not in ("Bearer good", "Bearer canary"):
            return vllm_error(401, "Unauthorized")
        return None

    fleet = Fleet(answer)
    app, _engine = middleware_of(
        fleet,
        [E0, E1, E2],
        forward_authorization=True,
        canary_api_key="canary",
        check_models=False,
        health_check_interval=0,
    )
    for seed in range(12):
        throttled = await post(
            app, chat_body(image(png(seed))), headers={"authorization": "Bearer over-quota"}
        )
        assert throttled.status_code == 429, throttled.text
        assert "Rate limit exceeded" in throttled.json()["error"]["message"]
    good = await post(app, chat_body(image(png(99))), headers={"authorization": "Bearer good"})
    assert good.status_code == 200
    assert healthy(app) == [E0, E1, E2]
    assert counters(app)["encoder_failures_blamed_server"] == 0
    # Never more than two tries for a throttled request: one encoder's word, then another's.
    assert sum(fleet.calls.values()) == 12 * 2 + 1
    assert all(key != "Bearer over-quota" for _, key, _ in fleet.canaries)


async def test_the_canary_never_carries_a_clients_key() -> None:
    """Under forward_authorization the calls carry the client's key; the canary carries canary_api_key,
    else encoder_api_key, else none: a client's key may be refused or throttled, which says nothing of the
    server. A canary refused for want of a key proves nothing either way (/health stands alone)."""

    said = iter(range(10**6))

    def broken_for_pil(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        # PIL's message names an object's address: it differs on every call, so no two servers agree.
        if png(66) in json.dumps(body):
            return vllm_error(500, f"cannot identify image file <_io.BytesIO object at 0x{next(said):x}>")
        return None

    for options, carried in (
        ({"canary_api_key": "canary"}, "Bearer canary"),
        ({"encoder_api_key": "operator"}, "Bearer operator"),
        ({}, None),
    ):
        fleet = Fleet(broken_for_pil)
        app, _ = middleware_of(
            fleet,
            [E0, E1],
            forward_authorization=True,
            check_models=False,
            health_check_interval=0,
            **options,
        )
        for _ in range(6):
            response = await post(app, chat_body(image(png(66))), headers={"authorization": "Bearer client"})
            assert response.status_code == 502
        assert fleet.canaries, options
        assert {key for _, key, _ in fleet.canaries} == {carried}
        assert healthy(app) == [E0, E1]


async def test_one_encoders_refusal_of_a_client_key_is_tried_on_another() -> None:
    """A key list rolled out to one encoder but not yet to the other: before, the refusal failed an honest
    request with no failover. Now the other encoder serves it, and the refusing one is counted: its
    refusal was its own."""

    def lagging(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        if server == E1 and request.headers.get("authorization") == "Bearer new-key":
            return vllm_error(401, "Unauthorized")
        return None

    fleet = Fleet(lagging)
    app, _ = middleware_of(fleet, [E0, E1], forward_authorization=True, check_models=False)
    for seed in range(6):
        response = await post(app, chat_body(image(png(seed))), headers={"authorization": "Bearer new-key"})
        assert response.status_code == 200
    assert counters(app)["encoder_failures_blamed_unmasked"] == 3
    assert pool_of(app).record(E1).blamed["unmasked"] == 3


# --- a server's "client fault" answer is the client's only while it is --------------------------------------


async def test_an_encoder_that_answers_501_to_everything_is_ejected_and_its_requests_are_served() -> None:
    """A server-side NotImplementedError answers 501 to every request: vLLM's status for what a request
    asks and cannot have. Before: never counted, never ejected, every request routed to it failed, and
    the INFO line was all anyone saw. Now its share of such answers makes it doubted, its canary fails
    too, and it is counted, ejected, its calls failed over."""

    def broken(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        return vllm_error(501, "Not implemented") if server == E1 else None

    fleet = Fleet(broken)
    app, _engine = middleware_of(fleet, [E0, E1])
    statuses = [(await post(app, chat_body(image(png(seed))))).status_code for seed in range(30)]
    # A share over a few answers is evidence; until then its word stands (a bad request costs one call).
    assert statuses.count(501) <= 3
    assert statuses[6:] == [200] * 24
    assert healthy(app) == [E0]
    assert counters(app)["encoder_ejections_ejected"] >= 1
    assert pool_of(app).record(E1).blamed["unmasked"] >= 3  # its canary failed too: its own failure


async def test_an_alias_an_encoder_does_not_serve_is_sent_under_a_name_it_does() -> None:
    """PD answers to two names (--served-model-name A B); an encoder serves only A. The model check took
    it (the names intersect), and every request for B got its 404. Now requests for B reach it as A (the
    embedding's hash depends on the model path, not the name), the canary too, and the status page and a
    WARNING say which names are mapped."""
    fleet = Fleet(served={E0: [MODEL, ALIAS], E1: [MODEL]})
    engine = FakeEngine()
    host = Host(expectation=Expectation(frozenset({MODEL, ALIAS})))
    app = EPDMiddleware(
        engine.app(),
        encoders=[E0, E1],
        host=host,
        encoder_selection="round_robin",
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(fleet)),
    )
    for seed in range(6):
        response = await post(app, chat_body(image(png(seed)), model=ALIAS))
        assert response.status_code == 200, response.text
    assert fleet.calls == {E0: 3, E1: 3}
    import anyio

    snapshot = pool_of(app).snapshot(anyio.current_time())
    assert snapshot[E1]["model"]["aliases_mapped"] == [ALIAS]
    assert snapshot[E0]["model"]["aliases_mapped"] == []
    # The engine still gets the client's own name.
    assert {record.json["model"] for record in engine.received} == {ALIAS}


async def test_a_client_asking_for_a_model_no_one_serves_costs_no_encoder_its_health() -> None:
    """Every encoder answers 404 to a name it does not serve. The canary must not ask for the client's
    name too (it would fail, and the servers be taken for broken): it asks for one of this server's."""
    fleet = Fleet()
    host = Host(expectation=Expectation(frozenset({MODEL})))
    app = EPDMiddleware(
        FakeEngine().app(),
        encoders=[E0, E1],
        host=host,
        encoder_selection="round_robin",
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(fleet)),
    )
    for seed in range(20):
        response = await post(app, chat_body(image(png(seed)), model="no-such-model"))
        assert response.status_code == 404
        assert (await post(app, chat_body(image(png(seed))))).status_code == 200
    assert healthy(app) == [E0, E1]
    assert {model for _, _, model in fleet.canaries} <= {MODEL}
    # One call each, bad and honest; round-robin puts every bad request on one encoder, whose share then
    # stands out: a second call, once per encoder and health-check interval, vindicates it.
    assert sum(fleet.calls.values()) <= 40 + 2


async def test_a_server_whose_rejections_stand_out_is_unmasked_by_a_second_server() -> None:
    """A server answers 400 to large images that the others encode (a smaller --max-model-len, say): its
    canary of a tiny image passes, but its share of rejections stands out from the others', so its next
    rejection is tried on another server, which serves it: the first server's answer was its own,
    counted as ``unmasked`` (the metric an alert reads)."""

    def small_context(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        if server == E1 and not is_canary(body):
            return vllm_error(400, "This model's maximum context length is 128 tokens")
        return None

    fleet = Fleet(small_context)
    app, _ = middleware_of(fleet, [E0, E1, E2])
    statuses = [(await post(app, chat_body(image(png(seed))))).status_code for seed in range(30)]
    assert statuses.count(400) <= 3
    assert statuses[-15:] == [200] * 15
    assert counters(app)["encoder_failures_blamed_unmasked"] >= 3
    prometheus = _middleware(app).pipeline.stats
    assert (
        prometheus.counters["encoder_failures_blamed_unmasked"] == pool_of(app).record(E1).blamed["unmasked"]
    )


async def test_an_attacker_concentrating_bad_requests_on_one_encoder_pays_a_second_call_once_a_while() -> (
    None
):
    """With content affinity the same bad image always lands on one encoder, whose share of rejections
    then stands out. A second server confirming the rejection vindicates it for a health-check interval:
    the attacker's stream costs one extra call a while, not one each, and no server's health."""
    bad = {"type": "image_url", "image_url": {"url": "data:image/png,not-base64-at-all"}}

    def vllm_like(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        if "not-base64" in json.dumps(body):
            return vllm_error(501, "Only base64 data URLs are supported for now.")
        return None

    fleet = Fleet(vllm_like)
    app, _ = middleware_of(fleet, [E0, E1, E2], encoder_selection="affinity", health_check_interval=60)
    for seed in range(40):
        assert (await post(app, chat_body(bad))).status_code == 501
        assert (await post(app, chat_body(image(png(seed))))).status_code == 200
    assert sum(fleet.calls.values()) <= 40 + 40 + 2
    assert healthy(app) == [E0, E1, E2]
    assert counters(app)["encoder_failures_blamed_server"] == 0
    assert counters(app)["encoder_failures_blamed_unmasked"] == 0


async def test_a_throttled_clients_refusals_vindicate_no_broken_encoder() -> None:
    """Found on real vLLM (tests/e2e/test_trust_e2e.py's gateway): two encoders refusing one client's
    key (429 on both) vindicated the first, which reset its share of "client fault" answers, so an
    encoder answering 501 to everything kept passing its 501s to every honest client (10 of 10) while a
    throttled client sent a request before each. A key's refusals say nothing of a server's other
    answers."""

    def answer(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        if request.headers.get("authorization") == "Bearer over-quota":
            return vllm_error(429, "Rate limit exceeded for this key")
        return vllm_error(501, "Not implemented") if server == E1 else None

    fleet = Fleet(answer)
    app, _ = middleware_of(fleet, [E0, E1], forward_authorization=True, canary_api_key="canary")
    statuses = []
    for seed in range(20):
        throttled = await post(
            app, chat_body(image(png(seed))), headers={"authorization": "Bearer over-quota"}
        )
        assert throttled.status_code == 429
        for other in (0, 1):  # two honest requests a round: round-robin sends one of them to each encoder
            honest = await post(
                app, chat_body(image(png(100 + 2 * seed + other))), headers={"authorization": "Bearer good"}
            )
            statuses.append(honest.status_code)
    assert fleet.calls[E1] >= 10  # honest requests reached the broken encoder
    assert statuses.count(501) <= 3
    assert statuses[-20:] == [200] * 20
    assert pool_of(app).record(E1).blamed["unmasked"] >= 3  # its canary failed too: its own failure


async def test_an_encoder_that_breaks_after_long_service_is_doubted_after_a_few_answers() -> None:
    """Its earlier successes keep its share of "client fault" answers under half for six more answers
    (the share decays by 0.9 an answer); three in a row are worth its canary."""
    broken = False

    def answer(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        return vllm_error(501, "Not implemented") if broken and server == E1 else None

    fleet = Fleet(answer)
    app, _ = middleware_of(fleet, [E0, E1])
    for seed in range(24):  # a long healthy service
        assert (await post(app, chat_body(image(png(seed))))).status_code == 200
    broken = True
    statuses = [(await post(app, chat_body(image(png(100 + seed))))).status_code for seed in range(20)]
    assert statuses.count(501) <= 3, statuses
    assert statuses[-10:] == [200] * 10
