"""The equivalence probe (issue 36): E + PD answers what PD alone would, proven per encoder, loudly.

The comparison is pure and tested on answers written here. The probe runs below the ASGI layer against
a fake vLLM: encoders that write an "embedding" (a digest of the image, the media options they honour
and their weights) into a shared storage, and an engine that answers a few tokens with logprobs from
the embedding it was handed (the EC connector's) or from the image it encodes itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Message

from epd_middleware import EPDConfig, EPDMiddleware, Host
from epd_middleware._comparison import ProbeAnswer, Step, answer_of, compare, default_tolerance
from epd_middleware._compat import Expectation
from epd_middleware._equivalence import DEFAULT_OPTIONS, Engine, probe_image
from epd_middleware._protocol import MOONCAKE_EC_CONNECTOR
from epd_middleware.config import ConfigurationError

from .fakes import MODEL, TEST_UUID_KEY, derived_hash, models_answer, reported_entries

pytestmark = pytest.mark.anyio

E0, E1, E2 = "http://enc-0:8001", "http://enc-1:8001", "http://enc-2:8001"
KEY = "vllm-key"


# The comparison ----------------------------------------------------------------------------------------


def steps(*tokens: tuple[str, float, dict[str, float]]) -> ProbeAnswer:
    return ProbeAnswer(
        40, tuple(Step(token, logprob, {token: logprob, **top}) for token, logprob, top in tokens)
    )


REFERENCE = steps(("a", -0.1, {"b": -3.0}), ("c", -0.5, {"d": -1.5}), ("e", -0.2, {"f": -4.0}))


def test_the_same_answer_matches_with_no_difference() -> None:
    compared = compare(REFERENCE, REFERENCE, 0.02)
    assert compared.equal
    assert compared.compared == 3
    assert compared.max_difference == 0
    assert compared.detail == "3 token(s) agree; largest logprob difference 0"


def test_logprobs_within_the_tolerance_match_and_beyond_it_do_not() -> None:
    near = steps(("a", -0.11, {"b": -3.01}), ("c", -0.5, {"d": -1.5}), ("e", -0.2, {"f": -4.0}))
    assert compare(REFERENCE, near, 0.02).equal
    far = steps(("a", -0.1, {"b": -3.0}), ("c", -0.5, {"d": -1.9}), ("e", -0.2, {"f": -4.0}))
    compared = compare(REFERENCE, far, 0.02)
    assert not compared.equal
    assert compared.detail == (
        "token 1 ('c'): the logprob of 'd' is -1.900 against -1.500, 0.4 apart (tolerance 0.02)"
    )


def test_another_token_is_a_mismatch_unless_it_is_a_near_tie() -> None:
    other = steps(("a", -0.1, {"b": -3.0}), ("x", -0.2, {"c": -2.9}), ("e", -0.2, {}))
    compared = compare(REFERENCE, other, 0.25)
    assert not compared.equal
    assert compared.detail.startswith("token 1: 'x' where the reference has 'c'")
    # 'c' and 'd' 0.1 apart in the reference: one rounding can flip a greedy choice there (vLLM's own
    # check_logprobs_close allows it); the answers diverge after it, so the comparison ends.
    tie = steps(("a", -0.1, {"b": -3.0}), ("d", -0.55, {"c": -0.6}), ("zzz", -0.1, {}))
    reference = steps(("a", -0.1, {"b": -3.0}), ("c", -0.5, {"d": -0.6}), ("e", -0.2, {}))
    compared = compare(reference, tie, 0.25)
    assert compared.equal
    assert compared.compared == 1
    assert "near tie ('c' or 'd', 0.1 apart)" in compared.detail
    # The same swap where the two were far apart in the reference is a real difference.
    assert not compare(REFERENCE, steps(("a", -0.1, {"b": -3.0}), ("d", -0.4, {"c": -0.9})), 0.25).equal


def test_a_prompt_of_another_length_is_a_mismatch_before_any_token() -> None:
    longer = ProbeAnswer(475, REFERENCE.steps)
    compared = compare(ProbeAnswer(54, REFERENCE.steps), longer, 1.0)
    assert not compared.equal
    assert compared.compared == 0
    assert compared.detail.startswith("prompt of 475 tokens, against 54")


def test_an_answer_that_stops_early_is_a_mismatch() -> None:
    shorter = ProbeAnswer(40, REFERENCE.steps[:2])
    compared = compare(REFERENCE, shorter, 0.02)
    assert not compared.equal
    assert compared.detail == "2 token(s) where the reference has 3"


def test_the_default_tolerance_follows_the_dtype() -> None:
    assert default_tolerance("float32") < default_tolerance("float16") < default_tolerance("bfloat16")
    assert default_tolerance(None) == default_tolerance("bfloat16")  # unknown: the widest


def test_an_answer_without_logprobs_says_so() -> None:
    with pytest.raises(ValueError, match="no logprobs"):
        answer_of({"choices": [{"message": {"content": "hi"}}]})
    reply = {
        "choices": [
            {
                "logprobs": {
                    "content": [
                        {
                            "token": "a",
                            "logprob": -0.5,
                            "top_logprobs": [
                                {"token": "a", "logprob": -0.5},
                                {"token": "b", "logprob": -9999.0},
                            ],
                        }
                    ]
                }
            }
        ],
        "usage": {"prompt_tokens": 12},
    }
    assert answer_of(reply) == ProbeAnswer(12, (Step("a", -0.5, {"a": -0.5, "b": -9999.0}),))


# A fake vLLM fleet -----------------------------------------------------------------------------------------


@dataclass
class Fleet:
    """Encoders and one PD engine that agree exactly when they run the same weights and honour the same
    options. ``storage``: the EC storage, mm_hash -> (embedding, the encoder's logprob offset)."""

    weights: dict[str, str] = field(default_factory=dict)  # per encoder, default "w1" (PD's)
    ignores_options: set[str] = field(default_factory=set)  # encoders whose processor ignores them
    offset: dict[str, float] = field(default_factory=dict)  # rounding: logprobs moved by this much
    failing: set[str] = field(default_factory=set)
    storage: dict[str, tuple[str, float]] = field(default_factory=dict)
    engine_bodies: list[dict[str, Any]] = field(default_factory=list)
    encoder_bodies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    engine_load: int = 0

    def encoder(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.netloc.decode()}"
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models_answer([MODEL]))
        body = json.loads(request.content)
        self.encoder_bodies.append((url, body))
        if url in self.failing:
            return httpx.Response(500, json={"error": {"message": "EngineCore died", "code": 500}})
        options = {} if url in self.ignores_options else body.get("media_io_kwargs") or {}
        for part in body["messages"][0]["content"]:
            mm_hash = derived_hash(body["model"], part["uuid"], "image", body)
            embedding = embed(part["image_url"]["url"], options, self.weights.get(url, "w1"))
            self.storage[mm_hash] = (embedding, self.offset.get(url, 0.0))
        reply = {"choices": [{"index": 0}], "ec_transfer_params": reported_entries(body)}
        return httpx.Response(200, json=reply)

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            if request.headers.get("authorization") != f"Bearer {KEY}":
                return JSONResponse({"error": {"message": "Unauthorized"}}, status_code=401)
            body = json.loads(await request.body())
            self.engine_bodies.append(body)
            handles = body.get("ec_transfer_params") or {}
            if handles:
                if len(handles) != 1 or next(iter(handles)) not in self.storage:
                    return JSONResponse({"error": {"message": "no embedding", "code": 500}}, status_code=500)
                embedding, offset = self.storage[next(iter(handles))]
            else:
                part = body["messages"][0]["content"][0]
                embedding, offset = (
                    embed(part["image_url"]["url"], body.get("media_io_kwargs") or {}, "w1"),
                    0.0,
                )
            return JSONResponse(answer(embedding, offset, body["max_tokens"]))

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])

    def host(self, **facts: Any) -> Host:
        return Host(
            inside_vllm=True,
            api_keys=(KEY,),
            vllm_api_keys=(KEY,),
            expectation=Expectation(frozenset({MODEL})),
            dtype="float32",
            engine_load=lambda: self.engine_load,
            **facts,
        )


