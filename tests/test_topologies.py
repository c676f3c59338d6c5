"""Every topology and surface over ASGI with fakes, on asyncio and trio: remote prefill (E -> P -> D and
P -> D), Mooncake push, and Anthropic Messages. The tests look at the exact bodies each server gets."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import pytest

from epd_middleware import EPDMiddleware
from epd_middleware._protocol import PREFILL_KV_TRANSFER_PARAMS
from epd_middleware.host import Host

from .fakes import (
    MODEL,
    SMALL_GRID,
    FakeEncoders,
    FakeEngine,
    FakePrefill,
    build_app,
    chat_body,
    content_hash,
    derived_hash,
    image,
)

pytestmark = pytest.mark.anyio

E0, E1 = "http://enc-0:8001", "http://enc-1:8001"
P0, P1 = "http://prefill-0:8100", "http://prefill-1:8100"
OPTIONS = {"mm_processor_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 50176}}}


def png(seed: int) -> str:
    return base64.b64encode(bytes((seed * 31 + i) % 256 for i in range(600))).decode()


async def post(app: Any, body: Any, path: str = "/v1/chat/completions", **kwargs: Any) -> httpx.Response:
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        return await client.post(f"http://pd{path}", content=json.dumps(body).encode(), headers=headers)


# --- remote prefill -------------------------------------------------------------------------------


async def test_prefill_gets_the_encoded_request_with_the_p_d_overrides_and_d_gets_p_params() -> None:
    encoders, prefill, engine = FakeEncoders([E0]), FakePrefill([P0]), FakeEngine()
    app, _ = build_app(encoders, engine, prefill)
    body = chat_body(
        image(png(1)),
        stream=True,
        stream_options={"include_usage": True},
        min_tokens=4,
        max_completion_tokens=16,
        **OPTIONS,
    )
    response = await post(app, body, headers={"x-request-id": "req-7"})
    assert response.status_code == 200

    [encoder_call] = encoders.calls
    [prefill_call] = prefill.calls
    [engine_call] = engine.received
    local = engine_call.json
    sent = prefill_call.body

    # P gets the engine's request (handles, metadata-only part, options) with the P/D overrides ...
    assert prefill_call.path == "/v1/chat/completions"
    assert sent["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert sent["stream"] is False
    assert sent["max_tokens"] == 1
    assert sent["max_completion_tokens"] == 1
    assert "stream_options" not in sent
    assert "min_tokens" not in sent
    assert sent["ec_transfer_params"] == local["ec_transfer_params"]
    assert sent["messages"] == local["messages"]
    assert sent["mm_processor_kwargs"] == OPTIONS["mm_processor_kwargs"]
    uuid = encoder_call.body["messages"][0]["content"][0]["uuid"]
    reported = derived_hash(MODEL, uuid, "image", encoder_call.body)
    assert list(sent["ec_transfer_params"]) == [reported]
    assert sent["messages"][0]["content"][1] == {
        "type": "image_embeds",
        "image_embeds": {"image_grid_thw": SMALL_GRID},
        "uuid": uuid,
    }
    # ... and D decodes with P's kv_transfer_params, the client's own settings intact.
    assert local["kv_transfer_params"] == FakePrefill.params(P0, "req-7-prefill")
    assert local["stream"] is True
    assert local["stream_options"] == {"include_usage": True}
    assert local["min_tokens"] == 4
    assert local["max_tokens"] == 16
    assert local["max_completion_tokens"] == 16
    assert prefill_call.headers["x-request-id"] == "req-7-prefill"
    assert encoder_call.headers["x-request-id"] == "req-7-enc0"


async def test_max_completion_tokens_is_only_set_when_the_client_sent_it() -> None:
    encoders, prefill, engine = FakeEncoders([E0]), FakePrefill([P0]), FakeEngine()
    app, _ = build_app(encoders, engine, prefill)
    assert (await post(app, chat_body(image(png(1))))).status_code == 200
    assert "max_completion_tokens" not in prefill.calls[0].body
    assert prefill.calls[0].body["max_tokens"] == 1


async def test_text_only_requests_go_through_prefill_too() -> None:
    encoders, prefill, engine = FakeEncoders([E0]), FakePrefill([P0]), FakeEngine()
    app, _ = build_app(encoders, engine, prefill)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    response = await post(app, body)
    assert response.status_code == 200
    assert encoders.calls == []
    [call] = prefill.calls
    assert call.body == {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_KV_TRANSFER_PARAMS,
    }
    assert engine.received[0].json == {
        **body,
        "kv_transfer_params": FakePrefill.params(P0, call.headers["x-request-id"]),
    }


async def test_prefill_without_encoders_sends_the_media_to_p_as_sent() -> None:
    prefill, engine = FakePrefill([P0]), FakeEngine()
    app = engine.app()
    client = httpx.AsyncClient(transport=httpx.MockTransport(prefill.handle))
    app.add_middleware(EPDMiddleware, prefill=[P0], http_client=client)
    body = chat_body(image(png(1)))
    assert (await post(app, body)).status_code == 200
    assert prefill.calls[0].body["messages"] == body["messages"]
    assert "ec_transfer_params" not in engine.received[0].json


async def test_prefill_calls_spread_round_robin() -> None:
    encoders, prefill, engine = FakeEncoders([E0]), FakePrefill([P0, P1]), FakeEngine()
    app, _ = build_app(encoders, engine, prefill)
    for seed in range(4):
        assert (await post(app, chat_body(image(png(seed))))).status_code == 200
    assert len(prefill.calls_to(P0)) == 2
    assert len(prefill.calls_to(P1)) == 2


@pytest.mark.parametrize("mode", ["500", "refuse", "no_params"])
async def test_a_failed_prefill_server_is_retried_on_another(mode: str) -> None:
    encoders, prefill, engine = FakeEncoders([E0]), FakePrefill([P0, P1], mode={P0: mode}), FakeEngine()
    app, _ = build_app(encoders, engine, prefill, health_check_interval=0)
    middleware = _middleware(app)
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == 200
    if mode == "no_params":
        # A connector that finds the KV by the prompt (ExampleConnector) gives no params: that is a
        # success, and D gets no kv_transfer_params at all.
        assert "kv_transfer_params" not in engine.received[0].json
        return
    assert engine.received[0].json["kv_transfer_params"]["remote_engine_id"] == f"engine@{P1}"
    assert middleware.pipeline.counters["prefill_failovers"] == 1
    assert middleware.pipeline.counters["prefill_calls_ok"] == 1
    if mode == "500":  # P0 recorded its call before failing: the retry sent the very same body
        first, retry = prefill.calls
        assert (first.server, retry.server) == (P0, P1)
        assert first.body == retry.body


@pytest.mark.parametrize(
    ("mode", "status", "words"),
    [
        ("500", 502, "HTTP 500"),
        ("refuse", 502, "connection"),
        ("400", 400, "prompt too long"),
        ("bad_params", 502, "kv_transfer_params is not an object"),
    ],
)
async def test_prefill_failures_name_the_prefill_server(mode: str, status: int, words: str) -> None:
    encoders, prefill, engine = FakeEncoders([E0]), FakePrefill([P0], mode={P0: mode}), FakeEngine()
    app, _ = build_app(encoders, engine, prefill, health_check_interval=0)
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == status
    error = response.json()["error"]
    # The role and the reason (vLLM's own words for a rejection); the server in the log only.
    assert error["message"].startswith("a prefill server failed: ") or mode == "400"
    assert words in error["message"]
    assert P0 not in error["message"]
    assert error["code"] == status
    assert engine.received == []


async def test_prefill_timeout_is_504() -> None:
    encoders, prefill, engine = FakeEncoders([E0]), FakePrefill([P0], mode={P0: "hang"}), FakeEngine()
    app, _ = build_app(encoders, engine, prefill, prefill_timeout=0.2, health_check_interval=0)
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == 504
    assert response.json()["error"]["message"] == "a prefill server failed: no answer within 0.2 s"


async def test_local_prefill_fallback_decodes_without_kv_params() -> None:
    encoders, prefill, engine = FakeEncoders([E0]), FakePrefill([P0], mode={P0: "refuse"}), FakeEngine()
    app, _ = build_app(encoders, engine, prefill, on_prefill_failure="local", health_check_interval=0)
    body = chat_body(image(png(1)), kv_transfer_params={"client": "set"})
    response = await post(app, body)
    assert response.status_code == 200
    local = engine.received[0].json
    assert "kv_transfer_params" not in local  # the client's own are never handed to the decoder
    assert local["ec_transfer_params"]  # the encoded media is still used
    assert _middleware(app).pipeline.counters["prefill_fallback"] == 1


async def test_a_prefill_rejection_is_not_hidden_by_the_local_fallback() -> None:
    encoders, prefill, engine = FakeEncoders([E0]), FakePrefill([P0], mode={P0: "400"}), FakeEngine()
    app, _ = build_app(encoders, engine, prefill, on_prefill_failure="local")
    assert (await post(app, chat_body(image(png(1))))).status_code == 400


async def test_an_engine_retry_starts_again_from_the_original_request() -> None:
    encoders, prefill, engine = FakeEncoders([E0]), FakePrefill([P0, P1]), FakeEngine(fail_next=1)
    app, _ = build_app(encoders, engine, prefill, engine_retries=1)
    body = chat_body(image(png(1)), stream=True)
    response = await post(app, body)
    assert response.status_code == 200
    first, second = prefill.calls
    assert first.server != second.server
    assert len(encoders.calls) == 2
    # Nothing of the first try (its kv params, its stream override) leaked into the second.
    assert second.body["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert engine.received[1].json["stream"] is True
    assert engine.received[1].json["kv_transfer_params"]["remote_engine_id"] == f"engine@{second.server}"


async def test_status_page_lists_the_prefill_servers() -> None:
    encoders, prefill, engine = FakeEncoders([E0]), FakePrefill([P0, P1]), FakeEngine()
    app, _ = build_app(encoders, engine, prefill)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        status = (await client.get("http://pd/epd/status")).json()
    assert set(status["prefill"]) == {P0, P1}
    assert status["prefill"][P0]["healthy"] is True


# --- Mooncake push --------------------------------------------------------------------------------

ZMQ = "tcp://10.0.0.5:15000"


async def test_push_bodies_carry_the_consumer_and_one_transfer_id_per_item() -> None:
    encoders, engine = FakeEncoders([E0, E1]), FakeEngine()
    app, _ = build_app(encoders, engine, ec_consumer_zmq=ZMQ, max_batch_size=8)
    body = chat_body(image(png(1)), image(png(2)), image(png(3)), **OPTIONS)
    assert (await post(app, body)).status_code == 200

    sent: dict[str, str] = {}  # uuid -> transfer id it was pushed under
    reported: dict[str, str] = {}  # uuid -> hash the encoder reported
    for call in encoders.calls:
        params = call.body["ec_transfer_params"]
        parts = call.body["messages"][0]["content"]
        assert params["consumer_zmq"] == ZMQ
        assert len(params["ec_items"]) == len(parts)  # one per item, in the call's item order
        assert all(set(item) == {"transfer_id"} for item in params["ec_items"])
        for part, item in zip(parts, params["ec_items"], strict=True):
            sent[part["uuid"]] = item["transfer_id"]
            reported[part["uuid"]] = derived_hash(MODEL, part["uuid"], "image", call.body)
    assert len(set(sent.values())) == 3

    local = engine.received[0].json
    uuids = [part["uuid"] for part in local["messages"][0]["content"][1:]]
    assert local["ec_transfer_params"]["ec_items"] == [
        {"mm_hash": reported[uuid], "transfer_id": sent[uuid]} for uuid in uuids
    ]
    assert set(local["ec_transfer_params"]) == {*reported.values(), "ec_items"}


async def test_push_retry_on_another_encoder_uses_fresh_transfer_ids() -> None:
    encoders, engine = FakeEncoders([E0, E1], mode={E0: "500"}), FakeEngine()
    app, _ = build_app(encoders, engine, ec_consumer_zmq=ZMQ, health_check_interval=0)
    assert (await post(app, chat_body(image(png(1))))).status_code == 200
    failed, succeeded = encoders.calls
    failed_id = failed.body["ec_transfer_params"]["ec_items"][0]["transfer_id"]
    retry_id = succeeded.body["ec_transfer_params"]["ec_items"][0]["transfer_id"]
    assert failed_id != retry_id
    [item] = engine.received[0].json["ec_transfer_params"]["ec_items"]
    assert item["transfer_id"] == retry_id


async def test_no_push_fields_without_a_consumer() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    assert (await post(app, chat_body(image(png(1))))).status_code == 200
    assert "ec_transfer_params" not in encoders.calls[0].body
    assert "ec_items" not in engine.received[0].json["ec_transfer_params"]


def mooncake_consumers_of(vllm_config: Any) -> Any:
    return Host.of_vllm(vllm_config).push


def mooncake_config(**parallel: Any) -> SimpleNamespace:
    ec = SimpleNamespace(
        ec_connector="ECMooncakeConnector", ec_role="ec_consumer", ec_ip="10.1.2.3", ec_port=15000
    )
    defaults = {"tensor_parallel_size": 1, "data_parallel_size": 1, "data_parallel_rank": 0}
    return SimpleNamespace(ec_transfer_config=ec, parallel_config=SimpleNamespace(**{**defaults, **parallel}))


def test_consumer_addresses_follow_vllm_mooncake_config() -> None:
    single = mooncake_consumers_of(mooncake_config())
    assert single is not None
    assert single.by_rank == {0: "tcp://10.1.2.3:15000"}
    assert not single.pin
    # Engine r listens on ec_port + r * tensor_parallel_size.
    dp = mooncake_consumers_of(
        mooncake_config(tensor_parallel_size=2, data_parallel_size=2, data_parallel_size_local=2)
    )
    assert dp is not None
    assert dp.by_rank == {0: "tcp://10.1.2.3:15000", 1: "tcp://10.1.2.3:15002"}
    assert dp.pin
    # External load balancing: this API server runs one engine, its own rank.
    external = mooncake_consumers_of(
        mooncake_config(data_parallel_size=4, data_parallel_rank=3, data_parallel_external_lb=True)
    )
    assert external is not None
    assert external.by_rank == {3: "tcp://10.1.2.3:15003"}
    assert not external.pin
    # Hybrid: the node's own ranks.
    hybrid = mooncake_consumers_of(
        mooncake_config(
            data_parallel_size=4,
            data_parallel_rank=2,
            data_parallel_size_local=2,
            data_parallel_hybrid_lb=True,
        )
    )
    assert hybrid is not None
    assert hybrid.by_rank == {2: "tcp://10.1.2.3:15002", 3: "tcp://10.1.2.3:15003"}
    v6 = mooncake_config()
    v6.ec_transfer_config.ec_ip = "fd00::5"
    assert mooncake_consumers_of(v6).by_rank == {0: "tcp://[fd00::5]:15000"}  # type: ignore[union-attr]
    producer = mooncake_config()
    producer.ec_transfer_config.ec_role = "ec_producer"
    assert mooncake_consumers_of(producer) is None
    assert mooncake_consumers_of(SimpleNamespace(ec_transfer_config=None)) is None


async def test_push_address_and_dp_rank_come_from_the_server_config() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    app.state.vllm_config = mooncake_config(
        tensor_parallel_size=2, data_parallel_size=2, data_parallel_size_local=2
    )
    for seed in range(3):
        assert (await post(app, chat_body(image(png(seed))))).status_code == 200
    pushed = [call.body["ec_transfer_params"]["consumer_zmq"] for call in encoders.calls]
    ranks = [record.headers["x-data-parallel-rank"] for record in engine.received]
    assert pushed == ["tcp://10.1.2.3:15000", "tcp://10.1.2.3:15002", "tcp://10.1.2.3:15000"]
    assert ranks == ["0", "1", "0"]  # each request runs on the engine its encoder pushed to

    # A client that pins a rank keeps it, and the push follows it.
    assert (
        await post(app, chat_body(image(png(9))), headers={"x-data-parallel-rank": "1"})
    ).status_code == 200
    assert encoders.calls[-1].body["ec_transfer_params"]["consumer_zmq"] == "tcp://10.1.2.3:15002"
    assert engine.received[-1].headers["x-data-parallel-rank"] == "1"


# --- Anthropic Messages ---------------------------------------------------------------------------


def messages_body(*blocks: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": [*blocks, {"type": "text", "text": "Describe."}]}],
        **fields,
    }


def image_block(data: str, media_type: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}


async def test_messages_images_are_encoded_as_vllm_sees_them_and_blocks_stay() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    url_block = {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}
    tool_result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "content": [{"type": "text", "text": "here"}, {"type": "image", "source": {"data": png(3)}}],
    }
    body = messages_body(image_block(png(1)), url_block, tool_result, cache_salt="s")
    body["system"] = "Be brief."
    response = await post(app, body, path="/v1/messages")
    assert response.status_code == 200

    [call] = encoders.calls
    parts = call.body["messages"][0]["content"]
    # The URL vLLM builds from each block (media_type defaults to image/jpeg), and no uuid, no options.
    urls = [
        f"data:image/png;base64,{png(1)}",
        "https://example.com/cat.png",
        f"data:image/jpeg;base64,{png(3)}",
    ]
    assert parts == [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    assert set(call.body) == {"model", "messages", "stream", "max_tokens"}

    local = engine.received[0].json
    assert local["messages"] == body["messages"]  # never rewritten
    assert local["system"] == "Be brief."
    assert set(local["ec_transfer_params"]) == {content_hash(url) for url in urls}


async def test_messages_without_images_pass_byte_for_byte() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "an image of a cat"}]}
    assert (await post(app, body, path="/v1/messages")).status_code == 200
    assert encoders.calls == []
    assert engine.received[0].body == json.dumps(body).encode()


async def test_messages_system_images_and_assistant_tool_results_are_left_to_vllm() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    body = {
        "model": MODEL,
        "max_tokens": 8,
        "messages": [
            {"role": "system", "content": [image_block(png(1)), {"type": "text", "text": "sys"}]},
            {"role": "assistant", "content": [{"type": "tool_result", "content": [image_block(png(2))]}]},
            {"role": "user", "content": [image_block(png(3))]},
        ],
    }
    assert (await post(app, body, path="/v1/messages")).status_code == 200
    [call] = encoders.calls
    assert [part["image_url"]["url"] for part in call.body["messages"][0]["content"]] == [
        f"data:image/png;base64,{png(3)}"
    ]


async def test_messages_same_image_twice_is_encoded_once() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    body = messages_body(image_block(png(1)), image_block(png(1)))
    assert (await post(app, body, path="/v1/messages")).status_code == 200
    assert len(encoders.calls[0].body["messages"][0]["content"]) == 1
    assert len(engine.received[0].json["ec_transfer_params"]) == 1


async def test_messages_with_prefill_go_to_the_prefill_messages_endpoint() -> None:
    encoders, prefill, engine = FakeEncoders([E0]), FakePrefill([P0]), FakeEngine()
    app, _ = build_app(encoders, engine, prefill)
    body = messages_body(image_block(png(1)), stream=True)
    assert (await post(app, body, path="/v1/messages")).status_code == 200
    [call] = prefill.calls
    assert call.path == "/v1/messages"
    assert call.body["max_tokens"] == 1
    assert call.body["stream"] is False
    assert call.body["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    assert call.body["messages"] == body["messages"]
    local = engine.received[0].json
    assert local["kv_transfer_params"]["remote_engine_id"] == f"engine@{P0}"
    assert local["stream"] is True
    assert local["max_tokens"] == 16


async def test_messages_with_push_name_each_pushed_item() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, ec_consumer_zmq=ZMQ)
    assert (await post(app, messages_body(image_block(png(1))), path="/v1/messages")).status_code == 200
    transfer_id = encoders.calls[0].body["ec_transfer_params"]["ec_items"][0]["transfer_id"]
    url = f"data:image/png;base64,{png(1)}"
    assert engine.received[0].json["ec_transfer_params"]["ec_items"] == [
        {"mm_hash": content_hash(url), "transfer_id": transfer_id}
    ]


def _middleware(app: Any) -> EPDMiddleware:
    """The app's middleware instance (the one requests go through, built on first use)."""
    if app.middleware_stack is None:
        app.middleware_stack = app.build_middleware_stack()
    stack = app.middleware_stack
    while not isinstance(stack, EPDMiddleware):
        stack = stack.app
    return stack


