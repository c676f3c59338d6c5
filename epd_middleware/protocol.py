"""What the middleware knows of vLLM's wire protocol (vLLM 0.32), in one place.

Sources in vLLM: ``renderers/chat_utils.py`` (content parts, the uuid rule, the raw/embeds mixing rule),
``entrypoints/openai/chat_completion/protocol.py`` (request fields),
``distributed/ec_transfer/ec_connector/utils.py`` (the ``ec_transfer_params`` entries an encoder reports),
``multimodal/processing/inputs.py`` (a uuid plus per-request options gives a new, derived hash).
"""

from __future__ import annotations

from typing import Final

# Content part type -> (modality, key of the media inside ``part[type]``). The media sits in an object
# under the part's type (``{"type": "image_url", "image_url": {"url": ...}}``); ``input_audio`` holds
# ``{"data": <base64>, "format": "wav"}`` rather than a URL.
MEDIA_PARTS: Final[dict[str, tuple[str, str]]] = {
    "image_url": ("image", "url"),
    "audio_url": ("audio", "url"),
    "video_url": ("video", "url"),
    "input_audio": ("audio", "data"),
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

MODEL: Final = "model"
MESSAGES: Final = "messages"
CONTENT: Final = "content"
TYPE: Final = "type"
UUID: Final = "uuid"
CACHE_SALT: Final = "cache_salt"
EC_TRANSFER_PARAMS: Final = "ec_transfer_params"

# Inside one ec_transfer_params entry reported by an encoder.
ITEM_INDICES: Final = "item_indices"
METADATA: Final = "metadata"

# vLLM takes the request id from this header (``_base_request_id``); E and PD logs join on it.
REQUEST_ID_HEADER: Final = b"x-request-id"

# ECExampleConnector stores one embedding per hash at <shared_storage_path>/<mm_hash>/<this file>.
EXAMPLE_CONNECTOR_FILE: Final = "encoder_cache.safetensors"


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
