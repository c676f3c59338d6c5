"""The fourth outside attack (after issue 35's mends), on asyncio and trio with loopback fakes modelled on
vLLM 0.32: each test names an attack. Those that found a defect fail on the code they were written
against and say what the right behaviour is; those that found none are marked "held" and guard the
behaviour.
"""

from __future__ import annotations

import inspect
import json
from collections import Counter
from typing import Any

import anyio
import httpx
import pytest

from epd_middleware import EPDMiddleware
from epd_middleware._compat import Expectation
from epd_middleware.host import Host

from .fakes import MODEL, TEST_MODELS, TEST_UUID_KEY, FakeEngine, chat_body, image, is_canary, models_answer
from .test_blame_both_ways import ALIAS, counters, encoded, healthy, middleware_of, pool_of, vllm_error
from .test_middleware import E0, E1, E2, png, post
from .test_resilience import _middleware

pytestmark = pytest.mark.anyio

BAD = png(66)  # an image every encoder refuses (vLLM's 400: the request's fault)
REFUSED = "height:1 or width:1 must be larger than factor:28"


class Fleet:
    """Encoders as vLLM serves them (/health, /v1/models, chat completions): test_blame_both_ways.py's
    Fleet, whose ``answer(server, body, request)`` may also be a coroutine (an answer that waits); None:
    encoded as a healthy vLLM would. ``served``: the names each serves (GET /v1/models, and a 404 to a
    call for another)."""

    def __init__(self, answer: Any = None, served: dict[str, list[str]] | None = None) -> None:
        self.answer = answer or (lambda server, body, request: None)
        self.served = served if served is not None else {}
        self.calls: Counter[str] = Counter()
        self.canaries: list[tuple[str, str | None, str]] = []  # server, its Authorization, its model
        self.health: Counter[str] = Counter()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        server = f"{request.url.scheme}://{request.url.netloc.decode()}"
        names = self.served.get(server, TEST_MODELS)
        if request.url.path == "/health":
            self.health[server] += 1
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models_answer(names))
        body = json.loads(request.content)
        if is_canary(body):
            self.canaries.append((server, request.headers.get("authorization"), body["model"]))
        else:
            self.calls[server] += 1
        if body["model"] not in names:
            return vllm_error(404, f"The model `{body['model']}` does not exist.")
        said = self.answer(server, body, request)
        if inspect.isawaitable(said):
            said = await said
        return said if said is not None else encoded(body, request)


def carries(body: dict[str, Any], marker: str) -> bool:
    return marker in json.dumps(body)


def blamed(app: Any, server: str) -> dict[str, int]:
    return dict(pool_of(app).record(server).blamed)


async def warm_up_standing_out(app: Any, rounds: int = 3) -> None:
    """Round-robin over E0, E1, E2: E0 gets ``rounds`` requests it rightly refuses and one it serves, E1
    and E2 one more than ``rounds`` each that they serve: E0's share of rejections is then over half of
    more than three answers, and stands out from the others' (0): its next rejection is tried on a
    second server. The warm-up never had it tried on one (while it was refusing, the others had fewer
    than three answers: nothing to stand out from), so it was never vindicated."""
    for seed in range(rounds):
        assert (await post(app, chat_body(image(BAD)))).status_code == 400
        for other in range(2):
            assert (await post(app, chat_body(image(png(1000 + seed * 2 + other))))).status_code == 200
    for seed in range(3):
        assert (await post(app, chat_body(image(png(2000 + seed))))).status_code == 200


# --- a healthy encoder's failures made to count through the doubt path --------------------------------


