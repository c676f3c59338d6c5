"""One request's path, top to bottom: body -> media parts -> plan -> encoder calls -> handles -> engine
request -> (remote prefill) -> body for the local engine.

The same path serves every surface and every topology: E + PD,
E + P + D (``prefill``), P + D without encoders, and Mooncake push (a consumer address to push to).
Surfaces: chat completions, Anthropic Messages, OpenAI Responses. Encoders and prefill servers come from
the pools (static URLs and DNS names, :mod:`.discovery`) or from a scheduler's headers
(:mod:`.scheduler`); :mod:`.selection` ranks them per item.
"""

from __future__ import annotations

import json
import logging
import time
import uuid as uuid_module
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from . import selection
from .compat import Expectation
from .config import EPDConfig
from .discovery import Discovery
from .encoders import EncoderRequest, encode
from .errors import (
    MediaRefused,
    NoHealthyUpstream,
    Overloaded,
    RefusedField,
    TooManyMediaItems,
    UnresolvableReference,
    UnwritableRequest,
    UpstreamError,
)
from .handles import Handle, ItemKey, part_metadata, push_items, transfer_params
from .identifiers import IdentifierRule
from .logs import logger
from .media_policy import MediaPolicy
from .metrics import Stats
from .plan import EncoderCall, MediaItem, media_items, plan_calls
from .pool import PoolPolicy, ServerPool
from .prefill import decode_fields, prefill
from .protocol import (
    EC_CONSUMER_ZMQ,
    EC_ITEM_TRANSFER_ID,
    EC_ITEMS,
    EC_TRANSFER_PARAMS,
    KV_TRANSFER_PARAMS,
    REQUEST_ID_HEADER,
    VLLM_XARGS,
    embedding_stored,
)
from .reuse import HandleCache, ReuseKey, request_key
from .scheduler import NO_ROUTE, Route, Scheduler
from .surfaces import ParsedRequest, Surface, Unusable, decode_object, encode_fields
from .transport import Transport

__all__ = ["Pipeline", "RequestContext"]


_REQUEST_ID = REQUEST_ID_HEADER.decode()


