"""One request's path, top to bottom: body -> media parts -> (encode stage: plan, encoder calls, handles)
-> engine request -> (prefill stage) -> body for the local engine.

The same path serves every surface and every topology: E + PD, E + P + D (``prefill``), P + D without
encoders, and Mooncake push (a consumer address to push to). Surfaces: chat completions (and its batch
form), Anthropic Messages, OpenAI Responses. Encoders and prefill servers come from the pools (static URLs
and DNS names, :mod:`._discovery`) or from a scheduler's headers (:mod:`._scheduler`); :mod:`._selection`
ranks them per item. The pipeline also makes the request's decisions that depend on the server it runs
in (:class:`~.host.Host`): which scheduler choices it may follow, where embeddings are pushed, what model
the servers must serve.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import anyio.abc

from ._blame import Ledger
from ._body_buffers import BodyBuffers
from ._checks import (
    check_by_uuid_alone,
    check_cache_salt,
    check_client_embeddings,
    check_client_uuids,
    check_media_budget,
    check_media_policy,
    check_references,
    check_references_again,
)
from ._compat import Expectation
from ._context import RequestContext
from ._discovery import Discovery
from ._encoding import EncodeStage
from ._logs import logger
from ._metrics import Stats
from ._placement import Placement, PlacementPolicy
from ._plan import UuidKey
from ._pool import PoolPolicy, ServerPool
from ._prefill import PrefillStage
from ._protocol import EC_TRANSFER_PARAMS, KV_TRANSFER_PARAMS, MODEL, VLLM_XARGS
from ._rawjson import Bytes, text_of
from ._reuse import HandleCache, reuse_blocker
from ._sampling import Sampler
from ._scheduler import NO_ROUTE, Route, Scheduler
from ._scheduling import NO_SCHEDULING, scheduling_of
from ._surfaces import ParsedRequest, Surface, Unusable, decode_object, encode_fields
from .config import EPDConfig
from .errors import (
    NoHealthyUpstream,
    Overloaded,
    RefusedField,
    TooManyMediaItems,
    UnwritableRequest,
)
from .host import Host
from .transport import Transport

__all__ = ["Pipeline", "Prepared", "RequestContext", "pool_policy", "refused_transfer_field"]


class Prepared(NamedTuple):
    """The body for the local engine, and whether any of its embeddings were pushed to it (Mooncake):
    only then does an engine 500 after the push wait mean a push that was never loaded."""

    body: bytes
    pushed: bool = False


@dataclass
class Pipeline:
    """Everything a request needs that outlives it: configuration, the server pools, statistics."""

    config: EPDConfig
    stats: Stats = field(default_factory=Stats)
    encoders: ServerPool = field(init=False)
    prefill: ServerPool = field(init=False)
    discoveries: tuple[Discovery, Discovery] = field(init=False)
    scheduler: Scheduler | None = field(init=False, default=None)
    reuse: HandleCache = field(init=False)
    placement: Placement = field(init=False)
    # Real requests taken for the equivalence probe (verify_share, _sampling.py).
    sampler: Sampler = field(init=False)
    pending: int = field(init=False, default=0)
    # Buffers that large request bodies are read into, kept between requests (_body_buffers.py).
    bodies: BodyBuffers = field(init=False, default_factory=BodyBuffers)
    _encode: EncodeStage = field(init=False)
    _prefill: PrefillStage = field(init=False)

    def __post_init__(self) -> None:
        config = self.config
        self.encoders = ServerPool("encoder", pool_policy(config, config.encoder_timeout), self.stats)
        self.prefill = ServerPool("prefill", pool_policy(config, config.prefill_timeout), self.stats)
        self.reuse = HandleCache(config.reuse_cache_size)
        self.encoders.models.headers = self.prefill.models.headers = self.probe_headers()
        self.discoveries = (
            self._discovery(self.encoders, config.encoders),
            self._discovery(self.prefill, config.prefill),
        )
        if config.scheduler == "llm-d":
            self.scheduler = Scheduler(
                config.scheduler_allow,
                config.scheduler_scheme,
                lambda: self.encoders.member_addresses,
                lambda: self.prefill.member_addresses,
                self.stats,
                max_encoders=config.max_media_items,
            )
        self.placement = Placement(placement_policy(config), self.encoders, self.stats)
        self.sampler = Sampler(config.verify_share)
        self._encode = EncodeStage(config, self.encoders, self.reuse, self.stats, self.placement)
        self._prefill = PrefillStage(config, self.prefill, self.stats)

    @property
    def uuid_key(self) -> UuidKey:
        """The key of the media's content uuids (:class:`~._plan.UuidKey`)."""
        return self._encode.uuid_key

    def _discovery(self, pool: ServerPool, urls: tuple[str, ...]) -> Discovery:
        config = self.config
        return Discovery(
            pool, urls, config.dns_refresh_interval, config.dns_timeout, config.dns_nameservers, self.stats
        )

    @property
    def counters(self) -> Counter[str]:
        return self.stats.counters

    # Before the body ---------------------------------------------------------------------------------

    def route(self, headers: list[tuple[bytes, bytes]], host: Host) -> Route:
        """What the scheduler chose for this request (:class:`~epd_middleware.errors.ForbiddenTarget`
        for a prefill target it may not call); nothing without a scheduler. A prefill target is followed
        only where this server can take a KV cache another server prefilled."""
        if self.scheduler is None:
            return NO_ROUTE
        route = self.scheduler.route(headers)
        if route.prefill is not None and not host.kv_consumer:
            self.stats.request("prefill_header_ignored")
            return Route(route.encoders, None)
        return route

    def parse(self, surface: Surface, body: Bytes, route: Route = NO_ROUTE) -> ParsedRequest | None:
        """The request's media parts (and the client's own references), or None when the body passes to
        the engine unchanged; an :class:`~epd_middleware.errors.EPDError` for a body that must not.

        Cheap for bodies without media: a byte scan, no JSON parse. With remote prefill every request
        goes through P, so every body is parsed. A body that sets ``ec_transfer_params`` is parsed too,
        whatever it holds: the engine's are the middleware's alone (:func:`~._surfaces.with_handles`).
        """
        with_prefill = bool(self.config.prefill or route.prefill)
        # Where the middleware runs remote prefill, where a decoder takes its KV cache from is its call.
        owns_kv = bool(self.config.prefill) or self.scheduler is not None
        # Cheapest and likeliest to settle it first: a body with media is parsed anyway, and a search for
        # a field name reads the whole body (0.23 ms for 1.2 MB of images here).
        if (
            not with_prefill
            and _scannable(body)
            and not surface.may_hold_media(body)
            and not (owns_kv and b"kv_transfer_params" in body)
            and b"ec_transfer_params" not in body
        ):
            return None
        started = time.perf_counter()
        request = surface.parse(body)
        if request is None:
            # Not this surface's request (a completion on /invocations), or one vLLM will judge: it
            # still sets nothing that is the middleware's to set.
            if owns_kv or b"_xargs" in body or b"\\u" in body or not _scannable(body):
                decoded = decode_object(body)
                if decoded is not None:
                    refused_transfer_field(decoded[0], owns_kv=owns_kv, prefilled=False)
            return None
        refused_transfer_field(request.fields, owns_kv=owns_kv, prefilled=with_prefill)
        if not (
            request.media
            or request.references
            # A reference by uuid alone: the engine gets a multimodal item all the same.
            or request.referenced_modalities
            or with_prefill
            # vLLM hands the engine only a value that is truthy (to_sampling_params).
            or request.fields.get(EC_TRANSFER_PARAMS)
        ):
            return None
        self.stats.stage("parse", time.perf_counter() - started)
        return request

    def context(
        self,
        request: ParsedRequest,
        host: Host,
        transport: Transport,
        request_id: str,
        *,
        authorization: str | None,
        headers: Iterable[tuple[bytes, bytes]],
        route: Route = NO_ROUTE,
        surface: Surface | None = None,
    ) -> RequestContext:
        """The request's context: where its embeddings are pushed (and the engine rank pinned for it),
        the key its calls carry (the client's own with ``forward_authorization``), its priority and
        session id as vLLM reads them on ``surface``. Inside vLLM the model the servers must serve is
        known from now on."""
        headers = tuple(headers)
        push_to, pin_rank = host.push_target(headers) if request.media else (None, None)
        if self.expectation is None and host.expectation is not None and self.config.check_models:
            self.expect(host.expectation)
        forwarded = self.config.forward_authorization and authorization is not None
        if not forwarded:
            authorization = self.config.encoder_authorization
        scheduling = scheduling_of(surface, request.fields, headers) if surface is not None else NO_SCHEDULING
        return RequestContext(
            transport,
            request_id,
            host,
            authorization,
            push_to,
            pin_rank,
            route,
            scheduling=scheduling,
            ledger=Ledger(request.media, credentials_forwarded=forwarded),
        )

    # The body for the engine -------------------------------------------------------------------------

    async def prepare(self, surface: Surface, request: ParsedRequest, context: RequestContext) -> Prepared:
        """The body the local engine should see, and whether encoders were asked to push embeddings to
        it (Mooncake).

        Raises an :class:`~epd_middleware.errors.EPDError` when the request must be answered with an
        error instead (limits, overload, encoders or prefill servers failing under the 'error' policy, a
        body that cannot be written again).
        """
        config = self.config
        check_cache_salt(request)
        parts = len(request.media) + len(request.references)
        if parts > config.max_media_items:
            raise TooManyMediaItems(parts, config.max_media_items)
        check_client_embeddings(surface, request, config.client_embeddings)
        references = check_references(surface, request, context.host, self.stats)
        check_by_uuid_alone(surface, request, context.host)
        if config.trust_client_uuid and surface.pins_uuids:  # EncodeStage makes such a uuid the hash
            check_client_uuids(surface, request)
        if context.host.media_policy is not None:
            await check_media_policy(surface, request, context.host.media_policy)
        budget = context.host.media_decode_budget
        if budget is not None and len(request.media) > 1:  # one item goes whole to one encoder
            check_media_budget(surface, request, budget)
        if self.pending >= config.max_pending_requests:
            raise Overloaded(
                f"{self.pending} requests are already waiting for encoders or prefill; retry later",
                config.retry_after,
            )
        self.pending += 1
        try:
            for discovery in self.discoveries:
                await discovery.ready()
            fields, notes, pushed = request.fields, [], False
            if request.media and (config.encoders or context.route.encoders):
                encoded = await self._encode.run(surface, request, context)
                fields, notes, pushed = encoded.fields, [encoded.note], encoded.pushed
            elif request.media:
                blocker = context.host.local_encoding_blocker
                if blocker is not None:
                    raise NoHealthyUpstream(
                        f"no encoder is configured or named for this request, and {blocker}",
                        config.retry_after,
                    )
                self.stats.encoder_source("local")  # no encoder anywhere: vLLM encodes it itself
            if fields is request.fields and EC_TRANSFER_PARAMS in fields:
                # Nothing of the client's own transfer parameters steers a transfer (with_handles).
                fields = {name: value for name, value in fields.items() if name != EC_TRANSFER_PARAMS}
            if config.prefill or context.route.prefill:
                prefilled = await self._prefill.run(surface, request, fields, context)
                fields = prefilled.fields
                notes.append(prefilled.note)
            check_references_again(surface, references, context.host, self.stats)
            body = encode_fields(fields, compat=request.compat)
            said = [note for note in notes if note]
            if said and context.logged:
                logger.info("%s", "; ".join(said))
            return Prepared(body, pushed)
        except Unusable:
            # Never the client's body as it came instead: the engine would read what was not checked.
            raise UnwritableRequest from None
        finally:
            self.pending -= 1

    async def probe(
        self, surface: Surface, request: ParsedRequest, context: RequestContext, encoder: str
    ) -> Prepared:
        """The engine body of an equivalence probe through ``encoder`` alone (:mod:`._equivalence`):
        none of a client's limits or slots, none of the pool's choices."""
        encoded = await self._encode.probe(surface, request, context, encoder)
        return Prepared(encode_fields(encoded.fields, compat=request.compat), encoded.pushed)

    # After the engine --------------------------------------------------------------------------------

    def engine_answered(self, request: ParsedRequest, surface: Surface | None = None) -> None:
        """The local engine answered 200. Outside vLLM and without ``expected_model``, its model is one
        this server serves, so the encoders and prefill servers must serve it too. A share of such
        requests is checked again by the equivalence probe (``verify_share``), after the answer."""
        if surface is not None:
            self.sampler.offer(surface, request)
        if self.expectation is not None or not self.config.check_models:
            return
        model = text_of(request.fields.get(MODEL))
        if isinstance(model, str) and model:
            self.expect(Expectation(frozenset({model})))
            logger.info(
                "epd: this server serves %r (the first request the engine answered); encoders and prefill "
                "servers are used once they serve it too",
                model,
            )

    # Servers -----------------------------------------------------------------------------------------

    def expect(self, expectation: Expectation) -> None:
        """Encoders and prefill servers are used only once seen serving ``expectation``."""
        self.encoders.models.expect(expectation)
        self.prefill.models.expect(expectation)

    @property
    def expectation(self) -> Expectation | None:
        return self.encoders.models.expectation

    def probe_headers(self) -> dict[str, str]:
        """Headers of the middleware's own GETs to the servers (health, models)."""
        auth = self.config.encoder_authorization
        return {"authorization": auth} if auth else {}

    def refresh_soon(self, group: anyio.abc.TaskGroup) -> None:
        """Where no lifespan looks DNS names up, a lookup beside this request when an answer is old."""
        for discovery in self.discoveries:
            discovery.refresh_soon(group)

    def reuse_status(self, host: Host) -> dict[str, Any]:
        """Whether media is reused (the answer for a request on this server without a pinned Mooncake
        rank), why not when it is not, and the cache's figures."""
        blocker = reuse_blocker(self.config.reuse_handles, host.storage, pushed=host.push is not None)
        cache = self.reuse
        return {
            "enabled": blocker is None,
            "why_not": blocker,
            "entries": len(cache),
            "hits": cache.hits,
            "stale_dropped": cache.stale,
        }


