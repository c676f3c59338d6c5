"""One intercepted request, from its first ASGI message to the engine's last: authentication, the body read
and replayed, the caller leaving, the engine's answer passed on (or withheld for a retry), typed errors
turned into answers. Every collaborator is handed in (as uvicorn's ``RequestResponseCycle`` is given its
app and connection); what the request means is the pipeline's to decide.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import anyio
import anyio.lowlevel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ._answers import answer
from ._asgi import first_header, replay
from ._context import RequestContext
from ._draining import AbortWatch, refusal
from ._logs import logger, request_id_of, request_scope
from ._pipeline import Pipeline
from ._protocol import DATA_PARALLEL_RANK_HEADER, REQUEST_ID_HEADER
from ._scheduler import NO_ROUTE, Route
from ._surfaces import ParsedRequest, Surface
from ._tracing import inject, record, request_span
from .errors import BodyTooLarge, EPDError, ShuttingDown, Unauthorized
from .host import Host
from .transport import Transport

__all__ = ["Exchange"]


class _Disconnected(Exception):
    """The caller went away; nothing more is sent or run for it."""


class Exchange:
    """One intercepted request: its state lives here, never on the middleware."""

    __slots__ = (
        "app",
        "buffer",
        "given_id",
        "host",
        "pipeline",
        "receive",
        "request_id",
        "route",
        "scheduled",
        "scope",
        "send",
        "surface",
        "transport",
    )

    def __init__(
        self,
        app: ASGIApp,
        pipeline: Pipeline,
        host: Host,
        transport: Transport,
        surface: Surface,
        scope: Scope,
        receive: Receive,
        send: Send,
        scheduled: list[tuple[bytes, bytes]] | None,
    ) -> None:
        self.app = app  # the engine app
        self.pipeline = pipeline
        self.host = host
        self.transport = transport  # to the encoders and prefill servers
        self.surface = surface
        self.scope = scope  # without the scheduler's headers
        self.receive = receive
        self.send = send
        self.scheduled = scheduled  # the request's headers as they came, when they held the scheduler's
        self.route: Route = NO_ROUTE
        self.request_id = ""  # set first thing in run()
        self.given_id = False
        self.buffer: bytearray | None = None  # the body's, from the pipeline's pool

    async def run(self) -> None:
        self.given_id = first_header(self.scope["headers"], REQUEST_ID_HEADER) is not None
        self.request_id = request_id_of(self.scope["headers"])
        try:
            with request_scope(self.request_id):
                await self._run()
        finally:
            if self.buffer is not None:
                self.pipeline.bodies.give_back(self.buffer)
                self.buffer = None

    async def _run(self) -> None:
        pipeline = self.pipeline
        if pipeline.config.authenticate and not self.host.authorizes(self.scope["headers"]):
            await self._answer(Unauthorized())
            return
        try:
            if self.scheduled is not None:
                self.route = pipeline.route(self.scheduled, self.host)  # before the body: a 403 reads nothing
            body = await self._read_body()
            request = pipeline.parse(self.surface, body, self.route)
        except _Disconnected:
            return
        except EPDError as exc:
            pipeline.stats.request(f"error_{exc.status}")
            await self._answer(exc)
            return
        if request is None:
            pipeline.stats.request("passed_through")
            # ASGI bodies are bytes, and the engine app may keep what it is given: never the buffer.
            await self.app(self.scope, replay(bytes(body), self.receive), self.send)
            return
        failure: Exception | None = None
        async with anyio.create_task_group() as group:
            caller = _CallerWatch(self.receive, group.cancel_scope)
            group.start_soon(caller.watch)
            pipeline.refresh_soon(group)
            try:
                await self._encode_and_run(request, caller)
            except Exception as exc:
                failure = exc  # the engine app's own error goes up as it is, not in an ExceptionGroup
            await caller.release()
        if failure is not None:
            raise failure

    async def _encode_and_run(self, request: ParsedRequest, caller: _CallerWatch) -> None:
        # Where vLLM traces, the request's span: its encode stage and calls are children, and the engine
        # gets its context, so vLLM's own engine span joins the same trace.
        with request_span(self.host.traces, self.scope["headers"]) as span:
            record(span, **{"epd.request_id": self.request_id})
            await self._encode_and_run_traced(request, caller)

    async def _encode_and_run_traced(self, request: ParsedRequest, caller: _CallerWatch) -> None:
        pipeline, headers, request_id = self.pipeline, self.scope["headers"], self.request_id
        context = pipeline.context(
            request,
            self.host,
            self.transport,
            request_id,
            authorization=_latin1(first_header(headers, b"authorization")),
            headers=headers,
            route=self.route,
            surface=self.surface,
        )
        # From before its placement to the engine's last byte: a request just handed to the engine is
        # not in the engine's count yet (_placement.py).
        with pipeline.placement.unfinished():
            await self._prepare_and_run(request, caller, context)

    async def _prepare_and_run(
        self, request: ParsedRequest, caller: _CallerWatch, context: RequestContext
    ) -> None:
        pipeline, headers, request_id = self.pipeline, self.scope["headers"], self.request_id
        retries = pipeline.config.engine_retries
        for attempt in range(retries + 1):
            if await self._refused_while_stopping():
                return
            try:
                # The caller leaving now cancels this (and the encoder or prefill calls in it).
                caller.preparing = True
                prepared = await pipeline.prepare(
                    self.surface, request, context.again() if attempt else context
                )
            except EPDError as exc:
                pipeline.stats.request(f"error_{exc.status}")
                await self._answer(exc)
                return
            finally:
                caller.preparing = False
            if await self._refused_while_stopping():
                return  # its encoder calls ran, but the engine would abort it now
            scope = dict(self.scope)
            trace: dict[str, str] = {}
            inject(self.host.traces, trace)
            scope["headers"] = _engine_headers(
                headers, len(prepared.body), None if self.given_id else request_id, context.pin_rank, trace
            )
            # The push wait only bounds a request whose embeddings were pushed to this server.
            guard = _EngineFailureGuard(
                self.send,
                hold=attempt < retries,
                hold_for=self.host.push_wait_s if prepared.pushed else None,
            )
            watch = AbortWatch(guard.send, self.host, self.surface.aborted)
            await self.app(scope, replay(prepared.body, caller.receive), watch.send)
            if watch.aborted:
                pipeline.stats.request("error_503")
                await self._answer(ShuttingDown(pipeline.config.retry_after))
                return
            if guard.status == 200:
                pipeline.engine_answered(request, self.surface)
            if guard.waited_out:
                pipeline.stats.engine_retry_skipped()
                logger.warning(
                    "the local engine answered 500 after the connector's whole push wait "
                    "(%g s): an embedding pushed for it was never loaded; not running it again, which "
                    "would wait as long once more%s",
                    self.host.push_wait_s,
                    " (ECMooncakeConnector on the V1 model runner: see the start-up warning)"
                    if self.host.known_problems
                    else "",
                )
            if not guard.withheld:
                return
            pipeline.stats.engine_retry()
            logger.warning(
                "the local engine answered 500 before any byte reached the client; "
                "encoding and running it again (%d of %d)",
                attempt + 1,
                retries,
            )

    async def _refused_while_stopping(self) -> bool:
        """Answered 503 because the server shuts down (``_draining.py``)."""
        refused = refusal(self.host, self.pipeline.config.retry_after)
        if refused is None:
            return False
        self.pipeline.stats.request(f"error_{refused.status}")
        await self._answer(refused)
        return True

    async def _answer(self, error: EPDError) -> None:
        """The middleware's own error, in the surface's language (Anthropic's on Messages)."""
        config = self.pipeline.config
        await answer(
            self.send,
            error,
            request_id=self.request_id,
            id_header=self.host.request_id_headers,
            expose=config.expose_upstream_addresses,
            retry_after=config.retry_after,
            body_of=self.surface.error_body,
        )

    async def _read_body(self) -> bytes | bytearray:
        """The whole body: the one message it came in, else its pieces gathered, a large body into a
        buffer of the pool (``_body_buffers``), handed back when the exchange ends."""
        limit = self.pipeline.config.max_body_bytes
        declared = _length(first_header(self.scope["headers"], b"content-length"))
        if declared is not None and declared > limit:
            raise BodyTooLarge(limit)
        message = await self.receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        first: bytes = message.get("body", b"")
        if len(first) > limit:
            raise BodyTooLarge(limit)
        if not message.get("more_body", False):
            return first
        filling = self.pipeline.bodies.filling(declared) if declared is not None else None
        if filling is None:
            chunks = [first]
            add = chunks.append
        else:
            filling.add(first)
            add = filling.add
        size = len(first)
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(limit)
                add(chunk)
            if not message.get("more_body", False):
                break
        if filling is None:
            return b"".join(chunks)
        self.buffer = filling.body()
        return self.buffer


class _CallerWatch:
    """The one reader of the server's ``receive`` once the body is in, for the whole exchange: the caller
    leaving cancels the encoder and prefill calls while they run, and reaches the engine app after.

    One task that ends by itself rather than a watcher per stage cancelled when the stage ends: the
    server answers ``receive`` with ``http.disconnect`` once the response is sent (ASGI spec), so in the
    common case nothing is cancelled. A cancellation costs about 40 us on anyio's asyncio backend (it
    formats the current task's repr), about a tenth of the middleware's CPU for a one-image request.
    """

    __slots__ = ("_arrived", "_message", "_receive", "_scope", "preparing")

    def __init__(self, receive: Receive, scope: anyio.CancelScope) -> None:
        self._receive = receive
        self._scope = scope
        self._arrived: anyio.Event | None = None  # made when someone waits: most requests never do
        self._message: Message | None = None
        self.preparing = False

    async def watch(self) -> None:
        # The body is read, so the server's next message can only be the disconnect.
        while (message := await self._receive())["type"] != "http.disconnect":
            pass
        self._message = message
        if self._arrived is not None:
            self._arrived.set()
        if self.preparing:
            self._scope.cancel()

    async def receive(self) -> Message:
        """What the engine app reads after the replayed body. Without waiting once the message is in,
        as a server's own receive: a poll under a cancelled scope (Starlette's ``is_disconnected``) must
        still see it."""
        if self._message is None:
            if self._arrived is None:
                self._arrived = anyio.Event()
            await self._arrived.wait()
        assert self._message is not None
        return self._message

    async def release(self) -> None:
        """Let the watcher end: it has, or is about to, once the response is complete; a server that
        keeps ``receive`` waiting after the response gets it cancelled."""
        if self._message is None:
            await anyio.lowlevel.checkpoint()
            if self._message is None:
                self._scope.cancel()


class _EngineFailureGuard:
    """Passes the engine's response through, except a 500 that may be retried: nothing of it is sent, so
    the caller never sees a byte of a response that is then replaced. Keeps the response's status.

    ``hold_for``: the engine's push wait (Mooncake ``push_wait_timeout_s``). A 500 that comes after it
    is what vLLM answers when a pushed embedding was never loaded (``mooncake/state.py`` expires the
    transfer, the scheduler finishes the request with an error); the engine says nothing more specific.
    Running the request again would wait as long again, for the same reason where the reason is the
    server's (an idle V1-runner PD never loads a push), so that 500 goes to the caller at once
    (``waited_out``). A 500 before the wait is retried as any other.
    """

    __slots__ = ("_send", "deadline", "hold", "status", "waited_out", "withheld")

    def __init__(self, send: Send, *, hold: bool, hold_for: float | None = None) -> None:
        self._send = send
        self.hold = hold
        self.deadline = anyio.current_time() + hold_for if hold and hold_for is not None else None
        self.withheld = False
        self.waited_out = False
        self.status = 0

    async def send(self, message: Message) -> None:
        if self.withheld:
            return
        if message["type"] == "http.response.start":
            self.status = message["status"]
            if self.hold and message["status"] == 500:
                if self.deadline is not None and anyio.current_time() >= self.deadline:
                    self.waited_out = True
                else:
                    self.withheld = True
                    return
        await self._send(message)


def _length(value: bytes | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _latin1(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value is not None else None


def _engine_headers(
    headers: Sequence[tuple[bytes, bytes]],
    length: int,
    request_id: str | None,
    rank: bytes | None,
    trace: Mapping[str, str],
) -> list[tuple[bytes, bytes]]:
    # The scheduler's headers are gone already (EPDMiddleware.__call__). A trace context of the
    # middleware's replaces the client's: the engine's span is a child of the request's.
    dropped = (
        b"content-length",
        b"transfer-encoding",
        DATA_PARALLEL_RANK_HEADER if rank else b"",
        *((b"traceparent", b"tracestate") if trace else ()),
    )
    out = [(name, value) for name, value in headers if name not in dropped]
    out.append((b"content-length", str(length).encode()))
    if request_id is not None:
        out.append((REQUEST_ID_HEADER, request_id.encode()))
    if rank is not None:
        out.append((DATA_PARALLEL_RANK_HEADER, rank))
    out.extend((name.encode("latin-1"), value.encode("latin-1")) for name, value in trace.items())
    return out
