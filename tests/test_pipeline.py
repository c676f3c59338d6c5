"""One request's path below the ASGI layer: :class:`Pipeline` parses a body, makes its context and prepares
the engine's body, its encoder and prefill calls going to a :class:`FakeTransport`, on asyncio and trio.

Each test reads the exact bodies the servers were sent and the body the local engine would get.
"""

from __future__ import annotations

import base64
import contextlib
import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from epd_middleware import EPDConfig, Host
from epd_middleware._compat import Expectation
from epd_middleware._context import RequestContext
from epd_middleware._pipeline import Pipeline
from epd_middleware._protocol import EXAMPLE_CONNECTOR_FILE, PREFILL_KV_TRANSFER_PARAMS
from epd_middleware._scheduler import NO_ROUTE, Route
from epd_middleware._surfaces import (
    ParsedRequest,
    Surface,
    anthropic_messages,
    openai_chat,
    openai_chat_batch,
    openai_responses,
)
from epd_middleware.errors import (
    NoHealthyUpstream,
    Overloaded,
    TooManyMediaItems,
    UnresolvableReference,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from epd_middleware.host import MooncakeConsumers

from .fake_transport import (
    DEFAULT_GRID,
    MODEL,
    SMALL_GRID,
    Call,
    FakeTransport,
    answer_status,
    content_hash,
    derived_hash,
    encoder,
    hang,
    prefill_answer,
    prefill_params,
    refuse,
    vllm,
)
from .fakes import TEST_UUID_KEY
from .fakes import uuid_of as keyed_uuid

pytestmark = pytest.mark.anyio

E0, E1 = "http://enc-0:8001", "http://enc-1:8001"
P0 = "http://prefill-0:8100"
ZMQ = "tcp://127.0.0.1:15000"
REQUEST_ID = "req-1"
CHAT = openai_chat.SURFACE
MESSAGES = anthropic_messages.SURFACE
RESPONSES = openai_responses.SURFACE
BATCH = openai_chat_batch.SURFACE
# Every option the encoder must see as the engine does (the size override makes the small grid).
OPTIONS: dict[str, Any] = {
    "mm_processor_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 50176}},
    "media_io_kwargs": {"image": {"mode": "RGB"}},
    "priority": 5,
    "session_id": "session-1",
}


def pipeline(**options: Any) -> Pipeline:
    defaults = {
        "encoders": (E0, E1),
        "health_check_interval": 0,
        "check_models": False,
        "encoder_selection": "round_robin",
        "uuid_key": TEST_UUID_KEY,
    }
    return Pipeline(EPDConfig(**{**defaults, **options}))


def png(seed: int) -> str:
    return base64.b64encode(bytes((seed * 31 + i) % 256 for i in range(600))).decode()


def url(seed: int) -> str:
    return f"data:image/png;base64,{png(seed)}"


def image(seed: int, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url(seed)}, **extra}


def audio(seed: int) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": png(seed), "format": "wav"}}


TEXT = {"type": "text", "text": "Describe."}


def chat_body(*parts: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": [TEXT, *parts]}],
        "temperature": 0,
        "max_tokens": 16,
        **fields,
    }


def uuid_of(seed: int, salt: str | None = None) -> str:
    """The content uuid the middleware gives an image (hashes the URL text as sent)."""
    return keyed_uuid("image", (url(seed),), salt)


def parsed(pipe: Pipeline, body: dict[str, Any], surface: Surface = CHAT) -> ParsedRequest:
    request = pipe.parse(surface, json.dumps(body).encode())
    assert request is not None
    return request


def context_of(
    pipe: Pipeline,
    request: ParsedRequest,
    transport: FakeTransport,
    host: Host | None = None,
    *,
    authorization: str | None = None,
    headers: tuple[tuple[bytes, bytes], ...] = (),
    route: Route = NO_ROUTE,
    surface: Surface | None = None,
) -> RequestContext:
    return pipe.context(
        request,
        host or Host(),
        transport,
        REQUEST_ID,
        authorization=authorization,
        headers=headers,
        route=route,
        surface=surface,
    )


async def prepared(pipe: Pipeline, surface: Surface, request: ParsedRequest, context: RequestContext) -> Any:
    return json.loads((await pipe.prepare(surface, request, context)).body)


async def run(
    pipe: Pipeline,
    body: dict[str, Any],
    transport: FakeTransport,
    *,
    surface: Surface = CHAT,
    host: Host | None = None,
    **context: Any,
) -> Any:
    """Parse, make the context and prepare: the engine's body, decoded."""
    request = parsed(pipe, body, surface)
    context = context_of(pipe, request, transport, host, surface=surface, **context)
    return await prepared(pipe, surface, request, context)


def encoders(*urls: str, storage: Path | None = None) -> FakeTransport:
    return FakeTransport({u: vllm(encoder(storage)) for u in urls})


