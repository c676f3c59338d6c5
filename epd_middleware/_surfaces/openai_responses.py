"""The OpenAI Responses surface (``POST /v1/responses``): where images sit in the body.

vLLM 0.32 turns a Responses request into chat messages (``entrypoints/openai/responses/utils.py``,
``construct_input_messages``) and parses their content with the chat-completions parser: a user (or
system, developer) message item keeps its content list, so its ``input_image`` parts (``{"type":
"input_image", "image_url": "<url>"}``) are images found exactly as in chat completions, a ``uuid``
included (the request's items keep extra keys); a ``function_call_output`` item becomes a tool message
whose content is its ``output``, images included; an assistant item keeps only its first text, unless
its first part has none: then vLLM passes it on whole, images included. The request takes
``mm_processor_kwargs``, ``media_io_kwargs``, ``priority`` and ``ec_transfer_params`` like chat
completions.

So parts are found and encoded as chat parts are, with the content uuid pinned, and the options are
forwarded. They are never rewritten to metadata-only references: a Responses input item accepts only
the OpenAI content part types, so the engine still decodes the image to place its tokens and takes the
embedding from ``ec_transfer_params`` under the hash the encoder reported.
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
    check_ec_params,
    parse_with,
    with_handles,
    with_parts,
)

# An encoder sees the parts and options exactly as in a chat request: with a uuid, vLLM reads an
# ``input_image`` part by its ``image_url`` key, as the engine will.
from .openai_chat import find_parts, may_hold_media

__all__ = ["SURFACE", "may_hold_media", "parse"]

_INPUT = "input"
_OUTPUT = "output"
_TOOL_OUTPUTS = frozenset({"function_call_output", "custom_tool_call_output"})
# A Responses request that continues a stored conversation: its history lives on this server only.
_HISTORY_FIELDS = ("previous_response_id", "conversation")


def parse(body: Bytes) -> ParsedRequest | None:
    """The image parts of a Responses body, or None when the body should pass through as it is."""
    return parse_with(body, _find_media)


def _parts_key(item: Mapping[str, Any]) -> str | None:
    """Where vLLM takes an input item's content parts from, or None when it takes no media from it."""
    if item.get(p.TYPE) in _TOOL_OUTPUTS:
        return _OUTPUT
    role = item.get("role")
    if role is None:
        return None  # output items, reasoning, calls
    if role == "assistant":
        # vLLM keeps the first text of an assistant item's content list, but passes the item on whole,
        # media included, when that first part has no "text" (``_construct_message_from_response_item``).
        content = item.get(p.CONTENT)
        if not isinstance(content, list) or not content:
            return None
        first = content[0]
        if not isinstance(first, dict):
            raise Unusable  # vLLM reads it with .get(): not a shape to guess at
        return None if first.get("text") is not None else p.CONTENT
    return p.CONTENT


def _find_media(fields: dict[str, Any]) -> ParsedRequest:
    items = fields.get(_INPUT)
    check_ec_params(fields)
    if not isinstance(items, list):
        return ParsedRequest(fields, ())  # a plain text input
    media: list[MediaPart] = []
    referenced: set[str] = set()
    references: list[Reference] = []
    for item_index, item in enumerate(items):
        if not isinstance(item, dict):
            raise Unusable
        key = _parts_key(item)
        parts = item.get(key) if key else None
        if isinstance(parts, list):
            find_parts((item_index,), parts, media, referenced, references)
    return ParsedRequest(fields, tuple(media), frozenset(referenced), tuple(references))


def engine_fields(
    request: ParsedRequest,
    uuids: Sequence[str],
    metadata: Sequence[Mapping[str, Any] | None],
    ec_transfer_params: Mapping[str, Any],
) -> dict[str, Any]:
    """The client's body with every media part's uuid pinned and the handles merged in."""
    fields = dict(request.fields)
    fields[_INPUT] = with_parts(
        fields[_INPUT],
        _found_parts_key,
        (
            (media.location, {**media.part, p.UUID: uuid})
            for media, uuid in zip(request.media, uuids, strict=True)
        ),
    )
    return with_handles(fields, ec_transfer_params)


def _found_parts_key(item: Mapping[str, Any]) -> str:
    key = _parts_key(item)
    assert key is not None  # a media part was found under it
    return key


def where(location: tuple[int, ...]) -> str:
    item, part = location
    return f"input[{item}] part {part}"


def prefill_limits(fields: Mapping[str, Any]) -> dict[str, Any]:
    """One output token, no stream, and neither stored nor run in the background on P."""
    return {"max_output_tokens": 1, p.STREAM: False, "store": False, "background": False}


def prefill_blocker(fields: Mapping[str, Any]) -> str | None:
    """Why this request cannot be prefilled elsewhere: a stored conversation it continues is only here."""
    for name in _HISTORY_FIELDS:
        if fields.get(name):
            return f"{name} refers to history stored on this server"
    return None


def aborted(answer: Mapping[str, Any]) -> bool:
    """vLLM's Responses answer to an aborted request (``responses/serving.py``): ``"cancelled"`` where
    it has output, ``"incomplete"`` with none."""
    status = answer.get("status")
    return answer.get("object") == "response" and (
        status == "cancelled" or (status == "incomplete" and not answer.get("output"))
    )


SURFACE = Surface(
    path=p.RESPONSES_PATH,
    field=_INPUT,
    pins_uuids=True,
    # An input item takes only the OpenAI content part types: no metadata-only references.
    rewrites=False,
    may_hold_media=may_hold_media,
    parse=parse,
    engine_fields=engine_fields,
    prefill_limits=prefill_limits,
    where=where,
    prefill_blocker=prefill_blocker,
    aborted=aborted,
)
