"""EPDMiddleware: the pure ASGI layer. Which requests are intercepted (path, method, content type), the
scheduler's headers kept from everyone else, the status page, and the lifespan: the owned transport
opened and closed, health probes and DNS lookups run, the start-up model check. One intercepted request
is an :class:`~epd_middleware._exchange.Exchange`; what it means is :mod:`epd_middleware._pipeline`'s.
"""

from __future__ import annotations

from functools import partial

import anyio
import httpx
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from typing_extensions import Unpack

from ._allocator import MMAP_THRESHOLD, TRIM_THRESHOLD, keep_freed_memory
from ._answers import answer
from ._asgi import first_header, route_path, send_json
from ._equivalence import Engine, Equivalence, EquivalencePolicy
from ._exchange import Exchange
from ._llmd import SCHEDULER_HEADERS
from ._logs import adopt_vllm_logging, log_as_json, logger, request_id_of, request_scope
from ._pipeline import Pipeline
from ._probes import probe_forever
from ._raw_media import RawMediaGuard
from ._status import status_page
from ._surfaces import Surface, anthropic_messages, openai_chat, openai_chat_batch, openai_responses
from ._version import __version__
from .config import EPDConfig, EPDOptions
from .errors import EPDError, MethodNotAllowed, StartupFailed, Unauthorized
from .host import Host
from .transport import HTTPClient, HttpxTransport, Transport

__all__ = ["EPDMiddleware"]

_JSON = b"application/json"


