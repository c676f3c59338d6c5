"""The middleware end to end over ASGI, with fake encoders and a fake PD app, on asyncio and trio."""

from __future__ import annotations

import base64
import json
import logging
import os
from typing import Any

import anyio
import httpx
import pytest

from epd_middleware import EPDConfig, EPDMiddleware

from .fakes import (
    DEFAULT_GRID,
    MODEL,
    SMALL_GRID,
    TEST_UUID_KEY,
    FakeEncoders,
    FakeEngine,
    app_with_encoder_handler,
    audio,
    build_app,
    chat_body,
    derived_hash,
    image,
    uuid_of,
)

pytestmark = pytest.mark.anyio

E0, E1, E2 = "http://enc-0:8001", "http://enc-1:8001", "http://enc-2:8001"
URL = "http://pd/v1/chat/completions"
OPTIONS = {
    "mm_processor_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 50176}},
    "media_io_kwargs": {"image": {"rgba_background_color": [0, 0, 0]}},
}


def png(seed: int, size: int = 600) -> str:
    return base64.b64encode(bytes((seed * 31 + i) % 256 for i in range(size))).decode()


async def post(app: Any, body: Any, **kwargs: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **kwargs.pop("headers", {})}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport) as client:
        return await client.post(URL, content=content, headers=headers, **kwargs)


def media_parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [part for message in body["messages"] for part in message["content"] if part.get("type") != "text"]


async def test_text_only_body_passes_byte_for_byte() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    raw = b'{"model": "m",  "messages": [{"role": "user", "content": "hi \\u00e9"}], "max_tokens": 3}'
    response = await post(app, raw)
    assert response.status_code == 200
    assert engine.received[0].body == raw
    assert encoders.calls == []


async def test_other_paths_methods_and_content_types_pass_through() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    body = json.dumps(chat_body(image(png(1)))).encode()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        other = await client.post(
            "http://pd/v1/completions", content=body, headers={"content-type": "application/json"}
        )
        plain = await client.post(URL, content=body, headers={"content-type": "text/plain"})
        health = await client.get("http://pd/health")
    assert other.status_code == plain.status_code == health.status_code == 200
    assert encoders.calls == []
    assert [record.body for record in engine.received] == [body, body]


async def test_one_image_is_encoded_and_rewritten_to_a_metadata_reference() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    data = png(1)
    response = await post(app, chat_body(image(data)))
    assert response.status_code == 200, response.text

    [call] = encoders.calls
    [sent] = call.body["messages"][0]["content"]
    uuid = uuid_of("image", (f"data:image/png;base64,{data}",))
    assert sent == {**image(data), "uuid": uuid}
    assert call.body["model"] == MODEL
    assert call.body["stream"] is False
    assert call.body["max_tokens"] == 1

    received = engine.received[0].json
    [part] = media_parts(received)
    assert part == {"type": "image_embeds", "image_embeds": {"image_grid_thw": DEFAULT_GRID}, "uuid": uuid}
    # Without options vLLM reports the uuid itself as the hash.
    assert received["ec_transfer_params"] == {
        uuid: {"item_indices": [0], "metadata": {"image_grid_thw": DEFAULT_GRID}}
    }
    assert data not in engine.received[0].body.decode()
    # Everything else of the request is intact.
    assert received["messages"][0]["content"][0] == {"type": "text", "text": "Describe."}
    assert received["temperature"] == 0
    assert received["max_tokens"] == 16
    assert int(engine.received[0].headers["content-length"]) == len(engine.received[0].body)