def by_request_id(calls: list[Call]) -> list[Call]:
    """Concurrent calls in the order of their request ids (enc0, enc1 ...)."""
    return sorted(calls, key=lambda call: call.request_id or "")


def sent_parts(call: Call) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = call.json["messages"][0]["content"]
    return parts


# --- what passes ---------------------------------------------------------------------------------------


async def test_a_text_only_body_passes_unparsed_and_nothing_is_called() -> None:
    pipe, transport = pipeline(), encoders(E0, E1)
    text = {"model": MODEL, "messages": [{"role": "user", "content": "an image_url, in words"}]}
    assert pipe.parse(CHAT, json.dumps(text).encode()) is None
    parts = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "image_url"}]}],
    }
    assert pipe.parse(CHAT, json.dumps(parts).encode()) is None  # parsed: no media in it
    assert transport.calls == []


# --- the encoder calls ---------------------------------------------------------------------------------


async def test_each_image_goes_to_an_encoder_with_its_uuid_the_forwarded_options_and_a_request_id() -> None:
    pipe, transport = pipeline(max_batch_size=1), encoders(E0, E1)
    body = chat_body(image(1), image(2), cache_salt="salt", **OPTIONS)
    await run(pipe, body, transport)
    first, second = by_request_id(transport.posts())
    assert (first.server, second.server) == (E0, E1)  # round robin from the pool's cursor
    assert (first.request_id, second.request_id) == (f"{REQUEST_ID}-enc0", f"{REQUEST_ID}-enc1")
    for call, seed in ((first, 1), (second, 2)):
        # The client's part with the content uuid (salted by cache_salt, which is not sent), the options
        # exactly as the engine will apply them, and nothing else of the client's request.
        assert call.json == {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{**image(seed), "uuid": uuid_of(seed, "salt")}]}],
            "stream": False,
            "max_tokens": 1,
            **OPTIONS,
        }
        assert call.headers["content-type"] == "application/json"
        assert "authorization" not in call.headers


async def test_images_on_one_encoder_travel_together_at_most_max_batch_size_a_call() -> None:
    pipe, transport = pipeline(encoders=(E0,), max_batch_size=2), encoders(E0)
    await run(pipe, chat_body(image(1), image(2), image(3)), transport)
    calls = by_request_id(transport.posts())
    assert [[part["uuid"] for part in sent_parts(call)] for call in calls] == [
        [uuid_of(1), uuid_of(2)],
        [uuid_of(3)],
    ]


async def test_the_same_image_twice_is_encoded_once_and_both_parts_reference_it() -> None:
    pipe, transport = pipeline(), encoders(E0, E1)
    out = await run(pipe, chat_body(image(1), image(1)), transport)
    [call] = transport.posts()
    assert [part["uuid"] for part in sent_parts(call)] == [uuid_of(1)]
    reference = {"type": "image_embeds", "image_embeds": {"image_grid_thw": DEFAULT_GRID}, "uuid": uuid_of(1)}
    assert out["messages"][0]["content"] == [TEXT, reference, reference]
    assert list(out["ec_transfer_params"]) == [uuid_of(1)]


async def test_the_callers_key_is_the_encoder_key_unless_the_clients_is_forwarded() -> None:
    body = chat_body(image(1))
    for options, expected in (
        ({}, None),
        ({"encoder_api_key": "enc-key"}, "Bearer enc-key"),
        ({"encoder_api_key": "enc-key", "forward_authorization": True}, "Bearer client-key"),
    ):
        transport = encoders(E0, E1)
        await run(pipeline(**options), body, transport, authorization="Bearer client-key")
        [call] = transport.posts()
        assert call.headers.get("authorization") == expected, options


# --- the engine's body ---------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, OPTIONS], ids=["no-options", "options"])
async def test_the_engine_body_references_each_image_by_the_hash_its_encoder_reported(
    options: dict[str, Any],
) -> None:
    """Without options vLLM reports the uuid itself as the hash; with them a hash derived from model, uuid
    and options, which the engine derives too: the handles go under what was reported, never the uuid."""
    pipe, transport = pipeline(), encoders(E0, E1)
    body = chat_body(image(1), image(2), **options)
    out = await run(pipe, body, transport)
    calls = by_request_id(transport.posts())
    hashes = [
        derived_hash(MODEL, uuid_of(seed), "image", call.json)
        for seed, call in zip((1, 2), calls, strict=True)
    ]
    assert (hashes == [uuid_of(1), uuid_of(2)]) == (not options)
    grid = SMALL_GRID if options else DEFAULT_GRID
    assert out["ec_transfer_params"] == {
        mm_hash: {"item_indices": [0], "metadata": {"image_grid_thw": grid}} for mm_hash in hashes
    }
    assert out["messages"][0]["content"] == [
        TEXT,
        *(
            {"type": "image_embeds", "image_embeds": {"image_grid_thw": grid}, "uuid": uuid_of(s)}
            for s in (1, 2)
        ),
    ]
    assert {key: value for key, value in out.items() if key not in ("messages", "ec_transfer_params")} == {
        key: value for key, value in body.items() if key != "messages"
    }


