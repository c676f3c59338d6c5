"""The encode stage of one request, step by step: its media as items (one per distinct piece, under the
uuid the engine will see), what the reuse cache already has, an encoder for the rest, the calls, and the
engine request with every handle in place. Each step is a method that returns what the next needs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import anyio

from . import _selection as selection
from ._canary import Canary, canary
from ._context import RequestContext
from ._encoders import EncodeJob, EncodeOutcome, encode
from ._handles import Handle, ItemKey, part_metadata, push_items, transfer_params
from ._logs import logger
from ._metrics import Stats
from ._placement import Decision, Placement, item_tokens
from ._plan import EncoderCall, MediaItem, UuidKey, media_items, plan_calls
from ._pool import ServerPool, no_server_left
from ._protocol import EC_ITEMS, MODEL, embedding_used
from ._rawjson import text_of
from ._reuse import HandleCache, ReuseKey, request_key, reuse_blocker
from ._scheduler import Route
from ._surfaces import ParsedRequest, Surface
from ._tracing import record, stage_span
from .config import EPDConfig
from .errors import UpstreamBadReply

__all__ = ["EncodeStage", "Encoded"]


class Encoded(NamedTuple):
    """The engine request's fields with the handles, what to say of it in the request's log line
    (None when not logged), and whether any embedding was pushed to this server (Mooncake)."""

    fields: dict[str, Any]
    note: str | None = None
    pushed: bool = False


class _Items(NamedTuple):
    """The request's distinct items, the uuid of each part's item, and the identifier the engine will
    give each item where the surface pins uuids (None: not derivable here)."""

    items: tuple[MediaItem, ...]
    uuids: tuple[str, ...]
    expected: dict[ItemKey, str | None]


class _Reused(NamedTuple):
    """What the reuse cache gave, and every item's reuse key (empty: reuse is off for this request)."""

    handles: Mapping[ItemKey, Handle]
    keys: Mapping[ItemKey, ReuseKey]


_NOTHING_REUSED = _Reused({}, {})


