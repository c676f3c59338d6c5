"""Outside attacks on the equivalence probe (issue 36), loopback fakes only: 12 defects found, each
test here failed before its mend; the rest are attacks that held.

Every test asserts the behaviour the docs promise (or a safe one).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import epd_middleware._equivalence as equivalence_module
from epd_middleware._comparison import ProbeAnswer, Step, answer_of, compare, judged_among
from epd_middleware._pd_check import pd_verdicts, run_canary
from epd_middleware._protocol import MOONCAKE_EC_CONNECTOR
from epd_middleware._sampling import sampled_requests
from epd_middleware._surfaces import openai_chat
from epd_middleware.cli import main

from .fakes import models_answer
from .test_check_strict import server as answering
from .test_equivalence import (
    E0,
    E1,
    E2,
    KEY,
    Fleet,
    answer,
    client_request,
    embed,
    engine_of,
    middleware_of,
    pd_with,
    pd_with_client,
    probe,
    probe_again,
    serving,
    settled,
)

anyio_mark = pytest.mark.anyio


def mooncake(fleet: Fleet) -> Any:
    return fleet.host(ec_connector=MOONCAKE_EC_CONNECTOR, ec_consumer=True)


# 1. The 10 s freshness rule counts from the start of a run --------------------------------------------


class Clock:
    """The probe's clocks (time.time for reports, time.monotonic for freshness), moved by hand."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


@anyio_mark
async def test_a_run_longer_than_10s_does_not_let_callers_run_probes_back_to_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each engine request takes 3 s (a real model on a loaded GPU/CPU): a run of one encoder is 4
    requests, 12 s. A caller POSTing as soon as the previous run answered must get that report, not a
    new run: "no caller can make the engine run probes back to back"."""
    clock = Clock()
    monkeypatch.setattr(equivalence_module, "time", clock)
    fleet = Fleet()
    app, _ = pd_with(fleet, [E0])
    inner = app.router

    async def slow_engine(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            clock.now += 3.0
        await inner(scope, receive, send)

    app.router = slow_engine  # type: ignore[assignment]
    assert (await probe(app)).status_code == 200
    first = len(fleet.engine_bodies)
    assert first == 4
    assert (await probe(app)).status_code == 200  # at once, 0 s after the run answered
    assert len(fleet.engine_bodies) == first, "a second run started right after the first finished"


# 2. A barred encoder brought back without a match ------------------------------------------------------


@anyio_mark
async def test_a_barred_encoder_is_not_brought_back_by_an_unproven_run() -> None:
    """Mooncake consumer, three encoders, E2 other weights: barred. Then E0 and E1 leave (ejected by
    failing calls): the next run has E2 alone, 'unproven' (nothing compared). Unproven proves nothing,
    yet _judge's else branch unbars on it."""
    fleet = Fleet(weights={E2: "w2"})
    app, _ = pd_with(fleet, [E0, E1, E2], host=mooncake(fleet), equivalence_eject=True)
    report = (await probe(app)).json()
    assert report["encoders"][E2]["result"] == "mismatch"
    pool = middleware_of(app).pipeline.encoders
    now = anyio.current_time()
    assert pool.available(now) == (E0, E1)
    for url in (E0, E1):
        pool.eject(url, now, "test: failing calls")
    await probe_again(app)
    assert middleware_of(app).equivalence.verdicts[E2].result == "unproven"
    assert E2 not in pool.available(anyio.current_time()), "the known-bad encoder is back in the pool"


@anyio_mark
async def test_a_barred_encoder_that_flaps_out_of_dns_and_back_stays_barred() -> None:
    """'only a probe that matches again brings it back': a DNS answer that drops the address for one
    lookup (a readiness flap, an NXDOMAIN blip) forgets its health record and with it the bar."""
    fleet = Fleet(weights={E1: "w2"})
    app, _ = pd_with(fleet, [E0, E1], equivalence_eject=True)
    assert (await probe(app)).json()["encoders"][E1]["result"] == "mismatch"
    pool = middleware_of(app).pipeline.encoders
    assert pool.available(anyio.current_time()) == (E0,)
    pool.set_members([E0])
    pool.set_members([E0, E1])
    assert pool.available(anyio.current_time()) == (E0,), "the bar was lost with the DNS flap"