async def test_a_request_with_a_good_and_a_bad_image_does_not_unmask_the_encoder_that_told_the_truth() -> (
    None
):
    """One request, two images: the bad one (every encoder refuses it, 400) lands on E0, whose share of
    rejections stands out, so its answer is doubted and tried on another encoder; the good one lands on
    E1 and is served meanwhile. ``Ledger.contradicted`` takes any success of the request's *role* for a
    contradiction of every doubted answer of that role: the good image's success counted E0 as
    ``unmasked`` (its own failure, towards ejection; the EPDEncoderHidesItsFailures alert), while the
    bad image's retry then got the same 400 -- which should have vindicated E0. The client's 400 is
    right; the blame is wrong. Right: a doubted answer is contradicted only by a success of the same
    call (the same items), and E0 is vindicated, never unmasked."""
    retried = anyio.Event()

    async def answer(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        if is_canary(body):
            return None
        if carries(body, BAD):
            if server != E0:
                retried.set()
                await anyio.sleep(0.05)  # the good image's success is in by now
            return vllm_error(400, REFUSED)
        if carries(body, png(7)):
            await retried.wait()  # served while the bad image's doubted answer is being retried
        return None

    fleet = Fleet(answer)
    app, _engine = middleware_of(fleet, [E0, E1, E2], health_check_interval=60, check_models=False)
    await warm_up_standing_out(app)
    with anyio.fail_after(5):
        response = await post(app, chat_body(image(BAD), image(png(7))))
    assert response.status_code == 400
    assert response.json()["error"]["message"] == REFUSED
    assert blamed(app, E0).get("unmasked", 0) == 0, blamed(app, E0)
    assert counters(app)["encoder_failures_blamed_unmasked"] == 0


# --- a broken encoder still hiding --------------------------------------------------------------------


async def test_two_broken_encoders_of_three_do_not_vindicate_each_other() -> None:
    """Two of three encoders are broken alike (a bad rollout: E1 and E2 answer 400 to every real image,
    and encode the tiny canary); E0 is healthy. A doubted answer of E1 is tried on the next server of
    the round-robin, E2, which says the same status: "the request's fault, by two servers", the client
    gets the 400 and E1 is vindicated for a health-check interval (its share starts again). Then the two
    vindicate each other in turn (with affinity, the default, an item ranked E1 then E2 always fails over
    there). Honest requests keep failing for good although E0 serves every one of
    them. Right: two servers whose own shares of rejections are high are no independent evidence; the
    doubted answer is tried on the most trusted server (E0 here), which serves it (``unmasked``)."""

    def broken(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        if server in (E1, E2) and not is_canary(body):
            return vllm_error(400, "Image features and image tokens do not match")
        return None

    fleet = Fleet(broken)
    app, _engine = middleware_of(
        fleet, [E0, E1, E2], encoder_selection="affinity", health_check_interval=60, check_models=False
    )
    statuses = [(await post(app, chat_body(image(png(seed))))).status_code for seed in range(60)]
    # A share over a few answers is evidence: after the first requests every honest request is served.
    assert statuses[:12].count(400) <= 8, statuses
    assert statuses[-30:].count(400) == 0, statuses


async def test_a_rejection_for_another_reason_does_not_vindicate_a_server() -> None:
    """A broken encoder (E1) answers 400 "its own words" to every real image; its share of rejections
    stands out and its answers are tried on E0, which serves them (``unmasked``): honest clients get
    200. Then one bad request lands on E1 (any client's: vLLM's 400 to a bad mm_processor_kwargs). Its
    doubted answer goes to E0, which answers 400 too, for its own reason (another message): ``_agreed``
    compares statuses alone, so E1 is vindicated for a health-check interval and every honest request
    routed to it gets E1's 400 again, though E0 never said anything like it. One bad request per
    interval keeps a broken server hidden. Right: agreement means the same answer (status and vLLM's
    message, as the 5xx rule compares them), and a different one vindicates nobody."""

    def broken(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        if is_canary(body):
            return None
        if server == E1:
            return vllm_error(400, "Image features and image tokens do not match")
        if body.get("mm_processor_kwargs"):
            return vllm_error(400, "Unexpected keyword argument 'bogus' for the image processor")
        return None

    fleet = Fleet(broken)
    app, _engine = middleware_of(fleet, [E0, E1], health_check_interval=60, check_models=False)
    for seed in range(12):
        await post(app, chat_body(image(png(seed))))
    served = [(await post(app, chat_body(image(png(100 + seed))))).status_code for seed in range(6)]
    assert served == [200] * 6  # E1 is doubted and unmasked by now
    # One bad request, to E1's turn of the round-robin.
    if pool_of(app)._next % 2 == 0:
        await post(app, chat_body(image(png(200))))
    bad = await post(app, chat_body(image(png(201)), mm_processor_kwargs={"bogus": 1}))
    assert bad.status_code == 400
    after = [(await post(app, chat_body(image(png(300 + seed))))).status_code for seed in range(10)]
    assert after == [200] * 10, after


async def test_held_a_refused_client_key_does_not_vindicate_an_encoder() -> None:
    """Held (since 0a48ce4; it failed on 70516ee): under forward_authorization a key both encoders refuse
    (401: a typo or an attacker's) is tried on two, and the second's 401 "agreed" with the first's, which
    vindicated the first server for a health-check interval and reset its share -- whatever else it had
    been answering. A broken encoder (E1: 400 to every real image, doubted and unmasked, its requests
    served by E0) was vindicated by one bad-key request landing on it, and honest requests routed to it
    got its 400 again for the interval. Now only an answer about the request vindicates."""

    def broken(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        key = request.headers.get("authorization")
        if key not in ("Bearer good", "Bearer canary-key-0123"):
            return vllm_error(401, "Unauthorized")
        if server == E1 and not is_canary(body):
            return vllm_error(400, "Image features and image tokens do not match")
        return None

    fleet = Fleet(broken)
    app, _engine = middleware_of(
        fleet,
        [E0, E1],
        forward_authorization=True,
        canary_api_key="canary-key-0123",
        check_models=False,
        health_check_interval=60,
    )
    good = {"authorization": "Bearer good"}
    for seed in range(12):
        await post(app, chat_body(image(png(seed))), headers=good)
    served = [
        (await post(app, chat_body(image(png(100 + seed))), headers=good)).status_code for seed in range(6)
    ]
    assert served == [200] * 6  # E1 is doubted and unmasked by now
    if pool_of(app)._next % 2 == 0:  # the bad key's request to E1's turn of the round-robin
        await post(app, chat_body(image(png(200))), headers=good)
    refused = await post(app, chat_body(image(png(201))), headers={"authorization": "Bearer typo"})
    assert refused.status_code == 401
    after = [
        (await post(app, chat_body(image(png(300 + seed))), headers=good)).status_code for seed in range(10)
    ]
    assert after == [200] * 10, after


# --- the canary asks for the client's model where this server's names are not known -----------------------


@pytest.mark.parametrize(
    "options",
    [
        {"check_models": False},
        {"check_models": False, "forward_authorization": True, "canary_api_key": "canary"},
        {},  # outside vLLM, no expected_model: not known until the engine first answers 200
    ],
    ids=["check-models-off", "forwarded-keys", "before-the-first-200"],
)
async def test_a_client_asking_for_a_model_no_one_serves_ejects_no_encoder(options: dict[str, Any]) -> None:
    """``own_name`` keeps the client's model where this server's names are not known: with
    check_models off (as forward_authorization without an encoder key needs it, canary_api_key set as
    the docs advise), or outside vLLM before the engine's first 200. A client sending a model name no
    encoder serves gets vLLM's 404 three times; then the encoder's share of rejections is doubted, its
    canary asks for the same unknown name, gets 404, "the canary encode failed": counted, and the
    client gets a 502 instead of vLLM's 404. Six such requests eject every encoder (confirmed by the same
    failing canary) and everyone gets 503. Right: a canary whose model is not known to be served
    proves nothing (as a keyless canary's 401 does), or asks for a name the encoder itself lists; no
    encoder is ejected, the client keeps getting 404."""

    def keyed(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        if options.get("forward_authorization") and request.headers.get("authorization") not in (
            "Bearer good",
            "Bearer canary",
        ):
            return vllm_error(401, "Unauthorized")
        return None

    fleet = Fleet(keyed, served={E0: [MODEL], E1: [MODEL]})
    app, _engine = middleware_of(fleet, [E0, E1], health_check_interval=0, **options)
    key = {"authorization": "Bearer good"}
    statuses = []
    for seed in range(12):
        response = await post(app, chat_body(image(png(seed)), model="no-such-model"), headers=key)
        statuses.append(response.status_code)
    assert statuses == [404] * 12, statuses
    assert healthy(app) == [E0, E1]
    assert (await post(app, chat_body(image(png(99))), headers=key)).status_code == 200


# --- the model-alias mapping ----------------------------------------------------------------------------


def aliased_app(fleet: Fleet, **options: Any) -> Any:
    """PD answering to two names (--served-model-name MODEL ALIAS), the encoders E0, E1."""
    options.setdefault("encoder_selection", "round_robin")
    options.setdefault("uuid_key", TEST_UUID_KEY)
    return EPDMiddleware(
        FakeEngine().app(),
        encoders=[E0, E1],
        host=Host(expectation=Expectation(frozenset({MODEL, ALIAS}))),
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(fleet)),
        **options,
    )


async def test_an_encoder_restarted_with_fewer_names_gets_requests_for_them_mapped() -> None:
    """E1 served both of PD's names when it was checked; it restarts with ``--served-model-name MODEL``
    only (no ejection: a rolling restart behind one Service address, or a pod replaced between two
    calls). Its names are read only by a model check, which runs for a member not known to match, on a
    return from ejection, and never for one that matches: requests for ALIAS still go to it as ALIAS,
    and each gets vLLM's 404 (the client's "fault"), while E0 serves them and E1 serves MODEL. Most of
    E1's traffic is for MODEL, so its share of rejections stays low: never doubted, never re-checked, a
    404 for every ALIAS request routed to it, for good. Right: an encoder's 404 for a name it was
    listed as serving has it asked again what it serves (or the periodic probe re-reads every
    member's names), and the request goes under a name it serves or to another encoder."""
    from epd_middleware._probes import probe
    from epd_middleware.transport import HttpxTransport

    fleet = Fleet(served={E0: [MODEL, ALIAS], E1: [MODEL, ALIAS]})
    app = aliased_app(fleet)
    for seed in range(4):
        assert (await post(app, chat_body(image(png(seed)), model=ALIAS))).status_code == 200
    fleet.served[E1] = [MODEL]  # restarted with one name
    # A round of health probes (the lifespan's, every health_check_interval) in between.
    await probe(pool_of(app), HttpxTransport(httpx.AsyncClient(transport=httpx.MockTransport(fleet))), {})
    statuses = []
    for seed in range(30):
        model = ALIAS if seed % 3 == 0 else MODEL
        statuses.append(
            (model, (await post(app, chat_body(image(png(100 + seed)), model=model))).status_code)
        )
    assert [status for _, status in statuses] == [200] * 30, statuses


def naming(*servers: str) -> dict[str, str]:
    """llm-d's header naming encoders for a request; a client can send it (the gateway does not remove
    it), and a member of the pool passes the allowlist."""
    return {"x-encoder-hosts-ports": ",".join(server.removeprefix("http://") for server in servers)}


async def make_e0_stand_out(app: Any) -> None:
    """Three requests every encoder rightly refuses, named to E0 (fewer than three answers: its word is
    taken); E1 and E2 serve four honest requests each, E0 one: E0's share (0.71 of 3.4 answers) is
    doubted and stands out from theirs (0), and no second call has vindicated it yet."""
    for _ in range(3):
        assert (await post(app, chat_body(image(BAD)), headers=naming(E0, E1))).status_code == 400
    for seed, server in enumerate([E0, E1, E1, E1, E1, E2, E2, E2, E2]):
        assert (
            await post(app, chat_body(image(png(1000 + seed))), headers=naming(server))
        ).status_code == 200
    assert pool_of(app).doubts(E0, anyio.current_time()) == (True, True)


async def test_an_image_host_that_answers_each_encoder_differently_unmasks_no_healthy_encoder() -> None:
    """The attacker runs the image host: it gives E0's address a 1 x 1 image (vLLM: 400, the processor's
    "must be larger than factor:28") and everyone else a good one. With llm-d's header (which a client
    can send) it names E0, then E1, for its requests: three bad images make E0's share of rejections
    stand out, then its URL: E0's 400 is doubted, E1 fetches a good image and serves it, and E0 -- which
    answered the image it was given truthfully -- is counted ``unmasked`` (its own failure, towards
    ejection; the EPDEncoderHidesItsFailures alert fires), once per such request, at will. Right: as
    with a 5xx naming the media's host, a server's answer about media it fetched itself says nothing
    about the server when another fetch succeeds: counted against nobody (``media``), never
    ``unmasked``."""

    def per_source(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        if is_canary(body):
            return None
        if carries(body, BAD) or (server == E0 and carries(body, "https://attacker.example/")):
            return vllm_error(400, REFUSED)
        return None

    fleet = Fleet(per_source)
    app, _engine = middleware_of(
        fleet, [E0, E1, E2], scheduler="llm-d", health_check_interval=60, check_models=False
    )
    await make_e0_stand_out(app)
    for index in range(3):
        part = {"type": "image_url", "image_url": {"url": f"https://attacker.example/{index}.png"}}
        assert (await post(app, chat_body(part), headers=naming(E0, E1))).status_code == 200
    assert blamed(app, E0).get("unmasked", 0) == 0, blamed(app, E0)
    assert counters(app)["encoder_failures_blamed_unmasked"] == 0


async def test_concurrent_bad_requests_cost_a_standing_out_encoder_one_second_call_not_one_each() -> None:
    """E0's share of rejections stands out (the attacker names it, or its bad image lands on it with
    affinity), so its next rejection is tried on a second server, whose agreement vindicates it for a
    health-check interval: "an attacker pays a second call a while, not one each" -- one request at a
    time. 30 at once are each doubted while the first second opinion is under way (a proof of health
    under way is shared; a second call is not): 30 second calls. Right: while a second opinion on a
    server's answers is under way, its other doubted answers wait for it (as a shared proof does): one
    extra call, not one per concurrent request."""
    arrived, all_arrived = [0], anyio.Event()
    attacking = False

    async def answer(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        if is_canary(body):
            await anyio.sleep(0.02)  # an encode takes a while
            return None
        if carries(body, BAD):
            if attacking and not all_arrived.is_set():
                arrived[0] += 1
                if arrived[0] == 30:
                    all_arrived.set()
                await all_arrived.wait()  # the 30 first calls are in at once
            await anyio.sleep(0.02)
            return vllm_error(400, REFUSED)
        return None

    fleet = Fleet(answer)
    app, _engine = middleware_of(
        fleet, [E0, E1, E2], scheduler="llm-d", health_check_interval=60, check_models=False
    )
    await make_e0_stand_out(app)
    before = sum(fleet.calls.values())
    attacking = True
    statuses: list[int] = []

    async def attack() -> None:
        statuses.append((await post(app, chat_body(image(BAD)), headers=naming(E0, E1))).status_code)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            for _ in range(30):
                group.start_soon(attack)
    assert statuses == [400] * 30
    assert healthy(app) == [E0, E1, E2]
    extra = sum(fleet.calls.values()) - before - 30
    assert extra <= 2, extra


# --- media past the Mooncake-consumer refusal -----------------------------------------------------------


def consumer(engine: FakeEngine, *routes: Any) -> Any:
    """A Mooncake consumer's app: the fake engine's routes and ``routes``, with the middleware."""
    from .test_handoff import mooncake_consumer

    app = engine.app()
    app.router.routes.extend(routes)
    app.add_middleware(EPDMiddleware, encoders=[E0], host=mooncake_consumer(), health_check_interval=0)
    return app


MEDIA = {"model": MODEL, "messages": [{"role": "user", "content": [image(png(1))]}]}


@pytest.mark.parametrize("how", ["mount", "path-parameter", "added-after-start"])
async def test_media_on_a_route_the_guard_did_not_read_is_refused(how: str) -> None:
    """The guard reads the app's routes once, at its first request, and keeps only plain ``Route``s
    without parameters: a sub-application mounted under a prefix (a plugin's or the operator's own
    router under ``/extra``), a POST route with a path parameter, and a route added after the first
    request are not guarded, and a Mooncake consumer's engine gets their media raw (it waits the whole
    push wait, then a bare 500). Right: every POST route of the running app that runs the engine is
    guarded (a Mount's routes by their full path, a parametrised one by its pattern, the app's routes
    read again when they change), or, where the guard cannot tell, media on a route it does not know
    is refused."""
    from starlette.routing import Mount, Route

    from .test_hostile_clients import post as post_to
    from .test_hostile_clients import recording_route

    engine = FakeEngine()
    if how == "mount":
        app, path = (
            consumer(engine, Mount("/extra", routes=[recording_route(engine, "/embed")])),
            "/extra/embed",
        )
    elif how == "path-parameter":
        endpoint = recording_route(engine, "/x").endpoint
        app, path = consumer(engine, Route("/v1/pool/{task}", endpoint, methods=["POST"])), "/v1/pool/embed"
    else:
        app, path = consumer(engine), "/v1/late"
        await post_to(app, {"model": MODEL, "prompt": "hi"}, "/v1/completions")  # the first request
        app.router.routes.append(recording_route(engine, path))
        engine.received.clear()
    response = await post_to(app, MEDIA, path)
    assert engine.received == [], path
    assert response.status_code == 501


async def drive(
    app: Any, path: str, chunks: list[bytes], headers: list[tuple[bytes, bytes]], root_path: str = ""
) -> int:
    """One POST through the ASGI app, its body in ``chunks`` (as a chunked upload comes); its status."""
    messages = [
        {"type": "http.request", "body": chunk, "more_body": index < len(chunks) - 1}
        for index, chunk in enumerate(chunks)
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": root_path + path,
        "raw_path": (root_path + path).encode(),
        "root_path": root_path,
        "query_string": b"",
        "headers": [(b"host", b"pd"), *headers],
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 5000),
    }
    with anyio.fail_after(5):
        await app(scope, receive, send)
    return int(next(message["status"] for message in sent if message["type"] == "http.response.start"))


JSON_TYPE = [(b"content-type", b"application/json")]
RAW_MEDIA = json.dumps(MEDIA).encode()
SPLIT = RAW_MEDIA.index(b"data:") + 2
UPLOAD = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\nRIFF\r\n--b--\r\n'


@pytest.mark.parametrize(
    ("path", "chunks", "headers", "root_path"),
    [
        ("/v1/embeddings", [RAW_MEDIA[:SPLIT], RAW_MEDIA[SPLIT:]], JSON_TYPE, ""),  # "data:" cut in two
        ("/v1/embeddings", [b"", RAW_MEDIA, b""], JSON_TYPE, ""),
        ("/v1/embeddings", [RAW_MEDIA], [(b"content-type", b"text/plain")], ""),
        ("/v1/embeddings", [RAW_MEDIA], [], ""),
        ("/v1/embeddings", [RAW_MEDIA.replace(b"data:image", b"DaTa:iMaGe")], JSON_TYPE, ""),
        ("/v1/embeddings", [b"\xef\xbb\xbf" + RAW_MEDIA], JSON_TYPE, ""),
        ("/v1/embeddings", [RAW_MEDIA], JSON_TYPE, "/api"),
        ("/v1/embeddings/", [RAW_MEDIA], JSON_TYPE, ""),  # Starlette redirects; the engine sees nothing
        ("//v1/embeddings", [RAW_MEDIA], JSON_TYPE, ""),
        (
            "/v1/audio/transcriptions",
            [UPLOAD],
            [(b"content-type", b"Multipart/Form-Data; boundary=b")],
            "",
        ),
    ],
    ids=[
        "split",
        "empty-chunks",
        "text-plain",
        "no-type",
        "case",
        "bom",
        "root-path",
        "slash",
        "double",
        "upload",
    ],
)
async def test_held_media_in_any_framing_never_reaches_a_consumers_engine(
    path: str, chunks: list[bytes], headers: list[tuple[bytes, bytes]], root_path: str
) -> None:
    """Held: media on a guarded route, its body cut across chunks (``data:`` split in two), with empty
    chunks, any content type or none, the scheme in mixed case, a UTF-8 BOM, under a root path, a
    trailing or doubled slash (Starlette redirects or answers 404), an upload in mixed-case multipart:
    refused (501) or not routed; never in the engine."""
    from .test_hostile_clients import recording_route

    engine = FakeEngine()
    routes = [recording_route(engine, p) for p in ("/v1/embeddings", "/v1/audio/transcriptions")]
    app = consumer(engine, *routes)
    status = await drive(app.build_middleware_stack(), path, chunks, headers, root_path)
    assert engine.received == []
    assert status in (501, 307, 404), status


# --- placement -------------------------------------------------------------------------------------------


def padded_png(width: int, height: int, padding: int) -> str:
    """A data URL of a ``width`` x ``height`` PNG followed by ``padding`` bytes after its IEND (Pillow
    stops at IEND; every byte is still sent, base64-decoded and read by the encoder)."""
    import base64

    from .test_placement import png_of

    data = base64.b64decode(png_of(width, height).split(",", 1)[1]) + b"\0" * padding
    return "data:image/png;base64," + base64.b64encode(data).decode()


async def test_an_image_padded_past_its_end_is_no_slowdown_of_small_images() -> None:
    """Issue 35 classed a call by its vision tokens, not its bytes, so that flat PNGs (few bytes, many
    tokens) no longer read as slow small calls. The mirror image games it the other way: a 56 x 56 PNG
    (4 tokens) followed by megabytes of padding after its IEND is a small call that takes as long as
    its bytes do to send and decode; one such call per encoder per health-check interval keeps every
    encoder ``saturated`` (its slowdown over the fastest 4-token call is a hundredfold), and every
    honest request at a PD with headroom is encoded on PD itself (``encoders_saturated``), its TPOT paid
    by everyone decoding there. Right: a call is compared only with calls of its size in bytes too (a
    size class of both), or its bytes' own cost taken out, so padding makes no encoder read as slow."""
    from .test_placement import picture

    padded = padded_png(56, 56, 2_000_000)

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content)
        # Every encode takes a while (a floor, so that a loaded test machine's jitter is no slowdown of
        # its own), and megabytes to read and decode much longer.
        await anyio.sleep(0.3 if len(request.content) > 1_000_000 else 0.03)
        return encoded(body, request)

    engine = FakeEngine()
    app = engine.app()
    app.add_middleware(
        EPDMiddleware,
        encoders=[E0],
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
        host=Host(engine_load=lambda: 1),  # PD has headroom: neither idle nor busy
        placement="adaptive",
        health_check_interval=60,
        uuid_key=TEST_UUID_KEY,
        check_models=False,
    )
    for side in (56, 57, 58):  # honest small calls: the class's fastest
        assert (await post(app, chat_body(picture(side, side)))).status_code == 200
    assert (await post(app, chat_body(picture(1024, 1024)))).status_code == 200
    assert engine.received[-1].json["messages"][0]["content"][1]["type"] == "image_embeds"  # remote
    attack = {"type": "image_url", "image_url": {"url": padded}}
    assert (await post(app, chat_body(attack))).status_code == 200
    engine.received.clear()
    assert (await post(app, chat_body(picture(1024, 1024)))).status_code == 200
    [received] = engine.received
    assert received.json["messages"][0]["content"][1]["type"] == "image_embeds"  # encoded remotely


@pytest.mark.parametrize("where", ["before-the-extensions", "five-bytes", "before-the-frame"])
def test_a_gif_with_a_stray_byte_before_its_frame_is_sized_as_pillow_sizes_it(where: str) -> None:
    """Pillow's GIF reader skips a byte it does not know between blocks (``GifImagePlugin._seek``: an
    unknown tag is passed over, "raise OSError, illegal GIF tag" commented out) and goes on to the first
    frame, growing the 1 x 1 screen to its 600 x 500 extent. The middleware's walk stops at the first
    unknown byte and answers the screen's size: 1 x 1. One stray byte and a 4000 x 4000 GIF counts 4
    bytes against vLLM 0.33's decode budget (a split request passes where a single instance refuses it)
    and 4 vision tokens in placement (``small``: encoded on PD). Pillow 13 gives (600, 500) for each of
    these files (checked). Right: skip unknown bytes as Pillow does, or answer None (not known)."""
    import base64

    from epd_middleware._media_budget import image_size

    from .test_media_budget import gif

    data = gif((1, 1), (600, 500))
    cut = data.index(b"!\xf9") if where != "before-the-frame" else data.index(b",")
    stray = b"\x00\x01\x02\x03\x04" if where == "five-bytes" else b"\x00"
    url = "data:image/gif;base64," + base64.b64encode(data[:cut] + stray + data[cut:]).decode()
    assert image_size(url) in ((600, 500), None)


# --- the client's key and the operator's ------------------------------------------------------------------


async def test_a_stranger_a_client_names_never_gets_the_operators_canary_key() -> None:
    """Under forward_authorization the calls carry the client's own key, and canary_api_key is the
    operator's key for the canary, valid on every encoder. A client can send llm-d's header (the
    gateway does not remove it) naming any address scheduler_allow admits (a pod network): a pod of its
    own there answers its calls 400, its share of rejections makes it doubted, and "its canary decides":
    the middleware sends it the canary, with the operator's key. Before issue 35 the canary ran only at an
    ejection's confirmation and carried the client's own key. Right: the operator's key goes to pool
    members only; a stranger's answers are taken or failed over without a canary carrying it."""
    stranger = "http://10.9.9.9:8001"
    keys_seen: list[str | None] = []

    def attacker(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        if server == stranger:
            keys_seen.append(request.headers.get("authorization"))
            if not is_canary(body):
                return vllm_error(400, "no")
        return None

    fleet = Fleet(attacker)
    app, _engine = middleware_of(
        fleet,
        [E0, E1],
        forward_authorization=True,
        canary_api_key="operator-canary-key-0123",
        check_models=False,
        scheduler="llm-d",
        scheduler_allow=["10.0.0.0/8:8001"],
        health_check_interval=0,
    )
    own = {"authorization": "Bearer attackers-own-key", "x-encoder-hosts-ports": "10.9.9.9:8001"}
    for seed in range(8):
        await post(app, chat_body(image(png(seed))), headers=own)
    assert keys_seen, "the stranger was called"
    assert "Bearer operator-canary-key-0123" not in keys_seen, keys_seen


# --- forged log lines ---------------------------------------------------------------------------------------


@pytest.fixture
def lines() -> Any:
    """What the middleware's logger writes, through a text handler with vLLM's kind of format."""
    import io
    import logging

    from epd_middleware._logs import logger

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


async def test_a_request_id_cannot_write_another_requests_line(lines: Any) -> None:
    """Every line of a request starts ``request <id>:``, its id the client's X-Request-Id where it sent
    one (printable ASCII kept as is: spaces and colons too). A client whose id is ``victim-7: answered
    200 OK;`` has its own refusal written as ``request victim-7: answered 200 OK;: answered 400 ...``:
    one physical line, but read (and grepped) as victim-7's, saying something nobody logged. Right: the
    id is shown so that it ends where it ends -- its spaces and colons escaped (or the id quoted), so
    the first ``: `` after ``request `` always ends the id."""
    fleet = Fleet(lambda server, body, request: vllm_error(400, REFUSED))
    app, _engine = middleware_of(fleet, [E0], check_models=False)
    forged = "victim-7: answered 200 OK;"
    response = await post(app, chat_body(image(png(1))), headers={"x-request-id": forged})
    assert response.status_code == 400
    written = lines.getvalue().splitlines()
    assert written
    for line in written:
        message = line.split(": ", 1)[1]  # after "LEVEL epd_middleware"
        assert not message.startswith("request victim-7: "), line


# --- the middleware's own answers, complete ---------------------------------------------------------------


async def test_the_status_pages_refusals_carry_a_request_id_and_leave_a_line(lines: Any) -> None:
    """Issue 35 put every answer of the middleware's own through one function: a line in the log, and
    X-Request-Id where vLLM's --enable-request-id-headers puts one on its answers. The status page's
    401 (a key missing or wrong: someone probing for the page that names every encoder) and 405 are
    still sent on their own: no X-Request-Id, no line. Right: they go through the same answer (one
    INFO line ``request <id>: answered 401 ...``, the id header)."""
    from .test_hostile_clients import get
    from .test_hostile_clients import post as post_to

    engine = FakeEngine()
    app = engine.app()
    app.add_middleware(
        EPDMiddleware,
        encoders=[E0],
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(Fleet())),
        host=Host(request_id_headers=True, api_keys=("good",)),
        uuid_key=TEST_UUID_KEY,
        health_check_interval=0,
    )
    refused = await get(app, "/epd/status", **{"x-request-id": "probe-1"})
    assert refused.status_code == 401
    wrong_method = await post_to(
        app, {}, "/epd/status", authorization="Bearer good", **{"x-request-id": "probe-2"}
    )
    assert wrong_method.status_code == 405
    assert refused.headers.get("x-request-id") == "probe-1"
    assert wrong_method.headers.get("x-request-id") == "probe-2"
    assert "request probe-1: answered 401" in lines.getvalue()
    assert "request probe-2: answered 405" in lines.getvalue()


@pytest.mark.parametrize("case", ["ejected", "pending", "ejected-messages", "encoders-own-503"])
async def test_held_every_503_says_when_to_come_back(case: str) -> None:
    """Held: a 503 of every kind carries Retry-After -- every encoder ejected (chat and Anthropic's
    Messages), the pending limit, and the encoders' own 503 given to the client as the request's answer
    (two encoders answer it, the second proves healthy)."""
    from .test_hostile_clients import post as post_to
    from .test_third_attack import surface_body

    release = anyio.Event()

    async def answer(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        if is_canary(body) and not case.startswith("ejected"):  # a broken encoder fails its canary too
            return None
        if case == "pending":
            await release.wait()
            return None
        if case == "encoders-own-503":
            return vllm_error(503, "The server is currently overloaded")
        return vllm_error(500, "EngineCore died")

    fleet = Fleet(answer)
    options: dict[str, Any] = {"check_models": False, "health_check_interval": 0, "retry_after": 7}
    if case.startswith("ejected"):
        options["eject_after"] = 1
    if case == "pending":
        options["max_pending_requests"] = 1
    app, _engine = middleware_of(fleet, [E0, E1], **options)
    path = "/v1/messages" if case == "ejected-messages" else "/v1/chat/completions"
    if case == "pending":
        async with anyio.create_task_group() as group:
            group.start_soon(post_to, app, surface_body(path, png(1)), path)
            await anyio.sleep(0.05)
            response = await post_to(app, surface_body(path, png(2)), path)
            release.set()
    else:
        for seed in range(4):
            response = await post_to(app, surface_body(path, png(seed)), path)
            if response.status_code == 503:
                break
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) >= 1


# --- what held ------------------------------------------------------------------------------------------


async def test_held_a_prefill_server_that_rejects_every_prompt_is_unmasked_and_its_requests_served() -> None:
    """Held: a prefill server answering 400 to every prompt (a smaller --max-model-len) among three: its
    share of rejections stands out, its answers are tried on another prefill server, which serves
    them (``unmasked``); after the first few, every request is served."""
    from .fakes import FakeEncoders, FakePrefill, build_app

    prefills = ["http://prefill-0:8100", "http://prefill-1:8100", "http://prefill-2:8100"]
    encoders, engine, prefill = FakeEncoders([E0]), FakeEngine(), FakePrefill(prefills)
    prefill.mode[prefills[1]] = "400"
    built, _ = build_app(encoders, engine, prefill, health_check_interval=60, check_models=False)
    app = built.build_middleware_stack()
    statuses = [(await post(app, chat_body(image(png(seed))))).status_code for seed in range(30)]
    assert statuses[-20:] == [200] * 20, statuses
    pipeline = _middleware(app).pipeline
    assert pipeline.prefill.record(prefills[1]).blamed["unmasked"] >= 3
    assert all(not state["failures_by_blame"] for state in pipeline.encoders.snapshot(0).values())


async def test_held_an_encoder_that_answers_501_to_every_real_call_but_encodes_the_canary_is_unmasked() -> (
    None
):
    """Held (with affinity, three encoders): an encoder answering 501 to every real call and encoding
    the tiny canary is doubted once its share is over half, its canary passes, its share stands out, and
    its answers are tried on another encoder, which serves them: counted ``unmasked``, and the clients
    get 200 after the first few."""

    def broken(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        if server == E1 and not is_canary(body):
            return vllm_error(501, "Only base64 data URLs are supported for now.")
        return None

    fleet = Fleet(broken)
    app, _engine = middleware_of(
        fleet, [E0, E1, E2], encoder_selection="affinity", health_check_interval=60, check_models=False
    )
    statuses = [(await post(app, chat_body(image(png(seed))))).status_code for seed in range(40)]
    assert statuses.count(501) <= 4, statuses
    assert statuses[-20:] == [200] * 20
    assert blamed(app, E1).get("unmasked", 0) >= 3


async def test_held_a_lora_adapters_name_is_sent_as_it_is_and_the_canary_asks_for_pds_own() -> None:
    """Held: a request for a LoRA adapter's name (not one of PD's served names) goes to the encoder
    under that name, never mapped to the base model's (the server judges it); an encoder that lacks it
    answers 404, the client gets it, and the canary that its share of rejections brings asks for one of
    PD's own names: no encoder is counted or ejected."""
    fleet = Fleet(served={E0: [MODEL, "my-lora"], E1: [MODEL]})
    app = aliased_app(fleet, health_check_interval=0)
    statuses = []
    for seed in range(12):
        statuses.append((await post(app, chat_body(image(png(seed)), model="my-lora"))).status_code)
    assert set(statuses) <= {200, 404}
    assert {model for _, _, model in fleet.canaries} <= {MODEL, ALIAS}
    assert healthy(app) == [E0, E1]
    assert all(state.get("server", 0) == 0 for state in (blamed(app, E0), blamed(app, E1)))


async def test_held_with_a_single_encoder_a_doubted_answer_costs_one_canary_a_while() -> None:
    """Held, bounded (and a limit of the design, not a defect of it): with one encoder there is no second
    server to contradict a "client fault" answer. An encoder answering 501 to every real call but
    encoding the canary keeps failing its clients with its 501 (nothing else could serve them); its
    doubt costs it one canary per health-check interval, not one per request, and it is never
    ejected on its own word."""

    def broken(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response | None:
        return None if is_canary(body) else vllm_error(501, "Not implemented")

    fleet = Fleet(broken)
    app, _engine = middleware_of(fleet, [E0], health_check_interval=60, check_models=False)
    statuses = [(await post(app, chat_body(image(png(seed))))).status_code for seed in range(20)]
    assert statuses == [501] * 20
    assert len(fleet.canaries) == 1
    assert healthy(app) == [E0]


HUGE = "1" + "0" * 400


@pytest.mark.parametrize(
    "extra",
    [
        f', "mm_processor_kwargs": {{"foo": {HUGE}, "size": {{"height": {HUGE}}}}}',
        ', "mm_processor_kwargs": {"max_pixels": 1e400, "min_pixels": NaN}',
        f', "media_io_kwargs": {{"image": {{"x": {HUGE}}}}}',
        f', "max_tokens": {HUGE}, "min_tokens": {HUGE}, "priority": {HUGE}',
        ', "cache_salt": "\\ud800", "user": "\\udfff"',
        f', "cache_salt": {HUGE}',
    ],
    ids=["kwargs-ints", "kwargs-floats", "media-io-int", "sampling-ints", "salt-surrogate", "salt-int"],
)
async def test_held_odd_numbers_and_surrogates_in_a_request_are_no_500(extra: str) -> None:
    """Held: ints no float or int64 holds, inf and NaN, lone surrogates, in the options, the sampling
    fields, the salt: never a 500 from the middleware (vLLM, on the encoder or the engine, answers
    them; the fake encoder here answers what it cannot read 400)."""
    from .fakes import FakeEncoders, build_app

    class Strict(FakeEncoders):
        async def handle(self, request: httpx.Request) -> httpx.Response:
            try:
                return await super().handle(request)
            except (TypeError, ValueError, AttributeError):
                return vllm_error(400, "invalid request")

    for part in (image(png(1)), {"type": "image_url", "image_url": {"url": "http://\\ud800.example/a.png"}}):
        body = json.dumps(chat_body(part)).replace("\\\\ud800", "\\ud800")
        raw = (body[:-1] + extra + "}").encode()
        app, _ = build_app(Strict([E0, E1]), FakeEngine())
        response = await post(app, raw)
        assert response.status_code != 500, response.text
        assert response.json()
