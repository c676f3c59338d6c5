"""What the middleware knows of vLLM's wire protocol (vLLM 0.32 and 0.33), in one place: names and
shapes on the wire and in the EC connector's storage. What a vLLM server says about itself (its
configuration) is read in :mod:`.host`.

Sources in vLLM: ``renderers/chat_utils.py`` (a package, ``renderers/chat_utils/``, in 0.33: content
parts, the uuid rule, the raw/embeds mixing rule),
``entrypoints/openai/chat_completion/protocol.py`` (request fields),
``distributed/ec_transfer/ec_connector/utils.py`` (the ``ec_transfer_params`` entries an encoder reports),
``multimodal/processing/inputs.py`` (a uuid plus per-request options gives a new, derived hash),
``distributed/kv_transfer/kv_connector/v1/`` (the P/D ``kv_transfer_params``),
``distributed/ec_transfer/ec_connector/mooncake/`` (Mooncake push: ``consumer_zmq``, ``ec_items``).
Where media sits in each request surface (chat completions, Anthropic Messages) is the business of that
surface's adapter in :mod:`epd_middleware._surfaces`.
"""

from __future__ import annotations

import os
import stat
import time
from typing import Any, Final

# Content part type -> (modality, key that holds the media, key of the media inside that holder). The
# media sits in an object under the part's type (``{"type": "image_url", "image_url": {"url": ...}}``);
# ``input_audio`` holds ``{"data": <base64>, "format": "wav"}`` rather than a URL; the Responses-style
# ``input_image`` part, which vLLM also takes in chat completions (``MM_PARSER_MAP``), holds the URL as a
# bare string under ``image_url`` (inner key None).
MEDIA_PARTS: Final[dict[str, tuple[str, str, str | None]]] = {
    "image_url": ("image", "image_url", "url"),
    "audio_url": ("audio", "audio_url", "url"),
    "video_url": ("video", "video_url", "url"),
    "input_audio": ("audio", "input_audio", "data"),
    "input_image": ("image", "image_url", None),
}

# vLLM finds the kind of a part that has no ``type``, or has a ``uuid``, by the first of these keys it
# holds (``_parse_chat_message_content_mm_part``); embeds keys come before the raw audio/video ones.
PART_KEY_ORDER: Final[tuple[str, ...]] = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
)

# Part kinds vLLM counts as raw media of a modality whose media never travels in JSON (a PIL image: the
# offline API's): in a request body such a part refers to earlier media by its uuid alone.
UUID_ONLY_PARTS: Final[dict[str, str]] = {"image_pil": "image"}

# Modalities sent one item per encoder request; images are batched.
UNBATCHED_MODALITIES: Final[frozenset[str]] = frozenset({"audio", "video"})


# Metadata-only part types -> modality: their embedding comes from the EC connector.
EMBEDS_PARTS: Final[dict[str, str]] = {
    "image_embeds": "image",
    "audio_embeds": "audio",
    "video_embeds": "video",
}


def embeds_type(modality: str) -> str:
    """The part type of a metadata-only reference for ``modality`` (``image_embeds`` ...)."""
    return f"{modality}_embeds"


# Per-request fields the encoder must see exactly as PD sees them: the options change the processed
# media and the hash vLLM derives from the uuid; priority and session_id steer scheduling.
FORWARDED_OPTIONS: Final[tuple[str, ...]] = (
    "mm_processor_kwargs",
    "media_io_kwargs",
    "priority",
    "session_id",
)

# Encoders are always driven through chat completions, whatever surface the client used.
CHAT_COMPLETIONS_PATH: Final = "/v1/chat/completions"
CHAT_BATCH_PATH: Final = "/v1/chat/completions/batch"
MESSAGES_PATH: Final = "/v1/messages"
RESPONSES_PATH: Final = "/v1/responses"

