"""The OpenAI chat-completions request surface: where media sits in the body and how it is written back.

Parsing is all-or-nothing: the middleware never guesses at a half-understood request. A body whose shape
is off anywhere the middleware must look is left to vLLM (which answers it with its own 400) when it
holds nothing the middleware must handle, and refused otherwise
(:func:`~epd_middleware._surfaces.parse_with`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epd_middleware import _protocol as p
from epd_middleware._rawjson import Bytes, text_of

from . import (
    MediaPart,
    ParsedRequest,
    Raw,
    Reference,
    Surface,
    Unusable,
    checked_messages,
    parse_with,
    with_handles,
    with_parts,
)

__all__ = [
    "SURFACE",
    "engine_fields",
    "engine_part",
    "find_in_messages",
    "find_parts",
    "may_hold_media",
    "parse",
    "prefill_limits",
    "reference_of",
]


# What every part or field the middleware must see holds, spelled without escapes: "_url" or "_audio"
# (media parts, input_audio), "_pil" (image_pil, a reference by uuid), "_embeds" (references), "_xargs"
# (vllm_xargs).
_TOKENS = (b"_url", b"_audio", b"_pil", b"_embeds", b"_xargs")


def may_hold_media(body: Bytes) -> bool:
    """False only when the body surely holds no media part, reference or ``vllm_xargs``; decides the
    no-parse pass-through.

    A multi-byte search runs at about 1.5 GB/s here, a one-byte one (memchr) at about 60 GB/s: so jump
    from underscore to underscore and look at what follows, falling back to plain searches when a body
    is full of underscores (code, say). JSON can spell any of these letters as a ``\\u`` escape, which
    no byte scan sees through: a body with an escape is parsed (``\\n`` and the like spell none of them).
    """
    position = body.find(b"_")
    for _ in range(64):
        if position < 0:
            return b"\\u" in body
        if body.startswith(_TOKENS, position):
            return True
        position = body.find(b"_", position + 1)
    return any(token in body for token in _TOKENS) or b"\\u" in body


def parse(body: Bytes) -> ParsedRequest | None:
    """The media parts of a chat-completions body, or None when the body should pass through as it is."""
    return parse_with(body, _find_media)


def _find_media(fields: dict[str, Any]) -> ParsedRequest | None:
    if p.MESSAGES not in fields:
        # Not a chat request: vLLM refuses it on the chat path, and SageMaker's /invocations, which
        # shares this surface, serves it as a completion (no media).
        return None
    messages = checked_messages(fields)
    media: list[MediaPart] = []
    referenced: set[str] = set()
    references: list[Reference] = []
    find_in_messages((), messages, media, referenced, references)
    return ParsedRequest(fields, tuple(media), frozenset(referenced), tuple(references))


def find_in_messages(
    prefix: tuple[int, ...],
    messages: list[Any],
    media: list[MediaPart],
    referenced: set[str],
    references: list[Reference],
) -> None:
    """The media of one conversation, at locations ``(*prefix, message index, part index)``."""
    for message_index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise Unusable
        content = message.get(p.CONTENT)
        if isinstance(content, list):
            find_parts((*prefix, message_index), content, media, referenced, references)


def find_parts(
    prefix: tuple[int, ...],
    parts: list[Any],
    media: list[MediaPart],
    referenced: set[str],
    references: list[Reference],
) -> None:
    """The media parts of one content list (vLLM's chat parser reads it), into ``media`` at locations
    ``(*prefix, part index)``; the modalities referenced by uuid alone into ``referenced``; the client's
    own metadata-only parts into ``references``."""
    for part_index, part in enumerate(parts):
        if not isinstance(part, dict):
            continue  # plain-string parts are text; vLLM judges anything else
        location = (*prefix, part_index)
        kind = _part_kind(part)
        reference = reference_of(part, location, kind)
        if reference is not None:
            references.append(reference)
            continue
        found = media_of(part, kind)
        if found is None:
            continue
        modality, media_content = found
        if media_content is None:
            referenced.add(modality)
            continue
        client_uuid = text_of(part.get(p.UUID))
        if client_uuid is not None and not isinstance(client_uuid, str):
            raise Unusable
        media.append(MediaPart(location, modality, _only_its_media(part, kind), media_content, client_uuid))


def _only_its_media(part: dict[str, Any], kind: str | None) -> dict[str, Any]:
    """The part without media keys of other kinds. Once the middleware pins a uuid on it, vLLM types it by
    the first media key it holds rather than by its ``type``: a stray ``video_embeds`` or ``image_url``
    beside a ``video_url`` would turn it into a reference to nothing, or an encoder's fetch of a URL no
    check saw. Without a uuid vLLM ignores those keys, so leaving them out changes nothing it reads."""
    holder = p.MEDIA_PARTS[kind or ""][1]
    if not any(key in _MEDIA_KEYS and key != holder for key in part):
        return part
    return {key: value for key, value in part.items() if key == holder or key not in _MEDIA_KEYS}


_MEDIA_KEYS = frozenset(p.PART_KEY_ORDER)


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


def reference_of(part: Mapping[str, Any], location: tuple[int, ...], kind: str | None) -> Reference | None:
    """The part as a client's embeds part, when it is one: metadata-only (no payload, or a payload of
    metadata arrays without the ``<modality>_embeds`` tensor: its embedding comes from elsewhere), or
    carrying its tensor (base64: ``tensor``). ``kind``: the part's kind as vLLM gives it
    (``_part_kind``)."""
    modality = p.EMBEDS_PARTS.get(kind or "")
    if modality is None:
        return None
    assert kind is not None
    payload = part.get(kind)
    tensor = isinstance(payload, (str, Raw)) or (
        isinstance(payload, dict) and isinstance(payload.get(kind), (str, Raw))
    )
    uuid = text_of(part.get(p.UUID))
    if uuid is not None and not isinstance(uuid, str):
        raise Unusable  # vLLM would take str(uuid): not a reference the middleware reads otherwise
    return Reference(location, kind, modality, uuid, tensor)


def media_of(part: Mapping[str, Any], kind: str | None) -> tuple[str, tuple[str | Raw, ...] | None] | None:
    """(modality, media content) for a raw media part of ``kind``, content None for a uuid-only
    reference."""
    if kind in p.UUID_ONLY_PARTS:
        return p.UUID_ONLY_PARTS[kind], None
    if kind not in p.MEDIA_PARTS:
        return None
    modality, holder_key, inner_key = p.MEDIA_PARTS[kind]
    holder = part.get(holder_key)
    if holder is None:
        return modality, None
    if inner_key is None and not isinstance(holder, (str, Raw)):
        raise Unusable  # vLLM validates this holder as a string: let it answer the request
    if kind == "input_audio":
        if not isinstance(holder, dict):
            raise Unusable
        data, fmt = holder.get("data"), holder.get("format")
        if data is None:
            return modality, None
        if not isinstance(data, (str, Raw)) or not isinstance(fmt, (str, type(None))):
            raise Unusable
        return modality, (data, fmt or "")
    # vLLM takes ``{"url": ...}``, and a bare string when the part has a uuid or no type.
    url = holder.get(inner_key) if isinstance(holder, dict) and inner_key else holder
    if url is None:
        return modality, None
    if not isinstance(url, (str, Raw)):
        raise Unusable
    return modality, (url,)


def engine_fields(
    request: ParsedRequest,
    uuids: Sequence[str],
    metadata: Sequence[Mapping[str, Any] | None],
    ec_transfer_params: Mapping[str, Any],
) -> dict[str, Any]:
    """The body for the local engine, as fields.

    ``uuids[i]`` and ``metadata[i]`` belong to ``request.media[i]``: a part with metadata becomes a
    metadata-only reference, one without stays raw with its uuid pinned, so the local engine derives the
    same hash as the encoder did. The handles are the engine's ``ec_transfer_params``, none of the
    client's own.
    """
    fields = dict(request.fields)
    fields[p.MESSAGES] = with_parts(
        fields[p.MESSAGES],
        lambda _: p.CONTENT,
        (
            (media.location, engine_part(media, uuid, meta))
            for media, uuid, meta in zip(request.media, uuids, metadata, strict=True)
        ),
    )
    return with_handles(fields, ec_transfer_params)


def engine_part(media: MediaPart, uuid: str, meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """The part the engine gets: a metadata-only reference, or the client's part with its uuid pinned."""
    if meta is None:
        return {**media.part, p.UUID: uuid}
    kind = p.embeds_type(media.modality)
    return {p.TYPE: kind, kind: meta, p.UUID: uuid}


def prefill_limits(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``max_tokens: 1``, and ``max_completion_tokens: 1`` when the client sent it: vLLM prefers that
    field to ``max_tokens``, so it must be capped too."""
    limits: dict[str, Any] = {p.MAX_TOKENS: 1, p.STREAM: False}
    if p.MAX_COMPLETION_TOKENS in fields:
        limits[p.MAX_COMPLETION_TOKENS] = 1
    return limits


def where(location: tuple[int, ...]) -> str:
    message, part = location
    return f"messages[{message}].content[{part}]"


SURFACE = Surface(
    path=p.CHAT_COMPLETIONS_PATH,
    field=p.MESSAGES,
    pins_uuids=True,
    rewrites=True,
    may_hold_media=may_hold_media,
    parse=parse,
    engine_fields=engine_fields,
    prefill_limits=prefill_limits,
    where=where,
)
