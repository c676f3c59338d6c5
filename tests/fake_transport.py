"""A fake :class:`epd_middleware.Transport`: the servers a pool calls, as Python callables, below the ASGI
layer and without httpx or sockets.

Each server (a base URL, ``scheme://host:port``) has a handler: a callable, sync or async, given the
:class:`Call` and giving ``(status, body bytes)``, or raising what a transport raises
(:class:`~epd_middleware.ConnectFailed`, ``TimeoutError``...). Small scripted behaviours make the common
ones: :func:`answer_json`, :func:`answer_status`, :func:`refuse`, :func:`hang`, :func:`after`,
:func:`in_turn`, and :func:`vllm` for a whole vLLM server (``/health``, ``/v1/models``, and its chat
completions answered by :func:`encoder_answer` or :func:`prefill_answer`, as vLLM 0.32 answers them).

Every request is recorded (method, URL, headers, body decoded as JSON), and so is every ``drop_idle``.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio

from epd_middleware import ConnectFailed
from epd_middleware._protocol import EXAMPLE_CONNECTOR_FILE
from epd_middleware.transport import Body

# What a vLLM server answers, as the ASGI-level fakes answer it: one copy of that logic.
from .fakes import (
    DEFAULT_GRID,
    MODEL,
    SMALL_GRID,
    content_hash,
    derived_hash,
    encoder_reply,
    item_metadata,
    media_failure,
    models_answer,
    part_modality,
    reported_entries,
)

__all__ = [
    "DEFAULT_GRID",
    "MODEL",
    "SMALL_GRID",
    "Call",
    "FakeTransport",
    "Handler",
    "after",
    "answer_bytes",
    "answer_json",
    "answer_status",
    "content_hash",
    "derived_hash",
    "encoder",
    "encoder_answer",
    "hang",
    "in_turn",
    "item_metadata",
    "models_answer",
    "part_modality",
    "prefill_answer",
    "prefill_params",
    "refuse",
    "reported_entries",
    "vllm",
]


@dataclass(frozen=True)
class Call:
    """One request the transport was asked to make."""

    method: str
    url: str
    headers: dict[str, str]
    body: bytes

    @property
    def server(self) -> str:
        """The base URL the request went to (``scheme://host:port``)."""
        return _base(self.url)

    @property
    def path(self) -> str:
        return urlsplit(self.url).path

    @property
    def json(self) -> Any:
        """The body decoded as JSON; None for an empty body."""
        return json.loads(self.body) if self.body else None

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id")


Answer = tuple[int, bytes]
Handler = Callable[[Call], Answer | Awaitable[Answer]]


def _base(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


@dataclass
class FakeTransport:
    """Routes each request to the handler of its server; a server without one refuses connections."""

    servers: dict[str, Handler] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    # The URLs ``drop_idle`` was called with, in order.
    dropped: list[str] = field(default_factory=list)
    closed: bool = False

    @property
    def is_closed(self) -> bool:
        return self.closed

    async def request(
        self, method: str, url: str, body: Body = b"", headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]:
        content = body if isinstance(body, bytes) else b"".join(body)
        call = Call(method, url, dict(headers or {}), content)
        self.calls.append(call)
        handler = self.servers.get(call.server)
        if handler is None:
            raise ConnectFailed("connection refused")
        result = handler(call)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def drop_idle(self, url: str) -> None:
        self.dropped.append(url)

    async def aclose(self) -> None:
        self.closed = True

    # Reading what happened ---------------------------------------------------------------------------

    def to(self, server: str, path: str | None = None, method: str | None = None) -> list[Call]:
        """The requests made to ``server`` (on ``path``, with ``method``, when given)."""
        return [
            call
            for call in self.calls
            if call.server == server
            and (path is None or call.path == path)
            and (method is None or call.method == method)
        ]

    def posts(self, path: str = "/v1/chat/completions") -> list[Call]:
        """Every POST on ``path``, whatever the server, in order."""
        return [call for call in self.calls if call.method == "POST" and call.path == path]


# Scripted behaviours -------------------------------------------------------------------------------


def answer_json(value: Any, status: int = 200) -> Handler:
    """Answer ``value`` as JSON with ``status``."""
    content = json.dumps(value).encode()
    return lambda call: (status, content)


def answer_bytes(content: bytes, status: int = 200) -> Handler:
    """Answer these bytes as they are (not JSON, say)."""
    return lambda call: (status, content)


def answer_status(status: int, message: str = "no") -> Handler:
    """Answer ``status`` with vLLM's OpenAI-style error body."""
    return answer_json({"error": {"message": message, "code": status}}, status)


def refuse() -> Handler:
    """Refuse the connection (as the built-in client says it)."""

    def handler(call: Call) -> Answer:
        raise ConnectFailed("connection refused")

    return handler


@dataclass
class _Hang:
    """Never answer; remembers each request that was cancelled while it waited."""

    cancelled: list[Call] = field(default_factory=list)

    async def __call__(self, call: Call) -> Answer:
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            self.cancelled.append(call)
            raise
        raise AssertionError("unreachable")


def hang() -> _Hang:
    """Wait until cancelled (``.cancelled`` lists the requests that were)."""
    return _Hang()


def after(delay: float, handler: Handler) -> Handler:
    """Answer as ``handler`` does, ``delay`` seconds later."""

    async def delayed(call: Call) -> Answer:
        await anyio.sleep(delay)
        result = handler(call)
        return await result if inspect.isawaitable(result) else result

    return delayed


def in_turn(*handlers: Handler) -> Handler:
    """The first request gets the first handler's answer, the next the next; the last one answers every
    request after that."""
    remaining = list(handlers)

    def handler(call: Call) -> Answer | Awaitable[Answer]:
        current = remaining.pop(0) if len(remaining) > 1 else remaining[0]
        return current(call)

    return handler


def vllm(
    chat: Handler | None = None,
    *,
    models: Sequence[str] = (MODEL,),
    root: str | None = None,
    health: Handler | None = None,
    models_handler: Handler | None = None,
    paths: Mapping[str, Handler] | None = None,
) -> Handler:
    """A vLLM server: ``GET /health`` 200 (or ``health``), ``GET /v1/models`` serving ``models``
    (or ``models_handler``), ``POST /v1/chat/completions`` answered by ``chat`` (default: as an encoder,
    :func:`encoder_answer`), and any other path in ``paths``."""
    routes: dict[str, Handler] = {
        "/health": health or (lambda call: (200, b"")),
        "/v1/models": models_handler or answer_json(models_answer(list(models), root)),
        "/v1/chat/completions": chat or encoder(),
        **(paths or {}),
    }

    def handler(call: Call) -> Answer | Awaitable[Answer]:
        route = routes.get(call.path)
        if route is None:
            return 404, json.dumps({"error": {"message": "Not Found", "code": 404}}).encode()
        return route(call)

    return handler


# The encoder's answer, as vLLM 0.32 gives it: tests/fakes.py's logic, shared ---------------------------


def encoder_answer(call: Call) -> dict[str, Any]:
    """vLLM's answer to an encoder call: ``id`` ``chatcmpl-<x-request-id>``, and the handles."""
    return encoder_reply(call.json, reported_entries(call.json), call.request_id)


def encoder(storage: Path | None = None) -> Callable[[Call], Answer]:
    """An encoder's chat completions: :func:`encoder_answer`; with ``storage``, each reported embedding is
    written where ECExampleConnector keeps it (``<storage>/<hash>/encoder_cache.safetensors``)."""

    def handler(call: Call) -> Answer:
        failed = media_failure(call.json)
        if failed is not None:
            return failed[0], json.dumps(failed[1]).encode()
        reply = encoder_answer(call)
        if storage is not None:
            for mm_hash in reply["ec_transfer_params"]:
                (storage / mm_hash).mkdir(parents=True, exist_ok=True)
                (storage / mm_hash / EXAMPLE_CONNECTOR_FILE).write_bytes(b"x")
        return 200, json.dumps(reply).encode()

    return handler


def prefill_params(server: str, request_id: str = "") -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefill server (NixlConnector) answers with."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": f"engine@{server}",
        "remote_block_ids": [1, 2, 3],
        "remote_host": urlsplit(server).hostname,
        "remote_port": 5600,
        "remote_request_id": request_id,
        "tp_size": 1,
    }


def prefill_answer(call: Call) -> Answer:
    """A prefill server's answer: its ``kv_transfer_params`` under vLLM's answer id."""
    reply = {
        "id": f"chatcmpl-{call.request_id or 'random-id'}",
        "choices": [{"index": 0, "finish_reason": "length"}],
        "kv_transfer_params": prefill_params(call.server, call.request_id or ""),
    }
    return 200, json.dumps(reply).encode()