async def test_responses_style_input_image_parts_are_encoded_too() -> None:
    """vLLM takes ``{"type": "input_image", "image_url": "<url>"}`` in chat completions as well."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    data = png(4)
    url = f"data:image/png;base64,{data}"
    part = {"type": "input_image", "image_url": url, "detail": "auto"}
    response = await post(app, chat_body(part, **OPTIONS))
    assert response.status_code == 200, response.text
    [call] = encoders.calls
    uuid = uuid_of("image", (url,))
    # With a uuid vLLM finds the kind by the first media key: image_url, here a bare URL string.
    assert call.body["messages"][0]["content"] == [{**part, "uuid": uuid}]
    [sent] = media_parts(engine.received[0].json)
    assert sent == {"type": "image_embeds", "image_embeds": {"image_grid_thw": SMALL_GRID}, "uuid": uuid}
    assert list(engine.received[0].json["ec_transfer_params"]) == [
        derived_hash(MODEL, uuid, "image", call.body)
    ]

    # An input_image whose image_url is an object is not what vLLM takes. The middleware cannot read it,
    # and does not pass on media it cannot read (vLLM might read it otherwise): a 400 naming the part.
    odd = chat_body({"type": "input_image", "image_url": {"url": url}})
    refused = await post(app, odd)
    assert refused.status_code == 400
    assert "'input_image' part" in refused.json()["error"]["message"]
    assert len(encoders.calls) == 1
    assert len(engine.received) == 1


async def test_options_reach_every_encoder_request_and_handles_use_the_derived_hash() -> None:
    encoders, engine = FakeEncoders([E0, E1]), FakeEngine()
    app, _ = build_app(encoders, engine)
    forwarded = {**OPTIONS, "priority": -3, "session_id": "sess-7"}
    images = [image(png(seed)) for seed in range(3)]
    response = await post(app, chat_body(*images, audio(png(9)), **forwarded))
    assert response.status_code == 200, response.text

    assert len(encoders.calls) >= 3
    for call in encoders.calls:
        for name, value in forwarded.items():
            assert call.body[name] == value, f"{name} was not forwarded to {call.encoder}"

    received = engine.received[0].json
    for part, options_part in zip(
        media_parts(received), media_parts(chat_body(*images, audio(png(9)))), strict=True
    ):
        assert part["uuid"]
        modality = "audio" if "audio" in part["type"] else "image"
        mm_hash = derived_hash(MODEL, part["uuid"], modality, received)
        assert mm_hash != part["uuid"]
        assert mm_hash in received["ec_transfer_params"], "handle must be keyed by the encoder-reported hash"
        assert part["uuid"] not in received["ec_transfer_params"]
        del options_part
    # The options stay on the local request: PD derives the same hash from the same uuid + options.
    for name, value in forwarded.items():
        assert received[name] == value
    image_parts = [part for part in media_parts(received) if part["type"] == "image_embeds"]
    assert [part["image_embeds"]["image_grid_thw"] for part in image_parts] == [SMALL_GRID] * 3


async def test_images_are_batched_per_encoder_and_the_cursor_persists_across_requests() -> None:
    encoders, engine = FakeEncoders([E0, E1]), FakeEngine()
    app, _ = build_app(encoders, engine, max_batch_size=2)
    body = chat_body(*(image(png(seed)) for seed in range(5)))
    assert (await post(app, body)).status_code == 200
    sizes = sorted((call.encoder, len(call.body["messages"][0]["content"])) for call in encoders.calls)
    # Items 0, 2, 4 go to enc-0 (a batch of 2 and one of 1), items 1, 3 to enc-1 (one batch of 2).
    assert sizes == [(E0, 1), (E0, 2), (E1, 2)]

    encoders.calls.clear()
    assert (await post(app, chat_body(image(png(50))))).status_code == 200
    # Five items moved the cursor to enc-1: the next request must not start again at enc-0.
    assert [call.encoder for call in encoders.calls] == [E1]
    encoders.calls.clear()
    assert (await post(app, chat_body(image(png(51))))).status_code == 200
    assert [call.encoder for call in encoders.calls] == [E0]

    received = engine.received[0].json
    assert len(received["ec_transfer_params"]) == 5
    assert all(part["type"] == "image_embeds" for part in media_parts(received))


async def test_audio_and_video_go_one_per_call_beside_batched_images() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    video = {"type": "video_url", "video_url": {"url": "http://media/clip.mp4"}}
    body = chat_body(image(png(1)), audio(png(2)), image(png(3)), audio(png(4)), video)
    assert (await post(app, body)).status_code == 200
    kinds = sorted(
        tuple(part["type"] for part in call.body["messages"][0]["content"]) for call in encoders.calls
    )
    assert kinds == [("image_url", "image_url"), ("input_audio",), ("input_audio",), ("video_url",)]
    types = [part["type"] for part in media_parts(engine.received[0].json)]
    assert types == ["image_embeds", "audio_embeds", "image_embeds", "audio_embeds", "video_embeds"]


async def test_same_media_twice_is_encoded_once_and_both_parts_get_the_handle() -> None:
    encoders, engine = FakeEncoders([E0, E1]), FakeEngine()
    app, _ = build_app(encoders, engine)
    data = png(1)
    assert (await post(app, chat_body(image(data), image(png(2)), image(data)))).status_code == 200
    sent = [part["uuid"] for call in encoders.calls for part in call.body["messages"][0]["content"]]
    assert len(sent) == 2
    assert len(set(sent)) == 2
    parts = media_parts(engine.received[0].json)
    assert parts[0] == parts[2]
    assert parts[0]["uuid"] != parts[1]["uuid"]


async def test_content_uuid_is_stable_across_requests_and_distinct_per_image() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    for data in (png(1), png(2), png(1)):
        assert (await post(app, chat_body(image(data)))).status_code == 200
    uuids = [media_parts(record.json)[0]["uuid"] for record in engine.received]
    assert uuids[0] == uuids[2] != uuids[1]


async def test_cache_salt_separates_the_cache_keys_of_the_same_image() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    data = png(1)
    for salt in (None, "tenant-a", "tenant-b", "tenant-a"):
        fields = {} if salt is None else {"cache_salt": salt}
        assert (await post(app, chat_body(image(data), **fields))).status_code == 200
    uuids = [media_parts(record.json)[0]["uuid"] for record in engine.received]
    assert len({uuids[0], uuids[1], uuids[2]}) == 3
    assert uuids[1] == uuids[3]


async def test_client_uuid_is_replaced_by_default_so_clients_cannot_collide() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    # Two clients, two different images, one uuid.
    for data in (png(1), png(2)):
        assert (await post(app, chat_body(image(data, uuid="shared-id")))).status_code == 200
    first, second = (media_parts(record.json)[0]["uuid"] for record in engine.received)
    assert "shared-id" not in (first, second)
    assert first != second
    assert [call.body["messages"][0]["content"][0]["uuid"] for call in encoders.calls] == [first, second]


async def test_client_uuid_is_kept_when_trusted() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, trust_client_uuid=True)
    assert (await post(app, chat_body(image(png(1), uuid="client-key"), image(png(2))))).status_code == 200
    first, second = media_parts(engine.received[0].json)
    assert first["uuid"] == "client-key"
    assert second["uuid"] == uuid_of("image", (f"data:image/png;base64,{png(2)}",))
    assert "client-key" in engine.received[0].json["ec_transfer_params"]


async def test_uuid_only_reference_stays_and_keeps_its_modality_raw() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    reference = {"type": "image_url", "image_url": None, "uuid": "seen-before"}
    body = chat_body(image(png(1)), reference, audio(png(2)))
    assert (await post(app, body)).status_code == 200
    parts = media_parts(engine.received[0].json)
    # The reference counts as a raw image for vLLM, so the other image must stay raw (uuid pinned) too;
    # audio has no reference and is rewritten.
    assert parts[0]["type"] == "image_url"
    assert parts[0]["image_url"] == image(png(1))["image_url"]
    assert parts[0]["uuid"] == uuid_of("image", (f"data:image/png;base64,{png(1)}",))
    assert parts[1] == reference
    assert parts[2]["type"] == "audio_embeds"
    sent = [part for call in encoders.calls for part in call.body["messages"][0]["content"]]
    assert len(sent) == 2
    assert reference not in sent


async def test_client_ec_transfer_params_never_reach_the_engine() -> None:
    """A client's entries would steer a transfer (a peer host, a push address: issue 29, item 6).
    Before: merged beside the handles."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    own = {"something-else": {"peer_host": "10.0.0.1"}, "consumer_zmq": "tcp://10.0.0.1:5555"}
    assert (await post(app, chat_body(image(png(1)), ec_transfer_params=own))).status_code == 200
    params = engine.received[0].json["ec_transfer_params"]
    assert list(params) == [encoders.calls[0].body["messages"][0]["content"][0]["uuid"]]