def placement_policy(config: EPDConfig) -> PlacementPolicy:
    """What placement reads of the configuration."""
    return PlacementPolicy(
        mode=config.placement,
        pd_idle_load=config.placement_pd_idle_load,
        small_tokens=config.placement_small_tokens,
        pd_max_load=config.placement_pd_max_load,
        encoder_slowdown=config.placement_encoder_slowdown,
        encoder_busy_calls=config.placement_encoder_busy_calls,
    )


def pool_policy(config: EPDConfig, timeout: float) -> PoolPolicy:
    """What a pool reads of the configuration (``timeout``: one call's, which differs by role)."""
    return PoolPolicy(
        timeout=timeout,
        max_attempts=config.max_attempts,
        max_inflight=config.max_inflight_per_encoder,
        eject_after=config.eject_after,
        eject_cooldown=config.eject_cooldown,
        max_eject_cooldown=config.max_eject_cooldown,
        health_check_interval=config.health_check_interval,
        health_check_timeout=config.health_check_timeout,
    )


def _scannable(body: Bytes) -> bool:
    """Whether a byte scan for ASCII tokens sees the body's text: UTF-8. vLLM's json.loads also takes
    UTF-16 and UTF-32 (told by a BOM or the zero bytes of the first characters), where every letter comes
    with zero bytes between: such a body is always parsed."""
    return json.detect_encoding(body[:4]) in _UTF8


_UTF8 = frozenset({"utf-8", "utf-8-sig"})


def refused_transfer_field(fields: Mapping[str, Any], *, owns_kv: bool, prefilled: bool) -> None:
    """Fields a client may not set. ``vllm_xargs`` setting ``ec_transfer_params`` or
    ``kv_transfer_params``: vLLM copies it into the engine request where the body's own field is empty,
    and its values are never the objects a connector reads (a string there breaks the engine's
    scheduler). And where the middleware runs remote prefill (``owns_kv``), the client's own
    ``kv_transfer_params`` on a request it does not prefill remotely: they would tell this decoder which
    host to take a KV cache from (a prefilled request gets P's instead)."""
    xargs = fields.get(VLLM_XARGS)
    if isinstance(xargs, dict):
        for name in (EC_TRANSFER_PARAMS, KV_TRANSFER_PARAMS):
            if name in xargs:
                raise RefusedField(f"vllm_xargs must not set {name}", param=VLLM_XARGS)
    if owns_kv and not prefilled and fields.get(KV_TRANSFER_PARAMS) is not None:
        raise RefusedField(
            "kv_transfer_params are set by this server, which runs remote prefill itself",
            param=KV_TRANSFER_PARAMS,
        )
