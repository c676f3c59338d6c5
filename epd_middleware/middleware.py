"""EPDMiddleware: the pure ASGI layer. Scope filtering, authentication, body buffering and replay, the
lifespan-owned HTTP client and health probes, disconnects, the engine retry, and typed errors turned
into responses. It knows nothing of message formats: the request path lives in
:mod:`epd_middleware.pipeline`.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import secrets
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import msgspec
from pydantic import ValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from typing_extensions import Unpack

from ._rawjson import text_of
from .compat import Expectation, expectation_of_vllm
from .config import EPDConfig, EPDOptions
from .errors import BodyTooLarge, EPDError, Unauthorized
from .identifiers import IdentifierRule
from .llmd import SCHEDULER_HEADERS
from .logs import adopt_vllm_logging, logger
from .media_policy import MediaPolicy
from .pipeline import Pipeline, RequestContext
from .protocol import (
    DATA_PARALLEL_RANK_HEADER,
    MODEL,
    REQUEST_ID_HEADER,
    MooncakeConsumers,
    cli_api_keys,
    example_connector_storage,
    mooncake_consumers,
    unguarded_routes,
)
from .scheduler import NO_ROUTE, Route
from .surfaces import (
    ParsedRequest,
    Surface,
    anthropic_messages,
    openai_chat,
    openai_chat_batch,
    openai_responses,
)
from .transport import HTTPClient, HttpxTransport, Transport

__all__ = ["EPDMiddleware"]


_JSON = b"application/json"
_encode = msgspec.json.Encoder().encode
_UNRESOLVED = object()
_OUTSIDE_VLLM = IdentifierRule()


class EPDMiddleware:
    """Encode the media of multimodal chat requests on remote vLLM encoders before the local engine runs.

    ``app.add_middleware(EPDMiddleware, encoders=["http://enc-0:8001"])``; every option of
    :class:`EPDConfig` is a keyword. ``config=EPDConfig(...)`` is the same as the keywords (not both).
    With no options the configuration comes from ``EPD_*`` environment variables, which is how
    ``vllm serve --middleware epd_middleware.EPDMiddleware`` loads it. ``http_client`` is used for every
    encoder call and never closed here.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        http_client: httpx.AsyncClient | None = None,
        config: EPDConfig | None = None,
        **options: Unpack[EPDOptions],
    ) -> None:
        if config is not None and options:
            raise TypeError(
                f"EPDMiddleware takes either config=EPDConfig(...) or keyword options, not both "
                f"(got config and {sorted(options)})"
            )
        if config is None:
            try:
                config = EPDConfig(**options) if options else EPDConfig.from_env()  # type: ignore[arg-type]
            except ValidationError as exc:
                raise ValueError(f"invalid EPDMiddleware configuration: {exc}") from None
        adopt_vllm_logging()
        self.app = app
        self.config = config
        self._surfaces: dict[str, Surface] = {
            **{path: openai_chat.SURFACE for path in config.paths},
            **{path: openai_chat_batch.SURFACE for path in config.batch_paths},
            **{path: anthropic_messages.SURFACE for path in config.messages_paths},
            **{path: openai_responses.SURFACE for path in config.responses_paths},
        }
        self._status_path = config.status_path
        self._pipeline = Pipeline(config)
        self._clients = _ClientHolder(http_client, config)
        self._server = _ServerFacts(config)

    @property
    def pipeline(self) -> Pipeline:
        return self._pipeline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scheduled: list[tuple[bytes, bytes]] | None = None
        if scope["type"] in ("http", "websocket"):
            headers = scope["headers"]
            if any(name in SCHEDULER_HEADERS for name, _ in headers):
                # A scheduler's routing headers (or a client's forgery of them) reach nobody but the
                # middleware, whatever the path and the mode.
                scheduled = headers
                scope = {**scope, "headers": [item for item in headers if item[0] not in SCHEDULER_HEADERS]}
        surface = self._intercepts(scope) if scope["type"] == "http" and scope["method"] == "POST" else None
        if surface is not None:
            await _Exchange(self, surface, scope, receive, send, scheduled).run()
        elif scope["type"] == "http" and self._status_path and _route_path(scope) == self._status_path:
            await self._status(scope, send)
        elif scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _intercepts(self, scope: Scope) -> Surface | None:
        surface = self._surfaces.get(_route_path(scope))
        if surface is None:
            return None
        for name, value in scope["headers"]:
            if name == b"content-type":
                # vLLM's own rule (validate_json_request): the first content-type header, lower-cased,
                # up to its first ';'. Anything else it answers 415 without reading the body.
                return surface if value.lower().split(b";", 1)[0] == _JSON else None
        return None

    def _authorized(self, scope: Scope) -> bool:
        """vLLM's own rule (``AuthenticationMiddleware``): the first Authorization header, a scheme of
        any case equal to "bearer", one space, then a key as it is; digests compared in constant time
        against every key (no early exit: which key matched does not show in the time taken)."""
        keys = self._server.api_keys(scope)
        if not keys:
            return True
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() != b"bearer":
                    return False
                # As vLLM reads it: the header's Latin-1 text, hashed as UTF-8.
                digest = hashlib.sha256(token.decode("latin-1").encode()).digest()
                matched = False
                for key in keys:
                    matched |= hmac.compare_digest(digest, key)
                return matched
        return False

    async def _status(self, scope: Scope, send: Send) -> None:
        """GET the status page: encoders, their health and load, counters. Behind the API keys."""
        if scope["method"] not in ("GET", "HEAD"):
            await _send_json(
                send, 405, {"error": {"message": "use GET", "type": "MethodNotAllowedError", "code": 405}}
            )
        elif not self._authorized(scope):
            await _send_error(send, Unauthorized())
        else:
            pipeline, config = self._pipeline, self.config
            await _send_json(
                send,
                200,
                {
                    # Every API-server process has its own middleware state (--api-server-count).
                    "pid": os.getpid(),
                    "encoders": pipeline.encoders.snapshot(anyio.current_time()),
                    "prefill": pipeline.prefill.snapshot(anyio.current_time()),
                    "dns": {
                        discovery.pool.role: discovery.snapshot()
                        for discovery in pipeline.discoveries
                        if discovery.dynamic
                    },
                    "pending_requests": pipeline.pending,
                    "counters": dict(pipeline.counters),
                    "embedding_storage_checked": self._server.storage(scope),
                    "client_references": self._reference_status(scope),
                    "media_policy": self._media_policy_status(scope),
                    "unguarded_routes": list(unguarded_routes(_vllm_args(scope))),
                    "handle_reuse": self._reuse_status(scope),
                    "config": config.model_dump(mode="json", exclude={"api_keys", "encoder_api_key"}),
                },
            )

    async def _startup_checks(self, scope: Scope) -> str | None:
        """Once the app started: ask every encoder and prefill server what it serves (DNS names looked
        up first), log what does not match, and with ``strict_startup`` say why the start fails."""
        config, pipeline = self.config, self._pipeline
        expectation = self._server.expectation(scope)
        if expectation is None:
            return None
        pipeline.expect(expectation)
        for discovery in pipeline.discoveries:
            await discovery.ready()
        client, headers = self._clients.open(), pipeline.probe_headers()
        for pool in (pipeline.encoders, pipeline.prefill):
            await pool.models.check(client, pool.members, headers)
        mismatched = [
            f"{pool.role} {url} serves {served}"
            for pool in (pipeline.encoders, pipeline.prefill)
            for url, served in pool.models.mismatched()
        ]
        if config.strict_startup and mismatched:
            return (
                f"epd: this server serves {expectation.describe()}, but "
                + "; ".join(mismatched)
                + " (strict_startup: the start fails; without it they are only left unused)"
            )
        return None

    def _reference_status(self, scope: Scope) -> dict[str, Any]:
        """Whether metadata-only parts a client writes itself are checked (and how far), or refused."""
        storage, rule = self._server.storage(scope), self._server.identifiers(scope)
        if storage is None:
            return {
                "checked": False,
                "why_not": "no embedding storage to look in (only ECExampleConnector with check_embeddings): "
                "every such part is refused with 400",
            }
        return {
            "checked": True,
            "storage": storage,
            "with_options": rule.derives_options,
            "why_not_with_options": None
            if rule.derives_options
            else rule.unknown_because
            or "outside vLLM the model path is not known: such parts with per-request options are refused",
        }

    def _media_policy_status(self, scope: Scope) -> dict[str, Any] | None:
        policy = self._server.media_policy(scope)
        if policy is None:
            return None
        return {
            "allowed_media_domains": list(policy.allowed_domains) or None,
            "local_files": policy.local_root is not None,
        }

    def _reuse_status(self, scope: Scope) -> dict[str, Any]:
        """Whether media is reused (the answer for a request on this server without a pinned Mooncake
        rank), why not when it is not, and the cache's figures."""
        server = self._server
        blocker = self._pipeline.reuse_blocker(server.storage(scope), pushed=server.pushes(scope))
        cache = self._pipeline.reuse
        return {
            "enabled": blocker is None,
            "why_not": blocker,
            "entries": len(cache),
            "hits": cache.hits,
            "stale_dropped": cache.stale,
        }

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Open the owned client and start health probes at start-up; stop and close at shutdown."""
        probes = anyio.CancelScope()
        server_scope = dict(scope)  # as it came: an app inside may put itself under "app"

        async with anyio.create_task_group() as group:

            async def probe(client: Transport) -> None:
                headers = self._pipeline.probe_headers()
                with probes:
                    async with anyio.create_task_group() as pools:
                        for discovery in self._pipeline.discoveries:
                            pools.start_soon(discovery.run)
                        pools.start_soon(self._pipeline.encoders.probe_forever, client, headers)
                        pools.start_soon(self._pipeline.prefill.probe_forever, client, headers)

            async def receive_opening() -> Message:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    group.start_soon(probe, self._clients.open())
                elif message["type"] == "lifespan.shutdown":
                    probes.cancel()
                return message

            async def send_closing(message: Message) -> None:
                if message["type"] == "lifespan.startup.complete":
                    problem = await self._startup_checks(server_scope)
                    if problem is not None:
                        message = {"type": "lifespan.startup.failed", "message": problem}
                if message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                    probes.cancel()
                    await self._clients.aclose()
                await send(message)

            try:
                await self.app(scope, receive_opening, send_closing)
            finally:
                probes.cancel()


class _ClientHolder:
    """The transport for encoder calls: the user's ``httpx.AsyncClient`` (never closed here), or the
    built-in HTTP/1.1 client, owned for the app's life.

    The owned client opens at lifespan startup and closes at shutdown; without a lifespan it opens on
    first use.
    """

    def __init__(self, injected: httpx.AsyncClient | None, config: EPDConfig) -> None:
        self._injected = HttpxTransport(injected) if injected is not None else None
        self._config = config
        self._owned: HTTPClient | None = None

    def open(self) -> Transport:
        if self._injected is not None:
            return self._injected
        if self._owned is None or self._owned.is_closed:
            config = self._config
            self._owned = HTTPClient(connect_timeout=min(config.connect_timeout, config.encoder_timeout))
        return self._owned

    async def aclose(self) -> None:
        owned, self._owned = self._owned, None
        if owned is not None:
            await owned.aclose()


class _ServerFacts:
    """What the middleware learns from the vLLM server it runs in, once: where embeddings are stored,
    and the API keys given on vLLM's command line (``--api-key``), which no environment variable shows."""

    def __init__(self, config: EPDConfig) -> None:
        self._config = config
        self._storage: object = config.ec_storage_path if config.ec_storage_path else _UNRESOLVED
        self._keys: tuple[bytes, ...] | None = None
        self._consumers: object = _UNRESOLVED
        self._kv_consumer: bool | None = None
        self._next_rank = 0
        self._identifiers: IdentifierRule | None = None
        self._media_policy: MediaPolicy | None = None

    def identifiers(self, scope: Scope) -> IdentifierRule:
        """How the engine identifies media items: vLLM's rule with this server's model path and
        options; outside vLLM only what needs no model path (an item without hash factors)."""
        if self._identifiers is None:
            vllm_config = _vllm_config(scope)
            if vllm_config is None:
                return _OUTSIDE_VLLM  # not known yet (or not inside vLLM): look again next time
            self._identifiers = IdentifierRule.of_vllm(vllm_config)
        return self._identifiers

    def media_policy(self, scope: Scope) -> MediaPolicy | None:
        """The server's --allowed-media-domains and --allowed-local-media-path; None outside vLLM."""
        if self._media_policy is None:
            vllm_config = _vllm_config(scope)
            if vllm_config is None:
                return None
            self._media_policy = MediaPolicy.of_vllm(vllm_config)
        return self._media_policy

    def api_keys(self, scope: Scope) -> tuple[bytes, ...]:
        """SHA-256 digests of every key accepted: the configured ones and vLLM's ``--api-key`` (a list
        from vLLM's command line; a plain string from older versions and custom launchers)."""
        if self._keys is None:
            keys = [*self._config.api_keys, *cli_api_keys(_vllm_args(scope))]
            self._keys = tuple(hashlib.sha256(key.encode()).digest() for key in dict.fromkeys(keys) if key)
        return self._keys

    def storage(self, scope: Scope) -> str | None:
        if not self._config.check_embeddings:
            return None
        if self._storage is _UNRESOLVED:
            vllm_config = _vllm_config(scope)
            if vllm_config is None:
                return None  # not known yet (or not inside vLLM): look again next time
            self._storage = example_connector_storage(vllm_config)
            if self._storage:
                logger.info("epd: checking embeddings under %s before referencing them", self._storage)
        return self._storage if isinstance(self._storage, str) else None

    def pushes(self, scope: Scope) -> bool:
        """Encoders push this server's embeddings (Mooncake)."""
        return self._config.ec_consumer_zmq is not None or self._mooncake(scope) is not None

    def _mooncake(self, scope: Scope) -> MooncakeConsumers | None:
        if self._consumers is _UNRESOLVED:
            vllm_config = _vllm_config(scope)
            if vllm_config is None:
                return None  # not known yet (or not inside vLLM): look again next time
            self._consumers = mooncake_consumers(vllm_config)
            if isinstance(self._consumers, MooncakeConsumers):
                logger.info("epd: encoders push embeddings to %s", self._consumers.by_rank)
        return self._consumers if isinstance(self._consumers, MooncakeConsumers) else None

    def expectation(self, scope: Scope) -> Expectation | None:
        """What the encoders and prefill servers must serve: this vLLM server's own model, else
        ``expected_model``; None when neither is known (yet) or the check is off."""
        if not self._config.check_models:
            return None
        vllm_config = _vllm_config(scope)
        if vllm_config is not None:
            found = expectation_of_vllm(vllm_config)
            if found is not None:
                return found
        model = self._config.expected_model
        return Expectation(frozenset({model})) if model else None

    def kv_consumer(self, scope: Scope) -> bool:
        """Whether this server can take a KV cache another server prefilled (``kv_consumer`` or
        ``kv_both``); True outside vLLM, where nothing says otherwise."""
        if self._kv_consumer is None:
            vllm_config = _vllm_config(scope)
            if vllm_config is None:
                return True  # not known yet (or not inside vLLM): look again next time
            role = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_role", None)
            self._kv_consumer = role in ("kv_consumer", "kv_both")
            if not self._kv_consumer and self._config.scheduler == "llm-d":
                logger.warning(
                    "epd: this server has no KV consumer role (kv_role %r): a scheduler's "
                    "x-prefiller-host-port is ignored and requests are prefilled here",
                    role,
                )
        return self._kv_consumer

    def push_target(self, scope: Scope) -> tuple[str | None, bytes | None]:
        """Mooncake push: the address encoders push this request's embeddings to, and the data-parallel
        rank to pin the request to so that the engine behind that address runs it (None: no pin).

        ``ec_consumer_zmq`` wins; otherwise the address follows the server's own ECMooncakeConnector
        configuration (:func:`~epd_middleware.protocol.mooncake_consumers`). A rank the client pinned
        itself is kept.
        """
        if self._config.ec_consumer_zmq is not None:
            return self._config.ec_consumer_zmq, None
        consumers = self._mooncake(scope)
        if consumers is None:
            return None, None
        ranks = list(consumers.by_rank)
        for name, value in scope["headers"]:
            if name == DATA_PARALLEL_RANK_HEADER:
                try:
                    pinned = int(value)
                except ValueError:
                    break
                if pinned in consumers.by_rank:
                    return consumers.by_rank[pinned], None
                break
        if not consumers.pin:
            return consumers.by_rank[ranks[0]], None
        rank = ranks[self._next_rank % len(ranks)]
        self._next_rank += 1
        return consumers.by_rank[rank], str(rank).encode()