@dataclass(frozen=True, slots=True)
class RequestContext:
    """What one request's path needs from the server it runs in."""

    client: Transport
    request_id: str
    # Where the local EC connector keeps embeddings as files (ECExampleConnector), to check them.
    storage: str | None = None
    # How the engine identifies media items (the hash it looks an embedding up under).
    identifiers: IdentifierRule = field(default_factory=IdentifierRule)
    # This server's media policy (inside vLLM), applied before any encoder call.
    media_policy: MediaPolicy | None = None
    # The client's Authorization header, sent on when forward_authorization is on.
    authorization: str | None = None
    # Mooncake push: the ZMQ address encoders push this request's embeddings to.
    push_to: str | None = None
    # The encoders and prefill server a scheduler chose for this request (empty: the pools decide).
    route: Route = NO_ROUTE
    # Encode every item again, reusing nothing (an engine retry: what it was given did not work).
    fresh: bool = False


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
    pending: int = field(init=False, default=0)

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

    def _discovery(self, pool: ServerPool, urls: tuple[str, ...]) -> Discovery:
        config = self.config
        return Discovery(
            pool, urls, config.dns_refresh_interval, config.dns_timeout, config.dns_nameservers, self.stats
        )

    @property
    def counters(self) -> Counter[str]:
        return self.stats.counters

    def route(self, headers: list[tuple[bytes, bytes]]) -> Route:
        """What the scheduler chose for this request (:class:`~epd_middleware.errors.ForbiddenTarget`
        for a prefill target it may not call); nothing without a scheduler."""
        return NO_ROUTE if self.scheduler is None else self.scheduler.route(headers)

    def parse(self, surface: Surface, body: bytes, route: Route = NO_ROUTE) -> ParsedRequest | None:
        """The request's media parts (and the client's own references), or None when the body passes to
        the engine unchanged; an :class:`~epd_middleware.errors.EPDError` for a body that must not.

        Cheap for bodies without media: a byte scan, no JSON parse. With remote prefill every request
        goes through P, so every body is parsed.
        """
        with_prefill = bool(self.config.prefill or route.prefill)
        # Where the middleware runs remote prefill, where a decoder takes its KV cache from is its call.
        owns_kv = bool(self.config.prefill) or self.scheduler is not None
        if (
            not with_prefill
            and not (owns_kv and b"kv_transfer_params" in body)
            and _scannable(body)
            and not surface.may_hold_media(body)
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
        if not (request.media or request.references or with_prefill):
            return None
        self.stats.stage("parse", time.perf_counter() - started)
        return request

    async def prepare(self, surface: Surface, request: ParsedRequest, context: RequestContext) -> bytes:
        """The body the local engine should see.

        Raises an :class:`~epd_middleware.errors.EPDError` when the request must be answered with an
        error instead (limits, overload, encoders or prefill servers failing under the 'error' policy, a
        body that cannot be written again).
        """
        config = self.config
        parts = len(request.media) + len(request.references)
        if parts > config.max_media_items:
            raise TooManyMediaItems(parts, config.max_media_items)
        self._check_references(surface, request, context)
        if context.media_policy is not None:
            await _check_media_policy(surface, request, context.media_policy)
        if self.pending >= config.max_pending_requests:
            raise Overloaded(
                f"{self.pending} requests are already waiting for encoders or prefill; retry later",
                config.retry_after,
            )
        self.pending += 1
        try:
            route = context.route
            fields = request.fields
            notes: list[str] = []
            remote_prefill = bool(config.prefill or route.prefill)
            for discovery in self.discoveries:
                await discovery.ready()
            if request.media and (config.encoders or route.encoders):
                fields = await self._encode(surface, request, context, notes)
            elif request.media:
                self.stats.encoder_source("local")  # no encoder anywhere: vLLM encodes it itself
            blocker = surface.prefill_blocker(fields) if remote_prefill else None
            if blocker is not None:
                self.stats.request("prefill_skipped")
                notes.append(f"prefilled here: {blocker}")
                fields = decode_fields(fields, None)
            elif remote_prefill:
                fields = await self._prefill(surface, request, fields, context, notes)
            body = encode_fields(fields, compat=request.compat)
            if notes and logger.isEnabledFor(logging.INFO):
                logger.info("request %s: %s", context.request_id, "; ".join(notes))
            return body
        except Unusable:
            # Never the client's body as it came instead: the engine would read what was not checked.
            raise UnwritableRequest from None
        finally:
            self.pending -= 1

    def _check_references(self, surface: Surface, request: ParsedRequest, context: RequestContext) -> None:
        """Every metadata-only part the client wrote itself must name an embedding this server has,
        under the identifier the engine will derive: a missing one kills vLLM's engine core. Where the
        middleware cannot confirm it (no storage it can look in, options it cannot follow), it is
        refused."""
        for reference in request.references:
            where = f"the {reference.kind} part at {surface.where(reference.location)}"
            if reference.uuid is None:
                raise UnresolvableReference(
                    f"{where} has no uuid: vLLM could not tell which embedding it means", param=surface.field
                )
            if context.storage is None:
                raise UnresolvableReference(
                    f"{where} refers to an embedding this server cannot confirm it has (its EC connector "
                    "keeps none the middleware can look at); send the media itself",
                    param=surface.field,
                )
            identifier = context.identifiers.identifier(reference.modality, reference.uuid, request.fields)
            if identifier is None:
                raise UnresolvableReference(
                    f"{where} refers to an embedding whose identifier under this request's options cannot "
                    "be derived here; send the media itself",
                    param=surface.field,
                )
            if not embedding_stored(context.storage, identifier):
                self.stats.request("reference_refused")
                raise UnresolvableReference(
                    f"{where} refers to embedding {identifier[:80]!r}, which this server does not have",
                    param=surface.field,
                )

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

    def _headers(self, context: RequestContext, suffix: str) -> dict[str, str]:
        headers = {_REQUEST_ID: f"{context.request_id}-{suffix}"}
        auth = context.authorization if self.config.forward_authorization else None
        if auth is None:
            auth = self.config.encoder_authorization
        if auth is not None:
            headers["authorization"] = auth
        return headers

    async def _encode(
        self, surface: Surface, request: ParsedRequest, context: RequestContext, notes: list[str]
    ) -> dict[str, Any]:
        """Encode the request's media on the encoders (what is not reused); the engine request with the
        handles."""
        config, pool = self.config, self.encoders
        items, uuids = media_items(
            request.media,
            trust_client_uuid=config.trust_client_uuid and surface.pins_uuids,
            salt=request.cache_salt,
            encoder_part=surface.encoder_part,
        )
        rule = context.identifiers
        # The identifier the engine will give each item, where the surface pins the uuid (Messages: the
        # engine hashes the image itself, and its parts are never references): a handle under any other
        # hash would name an embedding the engine never looks up.
        expected: dict[ItemKey, str | None] = (
            {
                (item.modality, item.uuid): rule.identifier(item.modality, item.uuid, request.fields)
                for item in items
            }
            if surface.pins_uuids
            else {}
        )
        reuse_keys: dict[ItemKey, ReuseKey] = {}
        reused: dict[ItemKey, Handle] = {}
        # A body read by Python's json may hold values the reuse key cannot tell apart (NaN and null):
        # such rare bodies are encoded afresh.
        if (
            not request.compat
            and self.reuse_blocker(context.storage, pushed=context.push_to is not None) is None
        ):
            assert context.storage is not None
            common = request_key(request.fields, pins_uuids=surface.pins_uuids)
            reuse_keys = {(item.modality, item.uuid): (item.modality, item.uuid, common) for item in items}
            if context.fresh:  # the engine could not use what it was given: nothing of it again
                self.reuse.forget(reuse_keys.values())
            else:
                reused = self.reuse.take(reuse_keys, context.storage, expected)
        to_encode = tuple(item for item in items if (item.modality, item.uuid) not in reused)
        local = config.on_encoder_failure == "local"
        choices, source = self._choose(to_encode, context.route) if to_encode else ([], "reuse")
        if to_encode and not choices and not local:
            raise NoHealthyUpstream("every encoder is failing its calls; retry later", config.retry_after)
        self.stats.encoder_source(source if choices or not to_encode else "local")
        calls = plan_calls(to_encode, choices, config.max_batch_size) if choices else ()
        started = time.perf_counter()
        outcome = await encode(
            pool,
            context.client,
            calls,
            self._encoder_requests(surface, request, calls, context.push_to),
            [self._headers(context, f"enc{index}") for index in range(len(calls))],
            deadline=config.encode_deadline,
            storage=context.storage,
            expected={key: value for key, value in expected.items() if value is not None},
            stop_at_first_failure=not local,
        )
        encoded = time.perf_counter()
        self.stats.stage("encode", encoded - started)
        if reuse_keys:
            self.reuse.put(reuse_keys, outcome.handles)
        fallen = 0
        if outcome.failed or (to_encode and not calls):
            # Only under the 'local' policy: those items go to the engine as the media the client sent.
            fallen = sum(len(call.items) for call, _ in outcome.failed) if calls else len(to_encode)
            reason = outcome.failed[0][1].message if outcome.failed else "no encoder is available"
            self.stats.fallback(fallen)
            logger.warning(
                "request %s: %d media item(s) left to the local engine: %s",
                context.request_id,
                fallen,
                reason,
            )

        handles = {**reused, **outcome.handles}
        keys = [(part.modality, uuid) for part, uuid in zip(request.media, uuids, strict=True)]
        rewrite = config.rewrite and surface.rewrites
        keep_raw = request.referenced_modalities
        if rewrite:
            keep_raw = keep_raw | self._unconfirmed(handles, expected, rule, context.storage, reuse_keys)
        metadata = part_metadata(keys, handles, rewrite=rewrite, keep_raw=keep_raw)
        ec_params = transfer_params(handles)
        if context.push_to is not None:
            ec_params[EC_ITEMS] = push_items(keys, handles)
        fields = surface.engine_fields(request, uuids, metadata, ec_params)
        rewritten = time.perf_counter()
        self.stats.stage("rewrite", rewritten - encoded)
        if reused:
            self.stats.reused(len(reused))
        if not fallen:
            self.stats.encoded(len(items), len(calls))
        if logger.isEnabledFor(logging.INFO):
            used = ", ".join(sorted({call.encoder for call in calls})) or "none"
            notes.append(
                f"{len(items)} media item(s), {len(calls)} encoder call(s) to {used}"
                + (f", {len(reused)} reused" if reused else "")
                + f"; encode {(encoded - started) * 1000:.1f} ms"
                + f", rewrite {(rewritten - encoded) * 1000:.2f} ms"
                + (f"; {fallen} left to the local engine" if fallen else "")
            )
        return fields

    def _unconfirmed(
        self,
        handles: Mapping[ItemKey, Handle],
        expected: Mapping[ItemKey, str | None],
        rule: IdentifierRule,
        storage: str | None,
        reuse_keys: Mapping[ItemKey, ReuseKey],
    ) -> frozenset[str]:
        """The modalities that must stay raw because one of their handles cannot be confirmed as a
        reference just before the engine gets it: inside vLLM (the model path known) an identifier that
        cannot be derived here, and with storage an embedding no longer there (it was checked when its
        call returned or when it was reused; a cleanup may have removed it while the other calls ran)."""
        unconfirmed: set[str] = set()
        for key, handle in handles.items():
            if rule.model is not None and key in expected and expected[key] is None:
                self.stats.counters["identifier_unknown_items"] += 1
                unconfirmed.add(key[0])
            elif storage is not None and not embedding_stored(storage, handle.mm_hash):
                self.stats.counters["embeddings_gone_before_the_engine"] += 1
                unconfirmed.add(key[0])
                if key in reuse_keys:
                    self.reuse.forget((reuse_keys[key],))
        return frozenset(unconfirmed)

    def reuse_blocker(self, storage: str | None, *, pushed: bool) -> str | None:
        """Why media may not be taken from the reuse cache (given where embeddings are checked, and
        whether encoders push them), or None when it may."""
        if not self.config.reuse_handles:
            return "off (reuse_handles=false)"
        if pushed:
            return "off: Mooncake push (a pushed embedding cannot be checked before it is referenced)"
        if storage is None:
            return (
                "off: no embedding storage to check (only ECExampleConnector with check_embeddings "
                "lets the middleware confirm an embedding is still there)"
            )
        return None

    def _choose(self, items: tuple[MediaItem, ...], route: Route) -> tuple[list[tuple[str, ...]], str]:
        """An encoder ranking per item, and who chose it (``scheduler`` or ``pool``); no rankings when no
        encoder is available."""
        pool, config, now = self.encoders, self.config, anyio.current_time()
        if route.encoders:
            rankings = selection.scheduled(route.encoders, len(items), lambda url: pool.usable(url, now))
            if rankings is not None:
                return rankings, "scheduler"
        encoders = pool.available(now)
        if not encoders:
            return [], "pool"
        if config.encoder_selection == "round_robin":
            return selection.round_robin(
                encoders, pool.reserve(len(items), len(encoders)), len(items)
            ), "pool"
        return (
            selection.affinity(
                items,
                encoders,
                pool.in_flight_by_server(),
                max_inflight=config.max_inflight_per_encoder,
                max_batch_size=config.max_batch_size,
            ),
            "pool",
        )

    @staticmethod
    def _encoder_requests(
        surface: Surface, request: ParsedRequest, calls: tuple[EncoderCall, ...], push_to: str | None
    ) -> Callable[[EncoderCall], EncoderRequest]:
        """How each encoder call's body is made, per try."""
        if push_to is None:
            # Built once: every try of a call sends the same body.
            built = {id(call): EncoderRequest(surface.encoder_body(request, _parts(call))) for call in calls}
            return lambda call: built[id(call)]

        def pushed(call: EncoderCall) -> EncoderRequest:
            # A fresh transfer id per item and per try: a push the failed encoder may have begun must
            # never be confused with the retry's.
            ids = tuple(uuid_module.uuid4().hex for _ in call.items)
            params = {EC_CONSUMER_ZMQ: push_to, EC_ITEMS: [{EC_ITEM_TRANSFER_ID: tid} for tid in ids]}
            return EncoderRequest(surface.encoder_body(request, _parts(call), params), ids)

        return pushed

    async def _prefill(
        self,
        surface: Surface,
        request: ParsedRequest,
        fields: dict[str, Any],
        context: RequestContext,
        notes: list[str],
    ) -> dict[str, Any]:
        """Prefill the engine request remotely; the decode request for the local engine."""
        config = self.config
        started = time.perf_counter()
        try:
            kv_params = await prefill(
                self.prefill,
                context.client,
                surface,
                fields,
                self._headers(context, "prefill"),
                retry_after=config.retry_after,
                preferred=(context.route.prefill,) if context.route.prefill else (),
                compat=request.compat,
            )
        except (UpstreamError, NoHealthyUpstream) as exc:
            rejected = isinstance(exc, UpstreamError) and not exc.retryable  # the request itself is bad
            if config.on_prefill_failure != "local" or rejected:
                raise
            self.stats.request("prefill_fallback")
            logger.warning("request %s: prefilled by the local engine: %s", context.request_id, exc.message)
            return decode_fields(fields, None)
        elapsed = time.perf_counter() - started
        self.stats.stage("prefill", elapsed)
        if not request.media:
            self.stats.request("prefilled")
        if logger.isEnabledFor(logging.INFO):
            notes.append(f"prefill {elapsed * 1000:.1f} ms")
        return decode_fields(fields, kv_params)


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


def _scannable(body: bytes) -> bool:
    """Whether a byte scan for ASCII tokens sees the body's text: UTF-8. vLLM's json.loads also takes
    UTF-16 and UTF-32 (told by a BOM or the zero bytes of the first characters), where every letter comes
    with zero bytes between: such a body is always parsed."""
    return json.detect_encoding(body[:4]) in _UTF8


_UTF8 = frozenset({"utf-8", "utf-8-sig"})


async def _check_media_policy(surface: Surface, request: ParsedRequest, policy: MediaPolicy) -> None:
    """What this server's own media policy refuses is refused here, before an encoder fetches it."""
    for media in request.media:
        url = media.url
        if url is None:
            continue
        refusal = await policy.refusal(url)
        if refusal is not None:
            raise MediaRefused(refusal, param=surface.field)


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


def _parts(call: EncoderCall) -> list[Mapping[str, Any]]:
    return [item.part for item in call.items]