def embed(url: str, options: dict[str, Any], weights: str) -> str:
    return hashlib.sha256(json.dumps([url, options, weights], sort_keys=True).encode()).hexdigest()


def answer(embedding: str, offset: float, tokens: int) -> dict[str, Any]:
    content = []
    for index in range(tokens):
        digit = int(embedding[index], 16)
        token, other = f"t{digit}", f"t{(digit + 1) % 16}"
        logprob = -0.2 - digit / 40 + offset
        content.append(
            {
                "token": token,
                "logprob": logprob,
                "top_logprobs": [
                    {"token": token, "logprob": logprob},
                    {"token": other, "logprob": logprob - 2},
                ],
            }
        )
    return {
        "choices": [{"logprobs": {"content": content}}],
        "usage": {"prompt_tokens": 30, "completion_tokens": tokens},
    }


def pd_with(
    fleet: Fleet, urls: list[str], host: Host | None = None, **options: Any
) -> tuple[Starlette, httpx.AsyncClient]:
    app = fleet.app()
    client = httpx.AsyncClient(transport=httpx.MockTransport(fleet.encoder))
    app.add_middleware(
        EPDMiddleware,
        encoders=urls,
        http_client=client,
        host=host or fleet.host(),
        uuid_key=TEST_UUID_KEY,
        **options,
    )
    return app, client