@pytest.mark.parametrize("mode", ["no_entries", "empty_metadata"])
async def test_rewrite_is_all_or_nothing_per_modality(mode: str) -> None:
    encoders, engine = FakeEncoders([E0, E1], mode={E1: mode}), FakeEngine()
    app, _ = build_app(encoders, engine, max_batch_size=1)
    body = chat_body(image(png(1)), image(png(2)), audio(png(3)))
    assert (await post(app, body)).status_code == 200
    parts = media_parts(engine.received[0].json)
    # Item 1 (second image) lands on enc-1, which gives no usable metadata: both images stay raw, with
    # their uuids pinned; the audio (item 2, enc-0) is rewritten.
    assert [part["type"] for part in parts] == ["image_url", "image_url", "audio_embeds"]
    assert all(part["uuid"] for part in parts)
    params = engine.received[0].json["ec_transfer_params"]
    assert parts[0]["uuid"] in params
    assert (parts[1]["uuid"] in params) == (mode == "empty_metadata")


async def test_rewrite_false_keeps_media_raw_with_uuid_and_handles() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, rewrite=False)
    assert (await post(app, chat_body(image(png(1)), **OPTIONS))).status_code == 200
    received = engine.received[0].json
    [part] = media_parts(received)
    assert part["type"] == "image_url"
    assert part["uuid"]
    assert derived_hash(MODEL, part["uuid"], "image", received) in received["ec_transfer_params"]


