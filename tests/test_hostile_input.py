"""What a hostile client can write, and what it gets (issue 29), on asyncio and trio with fakes: client
uuids that are not file names, raw control characters in long strings, cache salts vLLM refuses, and
local file URLs the file system cannot name. Each test names the item it closes; each failed against the
code before the fix. (Items 8 and 10 on the reuse key: ``tests/test_reuse.py``; item 9:
``tests/test_media_budget.py``.)"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from .fakes import FakeEncoders, FakeEngine, build_app, chat_body, image
from .test_hostile_clients import inside_vllm, post, recording_route, reference
from .test_middleware import E0, OPTIONS, png
from .test_reuse import app_with
from .test_topologies import image_block, messages_body

pytestmark = pytest.mark.anyio


# --- item 4: a trusted client uuid is a plain file name or refused ------------------------------------

NOT_FILE_NAMES = [
    "../outside",  # the encoder wrote outside the storage
    "victim/encoder_cache.safetensors",  # a directory where a reference to "victim" expects a file
    "..",
    ".",
    "a\\b",
    "nul\0byte",
    "x" * 256,  # longer than a file name may be
]


@pytest.mark.parametrize("options", [{}, OPTIONS], ids=["plain", "with_options"])
@pytest.mark.parametrize("uuid", NOT_FILE_NAMES)
async def test_a_trusted_client_uuid_that_is_not_a_plain_file_name_is_refused(
    tmp_path: Path, uuid: str, options: dict[str, Any]
) -> None:
    """issue 29 item 4: under ``trust_client_uuid`` the uuid is the item's hash, which ECExampleConnector
    makes a directory of (``<storage>/<mm_hash>/encoder_cache.safetensors``). Before: it reached the
    encoders, so ``../outside`` was written outside the storage and ``victim/encoder_cache.safetensors``
    planted a directory where a later reference to ``victim`` expects the file. Refused now (400, naming
    the part) before any encoder call, with or without options (with them vLLM derives a hex hash, but
    such a uuid is refused all the same)."""
    storage = tmp_path / "storage"
    storage.mkdir()
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = app_with(encoders, engine, storage, trust_client_uuid=True)
    response = await post(app, chat_body(image(png(1), uuid=uuid), **options))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert "messages[0].content[1]" in error["message"]
    assert "uuid" in error["message"]
    assert encoders.calls == []
    assert engine.received == []
    assert os.listdir(tmp_path) == ["storage"]  # nothing written beside the storage
    assert os.listdir(storage) == []


async def test_an_untrusted_client_uuid_is_not_judged_as_a_file_name(tmp_path: Path) -> None:
    """issue 29 item 4: without ``trust_client_uuid`` the content decides the hash, so the client's uuid
    names no file and is not refused."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = app_with(encoders, engine, tmp_path)
    response = await post(app, chat_body(image(png(1), uuid="../outside")))
    assert response.status_code == 200
    assert len(encoders.calls) == 1


async def test_a_directory_where_the_embedding_file_belongs_is_no_embedding(tmp_path: Path) -> None:
    """issue 29 item 4: vLLM loads ``<storage>/<hash>/encoder_cache.safetensors`` as a file; the check
    took any path that exists, so a directory planted there (as the uuid above once did) let a client's
    reference to ``victim`` through to the engine, which cannot load it."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, tmp_path)
    (tmp_path / "victim" / "encoder_cache.safetensors").mkdir(parents=True)
    response = await post(app, chat_body(reference("victim"), ec_transfer_params={"victim": {}}))
    assert response.status_code == 400
    assert "victim" in response.json()["error"]["message"]
    assert engine.received == []


# --- item 5: a long string with a raw control character -------------------------------------------


def _chat(fields: dict[str, Any]) -> dict[str, Any]:
    return chat_body(image(png(1, size=15_000)), **fields)


def _responses(fields: dict[str, Any]) -> dict[str, Any]:
    part = {"type": "input_image", "image_url": f"data:image/png;base64,{png(1, size=15_000)}"}
    return {"model": "m", "input": [{"role": "user", "content": [part]}], **fields}


def _batch(fields: dict[str, Any]) -> dict[str, Any]:
    conversation = [{"role": "user", "content": [image(png(1, size=15_000))]}]
    return {"model": "m", "messages": [conversation, conversation], **fields}


SURFACE_BODIES = {
    "/v1/chat/completions": _chat,
    "/invocations": _chat,
    "/v1/responses": _responses,
    "/v1/chat/completions/batch": _batch,
}
CONTROL = "\x01"  # json.dumps escapes it as \u0001; the raw byte is put back in its place


def raw_control(body: dict[str, Any]) -> bytes:
    """The body as JSON with each escaped control character written raw: not JSON as vLLM reads it."""
    raw = json.dumps(body).encode().replace(b"\\u0001", CONTROL.encode())
    assert CONTROL.encode() in raw
    return raw


@pytest.mark.parametrize("where", ["session_id", "vllm_xargs"])
@pytest.mark.parametrize("path", SURFACE_BODIES)
async def test_a_long_session_id_with_a_raw_control_character_is_left_to_vllm(path: str, where: str) -> None:
    """issue 29 item 5: long strings stayed raw, unchecked, until read as text; a session id of 2 KB or
    more holding a raw control character made that read raise (an unhandled 500) on chat,
    ``/invocations``, Responses and batch. vLLM's parser refuses such a body as a whole (400, "JSON
    decode error"): the parser now refuses it as vLLM's does, so the body goes to vLLM as it came and
    vLLM answers it, with no encoder call."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    for route in ("/invocations", "/v1/chat/completions/batch"):
        app.router.routes.append(recording_route(engine, route))
    session = "S" * 3000 + CONTROL
    fields = {"session_id": session} if where == "session_id" else {"vllm_xargs": {"session_id": session}}
    raw = raw_control(SURFACE_BODIES[path](fields))
    response = await post(app, raw, path)
    assert response.status_code != 500
    assert encoders.calls == []
    assert [record.body for record in engine.received] == [raw]