async def test_with_rewrite_off_the_parts_stay_raw_with_their_uuid_pinned() -> None:
    pipe, transport = pipeline(rewrite=False), encoders(E0, E1)
    out = await run(pipe, chat_body(image(1), image(2)), transport)
    assert out["messages"][0]["content"] == [
        TEXT,
        {**image(1), "uuid": uuid_of(1)},
        {**image(2), "uuid": uuid_of(2)},
    ]
    assert set(out["ec_transfer_params"]) == {uuid_of(1), uuid_of(2)}


async def test_a_clients_ec_transfer_params_never_reach_the_engine() -> None:
    """Connectors steer transfers by them (issue 29, item 6): the engine gets the handles alone. Before:
    the client's entries were merged beside them."""
    pipe, transport = pipeline(), encoders(E0, E1)
    out = await run(pipe, chat_body(image(1), ec_transfer_params={"client": {"x": 1}}), transport)
    assert out["ec_transfer_params"] == {
        uuid_of(1): {"item_indices": [0], "metadata": {"image_grid_thw": DEFAULT_GRID}},
    }


# --- other surfaces ------------------------------------------------------------------------------------


def messages_body(*blocks: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": [*blocks, {"type": "text", "text": "Describe."}]}],
        **fields,
    }


def image_block(seed: int) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png(seed)}}


async def test_messages_sends_no_uuid_and_no_options_to_the_encoder_and_keeps_its_blocks() -> None:
    """The engine hashes a Messages image itself, from the data URL vLLM builds of the block."""
    pipe, transport = pipeline(encoders=(E0,)), encoders(E0)
    body = messages_body(image_block(1), image_block(2), cache_salt="s")
    out = await run(pipe, body, transport, surface=MESSAGES)
    [call] = transport.posts()  # Messages is driven through chat completions on the encoder
    assert call.request_id == f"{REQUEST_ID}-enc0"
    assert call.json == {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url(s)}} for s in (1, 2)]}
        ],
        "stream": False,
        "max_tokens": 1,
    }
    assert out["messages"] == body["messages"]  # never rewritten
    assert set(out["ec_transfer_params"]) == {content_hash(url(1)), content_hash(url(2))}


async def test_responses_parts_are_encoded_with_their_uuid_and_options_and_only_pinned() -> None:
    pipe, transport = pipeline(), encoders(E0, E1)
    part = {"type": "input_image", "image_url": url(1), "detail": "auto"}
    body = {
        "model": MODEL,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Describe."}, part]}],
        **OPTIONS,
    }
    out = await run(pipe, body, transport, surface=RESPONSES)
    [call] = transport.posts()
    uuid = uuid_of(1)
    assert sent_parts(call) == [{**part, "uuid": uuid}]
    assert call.json["mm_processor_kwargs"] == OPTIONS["mm_processor_kwargs"]
    assert out["input"][0]["content"][1] == {**part, "uuid": uuid}
    assert list(out["ec_transfer_params"]) == [derived_hash(MODEL, uuid, "image", call.json)]


# --- failures ------------------------------------------------------------------------------------------


async def test_an_encoder_that_fails_over_to_another_still_yields_the_same_body() -> None:
    body = chat_body(image(1), image(2), **OPTIONS)
    healthy = await run(pipeline(), body, encoders(E0, E1))
    transport = FakeTransport({E0: refuse(), E1: vllm()})
    pipe = pipeline()
    assert await run(pipe, body, transport) == healthy
    assert sorted(call.server for call in transport.posts()) == [E0, E1, E1]
    assert pipe.counters["encoder_failovers"] == 1


async def test_under_the_error_policy_every_encoder_down_is_a_502_naming_one_then_a_503() -> None:
    pipe = pipeline(eject_after=1, eject_cooldown=60, retry_after=7)
    transport = FakeTransport({E0: refuse(), E1: refuse()})
    with pytest.raises(UpstreamUnavailable) as failed:
        await run(pipe, chat_body(image(1)), transport)
    assert failed.value.status == 502
    assert failed.value.server in (E0, E1)
    # One request costs at most one server a failure (issue 29): the second ejects the other ...
    with pytest.raises(UpstreamUnavailable):
        await run(pipe, chat_body(image(2)), transport)
    # ... and the next is refused without a call.
    with pytest.raises(NoHealthyUpstream) as refused:
        await run(pipe, chat_body(image(3)), transport)
    assert refused.value.status == 503
    # Retry-After: when the first one comes back (the 60 s cool-down), not retry_after (7 s)
    assert refused.value.headers() == [(b"retry-after", b"60")]
    assert len(transport.posts()) == 3


