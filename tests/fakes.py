"""Fake vLLM encoders and a fake PD engine app, faithful to vLLM 0.32 where the middleware depends on it.

The fake encoder reports, like vLLM: the uuid as hash when the request has no per-request options, else
a hash derived from model id + uuid + options (``multimodal/processing/inputs.py``); ``item_indices``
as positions among the request's items; and an ``image_grid_thw`` that depends on
``mm_processor_kwargs`` (numbers from docs/vllm-cpu.md: the 800x600 image gives 234 image
tokens by default and 54 with the size override).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from epd_middleware import EPDMiddleware
from epd_middleware._canary import CANARY_UUID
from epd_middleware._plan import UuidKey, content_uuid

DEFAULT_GRID = [1, 36, 26]  # 234 tokens after the 2x2 merge
SMALL_GRID = [1, 12, 18]  # 54 tokens
MODEL = "tiny-qwen2-vl"

# The model names the tests send; fake servers say they serve all of them unless told otherwise.
TEST_MODELS = [MODEL, "m", "a", "b", "bench"]
# The fleet secret the fakes' middleware keys content uuids with, so that a test can compute them.
TEST_UUID_KEY = "test-fleet-secret-0123456789abcdef"
_TEST_KEY = UuidKey(TEST_UUID_KEY)


def uuid_of(modality: str, content: Sequence[str], salt: str | None = None) -> str:
    """The content uuid the fakes' middleware gives this media (under :data:`TEST_UUID_KEY`)."""
    return content_uuid(modality, content, salt, _TEST_KEY)


def models_answer(names: list[str], root: str | None = None) -> dict[str, Any]:
    """vLLM's GET /v1/models answer."""
    cards = [{"id": name, "object": "model", "owned_by": "vllm", "root": root or name} for name in names]
    return {"object": "list", "data": cards}


PART_MODALITY = {"image_url": "image", "audio_url": "audio", "video_url": "video", "input_audio": "audio"}