class EPDMiddleware:
    """Encode the media of multimodal chat requests on remote vLLM encoders before the local engine runs.

    ``app.add_middleware(EPDMiddleware, encoders=["http://enc-0:8001"])``; every option of
    :class:`EPDConfig` is a keyword. ``config=EPDConfig(...)`` is the same as the keywords (not both).
    With no options the configuration comes from ``EPD_*`` environment variables, which is how
    ``vllm serve --middleware epd_middleware.EPDMiddleware`` loads it.

    The network: ``transport`` (any :class:`~epd_middleware.Transport`: a test's fake, a custom client)
    or ``http_client`` (an ``httpx.AsyncClient``, its limits, auth and proxies) carries every call to the
    encoders and prefill servers and is never closed here; without either, the built-in HTTP/1.1 client,
    owned for the app's life. ``host``: what the server says about itself, for servers other than vLLM
    and tests; inside vLLM it is read from the app's state.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        http_client: httpx.AsyncClient | None = None,
        transport: Transport | None = None,
        host: Host | None = None,
        config: EPDConfig | None = None,
        **options: Unpack[EPDOptions],
    ) -> None:
        if config is not None and options:
            raise TypeError(
                f"EPDMiddleware takes either config=EPDConfig(...) or keyword options, not both "
                f"(got config and {sorted(options)})"
            )
        if http_client is not None and transport is not None:
            raise TypeError("EPDMiddleware takes http_client or transport, not both")
        adopt_vllm_logging()
        if config is None:
            config = EPDConfig.of_options(options) if options else EPDConfig.from_env()
        if config.log_format == "json":
            log_as_json()
        for warning in config.warnings():
            logger.warning("epd: %s", warning)
        if config.tune_malloc and keep_freed_memory() == "set":
            logger.info(
                "epd: glibc's malloc keeps freed memory for the next large body (allocations under "
                "%d MiB from the heap, up to %d MiB of it kept; tune_malloc=false leaves it as it was)",
                MMAP_THRESHOLD >> 20,
                TRIM_THRESHOLD >> 20,
            )
        if config.uuid_key is None:
            logger.info(
                "epd: media uuids are keyed by a key of this process's own (uuid_key is not set): media "
                "sent through another process or PD replica is encoded again there; give every PD the "
                "same EPD_UUID_KEY (a Secret) to share it"
            )
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
        self._pipeline.stats.loaded(__version__)
        # Media on vLLM's routes this middleware does not intercept, where the engine cannot encode it.
        self._raw_media = RawMediaGuard(config, self._surfaces, self._pipeline.stats)
        self._transports = _Transports(
            HttpxTransport(http_client) if http_client is not None else transport, config
        )
        self._hosts = _Hosts(host, config)
        self._equivalence = Equivalence(equivalence_policy(config), self._pipeline)

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
            exchange = Exchange(
                self.app,
                self._pipeline,
                self._hosts.of(scope),
                self._transports.open(),
                surface,
                scope,
                receive,
                send,
                scheduled,
            )
            await exchange.run()
        elif scope["type"] == "http" and self._status_path and route_path(scope) == self._status_path:
            await self._status(scope, send)
        elif scope["type"] == "http" and self._status_path and route_path(scope) == self._equivalence_path:
            await self._probe_now(scope, send)
        elif (
            scope["type"] in ("http", "websocket")
            and (host := self._hosts.of(scope)).local_encoding_blocker is not None
            and self._raw_media.guards(scope)
            # Whom vLLM refuses, it refuses first (401), before anything is read.
            and host.authorizes(scope["headers"])
        ):
            await self._raw_media(self.app, scope, receive, send, host)
        elif scope["type"] == "lifespan":
            await self._lifespan(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    @property
    def equivalence(self) -> Equivalence:
        return self._equivalence

    @property
    def _equivalence_path(self) -> str:
        return self._status_path.rstrip("/") + "/equivalence"

    def _intercepts(self, scope: Scope) -> Surface | None:
        surface = self._surfaces.get(route_path(scope))
        if surface is None:
            return None
        # vLLM's own rule (validate_json_request): the first content-type header, lower-cased, up to its
        # first ';'. Anything else it answers 415 without reading the body.
        content_type = first_header(scope["headers"], b"content-type")
        if content_type is None or content_type.lower().split(b";", 1)[0] != _JSON:
            return None
        return surface

    async def _status(self, scope: Scope, send: Send) -> None:
        """GET the status page: encoders, their health and load, counters. Behind the API keys."""
        host = self._hosts.of(scope)
        refused: EPDError | None = None
        if scope["method"] not in ("GET", "HEAD"):
            refused = MethodNotAllowed("use GET")
        elif not host.authorizes(scope["headers"]):
            refused = Unauthorized()
        if refused is None:
            await send_json(send, 200, status_page(self._pipeline, host, self._equivalence))
            return
        config, request_id = self.config, request_id_of(scope["headers"])
        with request_scope(request_id):
            await answer(
                send,
                refused,
                request_id=request_id,
                id_header=host.request_id_headers,
                expose=False,
                retry_after=config.retry_after,
            )

    async def _probe_now(self, scope: Scope, send: Send) -> None:
        """POST the equivalence path: one equivalence probe now (``check --canary``), its report.
        Behind the API keys; a run under way, or one of the last 10 s, is the answer (no caller can
        make the engine run probes back to back)."""
        host = self._hosts.of(scope)
        refused: EPDError | None = None
        if scope["method"] != "POST":
            refused = MethodNotAllowed("use POST")
        elif not host.authorizes(scope["headers"]):
            refused = Unauthorized()
        if refused is None:
            engine = Engine(self.app, scope, host, self._transports.open())
            report = await self._equivalence.run_once(engine, fresh_within=10.0)
            await send_json(send, 200, report)
            return
        request_id = request_id_of(scope["headers"])
        with request_scope(request_id):
            await answer(
                send,
                refused,
                request_id=request_id,
                id_header=host.request_id_headers,
                expose=False,
                retry_after=self.config.retry_after,
            )

    async def _startup_checks(self, scope: Scope) -> str | None:
        """Once the app started: ask every encoder and prefill server what it serves (DNS names looked
        up first), log what does not match, and with ``strict_startup`` say why the start fails."""
        config, pipeline = self.config, self._pipeline
        expectation = self._hosts.of(scope).expectation
        if expectation is None:
            return None
        pipeline.expect(expectation)
        for discovery in pipeline.discoveries:
            await discovery.ready()
        transport, headers = self._transports.open(), pipeline.probe_headers()
        for pool in (pipeline.encoders, pipeline.prefill):
            await pool.models.check(transport, pool.members, headers)
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

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Open the owned transport and start health probes at start-up; stop and close at shutdown."""
        probes = anyio.CancelScope()
        server_scope = dict(scope)  # as it came: an app inside may put itself under "app"
        failed: list[str] = []
        try:
            await self._run_lifespan(scope, receive, send, probes, server_scope, failed)
        except BaseException as exc:
            if not failed:
                raise
            await self._transports.aclose()
            # The failure the server sees is the one raised at the failed start: ours, or the server's
            # own from sending it (hypercorn raises there). A task group on the way wraps it: unwrapped.
            while isinstance(getattr(exc, "exceptions", None), tuple) and len(exc.exceptions) == 1:  # type: ignore[attr-defined]
                exc = exc.exceptions[0]  # type: ignore[attr-defined]
            raise exc from None

    async def _run_lifespan(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        probes: anyio.CancelScope,
        server_scope: Scope,
        failed: list[str],
    ) -> None:

        started = anyio.Event()

        async def equivalence(transport: Transport) -> None:
            """The equivalence probe's schedule, from the end of a successful start (the engine is
            up and the model known then)."""
            await started.wait()
            engine = Engine(self.app, server_scope, self._hosts.of(server_scope), transport)
            try:
                async with anyio.create_task_group() as checks:
                    if self.config.verify_share > 0:
                        self._pipeline.sampler.running = True
                        checks.start_soon(self._equivalence.check_sampled_forever, engine)
                    if self.config.equivalence_interval > 0:
                        checks.start_soon(self._equivalence.run_forever, engine)
            finally:
                self._pipeline.sampler.running = False

        async with anyio.create_task_group() as group:

            async def probe(transport: Transport) -> None:
                headers = self._pipeline.probe_headers()
                with probes:
                    async with anyio.create_task_group() as pools:
                        if self.config.equivalence_interval > 0 or self.config.verify_share > 0:
                            pools.start_soon(equivalence, transport)
                        for discovery in self._pipeline.discoveries:
                            pools.start_soon(discovery.run)
                        for pool in (self._pipeline.encoders, self._pipeline.prefill):
                            ask_load = pool is self._pipeline.encoders and self.config.placement == "adaptive"
                            pools.start_soon(
                                partial(probe_forever, ask_load=ask_load), pool, transport, headers
                            )

            async def receive_opening() -> Message:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    group.start_soon(probe, self._transports.open())
                elif message["type"] == "lifespan.shutdown":
                    probes.cancel()
                return message

            async def send_closing(message: Message) -> None:
                if failed:
                    return  # the app's own report of the failure raised below: the server has ours
                if message["type"] == "lifespan.startup.complete":
                    problem = await self._startup_checks(server_scope)
                    if problem is not None:
                        failed.append(problem)
                        probes.cancel()
                        await send({"type": "lifespan.startup.failed", "message": problem})
                        # As Starlette does after a failed start: the lifespan ends with the error, so
                        # that every server stops (hypercorn and test clients wait on the app otherwise).
                        raise StartupFailed(problem)
                    started.set()
                if message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                    probes.cancel()
                    await self._transports.aclose()
                await send(message)

            try:
                await self.app(scope, receive_opening, send_closing)
            finally:
                probes.cancel()