class _Disconnected(Exception):
    """The client went away; nothing more is sent or run for it."""


class _Exchange:
    """One intercepted request: its state lives here, never on the middleware."""

    __slots__ = ("middleware", "receive", "route", "scheduled", "scope", "send", "surface")

    def __init__(
        self,
        middleware: EPDMiddleware,
        surface: Surface,
        scope: Scope,
        receive: Receive,
        send: Send,
        scheduled: list[tuple[bytes, bytes]] | None,
    ) -> None:
        self.middleware = middleware
        self.surface = surface
        self.scope = scope  # without the scheduler's headers
        self.receive = receive
        self.send = send
        self.scheduled = scheduled  # the request's headers as they came, when they held the scheduler's
        self.route: Route = NO_ROUTE

    async def run(self) -> None:
        middleware = self.middleware
        pipeline = middleware._pipeline
        if middleware.config.authenticate and not middleware._authorized(self.scope):
            await self._send_error(Unauthorized())
            return
        try:
            if self.scheduled is not None:
                self.route = pipeline.route(self.scheduled)  # before the body: a 403 reads nothing
                if self.route.prefill is not None and not middleware._server.kv_consumer(self.scope):
                    pipeline.stats.request("prefill_header_ignored")
                    self.route = Route(self.route.encoders, None)
            body = await self._read_body()
            request = pipeline.parse(self.surface, body, self.route)
        except _Disconnected:
            return
        except EPDError as exc:
            pipeline.stats.request(f"error_{exc.status}")
            await self._send_error(exc)
            return
        if request is None:
            pipeline.stats.request("passed_through")
            await middleware.app(self.scope, _replay(body, self.receive), self.send)
            return
        failure: Exception | None = None
        async with anyio.create_task_group() as group:
            client = _ClientWatch(self.receive, group.cancel_scope)
            group.start_soon(client.watch)
            for discovery in pipeline.discoveries:
                discovery.refresh_soon(group)
            try:
                await self._encode_and_run(request, client)
            except Exception as exc:
                failure = exc  # the engine app's own error goes up as it is, not in an ExceptionGroup
            await client.release()
        if failure is not None:
            raise failure

    async def _encode_and_run(self, request: ParsedRequest, client: _ClientWatch) -> None:
        middleware = self.middleware
        request_id, generated = self._request_id()
        push_to, pin_rank = middleware._server.push_target(self.scope) if request.media else (None, None)
        retries = middleware.config.engine_retries
        if middleware._pipeline.expectation is None and middleware.config.check_models:
            expectation = middleware._server.expectation(self.scope)
            if expectation is not None:
                middleware._pipeline.expect(expectation)
        for attempt in range(retries + 1):
            try:
                # The client leaving now cancels this (and the encoder or prefill calls in it).
                client.preparing = True
                new_body = await self._prepare(request, request_id, push_to, fresh=attempt > 0)
            except EPDError as exc:
                middleware._pipeline.stats.request(f"error_{exc.status}")
                await self._send_error(exc)
                return
            finally:
                client.preparing = False
            scope = dict(self.scope)
            scope["headers"] = _engine_headers(
                self.scope["headers"], len(new_body), request_id if generated else None, pin_rank
            )
            guard = _EngineFailureGuard(self.send, hold=attempt < retries)
            await middleware.app(scope, _replay(new_body, client.receive), guard.send)
            if guard.status == 200 and middleware._pipeline.expectation is None:
                self._learn_model(request)
            if not guard.withheld:
                return
            middleware._pipeline.stats.engine_retry()
            logger.warning(
                "request %s: the local engine answered 500 before any byte reached the client; "
                "encoding and running it again (%d of %d)",
                request_id,
                attempt + 1,
                retries,
            )

    def _learn_model(self, request: ParsedRequest) -> None:
        """Outside vLLM and without ``expected_model``: a model the local engine answered 200 for is one
        this server serves, so the encoders and prefill servers must serve it too."""
        if not self.middleware.config.check_models:
            return
        model = text_of(request.fields.get(MODEL))
        if isinstance(model, str) and model:
            self.middleware._pipeline.expect(Expectation(frozenset({model})))
            logger.info(
                "epd: this server serves %r (the first request the engine answered); encoders and prefill "
                "servers are used once they serve it too",
                model,
            )

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
        return _new_request_id(), True

    def _authorization(self) -> str | None:
        for name, value in self.scope["headers"]:
            if name == b"authorization":
                return str(value.decode("latin-1"))
        return None

    async def _prepare(
        self, request: ParsedRequest, request_id: str, push_to: str | None, *, fresh: bool
    ) -> bytes:
        middleware = self.middleware
        context = RequestContext(
            client=middleware._clients.open(),
            request_id=request_id,
            storage=middleware._server.storage(self.scope),
            identifiers=middleware._server.identifiers(self.scope),
            media_policy=middleware._server.media_policy(self.scope),
            authorization=self._authorization(),
            push_to=push_to,
            route=self.route,
            fresh=fresh,
        )
        return await middleware._pipeline.prepare(self.surface, request, context)

    async def _send_error(self, error: EPDError) -> None:
        await _send_error(self.send, error)