# 3. An encoder that answers no handle "matches" -------------------------------------------------------


@anyio_mark
async def test_an_encoder_that_answers_without_handles_is_not_a_match() -> None:
    """A plain vLLM server in E's place (no --ec-transfer-config), or a proxy that drops
    ec_transfer_params: 200 with no handle. The image stays raw in the E + PD body, PD encodes it
    itself, and the probe compares PD with PD: 'match', check --canary rc 0."""
    fleet = Fleet()

    def no_handles(request: httpx.Request) -> httpx.Response:
        reply = fleet.encoder(request)
        if request.url.path == "/v1/chat/completions" and "enc-1" in str(request.url):
            return httpx.Response(200, json={"choices": [{"index": 0, "message": {"content": "x"}}]})
        return reply

    app, _ = pd_with_client(fleet, [E0, E1], no_handles, equivalence_eject=True)
    report = (await probe(app)).json()
    raw = [body for body in fleet.engine_bodies if not body.get("ec_transfer_params")]
    assert len(raw) == 2  # PD alone's, per variant: the E1 path never reached the engine raw
    assert report["encoders"][E1]["result"] == "error", report["encoders"][E1]
    assert "PD would encode them itself" in report["encoders"][E1]["detail"]
    assert report["ok"] is False


# 4. Crashes from the engine's answer -------------------------------------------------------------------


def engine_answering(body: Any, status_code: int = 200) -> Starlette:
    async def chat(request: Request) -> Response:
        await request.body()
        if isinstance(body, bytes):
            return Response(body, status_code=status_code, media_type="application/json")
        return JSONResponse(body, status_code=status_code)

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def pd_over(engine: Starlette, fleet: Fleet, urls: list[str], **options: Any) -> Starlette:
    from epd_middleware import EPDMiddleware

    from .fakes import TEST_UUID_KEY

    client = httpx.AsyncClient(transport=httpx.MockTransport(fleet.encoder))
    engine.add_middleware(
        EPDMiddleware, encoders=urls, http_client=client, host=fleet.host(), uuid_key=TEST_UUID_KEY, **options
    )
    return engine


def good_answer() -> dict[str, Any]:
    return answer(embed("x", {}, "w1"), 0.0, 4)


ODD_ENGINE_ANSWERS = {
    "usage_not_a_number": {**good_answer(), "usage": {"prompt_tokens": "thirty", "completion_tokens": 4}},
    "usage_a_list": {**good_answer(), "usage": {"prompt_tokens": [30]}},
    "usage_huge_float": b'{"choices":[],"usage":{"prompt_tokens":1e400}}',
    "content_a_string": {"choices": [{"logprobs": {"content": "abc"}}]},
    "content_entries_lists": {"choices": [{"logprobs": {"content": [["t1", -0.1]]}}]},
    "logprob_huge_int": b'{"choices":[{"logprobs":{"content":[{"token":"a","logprob":1'
    + b"0" * 400
    + b"}]}}]}",
    "choices_a_dict": {"choices": {"0": {}}},
}


@anyio_mark
@pytest.mark.parametrize("name", sorted(ODD_ENGINE_ANSWERS))
async def test_an_odd_engine_answer_is_an_error_verdict_not_a_crash(name: str) -> None:
    fleet = Fleet()
    app = pd_over(engine_answering(ODD_ENGINE_ANSWERS[name]), fleet, [E0])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pd") as client:
        response = await client.post("/epd/status/equivalence", headers={"authorization": f"Bearer {KEY}"})
    assert response.status_code == 200
    # No crash: an error verdict, or (usage alone odd, the same on both paths) the logprobs compared.
    expected = {"match", "error"} if name.startswith("usage_") else {"error"}
    assert response.json()["encoders"][E0]["result"] in expected