async def test_streaming_response_passes_through() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    response = await post(app, chat_body(image(png(1)), stream=True))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.count("data: ") == 3
    assert response.text.endswith("data: [DONE]\n\n")
    assert engine.received[0].json["stream"] is True


async def test_request_id_is_propagated_to_encoders_and_generated_when_missing() -> None:
    encoders, engine = FakeEncoders([E0, E1]), FakeEngine()
    app, _ = build_app(encoders, engine)
    body = chat_body(image(png(1)), image(png(2)))
    assert (await post(app, body, headers={"x-request-id": "req-42"})).status_code == 200
    assert sorted(call.headers["x-request-id"] for call in encoders.calls) == ["req-42-enc0", "req-42-enc1"]
    assert engine.received[0].headers["x-request-id"] == "req-42"

    encoders.calls.clear()
    assert (await post(app, body)).status_code == 200
    generated = engine.received[1].headers["x-request-id"]
    assert generated
    assert {call.headers["x-request-id"] for call in encoders.calls} == {
        f"{generated}-enc0",
        f"{generated}-enc1",
    }


@pytest.mark.parametrize(
    ("mode", "status", "reason"),
    [
        ("500", 502, "an encoder failed: HTTP 500"),
        ("400", 400, "bad mm_processor_kwargs"),  # vLLM's own words, as a single instance answers
        ("refuse", 502, "an encoder failed: connection failed"),
        ("drop_connection", 502, "an encoder failed: connection closed"),
        ("garbage", 502, "an encoder failed: the answer is not JSON"),
        ("not_object", 502, "an encoder failed: the answer is not a JSON object"),
        ("bad_indices", 502, "out of range"),
        ("unmatched", 502, "matches none"),
        ("hang", 504, "an encoder failed: no answer within 0.2 s"),
    ],
)
@pytest.mark.parametrize("expose", [False, True])
async def test_encoder_failures_become_openai_errors_naming_the_encoder_in_the_log(
    mode: str, status: int, reason: str, expose: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The client reads the role and the reason; which encoder (an address of the deployment) is in
    the log, and in the answer only with expose_upstream_addresses (issue 29, item 15)."""
    caplog.set_level(logging.INFO, "epd_middleware")
    encoders, engine = FakeEncoders([E0, E1], mode={E1: mode}), FakeEngine()
    app, _ = build_app(
        encoders, engine, encoder_timeout=0.2, max_attempts=1, expose_upstream_addresses=expose
    )
    with anyio.fail_after(10):
        response = await post(app, chat_body(image(png(1)), image(png(2))))
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["code"] == status
    assert (reason in error["message"]) or expose
    assert (E1 in error["message"]) == expose
    assert E1 in caplog.text
    assert engine.received == []


async def test_httpx_client_timeout_is_a_504_too() -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("read timed out", request=request)

    app, _ = app_with_encoder_handler(slow, encoders=[E0])
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == 504
    assert response.json()["error"]["message"].startswith("an encoder failed: ")


async def test_oversized_body_gets_413_without_reading_it_all() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = engine.app()
    app.add_middleware(EPDMiddleware, encoders=[E0], http_client=encoders.client(), max_body_bytes=1000)
    big = json.dumps(chat_body(image(png(1, 5000)))).encode()
    response = await post(app, big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == 413

    # Declared by content-length: answered before any body message is read.
    reads = 0

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": big, "more_body": False}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = http_scope(big, content_length=True)
    await app(scope, receive, send)
    assert reads == 0
    assert sent[0]["status"] == 413

    # Chunked (no content-length): stops reading past the limit.
    chunks = [big[i : i + 400] for i in range(0, len(big), 400)]
    reads = 0

    async def chunked() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": chunks[reads - 1], "more_body": reads < len(chunks)}

    sent.clear()
    await app(http_scope(big, content_length=False), chunked, send)
    assert sent[0]["status"] == 413
    assert reads == 3 < len(chunks)
    assert encoders.calls == []
    assert engine.received == []


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "messages": [{"content": [{"type": "image_url"',
        b'["image_url"]',
        b'{"messages": "image_url"}',
        b"\xff\xfe not utf-8 image_url",
    ],
)
async def test_bodies_vllm_cannot_read_as_a_request_reach_the_app_untouched(raw: bytes) -> None:
    """Not JSON (as vLLM reads JSON), not an object, or no media anywhere it could look: vLLM answers it."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    response = await post(app, raw)
    assert response.status_code in (200, 400)
    assert engine.received[0].body == raw
    assert encoders.calls == []


@pytest.mark.parametrize(
    "raw",
    [
        b'{"messages": [5, {"content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
        b'{"messages": [{"content": [{"type": "image_url", "image_url": {"url": 7}}]}]}',
        b'{"messages": [{"content": [{"type": "image_url", "image_url": {"url": "x"}, "uuid": 3}]}]}',
        b'{"messages": [{"content": [{"type": 1, "image_url": {"url": "x"}}]}]}',
        b'{"ec_transfer_params": [1], "messages": '
        b'[{"content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
    ],
)
async def test_media_in_a_shape_the_middleware_cannot_read_is_refused_not_passed_on(raw: bytes) -> None:
    """vLLM might read media, a reference or transfer parameters there that the middleware did not: a
    400 from the middleware, before any encoder call, and nothing reaches the engine."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    response = await post(app, raw)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError"
    assert engine.received == []
    assert encoders.calls == []


async def test_an_escaped_part_type_is_read_as_vllm_reads_it() -> None:
    """A part type spelled with \\u escapes (legal JSON no common encoder writes) is still a media part:
    encoded remotely like any other, never left for PD to encode behind the middleware's back."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    raw = (
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image\\u005furl", '
        b'"image\\u005furl": {"url": "data:image/png;base64,AAAA"}}]}]}'
    )
    assert (await post(app, raw)).status_code == 200
    [call] = encoders.calls
    assert call.body["messages"][0]["content"][0]["image_url"] == {"url": "data:image/png;base64,AAAA"}
    [part] = media_parts(engine.received[0].json)
    assert part["type"] == "image_embeds"