class _ClientWatch:
    """The one reader of the server's ``receive`` once the body is in, for the whole exchange: the client
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
    the client never sees a byte of a response that is then replaced. Keeps the response's status."""

    __slots__ = ("_send", "hold", "status", "withheld")

    def __init__(self, send: Send, *, hold: bool) -> None:
        self._send = send
        self.hold = hold
        self.withheld = False
        self.status = 0

    async def send(self, message: Message) -> None:
        if self.withheld:
            return
        if message["type"] == "http.response.start":
            self.status = message["status"]
        if self.hold and message["type"] == "http.response.start" and message["status"] == 500:
            self.withheld = True
            return
        await self._send(message)


class _RequestIds:
    """Unique request ids without a random draw each: a random prefix per process and a counter.

    ``uuid4`` reads the kernel's random source on every call (about 8 us a request on the perf rig). The
    prefix is drawn again in a forked child, so processes never share one.
    """

    def __init__(self) -> None:
        self._pid = -1
        self._prefix = ""
        self._counter = itertools.count()

    def __call__(self) -> str:
        if self._pid != os.getpid():
            self._pid, self._prefix = os.getpid(), secrets.token_hex(8)
        return f"{self._prefix}{next(self._counter):08x}"


_new_request_id = _RequestIds()


def _vllm_args(scope: Scope) -> object | None:
    """The command line of the vLLM server the middleware runs in (its app's state), if any."""
    return getattr(getattr(scope.get("app"), "state", None), "args", None)


