"""The OpenAI chat-completions request surface: where media sits in the body and how it is written back.

Parsing is all-or-nothing: a body whose shape is off anywhere the middleware must look is left to vLLM,
which answers it with its own 400; the middleware never guesses at a half-understood request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from epd_middleware import protocol as p

__all__ = [
    "ChatRequest",
    "MediaPart",
    "Unusable",
    "encoder_body",
    "encoder_part",
    "may_hold_media",
    "parse",
    "rewritten_body",
]

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def may_hold_media(body: bytes) -> bool:
    """False only when the body holds no media part as JSON encoders write them; decides the no-parse
    pass-through.

    Every media part type holds "_url" or "_audio" (``input_audio``). A multi-byte search runs at about
    1.5 GB/s here, a one-byte one (memchr) at about 60 GB/s: so jump from underscore to underscore and
    look at what follows, falling back to plain searches when a body is full of underscores (code, say).

    A body that spells a part type with ``\\u`` escapes of ASCII letters (legal JSON that no common
    encoder writes) is not found here and goes to the engine unchanged: PD encodes that media itself,
    correctly, without the encoders. Looking for such escapes costs a scan of every long prompt with
    newlines, which is common; the case it would catch is not.
    """
    position = body.find(b"_")
    for _ in range(64):
        if position < 0:
            return False
        if body.startswith((b"_url", b"_audio"), position):
            return True
        position = body.find(b"_", position + 1)
    return b"_url" in body or b"_audio" in body


@dataclass(frozen=True, slots=True)
class MediaPart:
    """One content part that carries media, where it sits, and the text that identifies its media."""

    message_index: int
    part_index: int
    modality: str
    part: Mapping[str, Any]
    # The media as the client sent it (URL text, or input_audio data and format): what the content uuid
    # hashes. Never decoded: hashing the base64 text is cheaper and identifies the media as well.
    content: tuple[str, ...]
    client_uuid: str | None


@dataclass(frozen=True, slots=True)
class ChatRequest:
    fields: dict[str, Any]
    media: tuple[MediaPart, ...]
    # Modalities with a part that references earlier media by uuid alone: vLLM counts it as raw media,
    # so the other parts of that modality must stay raw too (no mixing of raw and embeds).
    referenced_modalities: frozenset[str]

    @property
    def cache_salt(self) -> str | None:
        salt = self.fields.get(p.CACHE_SALT)
        return salt if isinstance(salt, str) else None

    def forwarded_options(self) -> dict[str, Any]:
        """The per-request options the encoder must see exactly as the local engine does."""
        return {name: self.fields[name] for name in p.FORWARDED_OPTIONS if name in self.fields}


class Unusable(Exception):
    """The body's shape is off where the middleware must look: hand it to vLLM unchanged."""


def _encode_or_unusable(value: Any) -> bytes:
    try:
        return _encode(value)
    except (RecursionError, msgspec.EncodeError, OverflowError) as exc:
        # Decodable but too deep to encode again at this stack depth: vLLM judges it as sent.
        raise Unusable from exc


def parse(body: bytes) -> ChatRequest | None:
    """The media parts of a chat-completions body, or None when the body should pass through as it is."""
    try:
        fields = _decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    if not isinstance(fields, dict):
        return None
    try:
        return _find_media(fields)
    except Unusable:
        return None


def _find_media(fields: dict[str, Any]) -> ChatRequest:
    messages = fields.get(p.MESSAGES)
    if not isinstance(messages, list):
        raise Unusable
    ec_params = fields.get(p.EC_TRANSFER_PARAMS)
    if ec_params is not None and not isinstance(ec_params, dict):
        raise Unusable
    media: list[MediaPart] = []
    referenced: set[str] = set()
    for message_index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise Unusable
        content = message.get(p.CONTENT)
        if not isinstance(content, list):
            continue
        for part_index, part in enumerate(content):
            if not isinstance(part, dict):
                continue  # plain-string parts are text; vLLM judges anything else
            found = _media_of(part)
            if found is None:
                continue
            modality, media_content = found
            if media_content is None:
                referenced.add(modality)
                continue
            client_uuid = part.get(p.UUID)
            if client_uuid is not None and not isinstance(client_uuid, str):
                raise Unusable
            media.append(MediaPart(message_index, part_index, modality, part, media_content, client_uuid))
    return ChatRequest(fields, tuple(media), frozenset(referenced))