def http_scope(
    body: bytes, *, content_length: bool = True, path: str = "/v1/chat/completions"
) -> dict[str, Any]:
    headers = [(b"content-type", b"application/json")]
    if content_length:
        headers.append((b"content-length", str(len(body)).encode()))
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "server": ("pd", 80),
        "client": ("127.0.0.1", 5000),
    }


async def test_client_disconnect_cancels_encoder_calls_and_skips_the_engine() -> None:
    encoders, engine = FakeEncoders([E0, E1], mode={E0: "hang", E1: "hang"}), FakeEngine()
    encoders.started = anyio.Event()
    app, _ = build_app(encoders, engine)
    body = json.dumps(chat_body(image(png(1)), image(png(2)))).encode()
    messages = 0

    async def receive() -> dict[str, Any]:
        nonlocal messages
        messages += 1
        if messages == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        assert encoders.started is not None
        await encoders.started.wait()
        await anyio.sleep(0.05)  # both calls are in flight
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with anyio.fail_after(5):
        await app(http_scope(body), receive, send)
    assert sorted(encoders.cancelled) == [E0, E1]
    assert engine.received == []
    assert sent == []


async def test_disconnect_after_replay_still_reaches_the_app() -> None:
    """After the replayed body the app reads the real receive, so it sees the client leave."""
    seen: list[str] = []
    got_body = anyio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        seen.append((await receive())["type"])
        got_body.set()
        seen.append((await receive())["type"])

    encoders = FakeEncoders([E0])
    middleware = EPDMiddleware(app, encoders=[E0], http_client=encoders.client())
    body = json.dumps(chat_body(image(png(1)))).encode()
    queue = [{"type": "http.request", "body": body, "more_body": False}]
    disconnect = anyio.Event()

    async def receive() -> dict[str, Any]:
        if queue:
            return queue.pop(0)
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        pass

    async with anyio.create_task_group() as group:
        group.start_soon(middleware, http_scope(body), receive, send)
        await got_body.wait()
        disconnect.set()
    assert seen == ["http.request", "http.disconnect"]