async def test_under_the_local_policy_items_no_encoder_could_encode_go_to_the_engine_as_sent() -> None:
    pipe = pipeline(on_encoder_failure="local", eject_after=1, eject_cooldown=60)
    transport = FakeTransport({E0: vllm(answer_status(500)), E1: refuse()})
    body = chat_body(image(1), image(2))
    raw = [TEXT, {**image(1), "uuid": uuid_of(1)}, {**image(2), "uuid": uuid_of(2)}]
    # One request costs at most one encoder a failure (issue 29): two requests eject both.
    first = await run(pipe, body, transport)
    second = await run(pipe, body, transport)
    tried = len(transport.posts())
    third = await run(pipe, body, transport)  # every encoder is ejected now: no call at all
    assert len(transport.posts()) == tried
    for out in (first, second, third):
        assert out["messages"][0]["content"] == raw
        assert "ec_transfer_params" not in out
    assert pipe.counters["fallback_items"] == 6
    assert pipe.counters["fallback"] == 3


async def test_under_the_local_policy_what_did_encode_is_kept_and_the_rest_left_raw_per_modality() -> None:
    pipe = pipeline(on_encoder_failure="local", max_attempts=1)
    transport = FakeTransport({E0: vllm(), E1: vllm(answer_status(500))})
    out = await run(pipe, chat_body(image(1), audio(2)), transport)  # the image to E0, the audio to E1
    image_part, audio_part = out["messages"][0]["content"][1:]
    assert image_part == {
        "type": "image_embeds",
        "image_embeds": {"image_grid_thw": DEFAULT_GRID},
        "uuid": uuid_of(1),
    }
    assert audio_part == {**audio(2), "uuid": keyed_uuid("audio", (png(2), "wav"))}
    assert list(out["ec_transfer_params"]) == [uuid_of(1)]


async def test_an_encoders_rejection_of_the_request_reaches_the_caller_even_under_the_local_policy() -> None:
    pipe = pipeline(on_encoder_failure="local")
    transport = FakeTransport({E0: vllm(answer_status(400, "bad mm_processor_kwargs")), E1: vllm()})
    with pytest.raises(UpstreamRejected, match="bad mm_processor_kwargs") as info:
        await run(pipe, chat_body(image(1)), transport)
    assert info.value.status == 400
    assert len(transport.posts()) == 1


async def test_the_encode_deadline_passing_is_a_504_and_blames_no_encoder() -> None:
    pipe = pipeline(encoder_timeout=10, encode_deadline=0.05, eject_after=1)
    hanging = hang()
    transport = FakeTransport({E0: vllm(hanging), E1: vllm(hanging)})
    with pytest.raises(UpstreamTimeout) as info:
        await run(pipe, chat_body(image(1)), transport)
    assert info.value.status == 504
    assert "encode deadline of 0.05 s passed" in info.value.message
    assert len(transport.posts()) == 1  # no other encoder tried once the deadline passed
    assert len(hanging.cancelled) == 1
    assert pipe.encoders.available(anyio.current_time()) == (E0, E1)


async def test_the_encode_deadline_under_the_local_policy_leaves_the_items_to_the_engine() -> None:
    pipe = pipeline(encoder_timeout=10, encode_deadline=0.05, on_encoder_failure="local", max_batch_size=1)
    transport = FakeTransport({E0: vllm(hang()), E1: vllm(hang())})
    out = await run(pipe, chat_body(image(1), image(2)), transport)
    assert out["messages"][0]["content"][1:] == [{**image(s), "uuid": uuid_of(s)} for s in (1, 2)]
    assert pipe.encoders.available(anyio.current_time()) == (E0, E1)


async def test_too_many_media_parts_are_refused_before_any_call() -> None:
    pipe, transport = pipeline(max_media_items=2), encoders(E0, E1)
    with pytest.raises(TooManyMediaItems):
        await run(pipe, chat_body(image(1), image(2), image(3)), transport)
    assert transport.calls == []


async def test_requests_past_the_pending_bound_are_refused_with_retry_after() -> None:
    pipe = pipeline(encoders=(E0,), max_pending_requests=1, retry_after=3)
    entered, release = anyio.Event(), anyio.Event()
    answer = encoder()

    async def held(call: Call) -> tuple[int, bytes]:
        entered.set()
        await release.wait()
        return answer(call)

    transport = FakeTransport({E0: vllm(held)})
    bodies: list[Any] = []

    async def first() -> None:
        bodies.append(await run(pipe, chat_body(image(1)), transport))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(first)
            await entered.wait()
            assert pipe.pending == 1
            with pytest.raises(Overloaded) as info:
                await run(pipe, chat_body(image(2)), transport)
            assert info.value.status == 503
            assert info.value.headers() == [(b"retry-after", b"3")]
            release.set()
    assert len(bodies) == 1
    assert pipe.pending == 0
    assert len(transport.posts()) == 1