# --- OpenAI Responses -----------------------------------------------------------------------------


def responses_body(*items: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": list(items), "max_output_tokens": 16, **fields}


def input_image(data: str) -> dict[str, Any]:
    return {"type": "input_image", "image_url": f"data:image/png;base64,{data}", "detail": "auto"}


async def test_responses_images_are_encoded_with_options_and_pinned_never_rewritten() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, max_batch_size=8)
    body = responses_body(
        {"role": "user", "content": [input_image(png(1)), {"type": "input_text", "text": "Describe."}]},
        # vLLM keeps only an assistant's first text (one whose first part has none it keeps whole:
        # tests/test_third_attack.py)
        {"role": "assistant", "content": [{"type": "output_text", "text": "a cat"}, input_image(png(2))]},
        {"type": "function_call_output", "call_id": "c1", "output": [input_image(png(3))]},
        **OPTIONS,
    )
    response = await post(app, body, path="/v1/responses")
    assert response.status_code == 200

    [call] = encoders.calls
    parts = call.body["messages"][0]["content"]
    urls = [part["image_url"] for part in parts]
    assert urls == [f"data:image/png;base64,{png(1)}", f"data:image/png;base64,{png(3)}"]
    assert call.body["mm_processor_kwargs"] == OPTIONS["mm_processor_kwargs"]
    uuids = [part["uuid"] for part in parts]

    local = engine.received[0].json
    assert local["input"][0]["content"][0] == {**input_image(png(1)), "uuid": uuids[0]}
    assert local["input"][1] == body["input"][1]  # untouched
    assert local["input"][2]["output"][0] == {**input_image(png(3)), "uuid": uuids[1]}
    assert set(local["ec_transfer_params"]) == {
        derived_hash(MODEL, uuid, "image", call.body) for uuid in uuids
    }


