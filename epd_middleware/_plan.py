"""From media parts to encoder calls: content uuids, de-duplication, encoder assignment and batching.

Pure functions over small frozen dataclasses; nothing here does I/O.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from blake3 import blake3

from ._protocol import UNBATCHED_MODALITIES, UUID
from ._rawjson import Raw, raw_text

__all__ = [
    "EncoderCall",
    "MediaItem",
    "MediaSource",
    "UuidKey",
    "content_uuid",
    "media_items",
    "plan_calls",
]

# BLAKE3's key derivation context for the uuid key: a secret given for this purpose yields a key of its
# own, never the same 32 bytes another use of the secret would.
_KEY_CONTEXT = "epd-middleware 2026-12-02 media content uuid key"


class MediaSource(Protocol):
    """What a surface tells the planner about one media part."""

    @property
    def modality(self) -> str: ...
    @property
    def content(self) -> tuple[str | Raw, ...]: ...
    @property
    def client_uuid(self) -> str | None: ...
    @property
    def part(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One distinct piece of media of a request, under the uuid the encoder and the engine both see."""

    uuid: str
    modality: str
    part: Mapping[str, Any]  # the content part the encoder receives, uuid set


@dataclass(frozen=True, slots=True)
class EncoderCall:
    """One request to one encoder for one or more items; ``preferred``: where it fails over first."""

    encoder: str
    items: tuple[MediaItem, ...]
    preferred: tuple[str, ...] = ()


class UuidKey:
    """The key of the content uuids: BLAKE3 keyed by the fleet secret (``uuid_key``), else by a key this
    process draws at start. Without it no one can compute the uuid another request's media will have,
    so no one who reaches an encoder or the EC storage can plant an embedding under it in advance."""

    __slots__ = ("key", "shared")

    def __init__(self, secret: str | None = None) -> None:
        if secret is None:
            self.key = secrets.token_bytes(32)
        else:
            material = secret.encode("utf-8", "surrogatepass")
            self.key = blake3(material, derive_key_context=_KEY_CONTEXT).digest()
        # Whether the key is the fleet's (configured), so that other processes and replicas share uuids.
        self.shared = secret is not None


def content_uuid(
    modality: str, content: Sequence[str | Raw], salt: str | None = None, key: UuidKey | None = None
) -> str:
    """A uuid derived from the media as sent: equal media give equal uuids, across requests too (and
    across processes and replicas that share ``key``; None: the public, unkeyed hash, which anyone can
    compute for any media).

    Hashes the text (data URL, http URL or input_audio base64) without decoding it: decoding costs more
    than hashing and identifies the media no better. BLAKE3 (vLLM's own multimodal hasher) runs several
    times faster than SHA-256 on these sizes. The result is hex, safe as a file name for connectors that
    store embeddings under their hash.
    """
    hasher = blake3(key=key.key) if key is not None else blake3()
    hasher.update(b"epd-media-v1\0")
    if salt is not None:
        # The salt's length goes first so that salt and modality cannot trade characters.
        encoded_salt = salt.encode("utf-8", "surrogatepass")
        hasher.update(b"%d:" % len(encoded_salt))
        hasher.update(encoded_salt)
    hasher.update(modality.encode())
    for piece in content:
        hasher.update(b"\0")
        # A raw string's bytes are its text's UTF-8: the same uuid as the decoded text, without a copy.
        # surrogatepass: a body read by Python's json may hold a lone surrogate, which UTF-8 refuses.
        hasher.update(raw_text(piece) if isinstance(piece, Raw) else piece.encode("utf-8", "surrogatepass"))
    return hasher.hexdigest(length=16)


def plan_calls(
    items: Sequence[MediaItem],
    choices: Sequence[Sequence[str]],
    max_batch_size: int,
) -> tuple[EncoderCall, ...]:
    """Send each item to the first of its ``choices`` (an encoder ranking per item, from
    :mod:`._selection`); the rest of its ranking is where its call fails over first.

    Images that land on the same encoder travel together, at most ``max_batch_size`` a call, failing
    over in the order of the batch's first item; audio and video go one item a call (vLLM encodes them
    one by one and they are large).
    """
    batches: dict[str, list[MediaItem]] = {}
    preferred: dict[str, tuple[str, ...]] = {}
    calls: list[EncoderCall] = []
    for item, ranking in zip(items, choices, strict=True):
        encoder, rest = ranking[0], tuple(ranking[1:])
        if item.modality in UNBATCHED_MODALITIES:
            calls.append(EncoderCall(encoder, (item,), rest))
            continue
        batch = batches.setdefault(encoder, [])
        if not batch:
            preferred[encoder] = rest
        batch.append(item)
        if len(batch) == max_batch_size:
            calls.append(EncoderCall(encoder, tuple(batch), preferred[encoder]))
            batch.clear()
    calls.extend(
        EncoderCall(encoder, tuple(batch), preferred[encoder]) for encoder, batch in batches.items() if batch
    )
    return tuple(calls)


def media_items(
    parts: Sequence[MediaSource],
    *,
    trust_client_uuid: bool,
    salt: str | None,
    pin_uuid: bool,
    uuid_key: UuidKey | None = None,
) -> tuple[tuple[MediaItem, ...], tuple[str, ...]]:
    """The distinct items of a request and, for each part, the uuid of its item.

    Parts of one modality with the same uuid are one item, encoded once. A client uuid is kept only when
    trusted: it is a key that every client shares, so by default the content decides, hashed under
    ``uuid_key``. ``pin_uuid``: the encoder's part carries the uuid (the engine's will too); else it goes
    as the client sent it (the engine hashes the media itself).
    """
    uuids: list[str] = []
    items: dict[tuple[str, str], MediaItem] = {}
    for part in parts:
        if trust_client_uuid and part.client_uuid is not None:
            uuid = part.client_uuid
        else:
            uuid = content_uuid(part.modality, part.content, salt, uuid_key)
        uuids.append(uuid)
        key = (part.modality, uuid)
        if key not in items:
            items[key] = MediaItem(uuid, part.modality, {**part.part, UUID: uuid} if pin_uuid else part.part)
    return tuple(items.values()), tuple(uuids)
