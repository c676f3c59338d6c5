"""What a hostile client can write, and what it gets (issue 29), on asyncio and trio with fakes: client
uuids that are not file names, raw control characters in long strings, cache salts vLLM refuses, and
local file URLs the file system cannot name. Each test names the item it closes; each failed against the
code before the fix. (Items 8 and 10 on the reuse key: ``tests/test_reuse.py``; item 9:
``tests/test_media_budget.py``.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .fakes import FakeEncoders, FakeEngine, build_app, chat_body, image
from .test_hostile_clients import inside_vllm, post, recording_route
from .test_middleware import E0, png
from .test_topologies import image_block, messages_body

pytestmark = pytest.mark.anyio


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
