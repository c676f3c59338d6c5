"""Encoder replies -> handles keyed by the hash the encoder reported -> what the local engine receives.

An encoder answers ``ec_transfer_params = {<mm_hash>: {"item_indices": [...], "metadata": {...}, ...}}``.
The hash is vLLM's own: the uuid when the request had no per-request options, otherwise a hash derived
from model id + uuid + options. The local engine derives the same hash from the same uuid and options,
so the handle must be keyed by the reported hash, never by the uuid sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._plan import MediaItem
from ._protocol import EC_ITEM_MM_HASH, EC_ITEM_TRANSFER_ID, ENTRY_MODALITY, ITEM_INDICES, METADATA
from .errors import UpstreamBadReply

__all__ = [
    "Handle",
    "ItemKey",
    "match_reply",
    "part_metadata",
    "push_items",
    "transfer_params",
]

ItemKey = tuple[str, str]  # (modality, uuid)


@dataclass(frozen=True, slots=True)
class Handle:
    """What an encoder reported for one item: its hash and the whole entry (connector fields included)."""

    mm_hash: str
    entry: Mapping[str, Any]
    # The Mooncake transfer id the item was pushed under, when the encoder pushed it to this server.
    transfer_id: str | None = None

    @property
    def metadata(self) -> Mapping[str, Any] | None:
        """The placeholder metadata a metadata-only reference needs; None when there is none."""
        metadata = self.entry.get(METADATA)
        return metadata if isinstance(metadata, dict) and metadata else None


def match_reply(encoder: str, items: Sequence[MediaItem], ec_transfer_params: Any) -> dict[ItemKey, Handle]:
    """Match the entries of one encoder reply to the items of its call.

    By ``item_indices`` first (positions in the call's items), then by the uuid as key, then a lone
    entry to a lone item. An item with no entry gets no handle: not an error, it just stays raw.
    """
    if ec_transfer_params is None:
        return {}
    if not isinstance(ec_transfer_params, dict):
        raise UpstreamBadReply(encoder, "ec_transfer_params is not an object")
    by_uuid = {item.uuid: index for index, item in enumerate(items)}
    matched: dict[int, Handle] = {}

    def assign(index: int, handle: Handle) -> None:
        reported = handle.entry.get(ENTRY_MODALITY)
        if reported is not None and reported != items[index].modality:
            # The entry would reference an embedding of another kind than the item's placeholder.
            raise UpstreamBadReply(
                encoder,
                f"ec_transfer_params entry {handle.mm_hash[:80]!r} reports modality {str(reported)[:40]!r} "
                f"for item {index}, which is {items[index].modality!r}",
            )
        if index in matched:
            raise UpstreamBadReply(
                encoder,
                f"item {index} is claimed by both {matched[index].mm_hash[:80]!r} and "
                f"{handle.mm_hash[:80]!r}",
            )
        matched[index] = handle

    for mm_hash, entry in ec_transfer_params.items():
        if not isinstance(entry, dict):
            raise UpstreamBadReply(encoder, f"ec_transfer_params entry {mm_hash[:80]!r} is not an object")
        handle = Handle(mm_hash, entry)
        indices = entry.get(ITEM_INDICES)
        if indices is not None:
            for index in _checked_indices(encoder, len(items), mm_hash, indices):
                assign(index, handle)
        elif mm_hash in by_uuid:
            assign(by_uuid[mm_hash], handle)
        elif len(items) == 1 and len(ec_transfer_params) == 1:
            assign(0, handle)
        else:
            raise UpstreamBadReply(
                encoder,
                f"ec_transfer_params entry {mm_hash[:80]!r} matches none of the {len(items)} items sent",
            )
    return {(items[index].modality, items[index].uuid): handle for index, handle in matched.items()}


def _checked_indices(encoder: str, count: int, mm_hash: str, indices: Any) -> list[int]:
    if not isinstance(indices, list) or not indices:
        raise UpstreamBadReply(encoder, f"item_indices of {mm_hash[:80]!r} is not a non-empty list")
    for index in indices:
        if type(index) is not int:
            raise UpstreamBadReply(
                encoder, f"item_indices of {mm_hash[:80]!r} holds a non-integer {str(index)[:40]!r}"
            )
        if not 0 <= index < count:
            raise UpstreamBadReply(
                encoder,
                f"item_indices of {mm_hash[:80]!r} holds {index}, out of range for {count} items",
            )
    if len(set(indices)) != len(indices):
        raise UpstreamBadReply(encoder, f"item_indices of {mm_hash[:80]!r} repeats an index")
    return indices


def part_metadata(
    keys: Sequence[ItemKey],
    handles: Mapping[ItemKey, Handle],
    *,
    rewrite: bool,
    keep_raw: frozenset[str] = frozenset(),
) -> list[Mapping[str, Any] | None]:
    """For each part, the metadata of its reference, or None where the part must stay raw.

    vLLM rejects a request that mixes raw and embeds parts of one modality, so a modality is rewritten
    only when every one of its parts has metadata and none of its parts is a raw reference (``keep_raw``).
    """
    if not rewrite:
        return [None] * len(keys)
    raw_modalities = set(keep_raw)
    for key in keys:
        handle = handles.get(key)
        if handle is None or handle.metadata is None:
            raw_modalities.add(key[0])
    return [None if key[0] in raw_modalities else handles[key].metadata for key in keys]


def transfer_params(handles: Mapping[ItemKey, Handle]) -> dict[str, Any]:
    """``ec_transfer_params`` for the local engine: every entry whole, under its reported hash."""
    return {handle.mm_hash: dict(handle.entry) for handle in handles.values()}


def push_items(keys: Sequence[ItemKey], handles: Mapping[ItemKey, Handle]) -> list[dict[str, str]]:
    """Mooncake ``ec_items`` for the local engine: for each pushed item in the request's item order, the
    hash the encoder reported and the transfer id the push went under.

    The consumer matches an entry by position when its ``mm_hash`` agrees, else by ``mm_hash``
    (``ECMooncakeScheduler._request_transfer_id``); the hash is always given, so items left out (raw
    references, items without a push) cannot shift the others onto the wrong transfer.
    """
    items = []
    for key in keys:
        handle = handles.get(key)
        if handle is not None and handle.transfer_id is not None:
            items.append({EC_ITEM_MM_HASH: handle.mm_hash, EC_ITEM_TRANSFER_ID: handle.transfer_id})
    return items