def _vllm_config(scope: Scope) -> object | None:
    """The configuration of the vLLM server the middleware runs in (its app's state), if any."""
    return getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)


def _route_path(scope: Scope) -> str:
    path: str = scope["path"]
    root_path: str = scope.get("root_path", "")
    if root_path and path.startswith(root_path):
        return path[len(root_path) :]
    return path


async def _send_error(send: Send, error: EPDError) -> None:
    await _send_body(send, error.status, error.body(), error.headers())


async def _send_json(send: Send, status: int, payload: object) -> None:
    await _send_body(send, status, _encode(payload), [])


async def _send_body(send: Send, status: int, body: bytes, extra: list[tuple[bytes, bytes]]) -> None:
    headers = [(b"content-type", _JSON), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


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
    headers: Sequence[tuple[bytes, bytes]], length: int, request_id: str | None, rank: bytes | None
) -> list[tuple[bytes, bytes]]:
    # The scheduler's headers are gone already (EPDMiddleware.__call__).
    dropped = (b"content-length", b"transfer-encoding", DATA_PARALLEL_RANK_HEADER if rank else b"")
    out = [(name, value) for name, value in headers if name not in dropped]
    out.append((b"content-length", str(length).encode()))
    if request_id is not None:
        out.append((REQUEST_ID_HEADER, request_id.encode()))
    if rank is not None:
        out.append((DATA_PARALLEL_RANK_HEADER, rank))
    return out
