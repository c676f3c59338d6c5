"""Request surfaces: where media sits in a request body and how the body is written back for the engine.

Each surface (OpenAI chat completions and its batch form, Anthropic Messages, OpenAI Responses) is one
adapter module that holds all its protocol knowledge and describes itself as one :class:`Surface`; the
pipeline drives any of them through it and never looks inside a body itself.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from epd_middleware import _protocol as p
from epd_middleware import _rawjson
from epd_middleware._http import Body
from epd_middleware._rawjson import Bytes, Raw, text_of
from epd_middleware.errors import EPDError, UnreadableRequest

__all__ = [
    "Body",
    "MediaPart",
    "ParsedRequest",
    "Raw",
    "Reference",
    "Surface",
    "Unusable",
    "check_ec_params",
    "checked_messages",
    "controlled_content",
    "decode_object",
    "encode_fields",
    "encoder_request",
    "forwarded_options",
    "no_prefill_blocker",
    "outgoing_body",
    "parse_with",
    "with_handles",
    "with_parts",
]

_encode = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class MediaPart:
    """One content part (or block) that carries media, where it sits, and the text that identifies it.

    ``part`` is the part as an encoder receives it (a chat-completions content part); ``location`` is
    the surface's own address of the part in the body.
    """

    location: tuple[int, ...]
    modality: str
    part: Mapping[str, Any]
    # The media as the client sent it (URL text, or input_audio data and format): what the content uuid
    # hashes. Never base64-decoded: hashing the text is cheaper and identifies the media as well. Long
    # strings stay the raw JSON bytes they arrived as (``_rawjson``), never decoded at all.
    content: tuple[str | Raw, ...]
    client_uuid: str | None

    @property
    def url(self) -> str | Raw | None:
        """The URL vLLM would load the media from (``content`` is ``(url,)``); None for input_audio,
        whose content is ``(data, format)``."""
        return self.content[0] if len(self.content) == 1 else None


@dataclass(frozen=True, slots=True)
class Reference:
    """An embeds part the client wrote itself. Metadata-only (``{"type": "image_embeds", "image_embeds":
    {"image_grid_thw": [...]}, "uuid": ...}``): the engine takes its embedding from the EC connector, under
    the identifier it derives from the uuid, with nothing to fall back on if it is not there. Or carrying
    its tensor (``tensor``): the engine takes it as it is."""

    location: tuple[int, ...]
    kind: str  # image_embeds, audio_embeds, video_embeds
    modality: str
    uuid: str | None
    tensor: bool = False


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    fields: dict[str, Any]
    media: tuple[MediaPart, ...]
    # Modalities with a part that references earlier media by uuid alone: vLLM counts it as raw media,
    # so the other parts of that modality must stay raw too (no mixing of raw and embeds).
    referenced_modalities: frozenset[str] = frozenset()
    # Embeds parts the client wrote itself: refused, or checked before anything else is done.
    references: tuple[Reference, ...] = ()
    # Read by Python's json, as vLLM reads bodies, after the fast decoder refused the body (a BOM,
    # UTF-16, NaN, a lone surrogate ...): every body made from it is written by Python's json too, which
    # writes those values back as vLLM will read them.
    compat: bool = False

    @property
    def cache_salt(self) -> str | None:
        salt = text_of(self.fields.get(p.CACHE_SALT))
        return salt if isinstance(salt, str) else None


class Unusable(Exception):
    """The body's shape is off where the middleware must look: hand it to vLLM unchanged."""


EngineFields = Callable[
    [ParsedRequest, Sequence[str], Sequence[Mapping[str, Any] | None], Mapping[str, Any]], dict[str, Any]
]


def openai_error_body(error: EPDError) -> bytes:
    """An error in OpenAI's shape, as vLLM answers on its OpenAI routes."""
    return error.body()