# vLLM's other routes that run the engine on media a request carries (0.32: pooling, scoring, Cohere's
# API, audio transcription, the structured decisions API's ``images``/``audio``/``videos``, the
# token-in generate route's ``content_parts``; ``entrypoints/pooling/``, ``entrypoints/cohere/``,
# ``entrypoints/speech_to_text/``, ``entrypoints/generate/structured_decisions/``,
# ``entrypoints/scale_out/token_in_token_out/``), and the surfaces' own when a deployment does not
# intercept them. On a server whose engine cannot encode media (a Mooncake consumer) media there is
# refused (:mod:`._raw_media`); where the running app's routes can be read, they are guarded instead,
# less NO_MEDIA_ROUTES.
MEDIA_ROUTES: Final[frozenset[str]] = frozenset(
    {
        "/v1/systemone",
        "/inference/v1/generate",
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/v2/embed",
        "/cohere/v2/chat",
        "/generative_scoring",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        CHAT_COMPLETIONS_PATH,
        CHAT_BATCH_PATH,
        MESSAGES_PATH,
        RESPONSES_PATH,
        "/invocations",
    }
)
# vLLM's websockets that stream media to the engine: realtime audio transcription
# (``entrypoints/speech_to_text/realtime/api_router.py``, ``input_audio_buffer.append`` events).
MEDIA_WEBSOCKETS: Final[frozenset[str]] = frozenset({"/v1/realtime"})
# vLLM 0.32's POST routes that hand the engine no media (a renderer may read it, the engine never waits
# for it): administration, profiling, weights, LoRA adapters, tokenising and rendering, text completions
# (``prompt_embeds`` are tensors, not media), counting tokens. Every other POST route of the running app
# is taken to run the engine on what it is sent.
NO_MEDIA_ROUTES: Final[frozenset[str]] = frozenset(
    {
        "/abort_requests",
        "/inference/v1/abort_requests",
        "/collective_rpc",
        "/fault_tolerance/apply",
        "/ping",
        "/pause",
        "/resume",
        "/sleep",
        "/wake_up",
        "/scale_elastic_ep",
        "/is_scaling_elastic_ep",
        "/reset_prefix_cache",
        "/reset_encoder_cache",
        "/reset_mm_cache",
        "/release_kv_cache_memory",
        "/start_profile",
        "/stop_profile",
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/start_weight_update",
        "/start_draft_weight_update",
        "/finish_weight_update",
        "/update_weights",
        "/update_weight_version",
        "/weight_checker",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/tokenize",
        "/detokenize",
        "/v1/completions",
        "/v1/completions/render",
        "/v1/completions/derender",
        "/v1/chat/completions/render",
        "/v1/chat/completions/derender",
        "/v1/messages/render",
        "/v1/messages/count_tokens",
        "/v1/responses/render",
        "/cohere/v2/chat/render",
    }
)
# Keys under which those routes take media (besides data URLs anywhere): content parts, their
# references, Cohere's list of images, the decisions API's lists, the generate route's raw parts.
MEDIA_KEYS: Final[frozenset[str]] = frozenset(
    {
        *MEDIA_PARTS,
        *EMBEDS_PARTS,
        "image_pil",
        "images",
        "audio_url",
        "video_url",
        "audio",
        "videos",
        "content_parts",
    }
)

# vLLM's server load (``entrypoints/serve/instrumentator/basic.py``, ``--enable-server-load-tracking``):
# GET /load answers {"server_load": <requests in progress>}.
LOAD_PATH: Final = "/load"
SERVER_LOAD: Final = "server_load"

MODEL: Final = "model"
MM_PROCESSOR_KWARGS: Final = "mm_processor_kwargs"
MESSAGES: Final = "messages"
CONTENT: Final = "content"
TYPE: Final = "type"
UUID: Final = "uuid"
CACHE_SALT: Final = "cache_salt"
EC_TRANSFER_PARAMS: Final = "ec_transfer_params"
# Extra engine arguments; vLLM copies them under the request's own fields (``to_sampling_params``).
VLLM_XARGS: Final = "vllm_xargs"