def derived_hash(model: str, uuid: str, modality: str, body: Mapping[str, Any]) -> str:
    """vLLM's rule: the uuid itself without options, a hash of model + uuid + options with them."""
    media_io = (body.get("media_io_kwargs") or {}).get(modality)
    factors: dict[str, Any] = {}
    if media_io:
        factors["media_io_kwargs"] = {modality: media_io}
    if body.get("mm_processor_kwargs"):
        factors["mm_processor_kwargs"] = body["mm_processor_kwargs"]
    if not factors:
        return uuid
    # vLLM's hasher sorts its keywords, and serialises the values inside them in the order written.
    text = json.dumps(sorted({"model_id": model, modality: uuid, **factors}.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:40]


# What vLLM answers when it cannot load a request's media (multimodal/media/connector.py, and its error
# mapping in entrypoints/serve/exception_handling/error_response.py): the same on every server.
NOT_BASE64 = "Only base64 data URLs are supported for now."


def media_failure(body: Any) -> tuple[int, dict[str, Any]] | None:
    """vLLM's answer to a request whose media it cannot load, as an encoder gives it: 501 for a data URL
    that is not base64, 500 naming the host for an image host that does not resolve (``*.invalid``, as
    aiohttp's ClientConnectorDNSError reads); None when the media loads."""
    for url in _image_urls(body):
        if url[:5].lower() == "data:" and not url.partition(",")[0].endswith(";base64"):
            return 501, _vllm_error(NOT_BASE64, "NotImplementedError", 501)
        host = url.split("://", 1)[1].split("/", 1)[0] if "://" in url else ""
        if host.endswith(".invalid"):
            said = f"Cannot connect to host {host}:80 ssl:default [Name or service not known]"
            return 500, _vllm_error(said, "InternalServerError", 500)
    return None


def _image_urls(value: Any) -> list[str]:
    if isinstance(value, list):
        return [url for item in value for url in _image_urls(item)]
    if not isinstance(value, dict):
        return []
    inner = value.get("image_url")
    if isinstance(inner, dict) and isinstance(inner.get("url"), str):
        return [inner["url"]]
    return [url for item in value.values() for url in _image_urls(item)]


def _vllm_error(message: str, kind: str, status: int) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def is_canary(body: Mapping[str, Any]) -> bool:
    """Whether an encoder call is the middleware's canary encode (_canary.py), not a client's."""
    content = body["messages"][0]["content"]
    return len(content) == 1 and content[0].get("uuid") == CANARY_UUID


def content_hash(url: str) -> str:
    return "content-" + hashlib.sha256(url.encode()).hexdigest()[:24]


def part_modality(part: Mapping[str, Any]) -> str:
    if part.get("type") == "input_image" and part.get("uuid") is None:
        return "image"
    if part.get("type") in PART_MODALITY and part.get("uuid") is None:
        return PART_MODALITY[part["type"]]
    for key, modality in PART_MODALITY.items():
        if key in part:
            return modality
    raise AssertionError(f"not a media part: {part}")


def item_metadata(modality: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The placeholder metadata the fake reports: an image's grid depends on ``mm_processor_kwargs``."""
    if modality == "image":
        small = bool((body.get("mm_processor_kwargs") or {}).get("size"))
        return {"image_grid_thw": SMALL_GRID if small else DEFAULT_GRID}
    if modality == "audio":
        return {"audio_num_tokens": [50]}
    return {"video_grid_thw": [2, 12, 18]}


def reported_entries(body: Mapping[str, Any], version: str = "0.32") -> dict[str, Any]:
    """The ``ec_transfer_params`` an encoder reports for a chat-completions body: per media part i, its
    hash -> ``{"item_indices": [i], "metadata": ...}``; vLLM 0.33 adds ``"modality"`` to each entry
    (``ec_connector/utils.py``)."""
    entries: dict[str, Any] = {}
    for index, part in enumerate(body["messages"][0]["content"]):
        modality = part_modality(part)
        uuid = part.get("uuid")
        if uuid is None:
            # vLLM hashes the decoded media of a uuid-less item; the fake hashes its URL.
            mm_hash = content_hash(part["image_url"]["url"])
        else:
            mm_hash = derived_hash(body["model"], uuid, modality, body)
        entries[mm_hash] = {"item_indices": [index], "metadata": item_metadata(modality, body)}
        if version != "0.32":
            entries[mm_hash] = {"modality": modality, **entries[mm_hash]}
    return entries


def encoder_reply(
    body: Mapping[str, Any], entries: Mapping[str, Any], request_id: str | None
) -> dict[str, Any]:
    """vLLM's answer to an encoder call: id "chatcmpl-" and the x-request-id header (else a random one),
    and the handles."""
    return {
        "id": f"chatcmpl-{request_id or 'random-id'}",
        "object": "chat.completion",
        "model": body["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 0, "total_tokens": 10},
        "ec_transfer_params": dict(entries),
    }


@dataclass
class EncoderCallRecord:
    encoder: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class FakeEncoders:
    """Any number of fake encoders behind one httpx transport, keyed by base URL.

    ``mode[url]`` makes an encoder misbehave: "ok", "500", "400", "hang", "refuse", "garbage",
    "not_object", "no_entries", "empty_metadata", "bad_indices", "unmatched", "drop_connection",
    "wrong_modality" (0.33's ``modality`` naming another one), "bad_modality" (not a string), "abort"
    (shutting down: vLLM's abort of a call added while its engine drains).
    """

    urls: list[str]
    mode: dict[str, str] = field(default_factory=dict)
    calls: list[EncoderCallRecord] = field(default_factory=list)
    # The middleware's canary encodes (confirming an ejection), kept apart from the clients' calls.
    canaries: list[EncoderCallRecord] = field(default_factory=list)
    started: anyio.Event | None = None
    cancelled: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    # Like ECExampleConnector: each reported embedding is written under storage/<hash>/, except by the
    # encoders in skip_store (a producer whose file never lands).
    storage: Path | None = None
    skip_store: set[str] = field(default_factory=set)
    delay: float = 0.0
    # Seconds each call takes after it is recorded and ``started`` is set.
    pause: float = 0.0
    # The vLLM version whose answer shape the encoders give ("0.32", "0.33": entries name a modality).
    version: str = "0.32"
    in_flight: dict[str, int] = field(default_factory=dict)
    peak_in_flight: dict[str, int] = field(default_factory=dict)
    health_status: dict[str, int] = field(default_factory=dict)
    # What GET /v1/models answers, per encoder (default: the models the tests send, each its own root).
    served: dict[str, list[str]] = field(default_factory=dict)
    roots: dict[str, str] = field(default_factory=dict)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.MockTransport(self.handle))

    def calls_to(self, url: str) -> list[EncoderCallRecord]:
        return [call for call in self.calls if call.encoder == url]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        encoder = f"{request.url.scheme}://{request.url.netloc.decode()}"
        assert encoder in self.urls, f"call to unknown encoder {encoder}"
        if request.url.path == "/health":
            if self.mode.get(encoder) == "refuse":
                raise httpx.ConnectError("connection refused", request=request)
            return httpx.Response(self.health_status.get(encoder, 200))
        if request.url.path == "/v1/models":
            if self.mode.get(encoder) == "refuse":
                raise httpx.ConnectError("connection refused", request=request)
            names = self.served.get(encoder, TEST_MODELS)
            return httpx.Response(200, json=models_answer(names, self.roots.get(encoder)))
        assert request.url.path == "/v1/chat/completions"
        self.in_flight[encoder] = self.in_flight.get(encoder, 0) + 1
        self.peak_in_flight[encoder] = max(self.peak_in_flight.get(encoder, 0), self.in_flight[encoder])
        try:
            return await self._handle(encoder, request)
        finally:
            self.in_flight[encoder] -= 1

    async def _handle(self, encoder: str, request: httpx.Request) -> httpx.Response:
        if self.delay:
            await anyio.sleep(self.delay)
        body = json.loads(request.content)
        record = EncoderCallRecord(encoder, body, dict(request.headers))
        (self.canaries if is_canary(body) else self.calls).append(record)
        mode = self.mode.get(encoder, "ok")
        if self.started is not None:
            self.started.set()
        if self.pause:  # a slow encode, seen started
            await anyio.sleep(self.pause)
        if mode == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        if (failed := media_failure(body)) is not None:
            return httpx.Response(failed[0], json=failed[1])
        if mode == "drop_connection":
            raise httpx.RemoteProtocolError("peer closed connection", request=request)
        if mode == "hang":
            try:
                await anyio.sleep(3600)
            except anyio.get_cancelled_exc_class():
                self.cancelled.append(encoder)
                raise
        if mode == "500":
            return httpx.Response(500, json={"error": {"message": "EngineCore died", "code": 500}})
        if mode == "400":
            return httpx.Response(400, json={"error": {"message": "bad mm_processor_kwargs", "code": 400}})
        if mode == "garbage":
            return httpx.Response(200, content=b"<html>oops</html>")
        if mode == "not_object":
            return httpx.Response(200, json=[1, 2, 3])
        if mode == "abort":  # vLLM draining (SIGTERM): the engine aborts the call unrun
            reply = encoder_reply(body, {}, request.headers.get("x-request-id"))
            reply["choices"][0]["finish_reason"] = "abort"
            reply["ec_transfer_params"] = None
            return httpx.Response(200, json=reply)
        self.completed.append(encoder)
        reply = self.reply(body, mode, request.headers.get("x-request-id"))
        if self.storage is not None and encoder not in self.skip_store:
            for mm_hash in reply["ec_transfer_params"]:
                (self.storage / mm_hash).mkdir(parents=True, exist_ok=True)
                (self.storage / mm_hash / "encoder_cache.safetensors").write_bytes(b"x")
        return httpx.Response(200, json=reply)

    def reply(self, body: dict[str, Any], mode: str, request_id: str | None = None) -> dict[str, Any]:
        entries = reported_entries(body, self.version)
        if mode == "no_entries":
            entries = {}
        elif mode == "empty_metadata":
            entries = {key: {**entry, "metadata": {}} for key, entry in entries.items()}
        elif mode == "bad_indices":
            entries = {key: {**entry, "item_indices": [99]} for key, entry in entries.items()}
        elif mode == "wrong_modality":
            entries = {key: {**entry, "modality": "audio"} for key, entry in entries.items()}
        elif mode == "bad_modality":
            entries = {key: {**entry, "modality": ["image"]} for key, entry in entries.items()}
        elif mode == "unmatched":
            parts = body["messages"][0]["content"]
            entries = {f"nope-{i}": {"metadata": {"x": 1}} for i in range(len(parts) + 1)}
        return encoder_reply(body, entries, request_id)


@dataclass
class EngineRecord:
    body: bytes
    headers: dict[str, str]

    @property
    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class FakeEngine:
    """A stand-in for vLLM's OpenAI app: records what reached it, answers JSON or SSE."""

    received: list[EngineRecord] = field(default_factory=list)
    fail_next: int = 0  # answer this many requests with vLLM's 500 (an embedding it could not load)
    fail_after: float = 0.0  # seconds before that 500 (a Mooncake consumer's push wait)
    delay: float = 0.0  # seconds each chat completion takes (the engine at work)

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = await request.body()
            self.received.append(EngineRecord(body, dict(request.headers)))
            if self.delay:
                await anyio.sleep(self.delay)
            if self.fail_next:
                self.fail_next -= 1
                if self.fail_after:
                    await anyio.sleep(self.fail_after)
                return JSONResponse(
                    {
                        "error": {
                            "message": "EngineCore encountered an issue",
                            "type": "InternalServerError",
                            "code": 500,
                        }
                    },
                    status_code=500,
                )
            try:
                payload = json.loads(body)
            except (ValueError, RecursionError):
                return JSONResponse({"error": {"message": "invalid JSON", "code": 400}}, status_code=400)
            if isinstance(payload, dict) and payload.get("stream"):

                async def events() -> Any:
                    for word in ("hello", " world"):
                        chunk = {"choices": [{"index": 0, "delta": {"content": word}}]}
                        yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"

                return StreamingResponse(events(), media_type="text/event-stream")
            return JSONResponse({"choices": [{"message": {"role": "assistant", "content": "ok"}}]})

        async def messages(request: Request) -> Response:
            body = await request.body()
            self.received.append(EngineRecord(body, dict(request.headers)))
            return JSONResponse(
                {"type": "message", "role": "assistant", "content": [{"type": "text", "text": "ok"}]}
            )

        async def health(request: Request) -> Response:
            return Response(status_code=200)

        async def other(request: Request) -> Response:
            body = await request.body()
            self.received.append(EngineRecord(body, dict(request.headers)))
            return JSONResponse({"ok": True})

        return Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/completions", other, methods=["POST"]),
                Route("/v1/messages", messages, methods=["POST"]),
                Route("/v1/responses", other, methods=["POST"]),
                Route("/health", health, methods=["GET"]),
            ]
        )