# --- embeddings in storage: checks and reuse -----------------------------------------------------------


async def test_an_embedding_the_encoder_did_not_store_fails_its_call_over(tmp_path: Path) -> None:
    transport = FakeTransport({E0: vllm(encoder()), E1: vllm(encoder(tmp_path))})
    out = await run(pipeline(), chat_body(image(1)), transport, host=Host(storage=str(tmp_path)))
    assert [call.server for call in transport.posts()] == [E0, E1]
    assert list(out["ec_transfer_params"]) == [uuid_of(1)]


async def test_a_repeated_request_reuses_what_was_encoded_and_an_engine_retry_encodes_afresh(
    tmp_path: Path,
) -> None:
    pipe, host = pipeline(), Host(storage=str(tmp_path))
    transport = encoders(E0, E1, storage=tmp_path)
    body = chat_body(image(1), image(2))
    first = await run(pipe, body, transport, host=host)
    assert len(transport.posts()) == 2

    request = parsed(pipe, body)
    context = context_of(pipe, request, transport, host)
    assert await prepared(pipe, CHAT, request, context) == first
    assert len(transport.posts()) == 2  # nothing sent again
    assert pipe.counters["reused_items"] == 2

    # The engine could not use what it was given: nothing of it is reused.
    assert await prepared(pipe, CHAT, request, context.again()) == first
    assert len(transport.posts()) == 4


async def test_a_reused_embedding_that_has_gone_is_encoded_again(tmp_path: Path) -> None:
    pipe, host = pipeline(), Host(storage=str(tmp_path))
    transport = encoders(E0, E1, storage=tmp_path)
    body = chat_body(image(1))
    await run(pipe, body, transport, host=host)
    (tmp_path / uuid_of(1) / EXAMPLE_CONNECTOR_FILE).unlink()
    await run(pipe, body, transport, host=host)
    assert len(transport.posts()) == 2
    assert pipe.reuse.stale == 1


async def test_nothing_is_reused_with_mooncake_push(tmp_path: Path) -> None:
    """A pushed embedding cannot be checked before it is referenced."""
    pipe = pipeline()
    host = Host(storage=str(tmp_path), push=MooncakeConsumers({0: ZMQ}, pin=False))
    transport = encoders(E0, E1, storage=tmp_path)
    for _ in range(2):
        await run(pipe, chat_body(image(1)), transport, host=host)
    assert len(transport.posts()) == 2


REFERENCE = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": "cached-item"}


async def test_a_clients_reference_to_an_embedding_not_in_storage_is_refused_before_any_call(
    tmp_path: Path,
) -> None:
    """A metadata-only part naming a missing embedding would kill vLLM's engine core (clients trusted
    with embeddings: by default every one is refused, tests/test_third_attack.py)."""
    pipe, transport = pipeline(client_embeddings="trust"), encoders(E0, E1, storage=tmp_path)
    body = chat_body(REFERENCE, image(1))
    with pytest.raises(UnresolvableReference, match="which this server does not have"):
        await run(pipe, body, transport, host=Host(storage=str(tmp_path)))
    with pytest.raises(UnresolvableReference, match="cannot confirm it has"):
        await run(pipe, body, transport)  # no storage to look in
    with pytest.raises(UnresolvableReference, match="has no uuid"):
        await run(pipe, chat_body({k: v for k, v in REFERENCE.items() if k != "uuid"}), transport)
    assert transport.calls == []
    assert pipe.counters["reference_refused"] == 1


async def test_a_clients_reference_to_a_stored_embedding_passes_as_it_is(tmp_path: Path) -> None:
    (tmp_path / "cached-item").mkdir()
    (tmp_path / "cached-item" / EXAMPLE_CONNECTOR_FILE).write_bytes(b"x")
    pipe, transport = pipeline(client_embeddings="trust"), encoders(E0, E1)
    body = chat_body(REFERENCE)
    assert await run(pipe, body, transport, host=Host(storage=str(tmp_path))) == body
    assert transport.calls == []


# --- remote prefill ------------------------------------------------------------------------------------