async def probe(app: Starlette, key: str | None = KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pd") as client:
        return await client.post("/epd/status/equivalence", headers=headers)


async def status(app: Starlette) -> dict[str, Any]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pd") as client:
        page: dict[str, Any] = (
            await client.get("/epd/status", headers={"authorization": f"Bearer {KEY}"})
        ).json()
    return page


def middleware_of(app: Starlette) -> EPDMiddleware:
    stack: Any = app.middleware_stack or app.build_middleware_stack()
    app.middleware_stack = stack
    while not isinstance(stack, EPDMiddleware):
        stack = stack.app
    return stack


# The probe -------------------------------------------------------------------------------------------------


async def test_an_equal_fleet_matches_on_both_variants_and_each_path_computed_afresh() -> None:
    fleet = Fleet()
    app, _ = pd_with(fleet, [E0, E1])
    response = await probe(app)
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["ok"] is True
    assert report["mode"] == "pd_alone"
    assert report["tolerance"] == 0.02
    for url in (E0, E1):
        verdict = report["encoders"][url]
        assert verdict["result"] == "match", verdict
        assert set(verdict["variants"]) == {"default", "options"}
        assert verdict["max_logprob_difference"] == 0
    # Per variant: one PD-alone request and one E + PD request per encoder, each under a salt of its
    # own, so that neither the prefix cache nor the encoder cache gives one path the other's work.
    assert len(fleet.engine_bodies) == 2 * 3
    salts = [body["cache_salt"] for body in fleet.engine_bodies]
    assert len(set(salts)) == len(salts)
    local = [body for body in fleet.engine_bodies if not body.get("ec_transfer_params")]
    remote = [body for body in fleet.engine_bodies if body.get("ec_transfer_params")]
    assert len(local) == 2
    assert len(remote) == 4
    uuids = {part.get("uuid") for body in fleet.engine_bodies for part in body["messages"][0]["content"][:1]}
    assert None not in uuids
    assert len(uuids) == 6
    # Each encoder encoded the image itself, once per variant, the options forwarded on the second.
    assert sorted(url for url, _ in fleet.encoder_bodies) == [E0, E0, E1, E1]
    assert [body.get("media_io_kwargs") for _, body in fleet.encoder_bodies].count(
        DEFAULT_OPTIONS["media_io_kwargs"]
    ) == 2
    # A second run draws new identifiers: nothing of the first is reused.
    await probe_again(app)
    assert len({body["cache_salt"] for body in fleet.engine_bodies}) == 12


async def probe_again(app: Starlette) -> None:
    # A run within 10 s of the last answers with the last report; the schedule's runs are not held so.
    await middleware_of(app).equivalence.run_once(engine_of(app))


def engine_of(app: Starlette) -> Engine:
    middleware = middleware_of(app)
    transport = middleware._transports.open()
    return Engine(middleware.app, {"type": "lifespan", "app": app}, middleware._hosts.of({}), transport)


async def test_an_encoder_with_other_weights_is_named_counted_shown_and_ejected(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fleet = Fleet(weights={E1: "w2"})
    app, _ = pd_with(fleet, [E0, E1], equivalence_eject=True)
    with caplog.at_level(logging.WARNING, logger="epd_middleware"):
        report = (await probe(app)).json()
    assert report["ok"] is False
    assert report["encoders"][E0]["result"] == "match"
    mismatch = report["encoders"][E1]
    assert mismatch["result"] == "mismatch"
    assert "where the reference has" in mismatch["detail"]
    assert "(against PD alone)" in mismatch["detail"]
    line = next(record.getMessage() for record in caplog.records if E1 in record.getMessage())
    assert line.startswith(f"epd: encoder {E1} does not answer what PD alone answers: default: token 0")
    assert line.endswith("taken out of the pool until it does")
    page = await status(app)
    assert page["equivalence"]["encoders"][E1]["result"] == "mismatch"
    assert page["encoders"][E1]["healthy"] is False
    assert page["encoders"][E1]["why_not"].startswith("out of the pool: its answers differ from PD's own")
    assert page["counters"]["equivalence_mismatch"] == 1
    assert page["counters"]["equivalence_match"] == 1
    pipeline = middleware_of(app).pipeline
    assert pipeline.encoders.available(anyio.current_time()) == (E0,)
    # Fixed (the right weights loaded again): the next run brings it back.
    fleet.weights.clear()
    await probe_again(app)
    assert pipeline.encoders.available(anyio.current_time()) == (E0, E1)


async def test_a_mismatch_without_the_eject_option_is_loud_but_keeps_the_encoder() -> None:
    fleet = Fleet(weights={E1: "w2"})
    app, _ = pd_with(fleet, [E0, E1])
    assert (await probe(app)).json()["encoders"][E1]["result"] == "mismatch"
    assert middleware_of(app).pipeline.encoders.available(anyio.current_time()) == (E0, E1)


async def test_an_encoder_whose_processor_ignores_the_options_mismatches_on_the_options_variant() -> None:
    fleet = Fleet(ignores_options={E0})
    app, _ = pd_with(fleet, [E0, E1])
    verdict = (await probe(app)).json()["encoders"][E0]
    assert verdict["result"] == "mismatch"
    assert verdict["variants"]["default"].startswith("4 token(s) agree")
    assert verdict["detail"].startswith("options: token 0")


async def test_rounding_within_the_tolerance_matches_and_beyond_it_does_not() -> None:
    fleet = Fleet(offset={E0: 0.01, E1: 0.05})
    app, _ = pd_with(fleet, [E0, E1])
    report = (await probe(app)).json()
    assert report["encoders"][E0]["result"] == "match"
    assert report["encoders"][E0]["max_logprob_difference"] == pytest.approx(0.01)
    assert report["encoders"][E1]["result"] == "mismatch"  # float32's tolerance is 0.02
    app, _ = pd_with(Fleet(offset={E1: 0.05}), [E0, E1], equivalence_tolerance=0.1)
    assert (await probe(app)).json()["ok"] is True


async def test_a_failing_encoder_is_an_error_not_a_match_and_the_call_is_not_failed_over() -> None:
    fleet = Fleet(failing={E1})
    app, _ = pd_with(fleet, [E0, E1])
    report = (await probe(app)).json()
    assert report["encoders"][E1]["result"] == "error"
    assert "the encoder's call failed" in report["encoders"][E1]["detail"]
    # E1's image never went to E0 instead: its answer would have been E0's.
    assert [url for url, _ in fleet.encoder_bodies].count(E0) == 2


async def test_a_busy_engine_gets_no_probe() -> None:
    fleet = Fleet(engine_load=4)
    app, _ = pd_with(fleet, [E0])
    report = (await probe(app)).json()
    assert report["ok"] is None
    assert report["skipped"] == "the engine has 4 unfinished requests (equivalence_max_pd_load 4)"
    assert fleet.engine_bodies == []
    assert fleet.encoder_bodies == []
    page = await status(app)
    assert page["equivalence"]["cost"]["skipped"] == 1
    assert page["counters"]["equivalence_skipped"] == 1


async def test_the_probe_runs_only_for_a_key_holder_and_only_on_post() -> None:
    fleet = Fleet()
    app, _ = pd_with(fleet, [E0])
    assert (await probe(app, key=None)).status_code == 401
    assert (await probe(app, key="wrong")).status_code == 401
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pd") as client:
        got = await client.get("/epd/status/equivalence", headers={"authorization": f"Bearer {KEY}"})
    assert got.status_code == 405
    assert fleet.engine_bodies == []


async def test_probes_asked_for_back_to_back_run_once() -> None:
    fleet = Fleet()
    app, _ = pd_with(fleet, [E0])
    async with anyio.create_task_group() as group:
        for _ in range(5):
            group.start_soon(probe, app)
    assert len(fleet.engine_bodies) == 4  # one run: 2 variants x (PD alone + E0)


async def test_without_per_request_options_the_options_variant_is_not_run() -> None:
    fleet = Fleet()
    app, _ = pd_with(fleet, [E0], host=fleet.host(trusts_request_mm_kwargs=False))
    assert set((await probe(app)).json()["encoders"][E0]["variants"]) == {"default"}


async def test_the_status_page_shows_the_cost() -> None:
    fleet = Fleet()
    app, _ = pd_with(fleet, [E0, E1], equivalence_interval=600)
    await probe(app)
    cost = (await status(app))["equivalence"]["cost"]
    assert cost["runs"] == 1
    assert cost["requests"] == 6
    assert cost["requests_per_run"] == 6
    assert cost["prompt_tokens"] == 180
    assert cost["completion_tokens"] == 24
    assert cost["requests_per_hour"] == 36


# Where PD cannot encode: encoders compared with each other -------------------------------------------------


def mooncake_host(fleet: Fleet) -> Host:
    return fleet.host(ec_connector=MOONCAKE_EC_CONNECTOR, ec_consumer=True)


async def test_a_mooncake_consumer_compares_its_encoders_and_names_the_odd_one() -> None:
    fleet = Fleet(weights={E2: "w2"})
    app, _ = pd_with(fleet, [E0, E1, E2], host=mooncake_host(fleet))
    report = (await probe(app)).json()
    assert report["mode"] == "encoders_compared"
    assert {url: verdict["result"] for url, verdict in report["encoders"].items()} == {
        E0: "match",
        E1: "match",
        E2: "mismatch",
    }
    assert all(body.get("ec_transfer_params") for body in fleet.engine_bodies)  # PD never encodes
    page = await status(app)
    assert page["equivalence"]["weaker_proof"] is True


async def test_two_encoders_that_disagree_cannot_be_told_apart_and_one_alone_is_unproven() -> None:
    fleet = Fleet(weights={E1: "w2"})
    app, _ = pd_with(fleet, [E0, E1], host=mooncake_host(fleet), equivalence_eject=True)
    report = (await probe(app)).json()
    assert {verdict["result"] for verdict in report["encoders"].values()} == {"disagree"}
    assert report["ok"] is False
    assert middleware_of(app).pipeline.encoders.available(anyio.current_time()) == (E0, E1)  # no one ejected
    lone = Fleet()
    app, _ = pd_with(lone, [E0], host=mooncake_host(lone))
    assert (await probe(app)).json()["encoders"][E0]["result"] == "unproven"


# The schedule -----------------------------------------------------------------------------------------------


async def test_the_schedule_runs_at_start_up_and_again_each_interval() -> None:
    fleet = Fleet()
    app, _ = pd_with(fleet, [E0], equivalence_interval=0.2)
    async with serving(app) as sent:
        with anyio.fail_after(5):
            # Polled: the schedule has no hook of its own to wait on, and needs none.
            while middleware_of(app).equivalence.cost.runs < 2:  # noqa: ASYNC110
                await anyio.sleep(0.05)
    assert sent[0]["type"] == "lifespan.startup.complete"
    assert middleware_of(app).equivalence.verdicts[E0].result == "match"


async def test_no_schedule_by_default() -> None:
    fleet = Fleet()
    app, _ = pd_with(fleet, [E0])
    assert middleware_of(app).config.equivalence_interval == 0


# Real requests (verify_share) -----------------------------------------------------------------------------


@asynccontextmanager
async def serving(app: Starlette) -> AsyncIterator[list[dict[str, Any]]]:
    """The app with its lifespan started (the probe's workers run there), shut down after; what the
    server was told. Ready once the start-up completed and, where verify_share asks for it, the
    sampler's worker runs."""
    messages: list[dict[str, Any]] = [{"type": "lifespan.startup"}]
    shutdown = anyio.Event()
    sent: list[dict[str, Any]] = []

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        await shutdown.wait()
        return {"type": "lifespan.shutdown"}

    async def send(message: Message) -> None:
        sent.append(dict(message))

    middleware = middleware_of(app)

    def ready() -> bool:
        started = any(message["type"] == "lifespan.startup.complete" for message in sent)
        return started and (middleware.config.verify_share == 0 or middleware.pipeline.sampler.running)

    async with anyio.create_task_group() as group:
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "app": app}

        async def serve() -> None:
            await app(scope, receive, send)

        group.start_soon(serve)
        with anyio.fail_after(5):
            while not ready():  # noqa: ASYNC110
                await anyio.sleep(0.01)
        try:
            yield sent
        finally:
            shutdown.set()


def client_request(seed: int = 0) -> dict[str, Any]:
    """A client's chat request with an image of its own and its own options."""
    url = probe_image(112 + 8 * seed)
    return {
        "model": MODEL,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}],
            }
        ],
        "max_tokens": 8,
        "stream": False,
        "media_io_kwargs": {"image": {"rgba_background_color": [255, 0, 0]}},
    }