@dataclass
class PrefillCallRecord:
    server: str
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class FakePrefill:
    """Fake vLLM prefill servers (kv_producer), keyed by base URL: each answers with its own
    ``kv_transfer_params`` as NixlConnector does (engine id, blocks, host, port of the producer).

    ``mode[url]``: "ok", "500", "400", "hang", "refuse", "no_params", "bad_params".
    """

    urls: list[str]
    mode: dict[str, str] = field(default_factory=dict)
    calls: list[PrefillCallRecord] = field(default_factory=list)

    def calls_to(self, url: str) -> list[PrefillCallRecord]:
        return [call for call in self.calls if call.server == url]

    @staticmethod
    def params(server: str, request_id: str = "") -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": f"engine@{server}",
            "remote_block_ids": [1, 2, 3],
            "remote_host": server.split("//")[1].split(":")[0],
            "remote_port": 5600,
            "remote_request_id": request_id,
            "tp_size": 1,
        }

    async def handle(self, request: httpx.Request) -> httpx.Response:
        server = f"{request.url.scheme}://{request.url.netloc.decode()}"
        assert server in self.urls, f"call to unknown prefill server {server}"
        mode = self.mode.get(server, "ok")
        if mode == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models_answer(TEST_MODELS))
        body = json.loads(request.content)
        self.calls.append(PrefillCallRecord(server, request.url.path, body, dict(request.headers)))
        if mode == "hang":
            await anyio.sleep(3600)
        if mode == "500":
            return httpx.Response(500, json={"error": {"message": "KV cache full", "code": 500}})
        if mode == "400":
            return httpx.Response(400, json={"error": {"message": "prompt too long", "code": 400}})
        reply: dict[str, Any] = {
            "id": f"chatcmpl-{request.headers.get('x-request-id', 'random-id')}",
            "choices": [{"index": 0, "finish_reason": "length"}],
        }
        if mode == "ok":
            reply["kv_transfer_params"] = self.params(server, request.headers.get("x-request-id", ""))
        elif mode == "bad_params":
            reply["kv_transfer_params"] = [1]
        return httpx.Response(200, json=reply)


