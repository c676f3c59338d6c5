"""What a hostile client can write, and what it gets (issue 20), on asyncio and trio with fakes: bodies
vLLM reads otherwise than a fast parser, references the client made itself, media the PD's policy
forbids, forged scheduler headers, header bytes, keys in every spelling vLLM takes. Each test names the
hole it closes; each failed against the code before the fix."""

from __future__ import annotations

import codecs
import json
import logging
import math
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest

from epd_middleware import EPDConfig, EPDMiddleware
from epd_middleware._identifiers import hash_kwargs
from epd_middleware.host import Host
from epd_middleware.vllm_plugin import EPDPlugin, check_keys

from .fakes import (
    FakeEncoders,
    FakeEngine,
    FakePrefill,
    build_app,
    chat_body,
    image,
    scripted_receive,
    uuid_of,
)
from .test_middleware import E0, E1, http_scope, media_parts, png

pytestmark = pytest.mark.anyio

MODEL_PATH = "/models/tiny-qwen2-vl"
P0 = "http://prefill-0:8100"


async def post(app: Any, body: Any, path: str = "/v1/chat/completions", **headers: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        return await client.post(
            f"http://pd{path}", content=content, headers={"content-type": "application/json", **headers}
        )


async def get(app: Any, path: str, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        return await client.get(f"http://pd{path}", headers=headers)


def recording_route(engine: FakeEngine, path: str) -> Any:
    """A route of the fake engine at ``path`` that records what reaches it, as the others do."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from .fakes import EngineRecord

    async def endpoint(request: Any) -> Any:
        engine.received.append(EngineRecord(await request.body(), dict(request.headers)))
        return JSONResponse({"ok": True})

    return Route(path, endpoint, methods=["POST"])


def vllm_state(
    storage: Path | None = None,
    *,
    domains: list[str] | None = None,
    local: str = "",
    api_key: Any = None,
    **args: Any,
) -> SimpleNamespace:
    """What the middleware reads of the vLLM server it runs in (app.state)."""
    model_config = SimpleNamespace(
        model=MODEL_PATH,
        served_model_name=["tiny-qwen2-vl"],
        multimodal_config=SimpleNamespace(mm_hasher_algorithm="blake3", media_io_kwargs={}),
        allowed_media_domains=domains,
        allowed_local_media_path=local,
    )
    ec = (
        SimpleNamespace(
            ec_connector="ECExampleConnector",
            ec_role="ec_consumer",
            is_ec_consumer=True,
            ec_connector_extra_config={"shared_storage_path": str(storage)},
        )
        if storage is not None
        else None
    )
    return SimpleNamespace(
        vllm_config=SimpleNamespace(model_config=model_config, ec_transfer_config=ec),
        args=SimpleNamespace(api_key=api_key, **args),
    )


def inside_vllm(
    encoders: FakeEncoders,
    engine: FakeEngine,
    storage: Path | None = None,
    lora: Any = None,
    client_embeddings: str = "trust",
    **state: Any,
) -> Any:
    """The middleware inside a vLLM server that says what ``vllm_state`` holds (its Host, built as the
    middleware builds it from the app's state). These tests check what is done with references a client
    is trusted to write (issue 20): ``client_embeddings`` is "trust" unless said; the middleware's own
    default refuses every client embedding (issue 29)."""
    server = vllm_state(storage, **state)
    server.vllm_config.lora_config = lora
    options: dict[str, Any] = {
        "health_check_interval": 0,
        "check_models": False,
        "client_embeddings": client_embeddings,
    }
    host = Host.of_vllm(server.vllm_config, server.args, EPDConfig(encoders=encoders.urls, **options))
    app, _ = build_app(encoders, engine, host=host, **options)
    if storage is not None:
        encoders.storage = storage
    return app


def stored(storage: Path, identifier: str) -> None:
    (storage / identifier).mkdir(parents=True, exist_ok=True)
    (storage / identifier / "encoder_cache.safetensors").write_bytes(b"x")


def reference(uuid: str | None, **extra: Any) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, **extra}
    if uuid is not None:
        part["uuid"] = uuid
    return part


# --- references the client wrote itself (item 2) -------------------------------------------------


async def test_a_client_reference_to_an_embedding_that_is_not_stored_is_refused(tmp_path: Path) -> None:
    """Before: forwarded byte for byte (no media, so no check), and vLLM's engine died on it."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, tmp_path)
    body = chat_body(reference("not-there"), ec_transfer_params={"not-there": {"metadata": {}}})
    response = await post(app, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert "messages[0].content[1]" in error["message"]
    assert "not-there" in error["message"]
    assert error["param"] == "messages"
    assert engine.received == []
    assert encoders.calls == []


async def test_a_client_reference_that_is_stored_under_the_engines_identifier_passes(tmp_path: Path) -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, tmp_path)
    stored(tmp_path, "mine")
    assert (await post(app, chat_body(reference("mine")))).status_code == 200
    [sent] = media_parts(engine.received[0].json)
    assert sent == reference("mine")
    assert encoders.calls == []

    # With options the engine looks under the hash it derives, not under the uuid.
    options = {"mm_processor_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 50176}}}
    assert (await post(app, chat_body(reference("mine"), **options))).status_code == 400
    stored(tmp_path, hash_kwargs("blake3", model_id=MODEL_PATH, image="mine", **options))
    assert (await post(app, chat_body(reference("mine"), **options))).status_code == 200


@pytest.mark.parametrize(
    "part",
    [
        # Typed by its keys: with a uuid vLLM ignores "type" and takes the first media key it holds.
        {"type": "text", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": "x"},
        {"image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": "x"},
        {"type": "audio_embeds", "audio_embeds": {"audio_num_tokens": [5]}, "uuid": "x"},
        {"type": "video_embeds", "video_embeds": None, "uuid": "x"},
        {"type": "image_embeds", "image_embeds": {"image_grid_thw": "QUJD"}, "uuid": "x"},
    ],
)
async def test_every_spelling_of_a_reference_is_checked(tmp_path: Path, part: dict[str, Any]) -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, tmp_path)
    assert (await post(app, chat_body(part))).status_code == 400
    assert engine.received == []


async def test_an_escaped_reference_type_is_still_checked(tmp_path: Path) -> None:
    """Before: the byte scan looked for "_url" and "_audio" only, and saw nothing through escapes."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, tmp_path)
    raw = (
        b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image\\u005fembeds", '
        b'"image\\u005fembeds": {"image_grid_thw": [1, 4, 4]}, "uuid": "not-there"}]}]}'
    )
    assert (await post(app, raw)).status_code == 400
    assert engine.received == []


async def test_a_part_that_carries_its_own_tensor_is_not_a_reference(tmp_path: Path) -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, tmp_path)
    for part in (
        {"type": "image_embeds", "image_embeds": "QUJDRA==", "uuid": "x"},
        {"type": "image_embeds", "image_embeds": {"image_embeds": "QUJDRA==", "image_grid_thw": [1, 2, 2]}},
    ):
        assert (await post(app, chat_body(part))).status_code == 200
    assert len(engine.received) == 2


@pytest.mark.parametrize(
    ("storage", "uuid", "options", "why"),
    [
        (False, "x", {}, "cannot confirm"),
        (True, None, {}, "has no uuid"),
        (True, "x", {"mm_processor_kwargs": {"max_pixels": 1}}, "cannot be derived"),
    ],
)
async def test_a_reference_the_middleware_cannot_confirm_is_refused(
    tmp_path: Path, storage: bool, uuid: str | None, options: dict[str, Any], why: str
) -> None:
    """Outside vLLM (no model path) an identifier under options cannot be derived; without storage there
    is nothing to look in; without a uuid vLLM makes an identifier no embedding has."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    storage_path = {"ec_storage_path": str(tmp_path)} if storage else {}
    app, _ = build_app(encoders, engine, client_embeddings="trust", **storage_path)
    stored(tmp_path, "x")
    response = await post(app, chat_body(reference(uuid), **options))
    assert response.status_code == 400
    assert why in response.json()["error"]["message"]
    assert engine.received == []


async def test_references_in_responses_and_batch_bodies_are_checked(tmp_path: Path) -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, tmp_path)
    responses = {"model": "m", "input": [{"role": "user", "content": [reference("nope")]}]}
    batch = {"model": "m", "messages": [[{"role": "user", "content": [reference("nope")]}]]}
    for path, body in (("/v1/responses", responses), ("/v1/chat/completions/batch", batch)):
        response = await post(app, body, path)
        assert response.status_code == 400, path
    assert engine.received == []


async def test_the_status_page_says_how_client_references_are_treated(tmp_path: Path) -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    outside, _ = build_app(encoders, engine)
    status = (await get(outside, "/epd/status")).json()
    assert status["client_references"]["checked"] is False
    app = inside_vllm(encoders, engine, tmp_path)
    status = (await get(app, "/epd/status")).json()
    assert status["client_references"] == {
        "checked": True,
        "storage": str(tmp_path),
        "with_options": True,
        "why_not_with_options": None,
    }


# --- bodies as vLLM reads them (item 3) ----------------------------------------------------------

IMAGE_BODY = chat_body(image(png(1)), temperature=0.5)


def _encodings() -> list[tuple[str, bytes]]:
    text = json.dumps(IMAGE_BODY)
    return [
        ("utf-8 BOM", codecs.BOM_UTF8 + text.encode()),
        ("utf-16", text.encode("utf-16")),
        ("utf-16-le, no BOM", text.encode("utf-16-le")),
        ("utf-32", text.encode("utf-32")),
        ("utf-32-be, no BOM", text.encode("utf-32-be")),
        ("NaN", text.replace('"temperature": 0.5', '"temperature": NaN').encode()),
        ("Infinity", text.replace('"temperature": 0.5', '"temperature": Infinity').encode()),
        ("1e400", text.replace('"temperature": 0.5', '"temperature": 1e400').encode()),
        ("lone surrogate", text.replace('"Describe."', '"Describe \\ud800"').encode()),
    ]


@pytest.mark.parametrize(("name", "raw"), _encodings(), ids=[name for name, _ in _encodings()])
async def test_bodies_only_pythons_json_reads_are_read_as_vllm_reads_them(name: str, raw: bytes) -> None:
    """Before: msgspec refused them, so they went to the engine unread, image raw, no encoder call."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    assert (await post(app, raw)).status_code == 200
    assert len(encoders.calls) == 1
    sent = json.loads(engine.received[0].body)  # as vLLM will read it
    original = json.loads(raw)
    assert media_parts(sent)[0]["type"] == "image_embeds"
    assert sent["messages"][0]["content"][0] == original["messages"][0]["content"][0]  # lone surrogate too
    temperature = sent["temperature"]
    assert temperature == original["temperature"] or (math.isnan(temperature) and name == "NaN")


async def test_limits_hold_for_every_encoding() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, max_media_items=2)
    body = json.dumps(chat_body(*(image(png(seed)) for seed in range(3)))).encode("utf-16")
    assert (await post(app, body)).status_code == 400
    assert encoders.calls == []
    assert engine.received == []


async def test_with_a_prefill_pool_the_clients_own_kv_transfer_params_never_reach_the_decoder() -> None:
    """Before: a BOM body skipped the middleware, so the client's remote_host reached the decoder."""
    encoders, engine, prefill = FakeEncoders([E0]), FakeEngine(), FakePrefill([P0])
    app, _ = build_app(encoders, engine, prefill)
    forged = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 1, "remote_block_ids": [1]}
    raw = codecs.BOM_UTF8 + json.dumps(chat_body(image(png(1)), kv_transfer_params=forged)).encode()
    assert (await post(app, raw)).status_code == 200
    assert engine.received[0].json["kv_transfer_params"] == FakePrefill.params(
        P0, prefill.calls[0].headers["x-request-id"]
    )


@pytest.mark.parametrize("where", ["vllm_xargs", "vllm_xargs with media"])
async def test_vllm_xargs_never_sets_transfer_parameters(where: str) -> None:
    """vLLM copies vllm_xargs into the engine request where the body's own field is empty: a string
    there breaks the connector. Before: passed on (text-only bodies unparsed)."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    parts = [image(png(1))] if "media" in where else []
    for name in ("ec_transfer_params", "kv_transfer_params"):
        response = await post(app, chat_body(*parts, vllm_xargs={name: "abc", "other": 1}))
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "vllm_xargs"
    assert engine.received == []
    assert (await post(app, chat_body(*parts, vllm_xargs={"other": 1}))).status_code == 200


async def test_sagemaker_invocations_are_a_chat_surface_and_completions_pass() -> None:
    """vLLM serves a chat body on /invocations as a chat completion. Before: not intercepted at all."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    app.router.routes.append(recording_route(engine, "/invocations"))
    assert (await post(app, chat_body(image(png(1))), "/invocations")).status_code == 200
    assert len(encoders.calls) == 1
    assert media_parts(engine.received[0].json)[0]["type"] == "image_embeds"
    # A completion body (no messages) is vLLM's to serve as it is.
    completion = json.dumps({"model": "m", "prompt": "image_url", "kv_transfer_params": {"x": 1}}).encode()
    assert (await post(app, completion, "/invocations")).status_code == 200
    assert engine.received[1].body == completion


async def test_batch_conversations_are_encoded_and_written_back_each() -> None:
    """Before: /v1/chat/completions/batch was not intercepted: its media went to the engine raw."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    app.router.routes.append(recording_route(engine, "/v1/chat/completions/batch"))
    conversations = [chat_body(image(png(seed)))["messages"] for seed in (1, 2)]
    body = {"model": "tiny-qwen2-vl", "messages": conversations, "max_tokens": 4}
    assert (await post(app, body, "/v1/chat/completions/batch")).status_code == 200
    sent = engine.received[0].json
    parts = [conversation[0]["content"][1] for conversation in sent["messages"]]
    assert [part["type"] for part in parts] == ["image_embeds"] * 2
    uuids = [part["uuid"] for part in parts]
    assert uuids == [uuid_of("image", (f"data:image/png;base64,{png(seed)}",)) for seed in (1, 2)]
    assert set(sent["ec_transfer_params"]) == set(uuids)


# --- the PD's media policy (item 14) ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://169.254.169.254/latest/meta-data", "allowed domains"),
        ("HTTP://Evil.example/x.png", "Input URL domain: evil.example"),
        ("ftp://media.example/x.png", "either a HTTP, data or file URL"),
        ("file:///etc/passwd", "Cannot load local files"),
    ],
)
async def test_media_the_pds_policy_forbids_is_refused_before_any_encoder_call(
    url: str, message: str
) -> None:
    """Before: encoders fetched them, and the engine got only a reference: the PD's flags never applied."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, domains=["media.example"])
    part = {"type": "image_url", "image_url": {"url": url}}
    response = await post(app, chat_body(part))
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]
    assert encoders.calls == []
    assert engine.received == []
    allowed = {"type": "image_url", "image_url": {"url": "http://media.example/x.png"}}
    assert (await post(app, chat_body(allowed, image(png(1))))).status_code == 200


async def test_local_files_must_lie_under_the_allowed_path(tmp_path: Path) -> None:
    allowed, outside = tmp_path / "media", tmp_path / "secret"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "ok.png").write_bytes(b"x")
    (allowed / "link.png").symlink_to(outside / "s.png")
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, local=str(allowed))

    def part(path: Path | str) -> dict[str, Any]:
        return {"type": "image_url", "image_url": {"url": f"file://{path}"}}

    for refused in (outside / "s.png", allowed / "link.png", f"{allowed}/../secret/s.png", allowed):
        response = await post(app, chat_body(part(refused)))
        assert response.status_code == 400, refused
        assert str(allowed) not in response.json()["error"]["message"].split("subpath")[-1]
    assert (await post(app, chat_body(part(allowed / "ok.png")))).status_code == 200
    assert len(encoders.calls) == 1


