"""Who should encode each item: one ranking of encoders per item, whose first is where the item goes and
whose rest is where its call fails over first (then the pool's other members, round-robin).

- ``scheduled``: the encoders a scheduler named for the request (llm-d's ``x-encoder-hosts-ports``):
  item i goes to the i-th modulo their number, as llm-d's sidecar sends it, and fails over to the
  others in the header's order.
- ``affinity``: rendezvous (highest-random-weight) hashing of the item's content uuid over the available
  encoders. Every process of every PD replica ranks the same encoders the same way for the same media
  without talking to the others, so the encoders' own caches see repeats; removing an encoder moves only
  the items it ranked first. Bounded load: an item skips an encoder that is at its in-flight bound or
  clearly busier than the others (see :func:`affinity`).
- ``round_robin``: the pool's cursor, one item after the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from blake3 import blake3

from ._plan import MediaItem

__all__ = ["affinity", "load_bound", "round_robin", "scheduled"]

Ranking = tuple[str, ...]

_MASK = (1 << 64) - 1
_seeds: dict[str, int] = {}


def round_robin(encoders: Sequence[str], start: int, count: int) -> list[Ranking]:
    """Item i to ``encoders[start + i]``; failover is left to the pool's cursor."""
    size = len(encoders)
    return [(encoders[(start + index) % size],) for index in range(count)]


def scheduled(named: Sequence[str], count: int, usable: Callable[[str], bool]) -> list[Ranking] | None:
    """Item i to the i-th of the ``named`` encoders that are ``usable`` (modulo their number), then the
    others in order; None when none of them is usable (the pool decides then)."""
    live = [url for url in named if usable(url)]
    if not live:
        return None
    size = len(live)
    return [tuple(live[(index + offset) % size] for offset in range(size)) for index in range(count)]


def load_bound(mean: float, max_inflight: int) -> float:
    """The in-flight calls above which an encoder is skipped for an item that ranks it first.

    1.5 times the mean over the available encoders, plus 2: with idle or lightly loaded encoders (a mean
    below 1) every item keeps its encoder, since a couple of calls in flight cost an encoder little and
    its cache is worth more; under load no encoder carries more than half again the average, so one
    hot image (or one hot conversation) cannot pile every call onto one encoder. Never above the
    ``max_inflight_per_encoder`` bound, where calls would wait for a slot.
    """
    return min(1.5 * mean + 2, max_inflight - 1)


def affinity(
    items: Sequence[MediaItem],
    encoders: Sequence[str],
    in_flight: Mapping[str, int],
    *,
    max_inflight: int,
    max_batch_size: int,
) -> list[Ranking]:
    """Each item's encoders by rendezvous weight of (uuid, encoder), highest first, with the first
    moved back past any encoder over :func:`load_bound` (counting the calls this request adds)."""
    if len(encoders) == 1:
        return [(encoders[0],)] * len(items)
    seeds = [(url, _seed(url)) for url in encoders]
    load = {url: in_flight.get(url, 0) for url in encoders}
    batched: dict[str, int] = {}
    rankings: list[Ranking] = []
    for item in items:
        key = _key(item.uuid)
        ranking = [url for url, _ in sorted(seeds, key=lambda pair: _mix(key ^ pair[1]), reverse=True)]
        bound = load_bound(sum(load.values()) / len(load), max_inflight)
        chosen = next((url for url in ranking if load[url] <= bound), ranking[0])
        if chosen != ranking[0]:
            ranking.remove(chosen)
            ranking.insert(0, chosen)
        # The call this item adds: a new one unless it joins an open image batch on that encoder.
        joins = item.modality == "image" and batched.get(chosen, 0) % max_batch_size != 0
        if not joins:
            load[chosen] += 1
        if item.modality == "image":
            batched[chosen] = batched.get(chosen, 0) + 1
        rankings.append(tuple(ranking))
    return rankings


def _key(uuid: str) -> int:
    """64 bits of the item's uuid: its first 16 hex digits when it is a content uuid (a BLAKE3 hash
    already), else a hash of it (a client's own uuid)."""
    try:
        return int(uuid[:16], 16) if len(uuid) >= 16 else _hash64(uuid)
    except ValueError:
        return _hash64(uuid)


def _seed(url: str) -> int:
    seed = _seeds.get(url)
    if seed is None:
        if len(_seeds) > 4096:
            _seeds.clear()
        seed = _seeds[url] = _hash64(url)
    return seed


def _hash64(text: str) -> int:
    return int.from_bytes(blake3(text.encode()).digest(8), "big")


def _mix(value: int) -> int:
    """SplitMix64's finaliser: a stable 64-bit mix (the same in every process and Python version)."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)
