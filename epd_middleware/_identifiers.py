"""The identifier vLLM's engine gives a media item, derived here the way the engine derives it.

An EC consumer looks an item's embedding up under that identifier (ECExampleConnector: the file
``<storage>/<identifier>/encoder_cache.safetensors``), and for a metadata-only reference there is nothing
else to fall back on: a missing embedding kills vLLM's engine core. So the middleware hands the engine a
reference only under the identifier the engine itself will derive, and checks that one, never merely the
hash an encoder (or the reuse cache, or a client) names.

vLLM 0.32, ``multimodal/processing/inputs.py`` (``ProcessorInputs.get_mm_hashes``): an item with a uuid
and no hash factors is identified by the uuid itself; with factors (the request's
``mm_processor_kwargs`` less other modalities' scoped keys, and the item's modality's entry of
``media_io_kwargs`` merged over the server's ``--media-io-kwargs``) by
``MultiModalHasher.hash_kwargs(model_id=<model path>, <modality>=<uuid>, **factors)``
(``multimodal/hasher.py``), with the server's ``--mm-hasher-algorithm``. The serialisation below is
vLLM's, checked against vLLM's own function on every case of ``tests/test_identifiers.py``.

Video options are edited before they are hashed (``VideoMediaIO.merge_kwargs``: decoder settings of the
request dropped, a request's ``num_frames`` wiping the server's ``fps`` and the other way round), and
Qwen3-VL hashes each video again with its per-video frame rates when those are lists: both followed here
as far as they go without vLLM's video loader registry. Where the rule has a turn the middleware does not
follow (a request choosing a video decoder backend, per-video frame-rate lists, LoRA adapters on the
vision tower), or a value the hasher cannot serialise reproducibly, :meth:`IdentifierRule.identifier`
says None: not known, so not referenced. Models that hash images and videos as one "vision chunk"
modality derive other identifiers where options are given: the check against the encoder's report keeps
such items raw rather than referenced.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from blake3 import blake3

from ._rawjson import Raw, text_of

__all__ = ["IdentifierRule", "hash_kwargs", "video_lists"]

_HASHERS: dict[str, Callable[[], Any]] = {
    "blake3": blake3,
    "sha256": hashlib.sha256,
    "sha512": hashlib.sha512,
}
# vLLM's _HF_MODALITY_PROCESSOR_KWARGS: processor options scoped to one modality.
_SCOPED_KWARGS = {"image": "images_kwargs", "video": "videos_kwargs", "audio": "audio_kwargs"}
# Request video options the loader drops (startup-only), and those that choose a decoder backend, which
# vLLM strips or keeps depending on its loader registry.
_VIDEO_STARTUP_ONLY = ("hw_decoders", "pool_size", "device")
_VIDEO_BACKEND = ("video_backend", "backend")


class _NotReproducible(Exception):
    """A value vLLM's hasher serialises by object identity or pickle (an int beyond 64 bits)."""


def _length(size: int) -> bytes:
    return size.to_bytes(8, "little")


def _framed(chunk: bytes) -> Iterator[bytes]:
    yield _length(len(chunk))
    yield chunk


def _leaf(value: Any) -> Iterator[bytes]:
    # ``np.array(value).tobytes()``: bool one byte, int int64 (uint64 above its range), float float64.
    if isinstance(value, str):
        yield from _framed(value.encode("utf-8"))
    elif isinstance(value, bool):
        yield from _framed(b"\x01" if value else b"\x00")
    elif isinstance(value, int):
        if -(2**63) <= value < 2**63:
            yield from _framed(struct.pack("<q", value))
        elif 2**63 <= value < 2**64:
            yield from _framed(struct.pack("<Q", value))
        else:
            raise _NotReproducible
    elif isinstance(value, float):
        yield from _framed(struct.pack("<d", value))
    else:
        raise _NotReproducible


def _value(value: Any) -> Iterator[bytes]:
    if isinstance(value, Raw):
        value = text_of(value)
    if value is None:
        yield b"\x00"
    elif isinstance(value, (list, tuple)):
        yield b"\x01"
        yield _length(len(value))
        for item in value:
            yield from _value(item)
    elif isinstance(value, dict):
        yield b"\x02"
        yield _length(len(value))
        for key, item in value.items():
            yield from _framed(str(key).encode("utf-8"))
            yield from _value(item)
    else:
        yield b"\x03"
        yield from _leaf(value)