# --- scheduler headers (items 4, 9, 15) ------------------------------------------------------------


def llmd_app(**options: Any) -> tuple[Any, FakeEncoders, FakeEngine]:
    encoders = FakeEncoders(["http://127.0.0.11:8001", "http://127.0.0.12:8001"])
    engine = FakeEngine()
    app = engine.app()
    app.add_middleware(
        EPDMiddleware,
        scheduler="llm-d",
        http_client=encoders.client(),
        health_check_interval=0,
        **options,
    )
    return app, encoders, engine


@pytest.mark.parametrize("port", [b"8001\xb2", b"80\xb3\xb9", "80\u0660\u0661".encode()])
async def test_a_port_of_non_ascii_digits_is_a_forged_entry(port: bytes) -> None:
    """Before: str.isdigit() said yes to superscripts (Latin-1 0xB2), int() then raised: a 500."""
    app, encoders, engine = llmd_app(scheduler_allow=["127.0.0.0/24"], max_media_items=4)
    target = b"127.0.0.11:" + port
    response = await post(app, chat_body(image(png(1))), **{"x-encoder-hosts-ports": target})
    assert response.status_code == 200
    assert encoders.calls == []  # dropped: the engine encodes it itself
    assert len(engine.received) == 1
    refused = await post(app, chat_body(image(png(1))), **{"x-prefiller-host-port": target})
    assert refused.status_code == 403
    assert len(engine.received) == 1