async def test_responses_text_input_passes_byte_for_byte() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    body = {"model": MODEL, "input": "Describe an image_url in words."}
    assert (await post(app, body, path="/v1/responses")).status_code == 200
    assert encoders.calls == []
    assert engine.received[0].body == json.dumps(body).encode()


async def test_responses_prefill_caps_output_tokens_and_keeps_p_from_storing() -> None:
    encoders, prefill, engine = FakeEncoders([E0]), FakePrefill([P0]), FakeEngine()
    app, _ = build_app(encoders, engine, prefill)
    body = responses_body({"role": "user", "content": [input_image(png(1))]}, stream=True, store=True)
    assert (await post(app, body, path="/v1/responses")).status_code == 200
    [call] = prefill.calls
    assert call.path == "/v1/responses"
    assert call.body["max_output_tokens"] == 1
    assert call.body["stream"] is False
    assert call.body["store"] is False
    assert call.body["background"] is False
    assert call.body["kv_transfer_params"] == PREFILL_KV_TRANSFER_PARAMS
    local = engine.received[0].json
    assert local["kv_transfer_params"]["remote_engine_id"] == f"engine@{P0}"
    assert local["stream"] is True
    assert local["store"] is True
    assert local["max_output_tokens"] == 16


async def test_responses_continuing_a_stored_conversation_are_prefilled_here() -> None:
    encoders, prefill, engine = FakeEncoders([E0]), FakePrefill([P0]), FakeEngine()
    app, _ = build_app(encoders, engine, prefill)
    body = responses_body({"role": "user", "content": [input_image(png(1))]}, previous_response_id="resp_1")
    assert (await post(app, body, path="/v1/responses")).status_code == 200
    assert prefill.calls == []  # P does not hold resp_1
    assert len(encoders.calls) == 1  # the new image is still encoded remotely
    assert "kv_transfer_params" not in engine.received[0].json
    assert _middleware(app).pipeline.counters["prefill_skipped"] == 1