@pytest.mark.parametrize(
    "fields",
    [
        {"model": "m" * 3000 + CONTROL},
        {"mm_processor_kwargs": {"size": "s" * 3000 + CONTROL}},
        {"cache_salt": "c" * 3000 + CONTROL},
    ],
    ids=["model", "mm_processor_kwargs", "cache_salt"],
)
async def test_any_long_string_with_a_raw_control_character_leaves_the_body_to_vllm(
    tmp_path: Path, fields: dict[str, Any]
) -> None:
    """issue 29 item 5: not only the session id: every long string is read as vLLM's parser reads it,
    wherever it sits (the model, an option the identifier hashes, the salt), on every surface."""
    for path, body in (
        ("/v1/chat/completions", _chat(fields)),
        ("/v1/messages", messages_body(image_block(png(1, size=15_000)), **fields)),
    ):
        encoders, engine = FakeEncoders([E0]), FakeEngine()
        app = inside_vllm(encoders, engine, tmp_path)
        raw = raw_control(body)
        response = await post(app, raw, path)
        assert response.status_code != 500
        assert encoders.calls == []
        assert [record.body for record in engine.received] == [raw]


# --- item 8: a cache salt vLLM refuses ------------------------------------------------------------

SALT_TOO_LONG = (
    "Parameter 'cache_salt' must be at most 128 characters and must not contain '@', '/', '\\\\', or NUL."
)
SALT_NOT_A_STRING = "Parameter 'cache_salt' must be a non-empty string if provided."


@pytest.mark.parametrize(
    ("salt", "message"),
    [
        ("s" * 129, SALT_TOO_LONG),
        ("s" * (1 << 20), SALT_TOO_LONG),  # 1 MiB: the reuse cache kept it in every key
        ("tenant/a", SALT_TOO_LONG),
        ("a@b", SALT_TOO_LONG),
        ("a\\b", SALT_TOO_LONG),
        ("a\0b", SALT_TOO_LONG),
        ("", SALT_NOT_A_STRING),
        (7, SALT_NOT_A_STRING),
    ],
)
async def test_a_cache_salt_vllm_refuses_is_refused_before_any_encoder_call(
    tmp_path: Path, salt: Any, message: str
) -> None:
    """issue 29 item 8: vLLM refuses a ``cache_salt`` that is not a non-empty string of at most 128
    characters without ``@``, ``/``, ``\\`` or NUL (``validate_cache_salt``). Before: the encoders were
    called for it first, and the reuse cache kept the salt in every key. Refused now with vLLM's status
    and words, naming ``cache_salt``."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = app_with(encoders, engine, tmp_path)
    response = await post(app, chat_body(image(png(1)), image(png(2)), cache_salt=salt))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == message
    assert error["param"] == "cache_salt"
    assert encoders.calls == []
    assert engine.received == []
    assert len(app.pipeline.reuse) == 0


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions/batch", "/v1/messages"])
async def test_a_cache_salt_vllm_refuses_is_refused_on_every_surface(path: str) -> None:
    """issue 29 item 8: Responses checks the salt as chat does; batch and Messages requests become chat
    requests that check it."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    app.router.routes.append(recording_route(engine, "/v1/chat/completions/batch"))
    fields = {"cache_salt": "s" * 129}
    body = (
        messages_body(image_block(png(1)), **fields)
        if path == "/v1/messages"
        else {"/v1/responses": _responses, "/v1/chat/completions/batch": _batch}[path](fields)
    )
    response = await post(app, body, path)
    assert response.status_code == 400
    assert "cache_salt" in response.text
    assert encoders.calls == []
    assert engine.received == []


async def test_a_salt_vllm_takes_still_salts(tmp_path: Path) -> None:
    """issue 29 item 8: a salt of 128 characters is vLLM's limit, not past it."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = app_with(encoders, engine, tmp_path)
    response = await post(app, chat_body(image(png(1)), cache_salt="s" * 128))
    assert response.status_code == 200
    assert len(encoders.calls) == 1


# --- item 11: a file URL the file system cannot name -----------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_a_file_url_with_an_encoded_nul_is_refused_as_vllm_refuses_it(
    tmp_path: Path, path: str
) -> None:
    """issue 29 item 11: ``%00`` decodes to NUL, and resolving such a path raises ValueError
    ("embedded null byte"): before, an unhandled 500. vLLM's own check (``_load_file_url``) raises the
    same ValueError, which it answers 400 with its text."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, local=str(tmp_path))
    url = f"file://{tmp_path}/cat%00.png"
    if path == "/v1/messages":
        body = messages_body({"type": "image", "source": {"type": "url", "url": url}})
    else:
        body = chat_body({"type": "image_url", "image_url": {"url": url}})
    response = await post(app, body, path)
    assert response.status_code == 400
    assert "embedded null byte" in response.text
    assert encoders.calls == []
    assert engine.received == []