def upstream_client(encoders: FakeEncoders, prefill: FakePrefill | None = None) -> httpx.AsyncClient:
    """One client for calls to fake encoders and fake prefill servers, routed by base URL."""

    async def route(request: httpx.Request) -> httpx.Response:
        server = f"{request.url.scheme}://{request.url.netloc.decode()}"
        if prefill is not None and server in prefill.urls:
            return await prefill.handle(request)
        return await encoders.handle(request)

    return httpx.AsyncClient(transport=httpx.MockTransport(route))


def build_app(
    encoders: FakeEncoders, engine: FakeEngine, prefill: FakePrefill | None = None, **options: Any
) -> tuple[Starlette, httpx.AsyncClient]:
    app = engine.app()
    client = upstream_client(encoders, prefill) if prefill is not None else encoders.client()
    if prefill is not None:
        options.setdefault("prefill", prefill.urls)
    # These tests count calls per encoder in the order round-robin gives (today's behaviour, kept by
    # encoder_selection='round_robin'); the affinity tests ask for it explicitly.
    options.setdefault("encoder_selection", "round_robin")
    options.setdefault("uuid_key", TEST_UUID_KEY)
    # The allocator's start-up line would sit among the lines tests count (tests/test_allocator.py).
    options.setdefault("tune_malloc", False)
    app.add_middleware(EPDMiddleware, encoders=encoders.urls, http_client=client, **options)
    return app, client


def app_with_encoder_handler(
    handler: Callable[[httpx.Request], httpx.Response], **options: Any
) -> tuple[Starlette, FakeEngine]:
    """A fake engine app with the middleware, whose encoder calls all go to ``handler``."""
    engine = FakeEngine()
    app = engine.app()
    options.setdefault("encoder_selection", "round_robin")
    options.setdefault("uuid_key", TEST_UUID_KEY)
    options.setdefault("tune_malloc", False)
    app.add_middleware(
        EPDMiddleware, http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)), **options
    )
    return app, engine


def scripted_receive(body: bytes) -> Callable[[], Awaitable[dict[str, Any]]]:
    """An ASGI receive that gives ``body`` in one message, then waits (the client stays connected)."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    return receive


def chat_body(*parts: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Describe."}, *parts]}],
        "temperature": 0,
        "max_tokens": 16,
        **fields,
    }


def image(data: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}, **extra}


def audio(data: str) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
