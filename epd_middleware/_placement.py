"""Placement: where each modality of a request is encoded, here (the local engine, the media left raw) or
on an encoder.

``remote`` sends every item to an encoder (the default), ``local`` none. ``adaptive`` decides per request
and per modality (the engine request is rewritten per modality: a modality with one raw item keeps all
its items raw) from what only a middleware inside PD sees:

- the request's size: each image's vision tokens, from the size its own header gives (inline images)
  and the served model's patch grid (Qwen2-VL: one token per 28 x 28 pixels, within its pixel bounds);
- PD's own load: the requests its engine has unfinished and the prompt tokens it has yet to prefill
  (vLLM's ``engine_client``, read in-process);
- the encoders' load: this process's calls in flight to each, their recent latency against the
  fastest call of their size, and the load vLLM reports for them (``GET /load`` under
  ``--enable-server-load-tracking``).

PD has headroom while its engine holds fewer requests than ``placement_pd_max_load`` and the prompts
it has yet to prefill fit in one engine step (vLLM's ``max_num_batched_tokens``; its engine client's
``get_num_queued_tokens``): a request placed here then waits at most a step for the GPU.

Every modality goes local while PD is idle: no request is decoding there for a local encode to hold up,
and the request saves the remote path's fixed cost (the encoder's round trip and the engine step that
loads the embedding). Otherwise a modality goes local when PD has headroom and either its items are
small (few vision tokens: the encoder's round trip, queue and transfer cost more than encoding in place)
or every encoder it would use is saturated. Never where PD cannot encode (a Mooncake consumer waits for
a push of every item): there every modality goes remote, and the status page says why.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import anyio

from ._media_budget import image_size
from ._metrics import Stats
from ._plan import MediaItem
from ._pool import ServerPool
from ._protocol import MM_PROCESSOR_KWARGS
from ._rawjson import text_of
from ._surfaces import MediaPart
from .host import Host

__all__ = ["Placement", "PlacementPolicy", "vision_tokens"]


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    """What the configuration says about placement (``placement`` and its ``placement_*`` thresholds)."""

    mode: str = "remote"
    # PD is idle while its engine has fewer unfinished requests than this: every modality goes local.
    pd_idle_load: int = 1
    # A modality whose items to encode come to at most this many vision tokens is small.
    small_tokens: int = 0
    # PD has headroom while its engine has fewer unfinished requests than this.
    pd_max_load: int = 4
    # An encoder is saturated when its recent calls took this many times the fastest of their size ...
    encoder_slowdown: float = 3.0
    # ... or this process has this many calls in flight to it, or vLLM reports this load for it.
    encoder_busy_calls: int = 16


class Decision(NamedTuple):
    """Where the modalities of one request are encoded: those placed here, and why each went where."""

    local: frozenset[str]
    why: Mapping[str, tuple[str, str]]  # modality -> (where, why)


_REMOTE = Decision(frozenset(), {})
# How long an encoder's slowdown holds without a call renewing it, where health probes are off.
_SLOWDOWN_HOLDS_S = 5.0


class Placement:
    """Decides, per request, which modalities stay raw for the local engine. One per middleware."""

    __slots__ = ("_policy", "_pool", "_stats", "_unfinished")

    def __init__(self, policy: PlacementPolicy, pool: ServerPool, stats: Stats) -> None:
        self._policy = policy
        self._pool = pool
        self._stats = stats
        # Requests of this process between the start of their encode stage and the end of the engine's
        # answer (:meth:`unfinished`): those handed to the engine a moment ago are not in its count yet.
        self._unfinished = 0

    @property
    def policy(self) -> PlacementPolicy:
        return self._policy

    @contextmanager
    def unfinished(self) -> Iterator[None]:
        """The span of one request this process places work of: from before its placement to the end of
        the engine's answer. A burst at an idle PD must not see it idle for every request of the burst
        (the engine counts a request only once it has it)."""
        self._unfinished += 1
        try:
            yield
        finally:
            self._unfinished -= 1

    def _pd_load(self, host: Host) -> int | None:
        """PD's load as placement reads it: the engine's unfinished requests, or the requests this
        process has placed and not seen finish besides the one deciding now, whichever is more."""
        load = host.unfinished_requests()
        return None if load is None else max(load, self._unfinished - 1)

    def decide(
        self,
        items: Sequence[MediaItem],
        tokens: Mapping[tuple[str, str], int | None],
        host: Host,
        encoders: Sequence[str],
    ) -> Decision:
        """The placement of ``items`` (those still to encode), per modality. ``tokens``: each item's
        estimated vision tokens (None: not known); ``encoders``: the ones the request would use."""
        modalities = dict.fromkeys(item.modality for item in items)
        if not modalities:
            return _REMOTE
        policy = self._policy
        why: dict[str, tuple[str, str]] = {}
        if policy.mode == "remote":
            why = dict.fromkeys(modalities, ("remote", "policy"))
        elif host.local_encoding_blocker is not None:
            why = dict.fromkeys(modalities, ("remote", "pd_cannot_encode"))
        elif policy.mode == "local":
            why = dict.fromkeys(modalities, ("local", "policy"))
        elif (load := self._pd_load(host)) is None:
            why = dict.fromkeys(modalities, ("remote", "pd_load_unknown"))
        elif load < policy.pd_idle_load:
            why = dict.fromkeys(modalities, ("local", "pd_idle"))
        elif load >= policy.pd_max_load:
            why = dict.fromkeys(modalities, ("remote", "pd_busy"))
        elif _prefill_backlog(host):
            why = dict.fromkeys(modalities, ("remote", "pd_prefilling"))
        else:
            saturated = self.saturated(encoders)
            for modality in modalities:
                size = _total(
                    tokens[(item.modality, item.uuid)] for item in items if item.modality == modality
                )
                if size is not None and 0 < size <= policy.small_tokens:  # 0: never for size
                    why[modality] = ("local", "small")
                elif saturated:
                    why[modality] = ("local", "encoders_saturated")
                else:
                    why[modality] = ("remote", "large" if size is not None else "size_unknown")
        for where, reason in why.values():
            self._stats.placement(where, reason)
        return Decision(frozenset(m for m, (where, _) in why.items() if where == "local"), why)

    def saturated(self, encoders: Sequence[str]) -> bool:
        """Whether every one of ``encoders`` is saturated (none: not saturated, the policies for an
        empty pool decide)."""
        if not encoders:
            return False
        policy, pool = self._policy, self._pool
        # A slowdown no call renewed lately is no verdict: an encoder placement keeps idle would never
        # be measured again (the next request goes to it, and measures).
        fresh_since = time.monotonic() - (pool.policy.health_check_interval or _SLOWDOWN_HOLDS_S)
        for url in encoders:
            health = pool.known(url)
            if health is None:
                return False
            slow = health.slowdown >= policy.encoder_slowdown and health.slowdown_at >= fresh_since
            load = health.server_load
            busy = health.capacity.in_flight >= policy.encoder_busy_calls or (
                load is not None and load >= policy.encoder_busy_calls
            )
            if not (slow or busy):
                return False
        return True

    def status(self, host: Host) -> dict[str, Any]:
        """The policy, its thresholds and the live signals, for the status page."""
        policy, pool, now = self._policy, self._pool, anyio.current_time()
        return {
            "mode": policy.mode,
            "why_not_local": host.local_encoding_blocker,
            "thresholds": {
                "pd_idle_load": policy.pd_idle_load,
                "small_tokens": policy.small_tokens,
                "pd_max_load": policy.pd_max_load,
                "encoder_slowdown": policy.encoder_slowdown,
                "encoder_busy_calls": policy.encoder_busy_calls,
            },
            "pd_load": host.unfinished_requests(),
            "placed_unfinished": self._unfinished,
            "pd_queued_tokens": host.queued_tokens(),
            "pd_step_tokens": host.step_tokens,
            "encoders": {
                url: {
                    "in_flight": health.capacity.in_flight,
                    "latency_ms": round(health.latency * 1000, 2),
                    "slowdown": round(health.slowdown, 2),
                    "server_load": health.server_load,
                }
                for url in pool.available(now)
                if (health := pool.known(url)) is not None
            },
            "encoders_saturated": self.saturated(pool.available(now)),
            "decisions": {
                key.removeprefix("placement_"): count
                for key, count in self._stats.counters.items()
                if key.startswith("placement_")
            },
        }


def _prefill_backlog(host: Host) -> bool:
    """Whether the prompts PD has yet to prefill fill more than one engine step: work placed here would
    wait behind them, and its encode would hold up every one of them (unknown: no backlog, the request
    count decides alone)."""
    queued, step = host.queued_tokens(), host.step_tokens
    return queued is not None and step is not None and queued > step


def _total(values: Any) -> int | None:
    total = 0
    for value in values:
        if value is None:
            return None
        total += value
    return total


def item_tokens(
    media: Sequence[MediaPart], uuids: Sequence[str], fields: Mapping[str, Any], host: Host
) -> dict[tuple[str, str], int | None]:
    """Each item's estimated vision tokens, by (modality, uuid): images whose size their header gives;
    None for the rest (remote images, audio, video)."""
    options = text_of(fields.get(MM_PROCESSOR_KWARGS))
    bounds = _pixel_bounds(options if isinstance(options, dict) else {}, host.image_pixel_bounds)
    side = host.vision_token_side
    tokens: dict[tuple[str, str], int | None] = {}
    for part, uuid in zip(media, uuids, strict=True):
        key = (part.modality, uuid)
        if key in tokens:
            continue
        size = image_size(part.url) if part.modality == "image" and part.url is not None else None
        try:
            tokens[key] = vision_tokens(*size, side, *bounds) if size is not None else None
        except (OverflowError, ValueError):
            # Pixel bounds no float holds (min_pixels 10**400): not known here; vLLM answers them 400.
            tokens[key] = None
    return tokens


def _pixel_bounds(options: Mapping[str, Any], server: tuple[int, int]) -> tuple[int, int]:
    """The image processor's pixel bounds under a request's ``mm_processor_kwargs`` (Qwen2-VL reads
    ``min_pixels``/``max_pixels``, or ``size`` with ``shortest_edge``/``longest_edge`` as those) over the
    server's own."""
    low, high = server
    size = options.get("size")
    if isinstance(size, dict):
        low = _int(size.get("shortest_edge"), low)
        high = _int(size.get("longest_edge"), high)
    low = _int(options.get("min_pixels"), low)
    high = _int(options.get("max_pixels"), high)
    return low, max(low, high)


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def vision_tokens(width: int, height: int, side: int, min_pixels: int, max_pixels: int) -> int | None:
    """Vision tokens of a ``width`` x ``height`` image for a model with one token per ``side`` x ``side``
    pixels, resized as Qwen2-VL's ``smart_resize`` does (each edge to a multiple of ``side``, the area
    within the pixel bounds)."""
    if width <= 0 or height <= 0:
        return None  # no image Pillow decodes: its size is not known
    h = max(side, round(height / side) * side)
    w = max(side, round(width / side) * side)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(side, math.floor(height / beta / side) * side)
        w = max(side, math.floor(width / beta / side) * side)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / side) * side
        w = math.ceil(width * beta / side) * side
    return (h // side) * (w // side)