@anyio_mark
async def test_an_odd_engine_answer_on_the_schedule_does_not_bring_down_the_lifespan() -> None:
    """The scheduled probe runs in the lifespan's task group beside the health probes and DNS lookups:
    an exception out of a run ends them all (and cancels the app's own lifespan)."""
    fleet = Fleet()
    app = pd_over(
        engine_answering(ODD_ENGINE_ANSWERS["usage_not_a_number"]), fleet, [E0], equivalence_interval=0.1
    )
    with anyio.fail_after(5):
        async with serving(app):
            await anyio.sleep(0.5)
            runs = middleware_of(app).equivalence.cost.runs
    assert runs >= 2


def test_answer_of_raises_value_error_or_answers_for_any_json() -> None:
    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=3),
            lambda children: (
                st.lists(children, max_size=3)
                | st.dictionaries(
                    st.sampled_from(
                        ["choices", "logprobs", "content", "token", "logprob", "top_logprobs", "usage"]
                    ),
                    children,
                    max_size=4,
                )
            ),
            max_leaves=12,
        )
    )
    def check(reply: Any) -> None:
        with suppress(ValueError):
            answer_of(reply)

    check()


# 5. Sampled checks (verify_share) -----------------------------------------------------------------------


@anyio_mark
async def test_a_sampled_request_read_by_pythons_json_does_not_kill_the_lifespan() -> None:
    """A client's body with a lone surrogate (vLLM reads it with json.loads: compat). The client is
    answered 200; its check builds the E + PD body with msgspec (Pipeline.probe omits compat=):
    Unusable, which nothing catches: the worker, the health probes and DNS lookups die with it."""
    fleet = Fleet()
    app, _ = pd_with(fleet, [E0], verify_share=1.0)
    body = json.dumps(client_request()).replace('"hi"', '"hi \\ud800"').encode()
    with anyio.fail_after(5):
        async with serving(app):
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://pd"
            ) as client:
                response = await client.post(
                    "/v1/chat/completions",
                    content=body,
                    headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
                )
            assert response.status_code == 200
            await settled(app, 1)
            assert middleware_of(app).pipeline.sampler.running


def client_parsed(body: dict[str, Any]) -> Any:
    parsed = openai_chat.SURFACE.parse(json.dumps(body).encode())
    assert parsed is not None
    return parsed


def test_a_sampled_pd_alone_body_does_not_carry_the_clients_untrusted_uuid() -> None:
    """trust_client_uuid is off: a client's uuid is a key every client shares. The PD-alone body of a
    sampled check still carries it, so vLLM's processor and encoder caches (keyed by a given uuid)
    answer for it: a client can make PD alone read another image's embedding."""
    body = client_request()
    body["messages"][0]["content"][0]["uuid"] = "attacker-chosen"
    _remote, local = sampled_requests(client_parsed(body), "n0")
    assert b"attacker-chosen" not in local