def choices_aborted(answer: Mapping[str, Any]) -> bool:
    """Whether a chat answer is vLLM's abort of a request it never ran: every choice finished as
    ``"abort"`` with no text, as the engine answers a request added while it shuts down."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("finish_reason") != "abort":
            return False
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else choice.get("text")
        if text:
            return False
    return True


def no_prefill_blocker(fields: Mapping[str, Any]) -> str | None:
    """For surfaces whose requests carry all they need: any prefill server can take them."""
    return None


@dataclass(frozen=True, slots=True)
class Surface:
    """One request surface as the pipeline drives it: a description, one per surface module
    (``SURFACE``), whose functions hold that surface's protocol knowledge."""

    # The path vLLM serves this surface on: where a prefill request of it goes.
    path: str
    # The body field that holds the parts (``messages``, ``input``): what errors name.
    field: str
    # True when the engine's parts carry the uuid the encoder was sent, so the encoder is sent the uuid
    # and the per-request options the engine applies; False when the engine hashes the media itself, so
    # the encoder must be sent neither (Messages).
    pins_uuids: bool
    # True when encoded parts may become metadata-only references (the surface has such parts).
    rewrites: bool
    # False only when the body surely holds no media: decides the no-parse pass-through.
    may_hold_media: Callable[[Bytes], bool]
    # The media parts of a body, or None when the body should pass through as it is.
    parse: Callable[[Bytes], ParsedRequest | None]
    # The body for the local engine (and a prefill server), as fields: ``(request, uuid per part,
    # metadata per part, ec_transfer_params)``.
    engine_fields: EngineFields
    # The fields that make a prefill request of this surface stop after one token and answer at once
    # (``max_tokens: 1``, ``stream: false`` ...), given the engine request's fields.
    prefill_limits: Callable[[Mapping[str, Any]], dict[str, Any]]
    # A part's location as the client would write it (``messages[0].content[2]``).
    where: Callable[[tuple[int, ...]], str]
    # Why a request cannot be prefilled on another server (it refers to state kept here), or None.
    prefill_blocker: Callable[[Mapping[str, Any]], str | None] = no_prefill_blocker
    # Whether vLLM takes this surface's priority from the X-Vllm-Priority header (not on the batch
    # route: it reads the body's alone).
    reads_priority_header: bool = True
    # Whether vLLM reads ``priority``, ``session_id`` and ``vllm_xargs`` from this surface's body
    # (not from a Messages body: it builds a chat request without them).
    reads_scheduling_fields: bool = True
    # The body of the middleware's own error answers, in the surface's language.
    error_body: Callable[[EPDError], bytes] = openai_error_body
    # Whether an answer of the engine (its JSON object) is an abort of a request the engine never ran.
    aborted: Callable[[Mapping[str, Any]], bool] = choices_aborted

    def encoder_body(
        self,
        request: ParsedRequest,
        parts: Sequence[Mapping[str, Any]],
        ec_transfer_params: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Body:
        """A chat-completions request that makes an encoder-only vLLM instance encode ``parts``, with
        the per-request options the local engine will apply where it pins uuids (none otherwise), and
        ``extra`` fields over them (a session id that cannot travel as a header)."""
        options = forwarded_options(request) if self.pins_uuids else {}
        if extra:
            options = {**options, **extra}
        return encoder_request(
            request.fields.get(p.MODEL), parts, options, ec_transfer_params, compat=request.compat
        )


def forwarded_options(request: ParsedRequest) -> dict[str, Any]:
    """The per-request options the encoder must see exactly as the local engine does."""
    return {name: request.fields[name] for name in p.FORWARDED_OPTIONS if name in request.fields}


def encode_fields(fields: Any, *, compat: bool = False) -> bytes:
    """Serialise a body (``compat``: as Python's json writes it, see :attr:`ParsedRequest.compat`);
    :class:`Unusable` when it cannot be written again (too deep at this stack)."""
    try:
        if compat:
            # ASCII with escapes: a lone surrogate travels as "\\ud800", which json.loads reads back.
            return json.dumps(fields, ensure_ascii=True, allow_nan=True, separators=(",", ":")).encode()
        return _encode(fields)
    except (RecursionError, msgspec.EncodeError, OverflowError, TypeError, ValueError) as exc:
        raise Unusable from exc


def decode_object(body: Bytes) -> tuple[dict[str, Any], bool] | None:
    """The body as a JSON object, and whether Python's json had to read it (``compat``); None when vLLM
    cannot read it as one either (it answers its own 400).

    vLLM reads a body with ``json.loads`` (FastAPI, through Starlette's ``Request.json()``), which takes
    what msgspec refuses: a UTF-8 BOM, UTF-16 and UTF-32, ``NaN``, ``Infinity``, numbers out of a
    double's range, lone surrogates. Such a body is read again as vLLM reads it, never passed on unread:
    the engine would read media, references and transfer parameters the middleware never saw.
    """
    try:
        fields = _rawjson.decode(body)
        compat = False
    except (msgspec.DecodeError, RecursionError):
        try:
            fields = json.loads(body)
        except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            return None
        compat = True
    return (fields, compat) if isinstance(fields, dict) else None


def parse_with(body: Bytes, find: Callable[[dict[str, Any]], ParsedRequest | None]) -> ParsedRequest | None:
    """``find`` the media of a JSON object body; None when the body is not one (vLLM answers it), or
    ``find`` says it is not this surface's request at all.

    A body whose shape is off where ``find`` looks (it raises :class:`Unusable`) goes to vLLM as sent
    only when nothing in it is the middleware's to handle; otherwise :class:`UnreadableRequest`: vLLM
    might read media or an embedding reference there that the middleware did not.
    """
    decoded = decode_object(body)
    if decoded is None:
        return None
    fields, compat = decoded
    try:
        request = find(fields)
    except Unusable:
        found = controlled_content(fields)
        if found is not None:
            raise UnreadableRequest(found) from None
        return None
    if request is None:
        return None
    return dataclasses.replace(request, compat=True) if compat else request


# Keys and part types under which vLLM (chat, Messages, Responses) takes media or embedding references.
_CONTROLLED_KEYS = frozenset(
    {*p.MEDIA_PARTS, *(holder for _, holder, _ in p.MEDIA_PARTS.values()), *p.PART_KEY_ORDER}
)
_CONTROLLED_TYPES = frozenset({*_CONTROLLED_KEYS, "image", "input_image"})


def controlled_content(fields: Mapping[str, Any]) -> str | None:
    """What of the middleware's business a body holds (media or an embedding reference anywhere), named
    for the client; None when it holds none. A walk of the whole value, for bodies the surface could not
    read: it is not fooled by escapes or by where the content sits. (Transfer parameters such a body
    sets are the pipeline's to refuse, as in any body it passes on.)"""
    stack: list[Any] = [fields]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in _CONTROLLED_KEYS:
                    return f"a {key!r} part"
                if key == p.TYPE and isinstance(value, str) and value in _CONTROLLED_TYPES:
                    return f"a {value!r} part"
                if isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(item for item in node if isinstance(item, (dict, list)))
    return None


def checked_messages(fields: Mapping[str, Any]) -> list[Any]:
    """The body's ``messages`` list; :class:`Unusable` when it, or ``ec_transfer_params``, is not of the
    type vLLM takes."""
    messages = fields.get(p.MESSAGES)
    if not isinstance(messages, list):
        raise Unusable
    check_ec_params(fields)
    return messages


def check_ec_params(fields: Mapping[str, Any]) -> None:
    """:class:`Unusable` when the client's ``ec_transfer_params`` is not an object: the handles are
    merged into it."""
    ec_params = fields.get(p.EC_TRANSFER_PARAMS)
    if ec_params is not None and not isinstance(ec_params, dict):
        raise Unusable


def encoder_request(
    model: Any,
    parts: Sequence[Mapping[str, Any]],
    options: Mapping[str, Any],
    ec_transfer_params: Mapping[str, Any] | None,
    *,
    compat: bool = False,
) -> Body:
    """A chat-completions request that makes an encoder-only vLLM instance encode ``parts``."""
    body: dict[str, Any] = {
        p.MODEL: model,
        p.MESSAGES: [{"role": "user", p.CONTENT: list(parts)}],
        p.STREAM: False,
        # Harmless on an encoder-only instance, and keeps a full instance used as encoder from decoding.
        p.MAX_TOKENS: 1,
        **options,
    }
    if ec_transfer_params:
        body[p.EC_TRANSFER_PARAMS] = dict(ec_transfer_params)
    return outgoing_body(body, compat=compat)


def outgoing_body(fields: Any, *, compat: bool = False) -> Body:
    """A body to send to another server: the media strings it holds go from the client's body as they
    are, not copied into a new buffer (:func:`_rawjson.encode_pieces`). :class:`Unusable` as
    :func:`encode_fields`."""
    if compat:
        return encode_fields(fields, compat=True)  # read by Python's json: no raw strings in it
    return _rawjson.encode_pieces(fields, encode_fields)


def with_parts(
    containers: Sequence[Any],
    key_of: Callable[[Mapping[str, Any]], str],
    parts: Iterable[tuple[tuple[int, ...], Mapping[str, Any]]],
) -> list[Any]:
    """``containers`` (messages, input items) with ``parts`` put in place: each ``((container index,
    part index), part)`` replaces that part of the list under ``key_of(container)``. Only the containers
    and lists it changes are copied; the client's body is never mutated."""
    out = list(containers)
    copied: set[int] = set()
    for location, part in parts:
        container_index, part_index = location
        key = key_of(out[container_index])
        if container_index not in copied:
            container = dict(out[container_index])
            container[key] = list(container[key])
            out[container_index] = container
            copied.add(container_index)
        out[container_index][key][part_index] = part
    return out


def with_handles(fields: dict[str, Any], ec_transfer_params: Mapping[str, Any]) -> dict[str, Any]:
    """``fields`` with the middleware's handles as the engine's ``ec_transfer_params`` (in place), and
    nothing of the client's own: connectors read them to steer transfers (Mooncake pushes to their
    ``consumer_zmq`` and claims by their ``ec_items``, ECCPUConnector takes an entry per hash), and no
    connector needs a client's to load an embedding the middleware confirmed."""
    if ec_transfer_params:
        fields[p.EC_TRANSFER_PARAMS] = dict(ec_transfer_params)
    else:
        fields.pop(p.EC_TRANSFER_PARAMS, None)
    return fields