async def ask(app: Starlette, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pd") as client:
        return await client.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
        )


async def settled(app: Starlette, checked: int) -> None:
    sampler = middleware_of(app).pipeline.sampler
    with anyio.fail_after(5):
        while sampler.checked + sampler.skipped < checked:  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def test_a_sampled_request_is_checked_after_its_answer_with_its_own_media_and_options() -> None:
    fleet = Fleet()
    app, _ = pd_with(fleet, [E0, E1], verify_share=1.0)
    async with serving(app):
        response = await ask(app, client_request())
        assert response.status_code == 200
        await settled(app, 1)
    client, *probes = fleet.engine_bodies
    assert client["max_tokens"] == 8
    assert "logprobs" not in client
    assert len(probes) == 2
    for body in probes:
        assert (body["max_tokens"], body["logprobs"], body["top_logprobs"], body["stream"]) == (
            1,
            True,
            5,
            False,
        )
        assert body["media_io_kwargs"] == {"image": {"rgba_background_color": [255, 0, 0]}}  # the client's
        assert body["messages"][0]["content"][1] == {"type": "text", "text": "hi"}
    assert len({body["cache_salt"] for body in probes}) == 2
    assert [bool(body.get("ec_transfer_params")) for body in probes] == [True, False]
    page = (await status(app))["equivalence"]["sampled"]
    assert (page["share"], page["taken"], page["checked"], page["dropped"]) == (1.0, 1, 1, 0)
    assert page["requests"] == 2
    assert page["completion_tokens"] == 2
    [(_url, verdict)] = page["encoders"].items()
    assert verdict["result"] == "match"
    assert middleware_of(app).pipeline.sampler._receive.statistics().current_buffer_used == 0