def equivalence_policy(config: EPDConfig) -> EquivalencePolicy:
    """What the equivalence probe reads of the configuration."""
    return EquivalencePolicy(
        interval=config.equivalence_interval,
        tolerance=config.equivalence_tolerance,
        eject=config.equivalence_eject,
        tokens=config.equivalence_tokens,
        options=config.equivalence_options,
        max_pd_load=config.equivalence_max_pd_load,
    )


class _Hosts:
    """The host the middleware runs in: given, or read from the vLLM app's state once it shows one (the
    options alone until then)."""

    __slots__ = ("_config", "_given", "_outside")

    def __init__(self, given: Host | None, config: EPDConfig) -> None:
        self._config = config
        self._given = given
        self._outside = Host.outside(config)

    def of(self, scope: Scope) -> Host:
        if self._given is not None:
            return self._given
        found = Host.from_state(getattr(scope.get("app"), "state", None), self._config)
        if found is None:
            return self._outside  # not inside vLLM, or not yet: look again next time
        self._given = found
        return found


class _Transports:
    """The transport to the encoders and prefill servers: the one given (never closed here), or the
    built-in HTTP/1.1 client, owned for the app's life.

    The owned client opens at lifespan startup and closes at shutdown; without a lifespan it opens on
    first use.
    """

    def __init__(self, given: Transport | None, config: EPDConfig) -> None:
        self._given = given
        self._config = config
        self._owned: HTTPClient | None = None

    def open(self) -> Transport:
        if self._given is not None:
            return self._given
        if self._owned is None or self._owned.is_closed:
            config = self._config
            self._owned = HTTPClient(connect_timeout=min(config.connect_timeout, config.encoder_timeout))
        return self._owned

    async def aclose(self) -> None:
        owned, self._owned = self._owned, None
        if owned is not None:
            await owned.aclose()
