"""The third outside attack (after issue 29's mends), on asyncio and trio with loopback fakes modelled on
vLLM 0.32: each test names an attack. Those that found a defect say what happened before the mend; those
that found none are marked "held" and guard the behaviour.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import anyio
import httpx
import pytest

from .fakes import (
    MODEL,
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
from .test_hostile_clients import post as post_to
from .test_hostile_clients import recording_route
from .test_middleware import E0, E1, E2, png, post
from .test_resilience import _middleware

pytestmark = pytest.mark.anyio


def encoded(body: dict[str, Any], request: httpx.Request) -> httpx.Response:
    return httpx.Response(
        200, json=encoder_reply(body, reported_entries(body), request.headers.get("x-request-id"))
    )


class Encoders:
    """vLLM encoders behind one async handler: /health, /v1/models, and chat completions answered by
    ``chat`` (body, request) -> response, which may wait. Counts the canaries and /health probes each
    server got."""

    def __init__(self, chat: Any, canary_takes: float = 0.01, *, broken: bool = False) -> None:
        self.chat = chat
        self.canary_takes = canary_takes
        # A broken server: its canary fails as its clients' calls do.
        self.broken = broken
        self.canaries: dict[str, int] = {}
        self.health: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        server = f"{request.url.scheme}://{request.url.netloc.decode()}"
        if request.url.path == "/health":
            self.health[server] = self.health.get(server, 0) + 1
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models_answer(TEST_MODELS))
        body = json.loads(request.content)
        if is_canary(body):
            self.canaries[server] = self.canaries.get(server, 0) + 1
            await anyio.sleep(self.canary_takes)  # an encode takes a while
            if not self.broken:
                return encoded(body, request)
        else:
            self.calls[server] = self.calls.get(server, 0) + 1
        result = self.chat(server, body, request)
        if not isinstance(result, httpx.Response):
            result = await result
        return result


def states(app: Any) -> dict[str, dict[str, Any]]:
    return _middleware(app).pipeline.encoders.snapshot(anyio.current_time())


def healthy(app: Any) -> list[str]:
    return [url for url, state in states(app).items() if state["healthy"]]


def vllm_500(message: str) -> httpx.Response:
    error = {"message": message, "type": "InternalServerError", "code": 500}
    return httpx.Response(500, json={"error": error})


def pil_failure() -> httpx.Response:
    """A 500 whose message differs on every call and every server: PIL's "cannot identify image file"
    naming a Python object's address, as a server that does not strip it gives it (vLLM 0.32's
    sanitize_message does; another version, a proxy, or a message with a per-server id differs)."""
    return vllm_500(f"cannot identify image file <_io.BytesIO object at 0x7f{secrets.token_hex(5)}>")


def carries(body: dict[str, Any], marker: str) -> bool:
    return marker in json.dumps(body)


# --- the shared encoders: a healthy encoder's failures made to count against it --------------------------


async def test_a_client_holding_every_slot_of_an_encoder_does_not_get_it_ejected_by_its_canary() -> None:
    """The canary that confirms an ejection waited for one of this process's own slots on the server, like
    a client's call: a client holding them all with slow media (an image host that answers slowly) made
    it wait past its timeout, "the canary encode failed", and a healthy encoder left the pool on the
    next failure blamed on it (one request whose bytes PIL cannot read). Every user then got 503."""
    slow, release = png(7), anyio.Event()

    async def chat(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        if carries(body, slow):
            await release.wait()
        elif carries(body, png(66)):
            await anyio.sleep(0.1)  # meanwhile more slow requests queue for the slots
            return pil_failure()
        return encoded(body, request)

    app, _engine = app_with_encoder_handler(
        Encoders(chat),
        encoders=[E0],
        max_inflight_per_encoder=2,
        eject_after=1,
        health_check_timeout=0.2,
        health_check_interval=0,
    )
    middleware = app.build_middleware_stack()
    async with anyio.create_task_group() as group:
        group.start_soon(post, middleware, chat_body(image(slow)))
        await anyio.sleep(0.02)
        group.start_soon(post, middleware, chat_body(image(png(66))))
        await anyio.sleep(0.02)
        for _ in range(3):
            group.start_soon(post, middleware, chat_body(image(slow)))
        await anyio.sleep(0.5)
        assert healthy(middleware) == [E0]
        release.set()
    assert (await post(middleware, chat_body(image(png(1))))).status_code == 200


async def test_concurrent_bad_requests_cost_each_encoder_one_canary_not_one_each() -> None:
    """Canary amplification: a request that fails the same way on a second encoder has that encoder prove
    itself healthy (/health and a canary encode), and a proof holds a while, but only once it is made:
    every request that became suspect while one was under way made its own. 30 concurrent requests with
    bytes no server can decode cost the second encoder 30 canaries and 30 health checks at once (a client
    at c100 made a hundred encodes of the middleware's own per round trip). Now a proof under way is
    shared."""
    poison = png(66)

    async def chat(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        if carries(body, poison):
            await anyio.sleep(0.05)
            return vllm_500("cannot identify image file")
        return encoded(body, request)

    encoders = Encoders(chat, canary_takes=0.1)
    app, engine = app_with_encoder_handler(encoders, encoders=[E0, E1], health_check_interval=0)
    middleware = app.build_middleware_stack()
    answers: list[int] = []

    async def attack() -> None:
        answers.append((await post(middleware, chat_body(image(poison)))).status_code)

    with anyio.fail_after(10):
        async with anyio.create_task_group() as group:
            for _ in range(30):
                group.start_soon(attack)
    assert answers == [500] * 30  # vLLM's own answer, the request at fault
    assert sum(encoders.canaries.values()) <= 2
    assert sum(encoders.health.values()) <= 2
    assert healthy(middleware) == [E0, E1]
    assert engine.received == []


async def test_a_shared_proof_whose_maker_left_is_made_again_by_the_one_waiting() -> None:
    """The shared proof's guard: a request that left (its caller disconnected) while its proof was under
    way leaves no verdict; the request that waited for it makes its own rather than taking none."""
    from epd_middleware._pool import PoolPolicy, ServerPool
    from epd_middleware._probes import proves_healthy

    from .fake_transport import FakeTransport, after, vllm

    pool = ServerPool("encoder", PoolPolicy(timeout=1.0, health_check_timeout=1.0))
    pool.set_members([E0])
    transport = FakeTransport({E0: vllm(health=after(0.1, lambda call: (200, b"")))})
    said: list[str | None] = []

    async def waiting() -> None:
        await anyio.sleep(0.02)
        said.append(await proves_healthy(pool, transport, E0))

    async with anyio.create_task_group() as group:
        group.start_soon(waiting)
        with anyio.move_on_after(0.05):
            await proves_healthy(pool, transport, E0)
    assert said == [None]
    assert len(transport.to(E0, "/health")) == 2


EGRESS_DOWN = (
    "Cannot connect to host images.example.com:443 ssl:default [Temporary failure in name resolution]"
)


async def test_an_encoder_that_cannot_fetch_any_url_is_failed_over_not_taken_for_the_clients_fault() -> None:
    """A truly broken encoder (its own DNS or egress down) answers every http(s) image with aiohttp's
    "Cannot connect to host <the image's host>". A message naming the request's media host was taken
    as proof that the request is at fault: the client got that 500 after one call, never the encoder
    that could fetch it, and the broken one was never blamed. With affinity every request for that image
    failed, where a single instance (or the other encoder) answers 200."""

    def chat(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        if server == E0 and carries(body, "https://images.example.com/"):
            return vllm_500(EGRESS_DOWN)
        return encoded(body, request)

    app, engine = app_with_encoder_handler(Encoders(chat), encoders=[E0, E1], health_check_interval=0)
    middleware = app.build_middleware_stack()
    for index in range(4):
        part = {"type": "image_url", "image_url": {"url": f"https://images.example.com/{index}.png"}}
        response = await post(middleware, chat_body(part))
        assert response.status_code == 200, response.text
    assert len(engine.received) == 4
    # Not counted against it either: one server's failed fetch proves nothing about the server.
    assert states(middleware)[E0]["failures_by_blame"] == {"media": 4}
    assert healthy(middleware) == [E0, E1]


async def test_an_image_host_that_does_not_resolve_costs_two_calls_and_gets_vllms_answer() -> None:
    """The other side of the mend above (before: one call, the same answer): a client repeating an image
    host that resolves nowhere gets vLLM's 500 with vLLM's words once two encoders agreed, no encoder is
    blamed, no canary is sent, and with a single encoder the answer is vLLM's too (no other server to say
    otherwise)."""
    unresolvable = {"type": "image_url", "image_url": {"url": "https://images.nope.invalid/a.png"}}
    said = "Cannot connect to host images.nope.invalid:443 ssl:default [Name or service not known]"

    def chat(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        return vllm_500(said) if carries(body, "nope.invalid") else encoded(body, request)

    for pool in ([E0, E1, E2], [E0]):
        encoders = Encoders(chat)
        app, engine = app_with_encoder_handler(encoders, encoders=pool, health_check_interval=0)
        middleware = app.build_middleware_stack()
        for _ in range(6):
            response = await post(middleware, chat_body(unresolvable))
            assert response.status_code == 500
            assert response.json()["error"]["message"] == said
        assert sum(encoders.calls.values()) == 6 * min(len(pool), 2)
        assert sum(encoders.canaries.values()) == 0
        assert healthy(middleware) == pool
        assert all(state["consecutive_failures"] == 0 for state in states(middleware).values())
        assert engine.received == []


async def test_under_forward_authorization_a_canary_without_a_key_proves_nothing_either_way() -> None:
    """With forward_authorization the encoders check the clients' own keys, and the middleware has none
    of its own (no encoder_api_key, no canary_api_key; model checks off, as they need one). The canary
    went without any: every encoder answered it 401, "the canary encode failed", so any three failures
    blamed on a server (three requests with bytes PIL cannot read, from one client with a good key)
    ejected it, and six emptied a pool of two for everyone: issue 29's attack again. Issue 29 made the
    canary carry the client's key; issue 35 found that a throttled key then ejects every encoder. Now the
    canary never carries a client's key, and a 401 to a canary that carries none says nothing of the
    server's encoding: /health stands alone (tests/test_blame_both_ways.py: with canary_api_key)."""

    async def chat(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        if carries(body, png(66)):
            return pil_failure()
        return encoded(body, request)

    inner = Encoders(chat)
    refused_canaries: list[str | None] = []

    async def keyed(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/") and request.headers.get("authorization") != "Bearer good":
            if is_canary(json.loads(request.content)):
                refused_canaries.append(request.headers.get("authorization"))
            return httpx.Response(401, json={"error": "Unauthorized"})
        return await inner(request)

    app, _engine = app_with_encoder_handler(
        keyed, encoders=[E0, E1], forward_authorization=True, check_models=False, health_check_interval=0
    )
    middleware = app.build_middleware_stack()
    key = {"authorization": "Bearer good"}
    for _ in range(6):
        response = await post(middleware, chat_body(image(png(66))), headers=key)
        assert response.status_code == 502
    assert healthy(middleware) == [E0, E1]
    assert refused_canaries
    assert set(refused_canaries) == {None}
    assert (await post(middleware, chat_body(image(png(1))), headers=key)).status_code == 200


async def test_failures_that_differ_on_every_server_eject_no_healthy_encoder() -> None:
    """Held: a request whose failure reads differently on every server (``pil_failure``), so no two
    servers ever agree. Each request still costs one server one failure (the others are
    capped), and a server that reaches eject_after proves itself with a canary and stays."""

    def chat(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        return pil_failure() if carries(body, png(66)) else encoded(body, request)

    encoders = Encoders(chat)
    app, _engine = app_with_encoder_handler(encoders, encoders=[E0, E1, E2], health_check_interval=0)
    middleware = app.build_middleware_stack()
    for attack in range(12):
        assert (await post(middleware, chat_body(image(png(66))))).status_code == 502
        assert (await post(middleware, chat_body(image(png(attack))))).status_code == 200
    assert healthy(middleware) == [E0, E1, E2]
    blamed = [state["failures_by_blame"] for state in states(middleware).values()]
    assert sum(counts.get("server", 0) for counts in blamed) == 12
    assert sum(state["ejections_averted"] for state in states(middleware).values()) >= 3
    assert sum(encoders.canaries.values()) <= 3  # a proof holds a while


async def test_an_image_host_slower_than_the_encoder_timeout_ejects_no_encoder() -> None:
    """Held: media on a host that never answers times the call out on the first encoder (counted) and on
    the second (which proves healthy): the request is at fault, 504, the first count is taken back, and
    no third encoder is tried."""

    async def chat(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        if carries(body, "tarpit.example"):
            await anyio.sleep(10)
        return encoded(body, request)

    encoders = Encoders(chat)
    app, _engine = app_with_encoder_handler(
        encoders, encoders=[E0, E1, E2], encoder_timeout=0.1, health_check_interval=0
    )
    middleware = app.build_middleware_stack()
    slow = {"type": "image_url", "image_url": {"url": "https://tarpit.example/a.png"}}
    for _ in range(6):
        response = await post(middleware, chat_body(slow))
        assert response.status_code == 504
        assert "timed out on 2 encoders" in response.json()["error"]["message"]
    assert sum(encoders.calls.values()) == 12
    assert healthy(middleware) == [E0, E1, E2]
    assert all(state["consecutive_failures"] == 0 for state in states(middleware).values())


async def test_a_hung_encoder_is_not_shielded_by_a_clients_timeouts_being_taken_back() -> None:
    """Held: an encoder that hangs on every encode (its /health still answers) gets its failures counted
    by honest requests; a client whose own slow media times out everywhere has only its own count taken
    back, so the hung encoder still fails its canary and leaves the pool."""

    async def chat(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        if server == E0 or carries(body, "tarpit.example"):
            await anyio.sleep(10)
        return encoded(body, request)

    async def hung_canaries(request: httpx.Request) -> httpx.Response:
        server = f"{request.url.scheme}://{request.url.netloc.decode()}"
        if server == E0 and request.url.path == "/v1/chat/completions":
            await anyio.sleep(10)  # the canary hangs too
        return await inner(request)

    inner = Encoders(chat)
    app, _engine = app_with_encoder_handler(
        hung_canaries,
        encoders=[E0, E1],
        encoder_timeout=0.1,
        health_check_timeout=0.1,
        health_check_interval=0,
    )
    middleware = app.build_middleware_stack()
    slow = {"type": "image_url", "image_url": {"url": "https://tarpit.example/a.png"}}
    for seed in range(4):
        assert (await post(middleware, chat_body(slow))).status_code == 504
        assert (await post(middleware, chat_body(image(png(seed))))).status_code == 200
    assert healthy(middleware) == [E1]


async def test_a_client_holding_one_encoders_slots_does_not_make_honest_requests_wait() -> None:
    """Held: with affinity, an encoder whose slots a client holds (slow media) is skipped at once by
    the bounded-load rule; honest requests go to the next encoder of their ranking without waiting for a
    slot, and nothing is blamed."""
    slow, release = png(7), anyio.Event()

    async def chat(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        if carries(body, slow):
            await release.wait()
        return encoded(body, request)

    app, _engine = app_with_encoder_handler(
        Encoders(chat),
        encoders=[E0, E1],
        encoder_selection="affinity",
        max_inflight_per_encoder=2,
        health_check_interval=0,
    )
    middleware = app.build_middleware_stack()
    async with anyio.create_task_group() as group:
        for _ in range(2):
            group.start_soon(post, middleware, chat_body(image(slow)))
        await anyio.sleep(0.05)
        with anyio.fail_after(1):
            for seed in range(10, 18):
                assert (await post(middleware, chat_body(image(png(seed))))).status_code == 200
        release.set()
    assert all(not state["failures_by_blame"] for state in states(middleware).values())


async def test_an_encoder_whose_canary_passes_while_real_calls_fail_costs_clients_nothing() -> None:
    """Held for the clients, left for the server: an encoder that fails every real encode (say, out of
    memory on real images) but encodes the tiny canary is kept in the pool at every confirmation (it
    proves healthy on its own); every client still gets 200 from the encoder its call fails over to."""

    def chat(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        return vllm_500("CUDA out of memory") if server == E0 else encoded(body, request)

    app, _engine = app_with_encoder_handler(Encoders(chat), encoders=[E0, E1], health_check_interval=0)
    middleware = app.build_middleware_stack()
    for seed in range(9):
        assert (await post(middleware, chat_body(image(png(seed))))).status_code == 200
    assert states(middleware)[E0]["ejections_averted"] >= 1


# --- the engine: what reaches it unchecked, or read otherwise --------------------------------------------

FORGED = {"consumer_zmq": "tcp://203.0.113.9:5555", "ec_items": [{"transfer_id": "victims-id"}]}
UUID_ONLY = {"type": "image_url", "image_url": None, "uuid": "0123456789abcdef0123456789abcdef"}
PIL_UUID_ONLY = {"image_pil": None, "uuid": "0123456789abcdef0123456789abcdef"}


def fake_pd(**options: Any) -> tuple[Any, FakeEngine, FakeEncoders]:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, **options)
    for path in ("/v1/chat/completions/batch",):
        app.router.routes.append(recording_route(engine, path))
    return app, engine, encoders


def with_parts(path: str, *parts: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A body of ``path``'s surface whose user message holds ``parts`` (Responses: an input item)."""
    content = [{"type": "text", "text": "Describe."}, *parts]
    if path == "/v1/responses":
        return {"model": MODEL, "input": [{"role": "user", "content": content}], **fields}
    if path == "/v1/chat/completions/batch":
        return {"model": MODEL, "messages": [[{"role": "user", "content": content}]], **fields}
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


SURFACES = ["/v1/chat/completions", "/v1/responses", "/v1/chat/completions/batch"]


@pytest.mark.parametrize("path", SURFACES)
@pytest.mark.parametrize(
    "part",
    [UUID_ONLY, PIL_UUID_ONLY, {"type": "text", "text": "no media"}],
    ids=["image_url", "image_pil", "text"],
)
async def test_a_clients_transfer_params_never_reach_the_engine_beside_a_reference_by_uuid(
    path: str, part: dict[str, Any]
) -> None:
    """Item 6's rule held only for requests the middleware handled: a request whose only media is a
    part that refers to earlier media by uuid alone (vLLM resolves it from its processor cache; the
    engine then has a multimodal feature to transfer) went to the engine byte for byte, the client's
    ``ec_transfer_params`` with it: ECCPUConnector reads a per-hash entry's ``peer_host`` to fetch the
    embedding from, Mooncake claims and cancels pushes by the client's transfer ids. Now every
    intercepted body that sets them is parsed, and none of them reaches the engine (text only
    included, where they would steer nothing today)."""
    app, engine, _ = fake_pd()
    response = await post_to(app, with_parts(path, part, ec_transfer_params=FORGED), path)
    assert response.status_code == 200
    [received] = engine.received
    assert "ec_transfer_params" not in received.json


@pytest.mark.parametrize("path", SURFACES)
@pytest.mark.parametrize(
    "parts",
    [[UUID_ONLY], [PIL_UUID_ONLY], [image(png(1)), UUID_ONLY]],
    ids=["reference", "image_pil", "with-an-image"],
)
async def test_on_a_mooncake_consumer_a_reference_by_uuid_alone_is_refused_at_once(
    path: str, parts: list[dict[str, Any]]
) -> None:
    """Item 2's rule missed one path: a part referring to earlier media by uuid alone is raw media to
    the engine (vLLM resolves it from its processor cache), which on a Mooncake consumer waits the whole
    push wait for a push nobody was asked for (the middleware encodes nothing for it, and keeps the
    request's other items of that modality raw too) and answers a bare 500. It went to the engine;
    now the client gets a 400 at once, before any encoder call."""
    from .test_handoff import mooncake_consumer

    app, engine, encoders = fake_pd(host=mooncake_consumer(policy="error"))
    with anyio.fail_after(5):
        response = await post_to(app, with_parts(path, *parts), path)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "by its uuid alone" in error["message"]
    assert error["param"] == ("input" if path == "/v1/responses" else "messages")
    assert engine.received == []
    assert encoders.calls == []


async def test_elsewhere_a_reference_by_uuid_alone_still_goes_to_vllm() -> None:
    """Held (the mend's other side): a server that encodes media itself takes such a reference from its
    processor cache, as vLLM does."""
    app, engine, _ = fake_pd()
    assert (await post_to(app, with_parts("/v1/chat/completions", UUID_ONLY))).status_code == 200
    assert engine.received[0].json["messages"][0]["content"][1] == UUID_ONLY


async def test_an_image_in_a_responses_assistant_item_vllm_keeps_whole_is_encoded() -> None:
    """vLLM keeps an assistant item's first text only, but an item whose content does not start with a
    text (its first part has no "text") it passes on whole, media included
    (``responses/utils.py`` ``_construct_message_from_response_item``), and the chat parser reads media
    in assistant messages too. The middleware skipped every assistant item: such an image reached the
    engine unseen (PD encoded it itself; on a Mooncake consumer it waited the push wait), and no media
    policy, budget or encoder saw it. Now it is found and encoded like any other."""
    app, engine, encoders = fake_pd()
    picture = {"type": "input_image", "image_url": f"data:image/png;base64,{png(3)}"}
    body = {
        "model": MODEL,
        "input": [
            {"role": "assistant", "content": [picture]},
            {"role": "user", "content": [{"type": "input_text", "text": "and this one?"}]},
        ],
    }
    assert (await post_to(app, body, "/v1/responses")).status_code == 200
    assert len(encoders.calls) == 1
    [received] = engine.received
    sent = received.json["input"][0]["content"][0]
    assert sent["uuid"] == encoders.calls[0].body["messages"][0]["content"][0]["uuid"]
    assert received.json["ec_transfer_params"]


async def test_an_image_after_an_assistant_items_first_text_is_left_as_vllm_drops_it() -> None:
    """Held: an assistant item that starts with a text keeps that text alone in vLLM; its image is
    dropped, so no encoder is called for it."""
    app, _engine, encoders = fake_pd()
    picture = {"type": "input_image", "image_url": f"data:image/png;base64,{png(3)}"}
    said = {"type": "output_text", "text": "a cat"}
    body = {"model": MODEL, "input": [{"role": "assistant", "content": [said, picture]}]}
    assert (await post_to(app, body, "/v1/responses")).status_code == 200
    assert encoders.calls == []


# --- internal addresses in answers ------------------------------------------------------------------------


def surface_body(path: str, data: str) -> dict[str, Any]:
    """A one-image request of ``path``'s surface."""
    if path == "/v1/messages":
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
        return {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [block]}]}
    return with_parts(path, image(data))


def answering(status: int, content: Any) -> Any:
    def chat(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        if isinstance(content, bytes):
            return httpx.Response(status, content=content)
        return httpx.Response(status, json=content)

    return chat


async def refusing(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused to 10.0.3.7:8001", request=request)


async def hanging(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
    await anyio.sleep(10)
    raise AssertionError("unreachable")


FAILURES = {
    "500": answering(500, {"error": {"message": "EngineCore died at 10.0.3.7", "code": 500}}),
    "502 html": answering(502, b"<html>bad gateway enc-0.svc.cluster.local</html>"),
    "404": answering(404, {"error": {"message": "The model `x` does not exist.", "code": 404}}),
    "413": answering(413, {"error": {"message": "too large", "code": 413}}),
    "429": answering(429, {"error": {"message": "slow down", "code": 429}}),
    "not json": answering(200, b"<html>enc-0</html>"),
    "no handle": answering(200, {"ec_transfer_params": {"a": {"metadata": {"x": 1}}, "b": {"metadata": {}}}}),
    "hang": hanging,
}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
@pytest.mark.parametrize("failure", [*FAILURES, "refused", "ejected", "overloaded"])
async def test_no_answer_names_an_encoder_or_its_address(path: str, failure: str) -> None:
    """Held: every error path (every encoder failure, an empty pool's 503 with Retry-After, the pending
    limit's 503), on chat, Messages and Responses: the client reads the role and the reason, never an
    encoder's URL, its host name or the address in a transport error; nor do the headers."""
    handler: Any = Encoders(FAILURES.get(failure, answering(500, {"error": {"message": "x"}})), broken=True)
    if failure == "refused":
        handler = refusing
    options: dict[str, Any] = {
        "encoder_timeout": 0.1,
        "health_check_timeout": 0.1,
        "health_check_interval": 0,
    }
    if failure == "ejected":
        options["eject_after"] = 1
    if failure == "overloaded":
        options["max_pending_requests"] = 1
    app, _engine = app_with_encoder_handler(handler, encoders=[E0, E1], **options)
    middleware = app.build_middleware_stack()
    answers = []
    if failure == "overloaded":
        release = anyio.Event()

        async def held(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
            await release.wait()
            return encoded(body, request)

        handler.chat, handler.broken = held, False
        async with anyio.create_task_group() as group:
            group.start_soon(post_to, middleware, surface_body(path, png(1)), path)
            await anyio.sleep(0.05)
            answers.append(await post_to(middleware, surface_body(path, png(2)), path))
            release.set()
    else:
        for seed in range(3):
            answers.append(await post_to(middleware, surface_body(path, png(seed)), path))
    assert any(answer.status_code >= 400 for answer in answers)
    for answer in answers:
        seen = answer.text + json.dumps(dict(answer.headers))
        for secret in ("enc-0", "enc-1", "8001", "10.0.3.7", "cluster.local"):
            assert secret not in seen, (failure, seen)


def test_a_500_without_vllms_type_is_named_as_vllm_names_it() -> None:
    """The request's own answer keeps vLLM's status; where the server gave no type (a proxy's body), the
    type is named after the status as vLLM names it. For 500 that gave "InternalServerErrorError" (the
    phrase already ends in "Error"); vLLM says "InternalServerError"."""
    from epd_middleware.errors import UpstreamRejected

    assert UpstreamRejected(E0, 500, "upstream exploded").error_type == "InternalServerError"
    assert UpstreamRejected(E0, 503, "busy").error_type == "ServiceUnavailableError"
    assert UpstreamRejected(E0, 499, "gone").error_type == "ClientError"


@pytest.mark.parametrize("status", [204, 302, 304, 100])
async def test_a_status_that_is_no_error_never_becomes_the_clients_answer(status: int) -> None:
    """Two encoders (or a proxy before them) answering a request with a status that is no error and no
    answer (204, a redirect, 304, 1xx) "fail the same way", and the second proves healthy: the request
    was judged at fault and the client got that status, with a JSON body after a 204 or 304 (which
    HTTP forbids: servers abort such a response) or a 1xx as a final answer. Such a status says
    nothing about the request: it is the servers' bad answer, 502."""

    def chat(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        if carries(body, png(66)):
            return httpx.Response(status, headers={"location": "http://10.0.3.7/"})
        return encoded(body, request)

    app, _engine = app_with_encoder_handler(Encoders(chat), encoders=[E0, E1], health_check_interval=0)
    middleware = app.build_middleware_stack()
    response = await post(middleware, chat_body(image(png(66))))
    assert response.status_code == 502
    assert response.json()["error"]["message"].startswith("an encoder failed: HTTP")
    assert "location" not in response.headers


def escaped(body: dict[str, Any], *names: str) -> bytes:
    """``body`` as JSON with each of ``names`` spelled with a ``\\u`` escape for its underscore."""
    raw = json.dumps(body)
    for name in names:
        raw = raw.replace(f'"{name}"', '"' + name.replace("_", "\\u005f") + '"')
    return raw.encode()


@pytest.mark.parametrize("path", SURFACES)
async def test_transfer_params_spelled_with_escapes_are_dropped_all_the_same(path: str) -> None:
    """Held: ``ec_transfer_params`` spelled ``ec\\u005ftransfer\\u005fparams`` (any byte scan misses it;
    vLLM's json reads the same key), beside an image, a reference by uuid, or text alone: none of it
    reaches the engine."""
    for parts in ([image(png(1))], [UUID_ONLY], []):
        app, engine, _ = fake_pd()
        raw = escaped(with_parts(path, *parts, ec_transfer_params=FORGED), "ec_transfer_params")
        assert b"ec_transfer_params" not in raw
        assert (await post_to(app, raw, path)).status_code == 200
        assert "victims-id" not in engine.received[0].body.decode()


@pytest.mark.parametrize("path", [*SURFACES, "/v1/messages"])
async def test_vllm_xargs_setting_transfer_params_are_refused_in_any_spelling(path: str) -> None:
    """Held: ``vllm_xargs`` carrying ``ec_transfer_params`` (vLLM copies it into the engine request where
    the body's own is empty), plain or with its keys escaped, with or without media, on every surface
    that reads it: 400 naming vllm_xargs, nothing reaches the engine."""
    for parts in ([image(png(1))], []):
        body = (
            surface_body(path, png(1))
            if path == "/v1/messages" and parts
            else with_parts(path, *parts)
            if path != "/v1/messages"
            else {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
        )
        body["vllm_xargs"] = {"ec_transfer_params": "tcp://203.0.113.9:1"}
        for raw in (json.dumps(body).encode(), escaped(body, "vllm_xargs", "ec_transfer_params")):
            app, engine, encoders = fake_pd()
            response = await post_to(app, raw, path)
            assert response.status_code == 400
            assert engine.received == []
            assert encoders.calls == []


async def test_duplicate_keys_are_read_as_vllm_reads_them() -> None:
    """Held: a body with a key twice (``messages`` with an image, then text only; ``ec_transfer_params``
    twice) is read with the last value winning, as vLLM's json reads it, so the middleware never
    checks one value while the engine gets another."""
    app, engine, encoders = fake_pd()
    media = json.dumps([{"role": "user", "content": [image(png(1))]}])
    text = json.dumps([{"role": "user", "content": "hi"}])
    raw = (
        f'{{"model": "{MODEL}", "messages": {text}, "ec_transfer_params": {json.dumps(FORGED)}, '
        f'"messages": {media}, "ec_transfer_params": {{}}}}'
    ).encode()
    assert (await post_to(app, raw)).status_code == 200
    assert len(encoders.calls) == 1
    received = engine.received[0].json
    assert received["messages"][0]["content"][0]["type"] == "image_embeds"
    assert "victims-id" not in engine.received[0].body.decode()


# --- crashes and hangs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [
        b'{"error": ' * 5000 + b"1" + b"}" * 5000,
        b'{"error": {"message": ' + b"[" * 5000 + b"]" * 5000 + b"}}",
        b'{"error": {"message": "x", "type": ' + b"[" * 3000 + b"]" * 3000 + b"}}",
    ],
    ids=["nested-error", "nested-message", "nested-type"],
)
async def test_error_bodies_nested_past_any_stack_crash_nothing(answer: bytes) -> None:
    """Held: encoders answering 500 with bodies nested thousands deep, on both servers (so they are
    compared, and the request may be judged from them): the client gets a clean error, no 500."""

    def chat(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, content=answer)

    app, _engine = app_with_encoder_handler(Encoders(chat), encoders=[E0, E1], health_check_interval=0)
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code in (500, 502)
    assert response.json()["error"]["message"]


@pytest.mark.parametrize(
    "reply",
    [
        {"ec_transfer_params": [1, 2]},
        {"ec_transfer_params": {"epd-canary-v1": {"item_indices": ["x"], "metadata": 5}}},
        {"ec_transfer_params": {"a" * 300: {"metadata": {"g": [1]}}, "b": {"metadata": {"g": [1]}}}},
        [],
    ],
    ids=["list", "bad-entry", "two-entries", "not-an-object"],
)
async def test_a_canary_answered_with_garbage_fails_the_proof_and_nothing_else(reply: Any) -> None:
    """Held: the canary's answer is read as every encoder answer is: garbage fails the proof (the server
    is counted, and ejected once confirmed), never the request with a 500."""

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content)
        if is_canary(body):
            return httpx.Response(200, json=reply)
        return vllm_500("EngineCore died")

    app, _engine = app_with_encoder_handler(handler, encoders=[E0], eject_after=1, check_models=False)
    middleware = app.build_middleware_stack()
    response = await post(middleware, chat_body(image(png(1))))
    assert response.status_code == 502
    assert healthy(middleware) == []


async def test_a_client_leaving_during_a_confirmation_leaves_no_server_unejectable() -> None:
    """Held: the request whose failure started an ejection's confirmation is cancelled (its client left)
    while the canary runs; the server is not left marked "confirming" (which would stop every later
    confirmation), so the next request's failures still eject it."""
    canary_started = anyio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content)
        if is_canary(body):
            canary_started.set()
            await anyio.sleep(0.5)
        return vllm_500("EngineCore died")

    app, _engine = app_with_encoder_handler(
        handler, encoders=[E0], eject_after=1, check_models=False, health_check_timeout=0.2
    )
    middleware = app.build_middleware_stack()
    async with anyio.create_task_group() as group:
        group.start_soon(post, middleware, chat_body(image(png(1))))
        await canary_started.wait()
        group.cancel_scope.cancel()
    assert states(middleware)[E0]["healthy"]  # not decided: its confirmation was cut short
    assert (await post(middleware, chat_body(image(png(2))))).status_code == 502
    assert healthy(middleware) == []


async def test_a_responses_assistant_item_of_unreadable_shape_is_a_400_not_a_500() -> None:
    """Held (the mend's edge): an assistant item whose first part is not an object, beside an image: vLLM
    would read it with .get(); the middleware refuses it (400), never a 500, nothing reaches the engine."""
    app, engine, encoders = fake_pd()
    picture = {"type": "input_image", "image_url": f"data:image/png;base64,{png(3)}"}
    body = {"model": MODEL, "input": [{"role": "assistant", "content": ["text", picture]}]}
    response = await post_to(app, body, "/v1/responses")
    assert response.status_code == 400
    assert engine.received == []
    assert encoders.calls == []


# --- more of the same, and what bounds them ---------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions/batch"])
async def test_a_reference_removed_during_a_slow_call_never_reaches_the_engine_on_other_surfaces(
    path: str, tmp_path: Any
) -> None:
    """Held: item 3's re-check at hand-off on Responses and batch too (a cleanup removes a client's
    referenced embedding while an image of the same request is being encoded): 400, nothing reaches the
    engine (whose core would die on it)."""
    import shutil

    from .test_hostile_clients import inside_vllm, reference, stored

    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, tmp_path)
    app.router.routes.append(recording_route(engine, "/v1/chat/completions/batch"))
    identifier = "d" * 64
    stored(tmp_path, identifier)
    encoders.pause, encoders.started = 0.3, anyio.Event()
    answers: list[httpx.Response] = []

    async def send() -> None:
        answers.append(await post_to(app, with_parts(path, reference(identifier), image(png(1))), path))

    async with anyio.create_task_group() as group:
        group.start_soon(send)
        await encoders.started.wait()
        shutil.rmtree(tmp_path / identifier)
    assert answers[0].status_code == 400
    assert "no longer has" in answers[0].json()["error"]["message"]
    assert engine.received == []


async def test_a_client_costs_a_server_with_a_failing_canary_one_canary_per_request_at_most() -> None:
    """Held, measured (canary amplification where proofs fail and are not kept): a client repeating a
    request that fails the same way on both encoders, where the second fails its canary, costs that
    server at most one canary per request, one request at a time or many at once, and it leaves the pool
    once its own failures are confirmed."""

    def chat(server: str, body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        return vllm_500("cannot identify image file") if carries(body, png(66)) else encoded(body, request)

    encoders = Encoders(chat, canary_takes=0.05, broken=True)
    app, _engine = app_with_encoder_handler(encoders, encoders=[E0, E1], health_check_interval=0)
    middleware = app.build_middleware_stack()
    for _ in range(5):
        await post(middleware, chat_body(image(png(66))))
    async with anyio.create_task_group() as group:
        for _ in range(20):
            group.start_soon(post, middleware, chat_body(image(png(66))))
    assert sum(encoders.canaries.values()) <= 25
    assert sum(encoders.calls.values()) <= 2 * 25


async def test_an_engine_500_costs_the_encoders_a_bounded_number_of_encodes() -> None:
    """Held: a request the engine answers 500 before any byte is encoded again engine_retries times, no
    more (a client cannot loop the encoders with a request that breaks the engine)."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, engine_retries=2)
    engine.fail_next = 10
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == 500
    assert len(encoders.calls) == 3
    assert len(engine.received) == 3


async def test_a_server_that_breaks_right_after_proving_itself_leaves_within_a_proof_window() -> None:
    """Held, bounded (the proof cache): a proof of health is taken on trust for one health-check
    interval, so a server that breaks right after proving itself is kept through confirmations within
    that window; once it ends, the next confirmation finds it broken and it leaves the pool."""
    broken = {"now": False}

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(500 if broken["now"] else 200)
        body = json.loads(request.content)
        if is_canary(body) and not broken["now"]:
            return encoded(body, request)
        return vllm_500("EngineCore died")

    app, _engine = app_with_encoder_handler(
        handler, encoders=[E0, E1], eject_after=1, check_models=False, health_check_interval=0.3
    )
    middleware = app.build_middleware_stack()
    await post(middleware, chat_body(image(png(1))))  # both fail, both prove healthy: kept
    assert healthy(middleware) == [E0, E1]
    broken["now"] = True
    await anyio.sleep(0.35)
    for seed in (2, 3):  # a request costs one server one failure: two requests, two servers
        await post(middleware, chat_body(image(png(seed))))
    assert healthy(middleware) == []


@pytest.mark.parametrize("kind", ["reference", "tensor"])
async def test_a_client_embedding_never_reaches_the_engine_unless_clients_are_trusted_with_them(
    tmp_path: Any, kind: str
) -> None:
    """The PD must run with --enable-mm-embeds for the middleware's rewrite, which vLLM documents as "the
    engine may crash if incorrect shape of embeddings is passed; only for trusted users". A client
    reference to an embedding that exists (the canary's own, ``epd-canary-v1``, is always there once a
    canary ran; any image the client sent is stored under a content uuid it can compute) passes the
    presence check whatever its ``image_grid_thw`` says; a grid larger than the stored tensor makes the
    engine merge fewer embeddings than placeholders, a ValueError in the model runner that kills the engine
    core for everyone; a tensor of the wrong width does the same. Only presence can be checked here, never
    the shape: by default (client_embeddings=refuse) every client embedding is refused. Before: this
    reference reached the engine."""
    from .test_hostile_clients import inside_vllm, reference, stored

    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, tmp_path, client_embeddings="refuse")
    stored(tmp_path, "epd-canary-v1")  # a canary of 56 x 56 pixels: image_grid_thw [1, 4, 4]
    lie = reference("epd-canary-v1")
    if kind == "reference":
        lie["image_embeds"] = {"image_grid_thw": [1, 200, 200]}
    else:
        lie["image_embeds"] = "AAAA" * 64  # a tensor of the client's own
    response = await post_to(app, chat_body(lie))
    assert response.status_code == 400
    assert "client_embeddings=refuse" in response.json()["error"]["message"]
    assert engine.received == []


@pytest.mark.parametrize("key", [None, "Bearer wrong", "bearer  good", "Basic good"])
async def test_the_status_page_names_no_server_without_the_key(key: str | None) -> None:
    """Held: /epd/status (which names every encoder) answers 401 without a key the server takes, in any
    near-miss spelling of one, and POST gets 405; with the key it answers."""
    from .test_hostile_clients import get

    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, api_keys=["good"])
    headers = {"authorization": key} if key is not None else {}
    response = await get(app, "/epd/status", **headers)
    assert response.status_code == 401
    assert "enc-0" not in response.text
    assert (await post_to(app, {}, "/epd/status", authorization="Bearer good")).status_code == 405
    assert (await get(app, "/epd/status", authorization="Bearer good")).status_code == 200