def hash_kwargs(algorithm: str, **kwargs: Any) -> str:
    """``MultiModalHasher.hash_kwargs``: the keywords in key order, each framed, values tagged by kind.
    Raises ValueError for a value vLLM cannot hash reproducibly, or an unknown algorithm."""
    factory = _HASHERS.get(algorithm)
    if factory is None:
        raise ValueError(f"unknown mm_hasher_algorithm {algorithm!r}")
    hasher = factory()
    try:
        for key, value in sorted(kwargs.items()):
            for chunk in (*_framed(key.encode("utf-8")), *_value(value)):
                hasher.update(chunk)
    except (_NotReproducible, UnicodeEncodeError, RecursionError, ValueError):
        raise ValueError("not reproducibly hashable") from None
    digest: str = hasher.hexdigest()
    return digest


@dataclass(frozen=True, slots=True)
class IdentifierRule:
    """What the identifier of an item depends on besides the request: this server's model path
    (``model_config.model``), hash algorithm and ``--media-io-kwargs``.

    ``model`` None (outside vLLM, where the path is not known): only identifiers without hash factors
    are known.
    """

    model: str | None = None
    algorithm: str = "blake3"
    server_media_io: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # What makes every identifier unknown (LoRA adapters on the vision tower), or None.
    unknown_because: str | None = None
    # The server's --mm-processor-kwargs give per-video frame-rate lists (Qwen3-VL hashes videos again).
    video_lists: bool = False

    @property
    def derives_options(self) -> bool:
        """Whether identifiers under per-request options can be derived (the model path is known, as
        inside vLLM); where not, only identifiers without hash factors are."""
        return self.model is not None and self.unknown_because is None

    def identifier(self, modality: str, uuid: str, fields: Mapping[str, Any]) -> str | None:
        """The identifier the engine gives an item of ``modality`` sent with ``uuid`` in a request of
        ``fields``; None where it cannot be derived here."""
        if self.unknown_because is not None:
            return None
        if modality == "video" and (self.video_lists or video_lists(fields.get("mm_processor_kwargs"))):
            return None
        if (
            modality in _SCOPED_KWARGS
            and not self.server_media_io
            and not fields.get("mm_processor_kwargs")
            and not fields.get("media_io_kwargs")
        ):
            return uuid  # no hash factors at all: the common case, decided without building them
        factors = self._factors(modality, fields)
        if factors is None:
            return None
        if not factors:
            return uuid
        if self.model is None:
            return None
        try:
            return hash_kwargs(self.algorithm, model_id=self.model, **{modality: uuid}, **factors)
        except ValueError:
            return None

    def _factors(self, modality: str, fields: Mapping[str, Any]) -> dict[str, Any] | None:
        """The hash factors of the item, as vLLM computes them; None when their shape is not the one
        vLLM validates (it refuses such a request anyway)."""
        processor = fields.get("mm_processor_kwargs") or {}
        media_io = fields.get("media_io_kwargs") or {}
        if not isinstance(processor, dict) or not isinstance(media_io, dict):
            return None
        scoped = _SCOPED_KWARGS.get(modality)
        if scoped is None:
            return None
        processor = {
            key: value
            for key, value in processor.items()
            if key not in _SCOPED_KWARGS.values() or key == scoped
        }
        own = media_io.get(modality)
        if own is not None and not isinstance(own, dict):
            return None
        defaults = self.server_media_io.get(modality, {})
        if modality == "video":
            merged = _merged_video_options(defaults, own)
            if merged is None:
                return None
        else:
            # Server defaults first, the request's entry over them, key by key (MediaIO.merge_kwargs).
            merged = {**defaults, **(own or {})}
        factors: dict[str, Any] = {}
        if merged:
            factors["media_io_kwargs"] = {modality: merged}
        if processor:
            factors["mm_processor_kwargs"] = processor
        return factors


def _merged_video_options(
    defaults: Mapping[str, Any], request: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """``VideoMediaIO.merge_kwargs`` (``multimodal/media/video.py``); None where a request names a decoder
    backend, whose fate depends on vLLM's loader registry."""
    if not request:
        return dict(defaults)
    if any(request.get(key) for key in _VIDEO_BACKEND):
        return None
    own = {key: value for key, value in request.items() if key not in _VIDEO_STARTUP_ONLY}
    merged = {**defaults, **own}
    if "num_frames" in own and "fps" not in own:
        merged.pop("fps", None)
    elif "fps" in own and "num_frames" not in own:
        merged.pop("num_frames", None)
    return merged


def video_lists(processor: Any) -> bool:
    """Per-video ``fps`` or ``num_frames`` lists in ``videos_kwargs``: Qwen3-VL then hashes each video
    again with its own entries (``Qwen3VLMultiModalProcessor._get_mm_hashes``)."""
    scoped = processor.get("videos_kwargs") if isinstance(processor, dict) else None
    return isinstance(scoped, dict) and any(
        isinstance(scoped.get(key), list) for key in ("fps", "num_frames")
    )