# Inside one ec_transfer_params entry reported by an encoder.
ITEM_INDICES: Final = "item_indices"
METADATA: Final = "metadata"
# vLLM 0.33: the item's modality ("image", "video", "audio"; ``ec_connector/utils.py``); absent in 0.32.
ENTRY_MODALITY: Final = "modality"

# Remote prefill (P/D disaggregation). The prefill request asks P to keep the KV cache for a remote
# decoder and to stop after one token (vLLM's P/D proxies: tests/v1/kv_connector/nixl_integration/
# toy_proxy_server.py); P's answer carries the kv_transfer_params the decoder needs.
KV_TRANSFER_PARAMS: Final = "kv_transfer_params"
PREFILL_KV_TRANSFER_PARAMS: Final[dict[str, Any]] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
MAX_TOKENS: Final = "max_tokens"
MAX_COMPLETION_TOKENS: Final = "max_completion_tokens"
STREAM: Final = "stream"
STREAM_OPTIONS: Final = "stream_options"
# vLLM rejects min_tokens above max_tokens, and the prefill request has max_tokens 1.
MIN_TOKENS: Final = "min_tokens"

# Mooncake push (ECMooncakeConnector): the encoder request names the consumer to push to and one
# transfer id per item; the consumer's request names, per item, the reported hash and that transfer id.
EC_CONSUMER_ZMQ: Final = "consumer_zmq"
EC_ITEMS: Final = "ec_items"
EC_ITEM_TRANSFER_ID: Final = "transfer_id"
EC_ITEM_MM_HASH: Final = "mm_hash"
MOONCAKE_EC_CONNECTOR: Final = "ECMooncakeConnector"
EXAMPLE_EC_CONNECTOR: Final = "ECExampleConnector"

# vLLM sends a request to the data-parallel engine this header names (``_get_data_parallel_rank``).
DATA_PARALLEL_RANK_HEADER: Final = b"x-data-parallel-rank"

# vLLM takes the request id from this header (``_base_request_id``); E and PD logs join on it.
REQUEST_ID_HEADER: Final = b"x-request-id"
# vLLM reads a request's priority from this header before the body's ``priority`` (chat, completions,
# Responses; not the batch route), and its session id from the body's ``session_id``, then this header,
# then ``vllm_xargs.session_id`` (``entrypoints/generate/base/serving.py``: ``PRIORITY_HEADER``,
# ``SESSION_ID_HEADER``, ``_get_priority``, ``_get_session_id``; 0.32 and 0.33 alike).
PRIORITY_HEADER: Final = b"x-vllm-priority"
SESSION_ID_HEADER: Final = b"x-session-id"
SESSION_ID: Final = "session_id"

# vLLM answers a chat completion with "id": "chatcmpl-<x-request-id>" (``entrypoints/openai/
# chat_completion/serving.py``), and an Anthropic Messages request, which it serves as a chat completion,
# with the same id (``entrypoints/anthropic/serving.py`` ``messages_full_converter``). A Responses answer
# carries the body's ``request_id`` ("resp_<random>" by default), not the header: it cannot be bound.
_ANSWER_ID_PREFIXES: Final[dict[str, str]] = {CHAT_COMPLETIONS_PATH: "chatcmpl-", MESSAGES_PATH: "chatcmpl-"}


def foreign_answer_id(path: str, request_id: str, reply: dict[str, Any]) -> str | None:
    """The ``id`` of an answer that vLLM gave to another request than ``request_id``, else None.

    An answer without an id of vLLM's form (another server) is not judged by it.
    """
    prefix = _ANSWER_ID_PREFIXES.get(path)
    answer_id = reply.get("id")
    if prefix is None or not isinstance(answer_id, str) or not answer_id.startswith(prefix):
        return None
    return None if answer_id[len(prefix) :] == request_id else answer_id


