"""EPDMiddleware: the pure ASGI layer. Scope filtering, body buffering and replay, the lifespan-owned HTTP
client, disconnects, and typed errors turned into responses. It knows nothing of message formats: the
request path itself lives in :mod:`epd_middleware.pipeline`.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import anyio
import httpx
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .config import EPDConfig
from .encoders import EncoderPool
from .errors import BodyTooLarge, EPDError
from .pipeline import Pipeline
from .protocol import REQUEST_ID_HEADER
from .surfaces.openai_chat import ChatRequest

__all__ = ["EPDMiddleware"]

_JSON = b"application/json"


class EPDMiddleware:
    """Encode the media of multimodal chat requests on remote vLLM encoders before the local engine runs.

    ``app.add_middleware(EPDMiddleware, encoders=["http://enc-0:8001"])``. With no options at all the
    configuration comes from ``EPD_*`` environment variables (:meth:`EPDConfig.from_env`), which is how
    ``vllm serve --middleware epd_middleware.EPDMiddleware`` loads it.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        encoders: Sequence[str] | None = None,
        http_client: httpx.AsyncClient | None = None,
        encoder_timeout: float | None = None,
        paths: Sequence[str] | None = None,
        max_body_bytes: int | None = None,
        max_batch_size: int | None = None,
        rewrite: bool | None = None,
        trust_client_uuid: bool | None = None,
        config: EPDConfig | None = None,
    ) -> None:
        options: dict[str, Any] = {
            name: value
            for name, value in (
                ("encoders", encoders),
                ("encoder_timeout", encoder_timeout),
                ("paths", paths),
                ("max_body_bytes", max_body_bytes),
                ("max_batch_size", max_batch_size),
                ("rewrite", rewrite),
                ("trust_client_uuid", trust_client_uuid),
            )
            if value is not None
        }
        if config is not None and options:
            raise TypeError(
                f"EPDMiddleware takes either config=EPDConfig(...) or keyword options, not both "
                f"(got config and {sorted(options)})"
            )
        if config is None:
            try:
                config = EPDConfig(**options) if options else EPDConfig.from_env()
            except ValidationError as exc:
                raise ValueError(f"invalid EPDMiddleware configuration: {exc}") from None
        self.app = app
        self.config = config
        self._paths = frozenset(config.paths)
        self._pipeline = Pipeline(config, EncoderPool(config.encoders))
        self._clients = _ClientHolder(http_client, config.encoder_timeout)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and self._intercepts(scope):
            await _Exchange(self, scope, receive, send).run()
        elif scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _intercepts(self, scope: Scope) -> bool:
        path: str = scope["path"]
        root_path: str = scope.get("root_path", "")
        if root_path and path.startswith(root_path):
            path = path[len(root_path) :]
        if path not in self._paths:
            return False
        for name, value in scope["headers"]:
            if name == b"content-type":
                return bool(value.split(b";", 1)[0].strip().lower() == _JSON)
        return False

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def receive_opening() -> Message:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._clients.open()
            return message

        async def send_closing(message: Message) -> None:
            if message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                await self._clients.aclose()
            await send(message)

        await self.app(scope, receive_opening, send_closing)


class _ClientHolder:
    """The HTTP client for encoder calls: the user's, never closed here, or one owned for the app's life.

    The owned client opens at lifespan startup and closes at shutdown; without a lifespan it opens on
    first use.
    """

    def __init__(self, injected: httpx.AsyncClient | None, timeout: float) -> None:
        self._injected = injected
        self._timeout = timeout
        self._owned: httpx.AsyncClient | None = None

    def open(self) -> httpx.AsyncClient:
        if self._injected is not None:
            return self._injected
        if self._owned is None or self._owned.is_closed:
            self._owned = httpx.AsyncClient(timeout=httpx.Timeout(self._timeout))
        return self._owned

    async def aclose(self) -> None:
        owned, self._owned = self._owned, None
        if owned is not None:
            await owned.aclose()


class _Disconnected(Exception):
    """The client went away; nothing more is sent or run for it."""


class _Exchange:
    """One intercepted request: its state lives here, never on the middleware."""

    __slots__ = ("middleware", "receive", "scope", "send")

    def __init__(self, middleware: EPDMiddleware, scope: Scope, receive: Receive, send: Send) -> None:
        self.middleware = middleware
        self.scope = scope
        self.receive = receive
        self.send = send

    async def run(self) -> None:
        try:
            body = await self._read_body()
        except _Disconnected:
            return
        except BodyTooLarge as exc:
            await self._send_error(exc)
            return
        request = self.middleware._pipeline.parse(body)
        if request is None:
            await self.middleware.app(self.scope, _replay(body, self.receive), self.send)
            return
        request_id, generated = self._request_id()
        try:
            new_body = await self._prepare(request, request_id)
        except _Disconnected:
            return
        except EPDError as exc:
            await self._send_error(exc)
            return
        scope = dict(self.scope)
        scope["headers"] = _engine_headers(
            self.scope["headers"], len(new_body), request_id if generated else None
        )
        await self.middleware.app(scope, _replay(new_body, self.receive), self.send)

    async def _read_body(self) -> bytes:
        limit = self.middleware.config.max_body_bytes
        for name, value in self.scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    break
                if declared > limit:
                    raise BodyTooLarge(limit)
                break
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(limit)
                chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _request_id(self) -> tuple[str, bool]:
        for name, value in self.scope["headers"]:
            if name == REQUEST_ID_HEADER:
                return value.decode("latin-1"), False
        return uuid.uuid4().hex, True

    async def _prepare(self, request: ChatRequest, request_id: str) -> bytes:
        """Run the pipeline while listening for the client going away, which cancels the encoder calls."""
        pipeline = self.middleware._pipeline
        client = self.middleware._clients.open()
        result = b""
        failure: EPDError | None = None
        disconnected = False

        async with anyio.create_task_group() as group:

            async def watch_disconnect() -> None:
                nonlocal disconnected
                # The body is read, so the server's next message can only be the disconnect.
                while (await self.receive())["type"] != "http.disconnect":
                    pass
                disconnected = True
                group.cancel_scope.cancel()

            group.start_soon(watch_disconnect)
            try:
                result = await pipeline.prepare(request, client, request_id)
            except EPDError as exc:
                failure = exc
            finally:
                group.cancel_scope.cancel()
        if disconnected:
            raise _Disconnected
        if failure is not None:
            raise failure
        return result

    async def _send_error(self, error: EPDError) -> None:
        body = error.body()
        headers = [
            (b"content-type", _JSON),
            (b"content-length", str(len(body)).encode()),
            *error.headers(),
        ]
        await self.send({"type": "http.response.start", "status": error.status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the whole body as one message, then the real receive (disconnects)."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _engine_headers(
    headers: Sequence[tuple[bytes, bytes]], length: int, request_id: str | None
) -> list[tuple[bytes, bytes]]:
    out = [(name, value) for name, value in headers if name not in (b"content-length", b"transfer-encoding")]
    out.append((b"content-length", str(length).encode()))
    if request_id is not None:
        out.append((REQUEST_ID_HEADER, request_id.encode()))
    return out