def _part_kind(part: Mapping[str, Any]) -> str | None:
    """The kind vLLM gives a part: its ``type``, or with a uuid or no type, the first media key it holds."""
    part_type = part.get(p.TYPE)
    if part_type is not None and not isinstance(part_type, str):
        raise Unusable
    if part_type is not None and part.get(p.UUID) is None:
        return part_type
    for key in p.PART_KEY_ORDER:
        if key in part:
            return key
    return part_type


def _media_of(part: Mapping[str, Any]) -> tuple[str, tuple[str, ...] | None] | None:
    """(modality, media content) for a raw media part, content None for a uuid-only reference."""
    kind = _part_kind(part)
    if kind not in p.MEDIA_PARTS:
        return None
    modality, inner_key = p.MEDIA_PARTS[kind]
    holder = part.get(kind)
    if holder is None:
        return modality, None
    if kind == "input_audio":
        if not isinstance(holder, dict):
            raise Unusable
        data, fmt = holder.get(inner_key), holder.get("format")
        if data is None:
            return modality, None
        if not isinstance(data, str) or not isinstance(fmt, (str, type(None))):
            raise Unusable
        return modality, (data, fmt or "")
    # vLLM takes ``{"url": ...}``, and a bare string when the part has a uuid or no type.
    url = holder.get(inner_key) if isinstance(holder, dict) else holder
    if url is None:
        return modality, None
    if not isinstance(url, str):
        raise Unusable
    return modality, (url,)


def encoder_part(media: MediaPart, uuid: str) -> dict[str, Any]:
    """The part as an encoder receives it: the client's part with the item's uuid."""
    return {**media.part, p.UUID: uuid}


def encoder_body(request: ChatRequest, parts: Sequence[Mapping[str, Any]]) -> bytes:
    """A chat-completions request that makes an encoder-only vLLM instance encode ``parts``."""
    body: dict[str, Any] = {
        p.MODEL: request.fields.get(p.MODEL),
        p.MESSAGES: [{"role": "user", p.CONTENT: list(parts)}],
        "stream": False,
        # Harmless on an encoder-only instance, and keeps a full instance used as encoder from decoding.
        "max_tokens": 1,
    }
    body.update(request.forwarded_options())
    return _encode_or_unusable(body)


def rewritten_body(
    request: ChatRequest,
    uuids: Sequence[str],
    metadata: Sequence[Mapping[str, Any] | None],
    ec_transfer_params: Mapping[str, Any],
) -> bytes:
    """The body for the local engine.

    ``uuids[i]`` and ``metadata[i]`` belong to ``request.media[i]``: a part with metadata becomes a
    metadata-only reference, one without stays raw with its uuid pinned, so the local engine derives the
    same hash as the encoder did. The handles are merged over the client's own ``ec_transfer_params``.
    """
    fields = dict(request.fields)
    messages = list(fields[p.MESSAGES])
    copied: set[int] = set()
    for media, uuid, meta in zip(request.media, uuids, metadata, strict=True):
        if media.message_index not in copied:
            message = dict(messages[media.message_index])
            message[p.CONTENT] = list(message[p.CONTENT])
            messages[media.message_index] = message
            copied.add(media.message_index)
        content = messages[media.message_index][p.CONTENT]
        if meta is None:
            content[media.part_index] = {**media.part, p.UUID: uuid}
        else:
            kind = p.embeds_type(media.modality)
            content[media.part_index] = {p.TYPE: kind, kind: meta, p.UUID: uuid}
    fields[p.MESSAGES] = messages
    if ec_transfer_params:
        fields[p.EC_TRANSFER_PARAMS] = {**(fields.get(p.EC_TRANSFER_PARAMS) or {}), **ec_transfer_params}
    return _encode_or_unusable(fields)
