"""What the middleware knows of vLLM's wire protocol (vLLM 0.32), in one place.

Sources in vLLM: ``renderers/chat_utils.py`` (content parts, the uuid rule, the raw/embeds mixing rule),
``entrypoints/openai/chat_completion/protocol.py`` (request fields),
``distributed/ec_transfer/ec_connector/utils.py`` (the ``ec_transfer_params`` entries an encoder reports),
``multimodal/processing/inputs.py`` (a uuid plus per-request options gives a new, derived hash),
``distributed/kv_transfer/kv_connector/v1/`` (the P/D ``kv_transfer_params``),
``distributed/ec_transfer/ec_connector/mooncake/`` (Mooncake push: ``consumer_zmq``, ``ec_items``).
Where media sits in each request surface (chat completions, Anthropic Messages) is the business of that
surface's adapter in :mod:`epd_middleware.surfaces`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
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

MODEL: Final = "model"
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

# vLLM sends a request to the data-parallel engine this header names (``_get_data_parallel_rank``).
DATA_PARALLEL_RANK_HEADER: Final = b"x-data-parallel-rank"

# vLLM takes the request id from this header (``_base_request_id``); E and PD logs join on it.
REQUEST_ID_HEADER: Final = b"x-request-id"

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


# ECExampleConnector stores one embedding per hash at <shared_storage_path>/<mm_hash>/<this file>.
EXAMPLE_CONNECTOR_FILE: Final = "encoder_cache.safetensors"


def example_connector_file(storage: str, mm_hash: str) -> str | None:
    """Where ECExampleConnector keeps the embedding of ``mm_hash`` under ``storage``; None when the hash
    is not a plain file name (it would point elsewhere)."""
    if not mm_hash or "/" in mm_hash or "\\" in mm_hash or mm_hash in (".", "..") or "\0" in mm_hash:
        return None
    return os.path.join(storage, mm_hash, EXAMPLE_CONNECTOR_FILE)


def embedding_stored(storage: str, mm_hash: str) -> bool:
    """The embedding of ``mm_hash`` is where the local ECExampleConnector will look: a ``stat`` on the
    connector's (local or shared) file system."""
    path = example_connector_file(storage, mm_hash)
    return path is not None and os.path.exists(path)


def example_connector_storage(vllm_config: object) -> str | None:
    """The directory where this server's ECExampleConnector looks for embeddings, if that is its connector.

    ``distributed/ec_transfer/ec_connector/example_connector.py``: ``<shared_storage_path>/<mm_hash>/
    encoder_cache.safetensors``, ``shared_storage_path`` defaulting to ``/tmp``.
    """
    ec = getattr(vllm_config, "ec_transfer_config", None)
    if ec is None or getattr(ec, "ec_connector", None) != "ECExampleConnector":
        return None
    extra = getattr(ec, "ec_connector_extra_config", None) or {}
    path = extra.get("shared_storage_path", "/tmp") if isinstance(extra, dict) else "/tmp"
    return str(path)


@dataclass(frozen=True, slots=True)
class MooncakeConsumers:
    """Where encoders push embeddings for this server: one ZMQ address per data-parallel rank it runs.

    ``pin``: the server chooses among several engines, so the request must be sent to the rank whose
    address the encoder was given (``X-data-parallel-rank``).
    """

    by_rank: dict[int, str]
    pin: bool


def mooncake_consumers(vllm_config: object) -> MooncakeConsumers | None:
    """The consumer addresses of this server's ECMooncakeConnector, if that is its connector.

    ``distributed/ec_transfer/ec_connector/mooncake/config.py`` (``MooncakeECConfig.from_vllm_config``):
    an engine's control socket listens on ``tcp://<ec_ip>:<ec_port + data_parallel_index *
    tensor_parallel_size>``, ``data_parallel_index`` being its data-parallel rank
    (``config/parallel.py``), and the producer pushes to the ``consumer_zmq`` of the encoder request
    (``mooncake/scheduler.py`` ``_prepare_push_spec``). The ranks this API server runs are
    ``data_parallel_rank`` .. ``+ data_parallel_size_local``: all of them on a single node, the node's
    own with hybrid or external load balancing.
    """
    ec = getattr(vllm_config, "ec_transfer_config", None)
    if ec is None or getattr(ec, "ec_connector", None) != MOONCAKE_EC_CONNECTOR:
        return None
    if getattr(ec, "ec_role", None) not in ("ec_consumer", "ec_both"):
        return None
    parallel = getattr(vllm_config, "parallel_config", None)
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    dp = int(getattr(parallel, "data_parallel_size", 1) or 1)
    first = int(getattr(parallel, "data_parallel_rank", 0) or 0)
    local = getattr(parallel, "data_parallel_size_local", None)
    count = int(local) if local else dp
    if getattr(parallel, "data_parallel_external_lb", False):
        count = 1
    host, port = str(ec.ec_ip), int(ec.ec_port)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal, as vLLM's make_zmq_path writes it
    by_rank = {rank: f"tcp://{host}:{port + rank * tp}" for rank in range(first, first + count)}
    return MooncakeConsumers(by_rank, pin=dp > 1 and count > 1)


def cli_api_keys(args: object) -> list[str]:
    """The keys given on vLLM's command line (``--api-key``, ``nargs="+"``: a list; a plain string from
    older versions and custom launchers is one key)."""
    keys = getattr(args, "api_key", None) or []
    if isinstance(keys, str):
        keys = [keys]
    return [key for key in keys if isinstance(key, str) and key]


def unguarded_routes(args: object) -> tuple[str, ...]:
    """Routes this vLLM server serves (by its command line) that take multimodal references or transfer
    parameters in a form the middleware does not read: ``--enable-scale-out`` and ``--tokens-only`` open
    ``/inference/v1/generate`` (``entrypoints/scale_out/``), whose ``features`` name embeddings by hash
    and whose ``sampling_params.extra_args`` carry ``ec_transfer_params``."""
    if getattr(args, "enable_scale_out", False) or getattr(args, "tokens_only", False):
        return ("/inference/v1/generate",)
    return ()