async def test_a_header_naming_thousands_of_targets_is_read_only_as_far_as_media_items(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: every entry was parsed and de-duplicated by list: quadratic, 130 ms for one 59 KB header."""
    from epd_middleware import _scheduler as scheduler

    parsed: list[str] = []
    real = scheduler.split_host_port
    monkeypatch.setattr(scheduler, "split_host_port", lambda entry: parsed.append(entry) or real(entry))
    app, encoders, _ = llmd_app(scheduler_allow=["127.0.0.0/8"], max_media_items=4)
    entries = ",".join(f"127.0.{i // 250}.{i % 250 + 1}:8001" for i in range(5000))
    header = "127.0.0.11:8001,127.0.0.11:8001," + entries
    response = await post(app, chat_body(image(png(1))), **{"x-encoder-hosts-ports": header})
    assert response.status_code == 200
    assert len(parsed) == 4
    assert [call.encoder for call in encoders.calls] == ["http://127.0.0.11:8001"]


async def test_websocket_scopes_lose_the_scheduler_headers_too() -> None:
    seen: list[Any] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope)

    middleware = EPDMiddleware(inner, encoders=[E0])
    headers = [(b"x-encoder-hosts-ports", b"10.0.0.1:8000"), (b"x-prefiller-host-port", b"10.0.0.2:8000")]
    scope = {"type": "websocket", "path": "/v1/realtime", "headers": [*headers, (b"host", b"pd")]}
    await middleware(scope, scripted_receive(b""), lambda message: anyio.lowlevel.checkpoint())
    assert seen[0]["headers"] == [(b"host", b"pd")]


async def test_the_model_check_before_a_first_call_counts_against_the_encode_deadline() -> None:
    """Before: it ran outside the deadline, so a request could overrun it by health_check_timeout per
    server tried. The encoder never answers GET /v1/models here; the deadline is what ends the wait."""

    def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError("never called: the models check never ends")

    async def hang(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            await anyio.sleep(3600)
        return handler(request)

    engine = FakeEngine()
    app = engine.app()
    app.add_middleware(
        EPDMiddleware,
        encoders=[E0, E1],
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(hang)),
        expected_model="tiny-qwen2-vl",
        health_check_timeout=3600,
        encode_deadline=0.3,
        health_check_interval=0,
    )
    with anyio.fail_after(30):
        response = await post(app, chat_body(image(png(1))))
    assert response.status_code == 504
    assert "deadline" in response.json()["error"]["message"]


# --- header bytes (item 7) ----------------------------------------------------------------------


async def test_a_latin1_header_byte_goes_on_byte_for_byte_with_an_injected_httpx_client() -> None:
    """Before: httpx encoded header values as ASCII, the call failed before it was sent and counted
    against the encoder: three such requests ejected every encoder."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, eject_after=1, forward_authorization=True)
    for seed in range(3):
        headers = {"x-request-id": b"caf\xe9", "authorization": b"Bearer k\xe9"}
        assert (await post(app, chat_body(image(png(seed))), **headers)).status_code == 200
    assert encoders.calls[0].headers["x-request-id"] == "caf\xe9-enc0"
    assert encoders.calls[0].headers["authorization"] == "Bearer k\xe9"
    assert (await post(app, chat_body(image(png(9))))).status_code == 200
    assert len(encoders.calls) == 4


async def test_a_header_that_cannot_be_sent_is_the_requests_fault_never_the_encoders() -> None:
    """An ASGI server never hands a line break in a header value, but the middleware does not rely on
    it: such a value is refused (400) before any byte is sent, and no encoder is blamed."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    middleware = EPDMiddleware(engine.app(), encoders=[E0], http_client=encoders.client(), eject_after=1)
    raw = json.dumps(chat_body(image(png(1)))).encode()
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    for _ in range(3):
        scope = http_scope(raw)
        scope["headers"].append((b"x-request-id", b"a\r\nx-injected: 1"))
        await middleware(scope, scripted_receive(raw), send)
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [400] * 3
    assert middleware.pipeline.encoders.snapshot(anyio.current_time())[E0]["healthy"]
    assert encoders.calls == []
    sent.clear()
    await middleware(http_scope(raw), scripted_receive(raw), send)
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]


# --- keys (items 10, 11, 12, 13) -------------------------------------------------------------------


async def test_a_plain_string_api_key_is_one_key_not_its_characters() -> None:
    """Before: app.state.args.api_key "secret" was split into characters: "Bearer s" opened the page."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, api_key="secret")
    assert (await get(app, "/epd/status", authorization="Bearer s")).status_code == 401
    assert (await get(app, "/epd/status", authorization="Bearer secret")).status_code == 200


@pytest.mark.parametrize(
    ("header", "status"),
    [
        ("Bearer k1", 200),
        ("bearer k1", 200),
        ("BEARER k2", 200),
        ("Bearer  k1", 401),  # vLLM takes everything after the first space, as it is
        ("Bearer k1 ", 401),
        ("Basic k1", 401),
        ("k1", 401),
    ],
)
async def test_the_key_is_read_as_vllm_reads_it(header: str, status: int) -> None:
    """Before: the scheme had to be "Bearer" exactly, where vLLM takes it in any case."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, api_keys=["k1", "k2"])
    assert (await post(app, chat_body(image(png(1))), authorization=header)).status_code == status


async def test_the_plugin_refuses_to_start_with_keys_only_it_would_know(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: inside vLLM's key check (which checks nothing without --api-key) the middleware checked no
    key either: EPD_API_KEYS guarded nothing, although the documentation promised a 401."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    config = EPDConfig(encoders=[E0], api_keys=["k"], authenticate=False)
    with pytest.raises(RuntimeError, match="EPD_API_KEYS is set, but vLLM runs without --api-key"):
        check_keys(config, Host.of_vllm(SimpleNamespace(), SimpleNamespace(api_key=None)))
    check_keys(config, Host.of_vllm(SimpleNamespace(), SimpleNamespace(api_key=["k"])))
    check_keys(config, Host.of_vllm(SimpleNamespace(), SimpleNamespace(api_key="k")))
    monkeypatch.setenv("VLLM_API_KEY", "k")
    check_keys(config, Host.of_vllm(SimpleNamespace(), SimpleNamespace(api_key=None)))
    check_keys(EPDConfig(encoders=[E0]), Host.of_vllm(SimpleNamespace(), SimpleNamespace(api_key=None)))


async def test_the_plugin_warns_of_routes_it_cannot_guard(caplog: pytest.LogCaptureFixture) -> None:
    plugin = EPDPlugin()
    plugin.config = EPDConfig(encoders=[E0])
    state = vllm_state(Path("/tmp"))
    with caplog.at_level(logging.WARNING, logger="epd_middleware"):
        await plugin.init_state(None, state, SimpleNamespace(api_key=None, enable_scale_out=True))
    assert "/inference/v1/generate" in caplog.text


@pytest.mark.parametrize("field", ["encoders", "prefill"])
def test_credentials_in_a_server_url_are_refused_and_never_repeated(field: str) -> None:
    """Before: accepted, silently not sent, and shown in every 502, on the status page and in metrics."""
    with pytest.raises(ValueError, match="encoder_api_key") as raised:
        EPDConfig(**{field: ["http://user:s3cret@enc-0:8001"]})
    assert "s3cret" not in str(raised.value)
    with pytest.raises(ValueError, match="credentials") as from_env:
        EPDConfig.from_env({f"EPD_{field.upper()}": "dns+http://user:s3cret@enc:8001"})
    assert "s3cret" not in str(from_env.value)


# --- found by attacking the fixes above (an outside tester's report) -------------------------------


async def test_a_completion_on_invocations_sets_no_transfer_parameter_either() -> None:
    """A body without messages passes as vLLM's completion, but still carries nothing that is the
    middleware's to set: vllm_xargs transfer keys anywhere, kv_transfer_params where it prefills."""
    encoders, engine, prefill = FakeEncoders([E0]), FakeEngine(), FakePrefill([P0])
    app, _ = build_app(encoders, engine, prefill)
    app.router.routes.append(recording_route(engine, "/invocations"))
    forged = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 1}
    for fields in ({"kv_transfer_params": forged}, {"vllm_xargs": {"ec_transfer_params": "abc"}}):
        response = await post(app, {"model": "m", "prompt": "hi", **fields}, "/invocations")
        assert response.status_code == 400
    assert engine.received == []
    assert (await post(app, {"model": "m", "prompt": "hi"}, "/invocations")).status_code == 200