# vLLM refuses a cache_salt that is not a non-empty string of at most 128 characters without these
# (``entrypoints/generate/base/protocol.py`` ``validate_cache_salt``, run by the chat and Responses
# request models; batch and Messages requests become chat requests that run it too).
CACHE_SALT_MAX_LENGTH: Final = 128
_CACHE_SALT_FORBIDDEN: Final = frozenset("@/\\\0")


def cache_salt_refusal(salt: object) -> str | None:
    """vLLM's message refusing ``salt`` as a request's ``cache_salt``; None where vLLM takes it (None is
    the field absent)."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        return "Parameter 'cache_salt' must be a non-empty string if provided."
    if len(salt) > CACHE_SALT_MAX_LENGTH or not _CACHE_SALT_FORBIDDEN.isdisjoint(salt):
        return (
            f"Parameter 'cache_salt' must be at most {CACHE_SALT_MAX_LENGTH} characters and must "
            "not contain '@', '/', '\\\\', or NUL."
        )
    return None


# ECExampleConnector stores one embedding per hash at <shared_storage_path>/<mm_hash>/<this file>
# (``distributed/ec_transfer/ec_connector/example_connector.py``: ``os.path.join`` of the hash as given).
EXAMPLE_CONNECTOR_FILE: Final = "encoder_cache.safetensors"
# An embedding whose file was written or touched this recently is "used now" without another touch
# (:func:`embedding_used`): far under the cleanup's age, counted in minutes (EC_MAX_AGE_MINUTES, 60).
FRESH_SECONDS: Final = 10.0
# The longest name of one directory entry, in bytes (Linux's NAME_MAX).
_NAME_MAX = 255


def plain_file_name(name: str) -> bool:
    """Whether ``name`` names one entry of a directory and nothing else: not empty, not ``.`` or ``..``,
    no ``/``, ``\\`` or NUL, at most 255 bytes of UTF-8. A hash that is not one would make a connector
    that stores by hash write or read elsewhere (``../x``), or nest a directory where a file belongs
    (``x/encoder_cache.safetensors``)."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        return False
    try:
        return len(name.encode()) <= _NAME_MAX
    except UnicodeEncodeError:  # a lone surrogate (a body read by Python's json) names no file
        return False


def example_connector_file(storage: str, mm_hash: str) -> str | None:
    """Where ECExampleConnector keeps the embedding of ``mm_hash`` under ``storage``; None when the hash
    is not a plain file name (it would point elsewhere)."""
    if not plain_file_name(mm_hash):
        return None
    return os.path.join(storage, mm_hash, EXAMPLE_CONNECTOR_FILE)


def embedding_stored(storage: str, mm_hash: str) -> bool:
    """The embedding of ``mm_hash`` is where the local ECExampleConnector will load it from: a file (a
    directory of that name is not one), by a ``stat`` on the connector's (local or shared) file system."""
    path = example_connector_file(storage, mm_hash)
    return path is not None and os.path.isfile(path)


def embedding_used(storage: str, mm_hash: str) -> bool:
    """:func:`embedding_stored`, just before the engine gets a reference to it, and its modification
    time set to now: an age-based cleanup of the storage (deploy/kubernetes's CronJob) then counts from
    its last use, not from when an encoder first wrote it (an encoder that finds it there writes nothing).

    A file written or touched within the last :data:`FRESH_SECONDS` is left as it is: its time already
    says "used now" to a cleanup that counts in minutes, and on a shared file system the write is a round
    trip to the server (NFS's SETATTR) on the event loop, for each item of every request. A time in the
    future (another clock) is not trusted as fresh.
    """
    path = example_connector_file(storage, mm_hash)
    if path is None:
        return False
    try:
        found = os.stat(path)
    except OSError:
        return False
    if not stat.S_ISREG(found.st_mode):  # a directory of that name is not an embedding
        return False
    age = time.time() - found.st_mtime
    if 0 <= age < FRESH_SECONDS:
        return True
    try:
        os.utime(path)
    except OSError:  # gone since the stat, or a storage that takes no metadata writes: as stat said
        return os.path.isfile(path)
    return True