class UuidCachingFleet(Fleet):
    """As vLLM: a part with a uuid is looked up in the engine's caches by that uuid."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: dict[str, str] = {}

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = json.loads(await request.body())
            self.engine_bodies.append(body)
            handles = body.get("ec_transfer_params") or {}
            if handles:
                embedding, offset = self.storage[next(iter(handles))]
            else:
                part = body["messages"][0]["content"][0]
                fresh = embed(part["image_url"]["url"], body.get("media_io_kwargs") or {}, "w1")
                uuid = part.get("uuid")
                embedding = self.cache.setdefault(uuid, fresh) if uuid else fresh
                offset = 0.0
            return JSONResponse(answer(embedding, offset, body["max_tokens"]))

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


@anyio_mark
async def test_a_client_cannot_get_an_honest_encoder_barred_with_a_reused_uuid() -> None:
    fleet = UuidCachingFleet()
    app, _ = pd_with(fleet, [E0], verify_share=1.0, equivalence_eject=True)
    async with serving(app):
        for seed in (0, 1):
            body = client_request(seed)
            body["messages"][0]["content"][0]["uuid"] = "same"
            assert (await pd_ask(app, body)).status_code == 200
            await settled(app, seed + 1)
    verdict = middleware_of(app).equivalence.traffic[E0]
    assert verdict.result == "match", verdict
    assert middleware_of(app).pipeline.encoders.available(anyio.current_time()) == (E0,)


async def pd_ask(app: Starlette, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pd") as client:
        return await client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
        )


@anyio_mark
async def test_with_trusted_client_uuids_the_sampled_paths_do_not_reuse_the_clients_identifier() -> None:
    """trust_client_uuid on: the client's request went E + PD under its uuid; the sampled check sends
    both paths under that same uuid again, so the engine's encoder cache hands PD alone the encoder's
    embedding from the client's request: E compared with E, always a match."""
    fleet = Fleet()
    app, _ = pd_with(fleet, [E0], verify_share=1.0, trust_client_uuid=True)
    body = client_request()
    body["messages"][0]["content"][0]["uuid"] = "client-uuid-1"
    async with serving(app):
        assert (await pd_ask(app, body)).status_code == 200
        await settled(app, 1)
    _original, *checks = fleet.engine_bodies
    assert len(checks) == 2
    for check in checks:
        assert check["messages"][0]["content"][0].get("uuid") != "client-uuid-1", check["messages"][0]


@anyio_mark
async def test_at_most_one_requests_media_is_held() -> None:
    """The docs: 'the media held is one request's'. One check is stuck on its encoder call: the
    sampler still buffers another client's request (its media) behind it."""
    fleet = Fleet()
    release = anyio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        if request.headers.get("x-request-id", "").startswith("epd-equivalence-"):
            await release.wait()
        return fleet.encoder(request)

    app, _ = pd_with_client(fleet, [E0], slow, verify_share=1.0)
    async with serving(app):
        for seed in range(3):
            assert (await pd_ask(app, client_request(seed))).status_code == 200
        sampler = middleware_of(app).pipeline.sampler
        buffered = sampler._receive.statistics().current_buffer_used
        release.set()
        await settled(app, sampler.taken)
    assert buffered == 0, "one request under check and another's media buffered behind it"


# 6. check --pd / --canary with odd pages ----------------------------------------------------------------


@contextmanager
def server(answers: dict[tuple[str, str], Any]) -> Iterator[str]:
    """tests/test_check_strict.py's loopback server, its URL alone."""
    with answering(answers) as (url, _):
        yield url


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [name for name in os.environ if name.startswith(("EPD_", "VLLM_"))]:
        monkeypatch.delenv(name)


def page(**extra: Any) -> dict[str, Any]:
    return {
        "model_runner": "v2",
        "known_problems": [],
        "model": {"names": ["m"], "root": "/models/m"},
        "encoders": {},
        **extra,
    }


ENCODER = {("GET", "/health"): {}, ("GET", "/v1/models"): models_answer(["m"], "/models/m")}