@dataclass
class EncodeStage:
    """Encodes a request's media on the encoder pool (or reuses it), for the local engine."""

    config: EPDConfig
    pool: ServerPool
    reuse: HandleCache
    stats: Stats
    placement: Placement
    # The key of the content uuids (the fleet's uuid_key, else this process's own).
    uuid_key: UuidKey = field(init=False)

    def __post_init__(self) -> None:
        self.uuid_key = UuidKey(self.config.uuid_key)

    async def run(self, surface: Surface, request: ParsedRequest, context: RequestContext) -> Encoded:
        found = self._items(surface, request, context)
        reused = self._reused(surface, request, context, found)
        to_encode = tuple(item for item in found.items if (item.modality, item.uuid) not in reused.handles)
        tokens = self._tokens(request, context, found, to_encode)
        placed = self._placed(context, tokens, to_encode)
        if placed.local:
            to_encode = tuple(item for item in to_encode if item.modality not in placed.local)
        calls = self._plan(to_encode, context, bool(placed.local))
        started = time.perf_counter()
        attributes = {
            "epd.items": len(found.items),
            "epd.reused": len(reused.handles),
            "epd.calls": len(calls),
        }
        with stage_span(context.host.traces, "epd.encode", attributes) as span:
            outcome = await encode(
                self.pool, context.transport, self._job(surface, request, context, found, calls, tokens)
            )
            record(
                span,
                **{f"epd.placement.{m}": f"{where} ({why})" for m, (where, why) in placed.why.items()},
                **{"epd.fallback_items": sum(len(call.items) for call, _ in outcome.failed) or None},
            )
        encoded = time.perf_counter()
        self.stats.stage("encode", encoded - started)
        if reused.keys:
            self.reuse.put(reused.keys, outcome.handles)
        fallen = self._left_to_the_engine(outcome, to_encode, calls, context)
        handles = {**reused.handles, **outcome.handles}
        fields = self._engine_fields(surface, request, context, found, reused, handles, placed.local)
        rewritten = time.perf_counter()
        self.stats.stage("rewrite", rewritten - encoded)
        if reused.handles:
            self.stats.reused(len(reused.handles))
        if not fallen:
            self.stats.encoded(len(found.items), len(calls))
        pushed = context.push_to is not None and bool(outcome.handles)
        if not context.logged:
            return Encoded(fields, None, pushed)
        used = ", ".join(sorted(set(outcome.answered) - {""})) or "none"
        note = (
            f"{len(found.items)} media item(s), {len(calls)} encoder call(s) answered by {used}"
            + (f", {len(reused.handles)} reused" if reused.handles else "")
            + f"; encode {(encoded - started) * 1000:.1f} ms"
            + f", rewrite {(rewritten - encoded) * 1000:.2f} ms"
            + (f"; {fallen} left to the local engine" if fallen else "")
            + "".join(f"; {modality} placed {where} ({why})" for modality, (where, why) in placed.why.items())
        )
        return Encoded(fields, note, pushed)

    async def probe(
        self, surface: Surface, request: ParsedRequest, context: RequestContext, encoder: str
    ) -> Encoded:
        """The equivalence probe's encode (:mod:`._equivalence`): every item on ``encoder`` and only
        there, nothing reused, nothing placed here, no fallback, so that the answer the engine gives
        with these handles is that encoder's; no client's uuid, even a trusted one (the engine's caches
        would give the earlier request's embedding). Its failure is raised (an UpstreamError), and so is
        an answer without a handle for every item: the engine would encode that item itself, and the
        probe would compare PD with PD."""
        found = self._items(surface, request, context, trust_client_uuid=False)
        calls = plan_calls(found.items, [(encoder,)] * len(found.items), self.config.max_batch_size)
        job = self._job(surface, request, context, found, calls, {})._replace(
            stop_at_first_failure=True, canary=None, pinned=True
        )
        outcome = await encode(self.pool, context.transport, job)
        missing = [item for item in found.items if (item.modality, item.uuid) not in outcome.handles]
        if missing:
            raise UpstreamBadReply(
                encoder,
                f"no handle for {len(missing)} of {len(found.items)} item(s): PD would encode them itself",
            )
        fields = self._engine_fields(
            surface, request, context, found, _NOTHING_REUSED, outcome.handles, frozenset()
        )
        return Encoded(fields, None, context.push_to is not None and bool(outcome.handles))

    def _tokens(
        self, request: ParsedRequest, context: RequestContext, found: _Items, to_encode: tuple[MediaItem, ...]
    ) -> dict[ItemKey, int | None]:
        """Each item's vision tokens where its header tells them, under adaptive placement (which
        weighs them, and compares an encoder's calls by them); else none."""
        if self.placement.policy.mode != "adaptive" or not to_encode:
            return {}
        return item_tokens(request.media, found.uuids, request.fields, context.host)

    def _placed(
        self, context: RequestContext, tokens: Mapping[ItemKey, int | None], to_encode: tuple[MediaItem, ...]
    ) -> Decision:
        """Where the items still to encode are encoded, per modality (:mod:`._placement`)."""
        route = context.route.encoders
        encoders = route or self.pool.available(anyio.current_time())
        return self.placement.decide(to_encode, tokens, context.host, encoders)

    def _items(
        self,
        surface: Surface,
        request: ParsedRequest,
        context: RequestContext,
        *,
        trust_client_uuid: bool = True,
    ) -> _Items:
        items, uuids = media_items(
            request.media,
            trust_client_uuid=trust_client_uuid and self.config.trust_client_uuid and surface.pins_uuids,
            salt=request.cache_salt,
            pin_uuid=surface.pins_uuids,
            uuid_key=self.uuid_key,
        )
        # The identifier the engine will give each item, where the surface pins the uuid (Messages: the
        # engine hashes the image itself, and its parts are never references): a handle under any other
        # hash would name an embedding the engine never looks up.
        rule = context.host.identifiers
        expected = (
            {
                (item.modality, item.uuid): rule.identifier(item.modality, item.uuid, request.fields)
                for item in items
            }
            if surface.pins_uuids
            else {}
        )
        return _Items(items, uuids, expected)

    def _reused(
        self, surface: Surface, request: ParsedRequest, context: RequestContext, found: _Items
    ) -> _Reused:
        # A body read by Python's json may hold values the reuse key cannot tell apart (NaN and null):
        # such rare bodies are encoded afresh.
        storage = context.host.storage
        if (
            request.compat
            or reuse_blocker(self.config.reuse_handles, storage, pushed=context.push_to is not None)
            is not None
        ):
            return _NOTHING_REUSED
        assert storage is not None
        common = request_key(request.fields, pins_uuids=surface.pins_uuids)
        keys = {(item.modality, item.uuid): (item.modality, item.uuid, common) for item in found.items}
        if context.fresh:  # the engine could not use what it was given: nothing of it again
            self.reuse.forget(keys.values())
            return _Reused({}, keys)
        return _Reused(self.reuse.take(keys, storage, found.expected), keys)

    def _plan(
        self, to_encode: tuple[MediaItem, ...], context: RequestContext, placed_here: bool
    ) -> tuple[EncoderCall, ...]:
        """The calls for the items still to encode; none when no encoder is available and the policy
        leaves them to the engine."""
        local = self._local(context)
        nothing_left = "local" if placed_here else "reuse"
        choices, source = self._choose(to_encode, context.route) if to_encode else ([], nothing_left)
        if to_encode and not choices and not local:
            raise no_server_left(self.pool, "encoder", self.config.retry_after)
        self.stats.encoder_source(source if choices or not to_encode else "local")
        return plan_calls(to_encode, choices, self.config.max_batch_size) if choices else ()

    def _local(self, context: RequestContext) -> bool:
        """Whether media no encoder could take goes to the local engine as sent: the 'local' policy,
        where this server's engine can encode it (not a Mooncake consumer, whose engine would wait
        for a push that never comes)."""
        return self.config.on_encoder_failure == "local" and context.host.local_encoding_blocker is None

    def _choose(self, items: tuple[MediaItem, ...], route: Route) -> tuple[list[tuple[str, ...]], str]:
        """An encoder ranking per item, and who chose it (``scheduler`` or ``pool``); no rankings when no
        encoder is available."""
        pool, config, now = self.pool, self.config, anyio.current_time()
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

    def _job(
        self,
        surface: Surface,
        request: ParsedRequest,
        context: RequestContext,
        found: _Items,
        calls: tuple[EncoderCall, ...],
        tokens: Mapping[ItemKey, int | None],
    ) -> EncodeJob:
        return EncodeJob(
            surface,
            request,
            calls,
            tuple(context.call_headers(f"enc{index}") for index in range(len(calls))),
            deadline=self.config.encode_deadline,
            push_to=context.push_to,
            storage=context.host.storage,
            expected={key: value for key, value in found.expected.items() if value is not None},
            stop_at_first_failure=not self._local(context),
            extra_fields=context.scheduling.encoder_fields,
            ledger=context.ledger,
            canary=self._canary(request, context),
            raw_blocked=context.host.local_encoding_blocker,
            traced=context.host.traces,
            work=tokens,
        )

    def _left_to_the_engine(
        self,
        outcome: EncodeOutcome,
        to_encode: tuple[MediaItem, ...],
        calls: tuple[EncoderCall, ...],
        context: RequestContext,
    ) -> int:
        """How many items go to the engine as the media the client sent (only under the 'local'
        policy: their calls failed, or no encoder was available)."""
        if not outcome.failed and not (to_encode and not calls):
            return 0
        fallen = sum(len(call.items) for call, _ in outcome.failed) if calls else len(to_encode)
        reason = outcome.failed[0][1].logged if outcome.failed else "no encoder is available"
        self.stats.fallback(fallen)
        logger.warning("%d media item(s) left to the local engine: %s", fallen, reason)
        return fallen

    def _engine_fields(
        self,
        surface: Surface,
        request: ParsedRequest,
        context: RequestContext,
        found: _Items,
        reused: _Reused,
        handles: dict[ItemKey, Handle],
        placed_here: frozenset[str],
    ) -> dict[str, Any]:
        """The engine request: each part a reference to its embedding where the surface rewrites and
        every part of its modality can be one, else raw with its uuid pinned (a modality placed here
        stays raw whole); the handles in ``ec_transfer_params`` (and ``ec_items`` for Mooncake push)."""
        keys = [(part.modality, uuid) for part, uuid in zip(request.media, found.uuids, strict=True)]
        rewrite = self.config.rewrite and surface.rewrites
        keep_raw = request.referenced_modalities | placed_here
        if rewrite:
            keep_raw = keep_raw | self._unconfirmed(handles, found.expected, context, reused.keys)
        metadata = part_metadata(keys, handles, rewrite=rewrite, keep_raw=keep_raw)
        ec_params = transfer_params(handles)
        if context.push_to is not None:
            ec_params[EC_ITEMS] = push_items(keys, handles)
        return surface.engine_fields(request, found.uuids, metadata, ec_params)

    def _unconfirmed(
        self,
        handles: Mapping[ItemKey, Handle],
        expected: Mapping[ItemKey, str | None],
        context: RequestContext,
        reuse_keys: Mapping[ItemKey, ReuseKey],
    ) -> frozenset[str]:
        """The modalities that must stay raw because one of their handles cannot be confirmed as a
        reference just before the engine gets it: inside vLLM (the model path known) an identifier that
        cannot be derived here, and with storage an embedding no longer there (it was checked when its
        call returned or when it was reused; a cleanup may have removed it while the other calls ran)."""
        rule, storage = context.host.identifiers, context.host.storage
        unconfirmed: set[str] = set()
        for key, handle in handles.items():
            if rule.model is not None and key in expected and expected[key] is None:
                self.stats.counters["identifier_unknown_items"] += 1
                unconfirmed.add(key[0])
            elif storage is not None and not embedding_used(storage, handle.mm_hash):
                self.stats.counters["embeddings_gone_before_the_engine"] += 1
                unconfirmed.add(key[0])
                if key in reuse_keys:
                    self.reuse.forget((reuse_keys[key],))
        return frozenset(unconfirmed)

    def _canary(self, request: ParsedRequest, context: RequestContext) -> Canary | None:
        """The canary that proves an encoder healthy on its own for this request's calls: an image of
        the request's model where this server answers to that name (else of one of its names), with the
        operator's key for it (never the client's, which its calls may carry). It carries no push
        address, so under Mooncake an encoder encodes it and pushes nothing (``mooncake/scheduler.py``
        ``_prepare_push_spec`` skips a request without ``consumer_zmq``)."""
        model = text_of(request.fields.get(MODEL))
        if not isinstance(model, str) or not model:
            return None
        name = self.pool.models.own_name(model)
        return canary(name, context.host.storage, self.config.canary_authorization)