async def test_in_llm_d_mode_a_request_not_prefilled_remotely_takes_no_kv_source_from_the_client() -> None:
    """Without x-prefiller-host-port the request decodes here; the client's own kv_transfer_params would
    have told the decoder which host to pull a KV cache from, past the header's allowlist."""
    app, _, engine = llmd_app(scheduler_allow=["127.0.0.0/24"])
    forged = {"do_remote_prefill": True, "remote_host": "203.0.113.7", "remote_port": 5600}
    for body in (chat_body(kv_transfer_params=forged), chat_body(image(png(1)), kv_transfer_params=forged)):
        response = await post(app, body)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "kv_transfer_params"
    assert engine.received == []


@pytest.mark.parametrize("where", ["uuid", "cache_salt", "url"])
async def test_a_long_string_with_a_raw_control_character_is_left_to_vllm_not_a_500(where: str) -> None:
    """Long strings stay raw, unchecked, until read as text: one holding a raw newline made that read
    raise (a 500). Such a body is not JSON as vLLM reads it either: vLLM answers it."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, domains=["media.example"])
    bad = "A" * 3000 + "\n B"
    part: dict[str, Any] = image(png(1))
    fields: dict[str, Any] = {"pad": "C" * 20_000}
    if where == "uuid":
        part["uuid"] = bad
    elif where == "cache_salt":
        fields["cache_salt"] = bad
    else:
        part = {"type": "image_url", "image_url": {"url": "http://media.example/" + bad}}
    raw = json.dumps(chat_body(part, **fields)).encode().replace(b"\\n", b"\n")
    response = await post(app, raw)
    assert response.status_code in (200, 400)  # the fake engine's 400 for bodies it cannot read
    assert encoders.calls == []
    for record in engine.received:
        assert record.body == raw


async def test_responses_audio_is_found_counted_and_checked() -> None:
    """Before: the Responses byte scan looked for images only, so audio went to the engine unread."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, max_media_items=2)
    audio = {"type": "input_audio", "input_audio": {"data": "QUJD", "format": "wav"}}
    body = {"model": "m", "input": [{"role": "user", "content": [audio, audio, dict(audio, format="mp3")]}]}
    assert (await post(app, body, "/v1/responses")).status_code == 400
    assert engine.received == []