@pytest.mark.parametrize(
    "odd",
    [
        {"equivalence": {"encoders": ["http://e:1"]}},
        {"equivalence": {"encoders": "mismatch"}},
        {"encoders": {"http://e:1": {"member": True, "healthy": True}}, "equivalence": {"encoders": [1]}},
    ],
)
def test_check_pd_with_an_odd_equivalence_section_is_a_problem_not_a_traceback(
    odd: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    with server(ENCODER) as enc, server({("GET", "/epd/status"): page(**odd)}) as pd:
        code = main(["check", "--encoders", enc, "--pd", pd, "--json"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    json.loads(out)


@pytest.mark.parametrize(
    "report",
    [
        {"ok": False, "encoders": ["http://e:1"]},
        {"ok": False, "encoders": "mismatch"},
    ],
)
def test_check_canary_never_says_ok_for_a_report_that_is_not_ok(
    report: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    answers = {("GET", "/epd/status"): page(), ("POST", "/epd/status/equivalence"): report}
    with server(ENCODER) as enc, server(answers) as pd:
        code = main(["check", "--encoders", enc, "--pd", pd, "--canary", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 1, payload


# 7. Things that should hold -------------------------------------------------------------------------------


@anyio_mark
@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("POST", "/epd/status/equivalence/", 404),
        ("HEAD", "/epd/status/equivalence", 405),
        ("GET", "/epd/status/equivalence", 405),
        ("PUT", "/epd/status/equivalence", 405),
        ("POST", "/epd/status/Equivalence", 404),
        ("POST", "//epd/status/equivalence", 404),
    ],
)
async def test_no_other_route_or_method_runs_the_probe(method: str, path: str, expected: int) -> None:
    fleet = Fleet()
    app, _ = pd_with(fleet, [E0])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pd") as client:
        got = await client.request(method, path, headers={"authorization": f"Bearer {KEY}"})
    assert got.status_code in (expected, 404, 405)
    assert fleet.engine_bodies == []


@anyio_mark
async def test_a_hanging_encoder_is_bounded_by_its_timeout_and_others_are_still_probed() -> None:
    fleet = Fleet()

    async def hang(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions" and "enc-0" in str(request.url):
            await anyio.sleep(60)
        return fleet.encoder(request)

    app, _ = pd_with_client(fleet, [E0, E1], hang, encoder_timeout=0.3, encode_deadline=0.3)
    with anyio.fail_after(5):
        report = (await probe(app)).json()
    assert report["encoders"][E0]["result"] == "error"
    assert report["encoders"][E1]["result"] == "match"


@anyio_mark
async def test_concurrent_posts_during_a_run_share_it() -> None:
    fleet = Fleet()
    app, _ = pd_with(fleet, [E0, E1])
    results: list[int] = []

    async def one() -> None:
        results.append((await probe(app)).status_code)

    async with anyio.create_task_group() as group:
        for _ in range(10):
            group.start_soon(one)
    assert results == [200] * 10
    assert len(fleet.engine_bodies) == 6


@anyio_mark
async def test_the_status_page_is_strict_json_after_a_prompt_length_mismatch() -> None:
    fleet = Fleet()

    def longer(request: httpx.Request) -> httpx.Response:
        return fleet.encoder(request)

    app, _ = pd_with(fleet, [E0, E1], equivalence_eject=True)
    middleware = middleware_of(app)
    # A verdict with an infinite difference and one with NaN (as a broken comparison could give).
    middleware.equivalence._judge(E0, {"default": ("mismatch", "prompt", math.inf)}, 0.02, may_bar=True)
    middleware.equivalence._judge(E1, {"default": ("mismatch", "nan", math.nan)}, 0.02, may_bar=True)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pd") as client:
        text = (await client.get("/epd/status", headers={"authorization": f"Bearer {KEY}"})).text

    def refuse(constant: str) -> None:
        raise AssertionError(f"not strict JSON: {constant}")

    json.loads(text, parse_constant=refuse)


def test_judged_among_never_names_a_majority_of_one_in_two() -> None:
    a = ProbeAnswer(30, (Step("a", -0.1, {"a": -0.1}),))
    b = ProbeAnswer(30, (Step("b", -0.1, {"b": -0.1}),))
    out = judged_among({E0: a, E1: b}, 0.02)
    assert {result for result, _, _ in out.values()} == {"disagree"}
    out = judged_among({E0: a, E1: a, E2: b}, 0.02)
    assert out[E2][0] == "mismatch"
    assert out[E0][0] == "match"


def test_compare_with_infinite_logprobs_is_not_a_match_by_nan() -> None:
    reference = ProbeAnswer(30, (Step("a", math.inf, {"a": math.inf, "b": -1.0}),))
    candidate = ProbeAnswer(30, (Step("a", -0.1, {"a": -0.1, "b": -1.0}),))
    assert not compare(reference, candidate, 0.25).equal


@anyio_mark
async def test_a_mooncake_consumer_never_checks_a_sampled_request() -> None:
    fleet = Fleet()
    app, _ = pd_with(fleet, [E0], verify_share=1.0, host=mooncake(fleet))
    async with serving(app):
        assert (await pd_ask(app, client_request())).status_code == 200
        await settled(app, 1)
    sampler = middleware_of(app).pipeline.sampler
    assert sampler.skipped == 1  # a Mooncake consumer: no check, no probe to the engine
    assert len(fleet.engine_bodies) == 1


@anyio_mark
async def test_pd_verdicts_and_run_canary_direct_shapes() -> None:
    # pd_verdicts with odd member shapes should not raise
    findings = pd_verdicts({"encoders": {"u": None, "v": {"member": False}}, "equivalence": None}, "pd", [])
    assert findings.problems == []

    class T:
        async def request(self, method: str, url: str, **kw: Any) -> tuple[int, bytes]:
            return 200, b'{"skipped": "busy", "encoders": {}}'

    from epd_middleware.config import EPDConfig

    _report, found = await run_canary(EPDConfig.of_options({"encoders": [E0]}), T(), "http://pd", "pd", 1)  # type: ignore[arg-type]
    assert found.problems


# 8. More ----------------------------------------------------------------------------------------------------


@anyio_mark
async def test_a_wrong_reference_does_not_take_every_encoder_out_and_503_every_client() -> None:
    """PD's own processor is what is off (another --mm-processor-kwargs, a PD image of another vLLM):
    every encoder agrees with every other and all differ from PD alone. With equivalence_eject the
    probe bars them all, and every client request with media gets 503, the probe's own reference
    being the thing that is wrong."""
    fleet = Fleet(weights={E0: "w2", E1: "w2"})  # the encoders agree; PD alone ("w1") is the odd one
    app, _ = pd_with(fleet, [E0, E1], equivalence_eject=True)
    report = (await probe(app)).json()
    assert {v["result"] for v in report["encoders"].values()} == {"mismatch"}
    client = await pd_ask(app, client_request())
    assert middleware_of(app).pipeline.encoders.available(anyio.current_time()) != (), client.status_code


@anyio_mark
async def test_an_engine_request_that_never_ends_does_not_hold_the_probe_forever() -> None:
    """A probe request the engine never answers (a Mooncake consumer waiting for a push that never
    comes, a stuck engine): ask_app has no bound, the run holds the lock, and every later POST and
    scheduled run waits behind it."""
    fleet = Fleet()
    stuck = anyio.Event()
    app, _ = pd_with(fleet, [E0], encoder_timeout=1, encode_deadline=1)
    inner = app.router

    async def never(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            await stuck.wait()
        await inner(scope, receive, send)

    app.router = never  # type: ignore[assignment]
    with anyio.move_on_after(5) as scope:
        await probe(app)
    stuck.set()
    assert not scope.cancelled_caught, "the probe run had no bound: still waiting on the engine after 5 s"


@anyio_mark
async def test_a_caller_waiting_on_a_first_run_that_is_cancelled_gets_no_assertion_error() -> None:
    fleet = Fleet()
    # The caller then runs its own: its engine requests are bounded by the encode deadline.
    app, _ = pd_with(fleet, [E0], encode_deadline=0.5)
    inner = app.router
    entered = anyio.Event()

    async def slow(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            entered.set()
            await anyio.sleep(30)
        await inner(scope, receive, send)

    app.router = slow  # type: ignore[assignment]
    equivalence = middleware_of(app).equivalence
    engine = engine_of(app)
    failure: list[BaseException] = []
    async with anyio.create_task_group() as group:
        first = anyio.CancelScope()

        async def scheduled() -> None:
            with first:
                await equivalence.run_once(engine)

        async def caller() -> None:
            try:
                await equivalence.run_once(engine, fresh_within=10.0)
            except AssertionError as exc:
                failure.append(exc)

        group.start_soon(scheduled)
        await entered.wait()
        group.start_soon(caller)
        await anyio.sleep(0.05)
        first.cancel()  # shutdown, or a cancelled POST
    assert failure == [], "the waiting caller hit `assert self._report is not None` (a 500)"