# --- large media: the raw-string path gives the very bytes the plain path gives -----------------------


def big_png(seed: int) -> str:
    return base64.b64encode(bytes((seed * 131 + i * 7) % 256 for i in range(30_000))).decode()


@pytest.mark.parametrize("surface", ["chat", "messages", "responses"])
@pytest.mark.parametrize("options", [{}, {"rewrite": False}, {"prefill": True}])
async def test_large_media_bodies_equal_those_of_a_plain_decode(
    surface: str, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from epd_middleware import _rawjson

    if surface == "chat":
        body, path = chat_body(image(big_png(1)), image(big_png(2)), image(big_png(1)), **OPTIONS), None
    elif surface == "messages":
        body = messages_body(image_block(big_png(1)), image_block(big_png(2), media_type="image/jpeg"))
        path = "/v1/messages"
    else:
        parts = [input_image(big_png(1)), input_image(big_png(2))]
        body = {"model": MODEL, "input": [{"role": "user", "content": parts}], **OPTIONS}
        path = "/v1/responses"
    key = "input" if surface == "responses" else "messages"
    body[key][0]["content"].append({"type": "text", "text": "long words " * 500})

    async def run() -> tuple[list[dict[str, Any]], list[bytes], list[dict[str, Any]]]:
        encoders, engine = FakeEncoders([E0, E1]), FakeEngine()
        prefill = FakePrefill([P0]) if options.get("prefill") else None
        extra = {key: value for key, value in options.items() if key != "prefill"}
        app, _ = build_app(encoders, engine, prefill, max_batch_size=1, **extra)
        # A fixed request id: P's fake kv_transfer_params carry it.
        response = await post(app, body, headers={"x-request-id": "r"}, **({"path": path} if path else {}))
        assert response.status_code == 200
        prefill_bodies = [call.body for call in prefill.calls] if prefill else []
        return [call.body for call in encoders.calls], [r.body for r in engine.received], prefill_bodies

    decoded = _rawjson.decode(json.dumps(body).encode())
    assert isinstance(decoded[key][0]["content"][-1]["text"], _rawjson.Raw)  # the raw path is taken
    monkeypatch.setattr(_rawjson, "_MIN_SPLICED", 0)  # every outgoing body in pieces, however small
    raw_path = await run()
    monkeypatch.setattr(_rawjson, "_MIN_BODY", 1 << 40)  # never take the raw path
    plain_path = await run()
    assert raw_path[0]
    assert sorted(map(json.dumps, raw_path[0])) == sorted(map(json.dumps, plain_path[0]))
    assert raw_path[1] == plain_path[1]  # the engine's body, byte for byte
    assert raw_path[2] == plain_path[2]


# The middleware's own errors on /v1/messages, as vLLM 0.33 answers there (Anthropic's envelope and
# vocabulary); the same errors on chat keep OpenAI's.
ANTHROPIC_ERRORS = [
    ({"api_keys": ["k"]}, {}, 401, "authentication_error"),
    ({"max_media_items": 1}, {}, 400, "invalid_request_error"),
    ({"max_body_bytes": 200}, {}, 413, "request_too_large"),
    ({"on_encoder_failure": "error"}, {E0: "500"}, 502, "api_error"),
    ({"on_encoder_failure": "error", "encoder_timeout": 0.05}, {E0: "hang"}, 504, "api_error"),
]


@pytest.mark.parametrize(("options", "mode", "status", "kind"), ANTHROPIC_ERRORS)
async def test_messages_errors_speak_anthropic(
    options: dict[str, Any], mode: dict[str, str], status: int, kind: str
) -> None:
    encoders, engine = FakeEncoders([E0], mode=mode), FakeEngine()
    app, _ = build_app(encoders, engine, **options)
    body = messages_body(image_block(png(1)), image_block(png(2)))
    response = await post(app, body, path="/v1/messages")
    assert response.status_code == status
    payload = response.json()
    assert payload["type"] == "error"
    assert set(payload["error"]) == {"type", "message"}
    assert payload["error"]["type"] == kind
    assert payload["error"]["message"]
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
    chat = await post(app, chat_body(image(png(1)), image(png(2))))
    assert chat.status_code == status
    assert set(chat.json()) == {"error"}
    assert chat.json()["error"]["code"] == status  # OpenAI's shape on chat


async def test_an_overloaded_pd_answers_messages_with_overloaded_error_and_retry_after() -> None:
    encoders, engine = FakeEncoders([E0], mode={E0: "hang"}), FakeEngine()
    app, _ = build_app(encoders, engine, max_pending_requests=1, encoder_timeout=2, retry_after=3)
    body = messages_body(image_block(png(1)))
    async with anyio.create_task_group() as group:
        group.start_soon(post, app, body, "/v1/messages")
        await anyio.sleep(0.2)  # the first request now waits for its encoder
        response = await post(app, messages_body(image_block(png(2))), path="/v1/messages")
        group.cancel_scope.cancel()
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "overloaded_error"
    assert response.headers["retry-after"] == "3"
