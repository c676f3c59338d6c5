"""The Anthropic Messages surface (``POST /v1/messages``): where images sit in the body.

vLLM 0.32 turns a Messages request into a chat-completions one (``entrypoints/anthropic/serving.py``,
``to_chat_completion_request``): an ``image`` block becomes an ``image_url`` part whose URL is the
block's ``source`` URL, or the data URL ``data:<media_type>;base64,<data>`` it builds from a base64
source; images in the content list of a user's ``tool_result`` block become ``image_url`` parts of a
user message of their own; system messages keep only their text. No part gets a uuid, and a Messages
request carries no per-request processor options, so the engine hashes each image's decoded content.

So the encoders are sent the same URL vLLM builds, with no uuid and no options, and report the same
content hash the engine derives (provided the encoder keeps its processor cache on, vLLM's default:
with ``mm_processor_cache_gb=0`` vLLM gives uuid-less items per-request ids and nothing matches). The
blocks themselves are never rewritten: Messages has no metadata-only image block, so the engine still
decodes the image to place its tokens, and takes the embedding from ``ec_transfer_params``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from epd_middleware import _protocol as p
from epd_middleware._rawjson import Bytes, raw_text, text_of
from epd_middleware.errors import EPDError, error_json

from . import MediaPart, ParsedRequest, Raw, Surface, Unusable, checked_messages, parse_with, with_handles

__all__ = ["SURFACE", "image_url", "may_hold_media", "parse"]

_encode = msgspec.json.Encoder().encode
_IMAGE = "image"
_TOOL_RESULT = "tool_result"
_SOURCE = "source"


def may_hold_media(body: Bytes) -> bool:
    """False only when the body surely holds no ``"image"`` string (the type of an image block) and no
    ``vllm_xargs``; a body with a ``\\u`` escape is parsed (it could spell either)."""
    return b'"image"' in body or b"_xargs" in body or b"\\u" in body


def image_url(source: Mapping[str, Any]) -> str | Raw:
    """The URL vLLM makes of an image block's source (``_convert_image_source_to_url``), to the byte.

    A long base64 payload arrives raw (``_rawjson``); the URL is then built as raw JSON too, without
    decoding it: the prefix, then the payload's bytes (its text, having no escapes).
    """
    if source.get(p.TYPE) == "url":
        url = source.get("url", "")
        return url if isinstance(url, Raw) else str(url)
    media_type = text_of(source.get("media_type", "image/jpeg"))
    data = source.get("data", "")
    if isinstance(data, Raw):
        prefix = _encode(f"data:{media_type};base64,")[:-1]  # opening quote, no closing one
        return Raw(b"".join((prefix, raw_text(data), b'"')))
    return f"data:{media_type};base64,{data}"


def parse(body: Bytes) -> ParsedRequest | None:
    """The image blocks of a Messages body, or None when the body should pass through as it is."""
    return parse_with(body, _find_images)


def _find_images(fields: dict[str, Any]) -> ParsedRequest:
    messages = checked_messages(fields)
    media: list[MediaPart] = []
    for message_index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise Unusable
        role = message.get("role")
        content = message.get(p.CONTENT)
        if role == "system" or not isinstance(content, list):
            continue  # vLLM keeps only the text of system messages
        for block_index, block in enumerate(content):
            if not isinstance(block, dict):
                raise Unusable
            kind = block.get(p.TYPE)
            if kind == _IMAGE:
                source = block.get(_SOURCE)
                if source:  # vLLM skips an image block without a source
                    media.append(_image((message_index, block_index), source))
            elif kind == _TOOL_RESULT and role == "user":
                inner = block.get(p.CONTENT)
                if not isinstance(inner, list):
                    continue
                for item_index, item in enumerate(inner):
                    if isinstance(item, dict) and item.get(p.TYPE) == _IMAGE:
                        found = _image((message_index, block_index, item_index), item.get(_SOURCE, {}))
                        if len(found.content[0]):  # vLLM drops a tool-result image whose URL is empty
                            media.append(found)
    return ParsedRequest(fields, tuple(media))


def _image(location: tuple[int, ...], source: Any) -> MediaPart:
    if not isinstance(source, dict):
        raise Unusable
    url = image_url(source)
    return MediaPart(location, "image", {p.TYPE: "image_url", "image_url": {"url": url}}, (url,), None)


def engine_fields(
    request: ParsedRequest,
    uuids: Sequence[str],
    metadata: Sequence[Mapping[str, Any] | None],
    ec_transfer_params: Mapping[str, Any],
) -> dict[str, Any]:
    """The client's body with the handles merged over its own ``ec_transfer_params``; blocks unchanged."""
    return with_handles(dict(request.fields), ec_transfer_params)


def where(location: tuple[int, ...]) -> str:
    """``messages[m].content[b]``, and ``.content[i]`` inside a tool result."""
    message, block, *inner = location
    return f"messages[{message}].content[{block}]" + "".join(f".content[{index}]" for index in inner)


def prefill_limits(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Messages has one token limit, ``max_tokens`` (vLLM skips its thinking-budget check on a leg with
    ``do_remote_decode``)."""
    return {p.MAX_TOKENS: 1, p.STREAM: False}


# Anthropic's error vocabulary by status, as vLLM 0.33 answers on /v1/messages
# (``entrypoints/anthropic/protocol.py`` ``translate_error_type``); 0.32 used the same envelope with its
# OpenAI type names inside.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def error_body(error: EPDError) -> bytes:
    """``{"type": "error", "error": {"type": ..., "message": ...}}``: what Anthropic's SDKs read."""
    detail = {"type": error_type(error.status), "message": error.message}
    return error_json({"type": "error", "error": detail})


def aborted(answer: Mapping[str, Any]) -> bool:
    """vLLM's Messages answer to an aborted request: no content and no ``stop_reason`` (its
    ``_to_anthropic_stop_reason`` maps ``"abort"`` to None)."""
    return answer.get("type") == "message" and answer.get("stop_reason") is None and not answer.get("content")


SURFACE = Surface(
    path=p.MESSAGES_PATH,
    field=p.MESSAGES,
    # No uuid and no options for the encoder: the engine hashes each image's content itself.
    pins_uuids=False,
    reads_scheduling_fields=False,
    error_body=error_body,
    aborted=aborted,
    # Messages has no metadata-only image block.
    rewrites=False,
    may_hold_media=may_hold_media,
    parse=parse,
    engine_fields=engine_fields,
    prefill_limits=prefill_limits,
    where=where,
)