async def test_with_remote_prefill_p_gets_the_encoded_request_for_one_token_and_the_engine_ps_params() -> (
    None
):
    pipe = pipeline(encoders=(E0,), prefill=(P0,))
    transport = FakeTransport({E0: vllm(), P0: vllm(prefill_answer)})
    body = chat_body(
        image(1), stream=True, stream_options={"include_usage": True}, min_tokens=4, max_completion_tokens=16
    )
    out = await run(pipe, body, transport)
    assert [call.server for call in transport.posts()] == [E0, P0]  # encoded first, then prefilled
    [prefill_call] = transport.to(P0)
    sent = prefill_call.json
    assert prefill_call.path == "/v1/chat/completions"
    assert prefill_call.request_id == f"{REQUEST_ID}-prefill"
    assert sent["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert sent["kv_transfer_params"]["do_remote_decode"] is True
    assert (sent["max_tokens"], sent["max_completion_tokens"], sent["stream"]) == (1, 1, False)
    assert "stream_options" not in sent
    assert "min_tokens" not in sent
    # P prefills what the engine decodes: the same parts and handles.
    assert sent["messages"] == out["messages"]
    assert sent["ec_transfer_params"] == out["ec_transfer_params"] != {}
    assert out["kv_transfer_params"] == prefill_params(P0, f"{REQUEST_ID}-prefill")
    assert (out["stream"], out["min_tokens"], out["max_tokens"]) == (True, 4, 16)
    assert out["stream_options"] == {"include_usage": True}


async def test_with_remote_prefill_a_text_only_body_is_parsed_and_prefilled_too() -> None:
    pipe = pipeline(encoders=(E0,), prefill=(P0,))
    transport = FakeTransport({E0: vllm(), P0: vllm(prefill_answer)})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    out = await run(pipe, body, transport)
    assert [call.server for call in transport.posts()] == [P0]
    assert out == {**body, "kv_transfer_params": prefill_params(P0, f"{REQUEST_ID}-prefill")}


async def test_under_the_local_prefill_policy_a_prefill_server_down_gives_a_body_without_kv_params() -> None:
    pipe = pipeline(encoders=(E0,), prefill=(P0,), on_prefill_failure="local")
    transport = FakeTransport({E0: vllm(), P0: refuse()})
    out = await run(pipe, chat_body(image(1), kv_transfer_params={"client": "set"}), transport)
    assert "kv_transfer_params" not in out  # never the client's own for the decoder
    assert list(out["ec_transfer_params"]) == [uuid_of(1)]  # the encoded media is still used
    assert pipe.counters["prefill_fallback"] == 1


async def test_under_the_error_prefill_policy_a_prefill_server_down_is_an_error_naming_it() -> None:
    pipe = pipeline(encoders=(E0,), prefill=(P0,))
    transport = FakeTransport({E0: vllm(), P0: refuse()})
    with pytest.raises(UpstreamUnavailable, match=f"prefill {P0} failed") as info:
        await run(pipe, chat_body(image(1)), transport)
    assert info.value.status == 502


async def test_a_prefill_rejection_is_not_hidden_by_the_local_prefill_policy() -> None:
    pipe = pipeline(encoders=(E0,), prefill=(P0,), on_prefill_failure="local")
    transport = FakeTransport({E0: vllm(), P0: vllm(answer_status(400, "prompt too long"))})
    with pytest.raises(UpstreamRejected, match="prompt too long"):
        await run(pipe, chat_body(image(1)), transport)


# --- Mooncake push -------------------------------------------------------------------------------------


async def test_with_mooncake_push_each_call_names_the_consumer_and_a_fresh_transfer_id_per_item() -> None:
    pipe, transport = pipeline(), encoders(E0, E1)
    host = Host(push=MooncakeConsumers({0: ZMQ}, pin=False))
    body = chat_body(image(1), image(2), image(3))
    request = parsed(pipe, body)
    context = context_of(pipe, request, transport, host)
    assert (context.push_to, context.pin_rank) == (ZMQ, None)
    out = await prepared(pipe, CHAT, request, context)

    pushed: dict[str, str] = {}  # uuid -> the transfer id it was pushed under
    for call in transport.posts():
        params = call.json["ec_transfer_params"]
        assert params["consumer_zmq"] == ZMQ
        assert len(params["ec_items"]) == len(sent_parts(call))  # one per item, in the call's order
        for part, item in zip(sent_parts(call), params["ec_items"], strict=True):
            assert set(item) == {"transfer_id"}
            pushed[part["uuid"]] = item["transfer_id"]
    assert len(set(pushed.values())) == 3
    assert out["ec_transfer_params"]["ec_items"] == [
        {"mm_hash": uuid_of(seed), "transfer_id": pushed[uuid_of(seed)]} for seed in (1, 2, 3)
    ]


async def test_with_mooncake_push_a_retry_on_another_encoder_gets_a_fresh_transfer_id() -> None:
    """A push the failed encoder may have begun must never be taken for the retry's."""
    pipe = pipeline()
    transport = FakeTransport({E0: vllm(answer_status(500)), E1: vllm()})
    host = Host(push=MooncakeConsumers({0: ZMQ}, pin=False))
    out = await run(pipe, chat_body(image(1)), transport, host=host)
    failed, retried = transport.posts()
    assert (failed.server, retried.server) == (E0, E1)
    failed_id = failed.json["ec_transfer_params"]["ec_items"][0]["transfer_id"]
    retry_id = retried.json["ec_transfer_params"]["ec_items"][0]["transfer_id"]
    assert failed_id != retry_id
    assert out["ec_transfer_params"]["ec_items"] == [{"mm_hash": uuid_of(1), "transfer_id": retry_id}]


async def test_with_several_push_consumers_requests_take_the_ranks_in_turn_and_a_clients_pin_is_kept() -> (
    None
):
    pipe, transport = pipeline(), encoders(E0, E1)
    host = Host(push=MooncakeConsumers({0: "tcp://h:15000", 1: "tcp://h:15002"}, pin=True))
    request = parsed(pipe, chat_body(image(1)))
    targets = [context_of(pipe, request, transport, host) for _ in range(3)]
    assert [(c.push_to, c.pin_rank) for c in targets] == [
        ("tcp://h:15000", b"0"),
        ("tcp://h:15002", b"1"),
        ("tcp://h:15000", b"0"),
    ]
    pinned = context_of(pipe, request, transport, host, headers=((b"x-data-parallel-rank", b"1"),))
    assert (pinned.push_to, pinned.pin_rank) == ("tcp://h:15002", None)


# --- routes and models ---------------------------------------------------------------------------------


async def test_a_schedulers_encoder_choice_is_followed_and_without_a_scheduler_there_is_no_route() -> None:
    header = [(b"x-encoder-hosts-ports", b"enc-1:8001")]
    assert pipeline().route(header, Host()) == NO_ROUTE
    pipe, transport = pipeline(scheduler="llm-d"), encoders(E0, E1)
    route = pipe.route(header, Host())
    assert route == Route((E1,), None)
    await run(pipe, chat_body(image(1), image(2)), transport, route=route)
    assert [call.server for call in transport.posts()] == [E1]
    assert pipe.counters["encoders_chosen_by_scheduler"] == 1


async def test_a_schedulers_prefill_target_is_ignored_where_this_server_takes_no_kv_cache() -> None:
    pipe = pipeline(scheduler="llm-d", prefill=(P0,))
    header = [(b"x-prefiller-host-port", b"prefill-0:8100")]
    assert pipe.route(header, Host()) == Route((), P0)
    assert pipe.route(header, Host(inside_vllm=True, kv_role="kv_producer")) == NO_ROUTE
    assert pipe.counters["prefill_header_ignored"] == 1


async def test_the_first_model_the_engine_answered_is_expected_of_every_server_when_none_is_known() -> None:
    pipe = pipeline(check_models=True)
    request = parsed(pipe, chat_body(image(1)))
    assert pipe.expectation is None
    pipe.engine_answered(request)
    assert pipe.expectation == Expectation(frozenset({MODEL}))
    assert pipe.prefill.models.expectation == Expectation(frozenset({MODEL}))
    pipe.engine_answered(parsed(pipe, chat_body(image(1), model="another-model")))  # known: kept
    assert pipe.expectation == Expectation(frozenset({MODEL}))

    transport = encoders(E0, E1)
    await run(pipe, chat_body(image(1)), transport)
    assert [(call.method, call.path) for call in transport.calls] == [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
    ]


async def test_with_model_checks_off_the_engines_answer_sets_no_expectation() -> None:
    pipe = pipeline()
    pipe.engine_answered(parsed(pipe, chat_body(image(1))))
    assert pipe.expectation is None


async def test_what_the_host_says_it_serves_is_expected_from_the_first_request_on() -> None:
    pipe = pipeline(check_models=True)
    expectation = Expectation(frozenset({MODEL}), "/models/tiny")
    request = parsed(pipe, chat_body(image(1)))
    context_of(pipe, request, encoders(E0), Host(expectation=expectation))
    assert pipe.expectation == expectation


async def test_with_model_checks_off_a_hosts_model_sets_no_expectation() -> None:
    """Before: a Host built by hand with an expectation set one even under check_models=False."""
    pipe = pipeline(check_models=False)
    request = parsed(pipe, chat_body(image(1)))
    context_of(pipe, request, encoders(E0), Host(expectation=Expectation(frozenset({MODEL}))))
    assert pipe.expectation is None


# --- priority and session id, as vLLM reads them ---------------------------------------------------------


def vllm_reads(route: str, headers: dict[str, str], body: dict[str, Any]) -> tuple[Any, str | None]:
    """The priority and session id vLLM 0.32/0.33 gives a request on ``route``
    (``entrypoints/generate/base/serving.py`` ``_get_priority``, ``_get_session_id``; the batch route
    takes the body's priority alone; a Messages request becomes a chat request without the body's
    fields)."""
    fields = body if route != "/v1/messages" else {}
    priority: Any = fields.get("priority", 0)
    if route != "/v1/chat/completions/batch" and "x-vllm-priority" in headers:
        with contextlib.suppress(ValueError):
            priority = int(headers["x-vllm-priority"])
    xargs = fields.get("vllm_xargs") or {}
    for session in (fields.get("session_id"), headers.get("x-session-id"), xargs.get("session_id")):
        if isinstance(session, str) and session:
            return priority, session
    return priority, None


SCHEDULING_CASES = [
    ({"x-vllm-priority": "7"}, {}),
    ({"x-vllm-priority": "7"}, {"priority": 3}),
    ({"x-vllm-priority": "-2"}, {"priority": 3, "session_id": "body"}),
    ({"x-vllm-priority": "soon"}, {"priority": 3}),  # not a number: the body's
    ({"x-session-id": "header"}, {}),
    ({"x-session-id": "header"}, {"session_id": "body"}),
    ({"x-session-id": "header"}, {"vllm_xargs": {"session_id": "xargs"}}),
    ({"x-session-id": ""}, {"vllm_xargs": {"session_id": "xargs"}}),
    ({}, {"vllm_xargs": {"session_id": "xargs"}}),
    ({}, {"session_id": "", "vllm_xargs": {"session_id": "xargs"}}),
    ({}, {"vllm_xargs": {"session_id": "会话-1"}}),  # no header carries it: the encoder's body does
    ({}, {"vllm_xargs": {"session_id": " padded "}}),  # a header would lose the spaces
    ({}, {"vllm_xargs": {"session_id": "tab\there"}}),
    ({"x-vllm-priority": "4", "x-session-id": "header"}, {"priority": 1, "session_id": "body"}),
    ({"x-session-id": "header"}, {"session_id": "long" * 5000}),  # a long string: kept raw by the parser
    ({}, {"vllm_xargs": {"session_id": "long" * 5000}}),
]


def raw_headers(headers: dict[str, str]) -> tuple[tuple[bytes, bytes], ...]:
    return tuple((name.encode(), value.encode("latin-1")) for name, value in headers.items())


@pytest.mark.parametrize(("headers", "fields"), SCHEDULING_CASES)
async def test_every_encoder_and_prefill_call_is_scheduled_as_vllm_reads_the_chat_request(
    headers: dict[str, str], fields: dict[str, Any]
) -> None:
    pipe = pipeline(encoders=(E0, E1), prefill=(P0,), max_batch_size=1)
    transport = FakeTransport({E0: vllm(), E1: vllm(), P0: vllm(prefill_answer)})
    body = chat_body(image(1), image(2), **fields)
    out = await run(pipe, body, transport, headers=raw_headers(headers))
    expected = vllm_reads("/v1/chat/completions", headers, body)
    assert vllm_reads("/v1/chat/completions", headers, out) == expected  # the engine's own request
    calls = transport.posts()
    assert sorted(call.server for call in calls) == [E0, E1, P0]
    for call in calls:
        assert vllm_reads("/v1/chat/completions", call.headers, call.json) == expected, call


def _responses_body(fields: dict[str, Any]) -> dict[str, Any]:
    content = [{"type": "input_image", "image_url": url(1)}]
    return {"model": MODEL, "input": [{"role": "user", "content": content}], **fields}


def _batch_body(fields: dict[str, Any]) -> dict[str, Any]:
    conversation = [{"role": "user", "content": [TEXT, image(1)]}]
    return {"model": MODEL, "messages": [conversation, conversation], "max_tokens": 4, **fields}


# Each surface as vLLM reads it: Responses as chat; Messages from the headers alone (its body's fields
# are not read); the batch route takes its priority from the body alone, so the header must not reach
# the encoder.
OTHER_SURFACES = {
    "responses": (RESPONSES, "/v1/responses", _responses_body),
    "messages": (MESSAGES, "/v1/messages", lambda fields: messages_body(image_block(1), **fields)),
    "batch": (BATCH, "/v1/chat/completions/batch", _batch_body),
}


@pytest.mark.parametrize("name", OTHER_SURFACES)
@pytest.mark.parametrize(("headers", "fields"), SCHEDULING_CASES)
async def test_encoder_calls_of_every_other_surface_are_scheduled_as_vllm_reads_the_request(
    name: str, headers: dict[str, str], fields: dict[str, Any]
) -> None:
    surface, route, make_body = OTHER_SURFACES[name]
    pipe, transport = pipeline(encoders=(E0,)), encoders(E0)
    body = make_body(fields)
    await run(pipe, body, transport, surface=surface, headers=raw_headers(headers))
    [call] = transport.posts()
    assert vllm_reads("/v1/chat/completions", call.headers, call.json) == vllm_reads(route, headers, body)
