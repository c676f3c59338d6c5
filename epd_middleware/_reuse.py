"""Handle reuse: media already encoded is not sent to an encoder again.

Multi-turn chats resend every image of the conversation on every turn. What an encoder reported for an
item (its hash, metadata and connector entry) is kept in a bounded LRU cache under everything that can
change the embedding: the item's modality and uuid (the content uuid, salted by ``cache_salt``, or a
trusted client uuid), and a digest of the request's ``model``, ``mm_processor_kwargs``,
``media_io_kwargs`` and ``cache_salt`` in the order the client wrote them (vLLM's hasher serialises
options in that order: two orderings are two hashes, never one key). Before the encoder calls are planned,
each item whose key is cached *and* whose embedding is confirmed present in the connector's storage is
taken from the cache; the engine request is built from reused and fresh handles exactly as if all had
been encoded in this request.

Only where presence can be confirmed: with ECExampleConnector (a ``stat`` of the embedding's file, the
check every encoded item gets too). Where it cannot (Mooncake push, NIXL, other connectors), reuse is
off: a reference to an embedding that is not there kills vLLM's engine core. A cached entry whose
embedding has gone is dropped and the item encoded again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from blake3 import blake3

from ._handles import Handle, ItemKey
from ._protocol import CACHE_SALT, MODEL, embedding_stored

__all__ = ["HandleCache", "ReuseKey", "request_key", "reuse_blocker"]

# (modality, uuid, digest of the request's embedding-relevant fields)
ReuseKey = tuple[str, str, bytes]

_EMBEDDING_FIELDS = (MODEL, "mm_processor_kwargs", "media_io_kwargs", CACHE_SALT)
# Keys in the order written: vLLM's MultiModalHasher sorts only its top-level keywords and serialises
# what is inside them (the options' own keys, at every depth) in insertion order.
_encode = msgspec.json.Encoder().encode


def request_key(fields: Mapping[str, Any], *, pins_uuids: bool) -> bytes:
    """The part of every item's key that comes from the request: whether the surface pins the uuid (the
    engine then identifies the item by it; otherwise by the decoded media, so an encoder reports another
    hash for the same media), and the fields that can change an embedding (absent and null are the same),
    as JSON in the client's order, which tells apart every value vLLM's hasher does (a string from a
    number, 1 from 1.0 and from true, one key order from another). Kept as a 32-byte BLAKE3 digest: the
    cache holds thousands of keys, and the fields are the client's to make large."""
    return blake3(_encode([pins_uuids, *(fields.get(name) for name in _EMBEDDING_FIELDS)])).digest()


def reuse_blocker(enabled: bool, storage: str | None, *, pushed: bool) -> str | None:
    """Why media may not be taken from the reuse cache (``enabled``: ``reuse_handles``; where
    embeddings are checked, and whether encoders push them), or None when it may."""
    if not enabled:
        return "off (reuse_handles=false)"
    if pushed:
        return "off: Mooncake push (a pushed embedding cannot be checked before it is referenced)"
    if storage is None:
        return (
            "off: no embedding storage to check (only ECExampleConnector with check_embeddings "
            "lets the middleware confirm an embedding is still there)"
        )
    return None


@dataclass
class HandleCache:
    """What encoders reported, by reuse key, least recently used first. One per API-server process."""

    size: int
    hits: int = 0
    stale: int = 0
    _entries: OrderedDict[ReuseKey, Handle] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._entries)

    def take(
        self,
        keys: Mapping[ItemKey, ReuseKey],
        storage: str,
        expected: Mapping[ItemKey, str | None],
    ) -> dict[ItemKey, Handle]:
        """The handles of the items whose key is cached, whose hash is the identifier the engine will
        derive (``expected``, where known) and whose embedding is in ``storage``; any other cached entry
        is forgotten."""
        reused: dict[ItemKey, Handle] = {}
        entries = self._entries
        for item, key in keys.items():
            handle = entries.get(key)
            if handle is None:
                continue
            identifier = expected.get(item)
            if (identifier is None or handle.mm_hash == identifier) and embedding_stored(
                storage, handle.mm_hash
            ):
                entries.move_to_end(key)
                reused[item] = handle
            else:
                del entries[key]
                self.stale += 1
        self.hits += len(reused)
        return reused

    def put(self, keys: Mapping[ItemKey, ReuseKey], handles: Mapping[ItemKey, Handle]) -> None:
        """Remember what the encoders reported for these items."""
        entries = self._entries
        for item, handle in handles.items():
            key = keys.get(item)
            if key is None:
                continue
            entries[key] = handle
            entries.move_to_end(key)
        while len(entries) > self.size:
            entries.popitem(last=False)

    def forget(self, keys: Iterable[ReuseKey]) -> None:
        for key in keys:
            self._entries.pop(key, None)