async def test_lifespan_opens_and_closes_the_owned_client() -> None:
    engine = FakeEngine()
    middleware = EPDMiddleware(engine.app(), encoders=[E0])
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[str] = []
    clients: list[httpx.AsyncClient] = []

    async def receive() -> dict[str, Any]:
        message = messages.pop(0)
        if message["type"] == "lifespan.shutdown":
            clients.append(middleware._transports.open())
        return message

    async def send(message: dict[str, Any]) -> None:
        sent.append(message["type"])

    await middleware({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert clients[0].is_closed
    assert middleware._transports._owned is None


async def test_owned_client_works_without_lifespan() -> None:
    engine = FakeEngine()
    middleware = EPDMiddleware(engine.app(), encoders=[E0])
    client = middleware._transports.open()
    assert not client.is_closed
    assert middleware._transports.open() is client
    await middleware._transports.aclose()


async def test_injected_client_is_never_closed() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    client = encoders.client()
    middleware = EPDMiddleware(engine.app(), encoders=[E0], http_client=client)
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        pass

    await middleware({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    assert not client.is_closed
    assert (await post(middleware, chat_body(image(png(1))))).status_code == 200
    await client.aclose()


async def test_add_middleware_builds_at_startup_and_bad_config_fails_there() -> None:
    engine = FakeEngine()
    app = engine.app()
    app.add_middleware(EPDMiddleware, encoders=["ftp://nope"])
    messages = [{"type": "lifespan.startup"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "lifespan.shutdown"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with pytest.raises(ValueError, match="ftp://nope"):
        await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)


async def test_config_object_is_equivalent_to_keyword_options() -> None:
    encoders = FakeEncoders([E0, E1])
    results = []
    for options in (
        {"encoders": [E0, E1], "max_batch_size": 1, "uuid_key": TEST_UUID_KEY},
        {"config": EPDConfig(encoders=(E0, E1), max_batch_size=1, uuid_key=TEST_UUID_KEY)},
    ):
        engine = FakeEngine()
        app = engine.app()
        app.add_middleware(EPDMiddleware, http_client=encoders.client(), **options)
        assert (await post(app, chat_body(image(png(1)), image(png(2)), image(png(3))))).status_code == 200
        results.append(engine.received[0].body)
    assert results[0] == results[1]
    assert os.environ.get("EPD_ENCODERS") is None


async def test_nixl_and_cpu_connector_handles_reach_the_engine_whole_under_the_reported_hash() -> None:
    """Connectors that pull embeddings from the producer (NIXL, vLLM's CPU connector) report transfer
    coordinates beside ``metadata``; the consumer looks them up by the hash it derives
    (``ec_connector/cpu/scheduler``: ``request.ec_transfer_params.get(mm_hash)``, needs ``peer_host``)."""
    reported: dict[str, Any] = {}

    def encoder(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        entries = {}
        for index, part in enumerate(body["messages"][0]["content"]):
            mm_hash = derived_hash(body["model"], part["uuid"], "image", body)
            entries[mm_hash] = reported[mm_hash] = {
                "item_indices": [index],
                "metadata": {"image_grid_thw": SMALL_GRID},
                "peer_host": "10.1.2.3",
                "peer_port": 5600 + index,
                "size_bytes": 54 * 128 * 4,
                "shape": [54, 128],
                "dtype": "float32",
            }
        return httpx.Response(200, json={"ec_transfer_params": entries})

    app, engine = app_with_encoder_handler(encoder, encoders=[E0])
    assert (await post(app, chat_body(image(png(1)), image(png(2)), **OPTIONS))).status_code == 200
    received = engine.received[0].json
    assert received["ec_transfer_params"] == reported
    for part in media_parts(received):
        assert part["uuid"] not in received["ec_transfer_params"]  # keyed by the derived hash
        assert derived_hash(MODEL, part["uuid"], "image", received) in received["ec_transfer_params"]


def test_generated_request_ids_are_unique_and_drawn_anew_in_a_forked_child(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from epd_middleware import _logs as module

    ids = {module.new_request_id() for _ in range(1000)}
    assert len(ids) == 1000
    parent = module.new_request_id()
    monkeypatch.setattr(module.os, "getpid", lambda: -7)  # what a forked child sees: another pid
    child = module.new_request_id()
    assert child[:16] != parent[:16]


async def test_the_client_s_priority_and_session_headers_reach_every_encoder_call() -> None:
    """vLLM reads both from headers too (X-Vllm-Priority before the body's priority, X-Session-ID after
    the body's session_id): the encoders must schedule the request as the local engine does."""
    encoders, engine = FakeEncoders([E0, E1]), FakeEngine()
    app, _ = build_app(encoders, engine, max_batch_size=1)
    headers = {"x-vllm-priority": "9", "x-session-id": "chat-42"}
    response = await post(app, chat_body(image(png(1)), image(png(2))), headers=headers)
    assert response.status_code == 200
    assert len(encoders.calls) == 2
    for call in encoders.calls:
        assert call.headers["x-vllm-priority"] == "9"
        assert call.headers["x-session-id"] == "chat-42"
    assert engine.received[0].headers["x-vllm-priority"] == "9"  # and the engine's request keeps them