async def test_an_encoder_that_mishandles_a_real_option_is_found_by_sampling_not_by_the_canary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The encoder honours the canary's black background but not a client's red one: only real media
    and options find it."""
    fleet = Fleet()

    def red_blind(request: httpx.Request) -> httpx.Response:
        red = request.url.path == "/v1/chat/completions" and b"[255,0,0]" in request.content.replace(
            b" ", b""
        )
        (fleet.ignores_options.add if red else fleet.ignores_options.discard)(E0)
        return fleet.encoder(request)

    app, _ = pd_with_client(fleet, [E0, E1], red_blind, verify_share=1.0, equivalence_eject=True)
    assert (await probe(app)).json()["ok"] is True  # E1 matches too: it vouches for PD's answers
    with caplog.at_level(logging.WARNING, logger="epd_middleware"):
        async with serving(app):
            assert (await ask(app, client_request(1))).status_code == 200
            await settled(app, 1)
    verdict = (await status(app))["equivalence"]["sampled"]["encoders"][E0]
    assert verdict["result"] == "mismatch", verdict
    assert f"epd: encoder {E0} does not answer a sampled request as PD alone does" in caplog.text
    assert middleware_of(app).pipeline.encoders.available(anyio.current_time()) == (E1,)
    assert (await status(app))["counters"]["equivalence_traffic_mismatch"] == 1


async def test_the_client_is_never_kept_waiting_and_one_request_is_checked_at_a_time() -> None:
    fleet = Fleet()
    release = anyio.Event()

    async def slow(request: httpx.Request) -> httpx.Response:
        if request.headers.get("x-request-id", "").startswith("epd-equivalence-"):
            await release.wait()  # the check's encoder call, stuck
        return fleet.encoder(request)

    app, _ = pd_with_client(fleet, [E0], slow, verify_share=1.0)
    async with serving(app):
        with anyio.fail_after(2):  # the first check is stuck on its encoder: no client waits for it
            for seed in range(4):
                assert (await ask(app, client_request(seed))).status_code == 200
        sampler = middleware_of(app).pipeline.sampler
        assert sampler.taken == 1  # the one under way: none queued behind it (its media is not held)
        assert sampler.dropped == 3
        release.set()
        await settled(app, 1)


def pd_with_client(
    fleet: Fleet, urls: list[str], handler: Any, **options: Any
) -> tuple[Starlette, httpx.AsyncClient]:
    """The fleet's PD whose encoder calls go to ``handler`` (sync or async, as httpx's MockTransport)."""
    app = fleet.app()
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    app.add_middleware(
        EPDMiddleware, encoders=urls, http_client=client, host=fleet.host(), uuid_key=TEST_UUID_KEY, **options
    )
    return app, client


async def test_no_share_no_check_and_a_busy_engine_skips() -> None:
    fleet = Fleet()
    app, _ = pd_with(fleet, [E0])
    async with serving(app):
        assert (await ask(app, client_request())).status_code == 200
    assert len(fleet.engine_bodies) == 1
    busy = Fleet(engine_load=9)
    app, _ = pd_with(busy, [E0], verify_share=1.0)
    async with serving(app):
        assert (await ask(app, client_request())).status_code == 200
        await settled(app, 1)
    assert middleware_of(app).pipeline.sampler.skipped == 1
    assert len(busy.engine_bodies) == 1


def test_a_share_can_only_be_between_0_and_1() -> None:
    with pytest.raises(ConfigurationError, match="verify_share"):
        EPDConfig.of_options({"encoders": [E0], "verify_share": 1.5})
