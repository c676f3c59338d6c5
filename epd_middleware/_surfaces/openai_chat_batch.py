"""vLLM's batch chat surface (``POST /v1/chat/completions/batch``): ``messages`` is a list of
conversations, each rendered by the chat parser as one chat request with the batch's other fields
(``entrypoints/openai/chat_completion/batch_serving.py``; the request keeps extra fields, so
``ec_transfer_params`` reaches every conversation's engine request).

So each conversation's parts are found and written back exactly as in chat completions, with the batch's
options forwarded to the encoders. A batch is never prefilled remotely: one prefill request cannot carry a
KV cache per conversation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from epd_middleware import _protocol as p
from epd_middleware._rawjson import Bytes

from . import (
    MediaPart,
    ParsedRequest,
    Reference,
    Surface,
    Unusable,
    checked_messages,
    parse_with,
    with_handles,
    with_parts,
)
from .openai_chat import engine_part, find_in_messages, may_hold_media, prefill_limits

__all__ = ["SURFACE", "parse"]


def parse(body: Bytes) -> ParsedRequest | None:
    """The media parts of every conversation of a batch body (locations ``(conversation, message,
    part)``), or None when the body should pass through as it is."""
    return parse_with(body, _find_media)


def _find_media(fields: dict[str, Any]) -> ParsedRequest | None:
    if p.MESSAGES not in fields:
        return None
    conversations = checked_messages(fields)
    media: list[MediaPart] = []
    referenced: set[str] = set()
    references: list[Reference] = []
    for index, conversation in enumerate(conversations):
        if not isinstance(conversation, list):
            raise Unusable
        find_in_messages((index,), conversation, media, referenced, references)
    # One modality left raw anywhere keeps it raw in every conversation: stricter than vLLM's rule (per
    # conversation), never in breach of it.
    return ParsedRequest(fields, tuple(media), frozenset(referenced), tuple(references))


def engine_fields(
    request: ParsedRequest,
    uuids: Sequence[str],
    metadata: Sequence[Mapping[str, Any] | None],
    ec_transfer_params: Mapping[str, Any],
) -> dict[str, Any]:
    """Each conversation written back as chat completions writes one; the handles merged once (every
    conversation's engine request gets the batch's ``ec_transfer_params``)."""
    by_conversation: dict[int, list[tuple[tuple[int, ...], Mapping[str, Any]]]] = {}
    for media, uuid, meta in zip(request.media, uuids, metadata, strict=True):
        conversation, *location = media.location
        by_conversation.setdefault(conversation, []).append((tuple(location), engine_part(media, uuid, meta)))
    fields = dict(request.fields)
    conversations = list(fields[p.MESSAGES])
    for index, parts in by_conversation.items():
        conversations[index] = with_parts(conversations[index], lambda _: p.CONTENT, parts)
    fields[p.MESSAGES] = conversations
    return with_handles(fields, ec_transfer_params)


def where(location: tuple[int, ...]) -> str:
    conversation, message, part = location
    return f"messages[{conversation}][{message}].content[{part}]"


def prefill_blocker(fields: Mapping[str, Any]) -> str | None:
    return "a batch of conversations cannot be prefilled as one request"


SURFACE = Surface(
    path=p.CHAT_BATCH_PATH,
    field=p.MESSAGES,
    pins_uuids=True,
    rewrites=True,
    may_hold_media=may_hold_media,
    parse=parse,
    engine_fields=engine_fields,
    prefill_limits=prefill_limits,
    where=where,
    prefill_blocker=prefill_blocker,
    reads_priority_header=False,
)