@pytest.mark.parametrize(
    ("part", "stray"),
    [
        (
            {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}, "video_embeds": None},
            "video_embeds",
        ),
        (
            {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}, "audio_embeds": None},
            "audio_embeds",
        ),
        (
            {
                "type": "video_url",
                "video_url": {"url": "data:video/mp4;base64,AAAA"},
                "image_url": {"url": "http://169.254.169.254/x"},
            },
            "image_url",
        ),
    ],
)
async def test_a_pinned_uuid_never_changes_how_vllm_types_a_part(part: dict[str, Any], stray: str) -> None:
    """With a uuid vLLM types a part by the first media key it holds, not by its type: a stray key
    beside the media turned the part the middleware pinned into a reference to nothing, or made the
    encoder fetch a URL no policy saw. The stray key is dropped (without a uuid vLLM ignores it)."""
    encoders, engine = FakeEncoders([E0], mode={E0: "no_entries"}), FakeEngine()
    app = inside_vllm(encoders, engine, domains=["media.example"])
    assert (await post(app, chat_body(part))).status_code == 200
    [call] = encoders.calls
    assert stray not in call.body["messages"][0]["content"][0]
    [sent] = media_parts(engine.received[0].json)
    assert stray not in sent
    assert sent["type"] == part["type"]
    assert "uuid" in sent


async def test_an_embedding_removed_while_other_calls_ran_is_not_referenced(tmp_path: Path) -> None:
    """Checked when its call returned (or when reused), an embedding can go before the engine gets the
    body: a cleanup while a slow sibling call runs. Each is looked at again at hand-off."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, tmp_path)
    first = image(png(1))
    assert (await post(app, chat_body(first))).status_code == 200  # cached and stored
    [cached] = media_parts(engine.received[0].json)

    real = encoders._handle

    async def slow(encoder: str, request: httpx.Request) -> httpx.Response:
        shutil.rmtree(tmp_path / cached["uuid"])  # gone while this call runs
        return await real(encoder, request)

    encoders._handle = slow  # type: ignore[method-assign]
    assert (await post(app, chat_body(first, image(png(2))))).status_code == 200
    parts = media_parts(engine.received[1].json)
    assert [part["type"] for part in parts] == ["image_url", "image_url"]  # one modality: both stay raw
