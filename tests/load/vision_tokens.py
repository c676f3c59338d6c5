"""How many vision tokens an image becomes, as a Qwen2.5-VL encoder and engine compute them, and small
valid PNGs of a given size to send. Only the standard library: the fake encoder process imports it.

The count follows Hugging Face's ``smart_resize`` (``models/qwen2_vl/image_processing_qwen2_vl.py``):
each side rounded to a multiple of 28 (patch 14 times the 2x2 merge), the area clamped between the
processor's ``min_pixels`` and ``max_pixels`` (Qwen2.5-VL's ``preprocessor_config.json``: 3,136 and
12,845,056); the encoder reports ``image_grid_thw = [1, H/14, W/14]`` and the image takes
``H/28 * W/28`` tokens of the prompt. 448x448 -> 256, 1024x1024 -> 1369, 1920x1080 -> 2691.
"""

from __future__ import annotations

import base64
import math
import struct
import zlib

PATCH = 14
MERGE = 2
FACTOR = PATCH * MERGE
MIN_PIXELS = 3136
MAX_PIXELS = 12_845_056


def smart_resize(height: int, width: int) -> tuple[int, int]:
    """The size the processor resizes an image to (Hugging Face's rule, Qwen2.5-VL's limits)."""
    h_bar = round(height / FACTOR) * FACTOR
    w_bar = round(width / FACTOR) * FACTOR
    if h_bar * w_bar > MAX_PIXELS:
        beta = math.sqrt((height * width) / MAX_PIXELS)
        h_bar = max(FACTOR, math.floor(height / beta / FACTOR) * FACTOR)
        w_bar = max(FACTOR, math.floor(width / beta / FACTOR) * FACTOR)
    elif h_bar * w_bar < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (height * width))
        h_bar = math.ceil(height * beta / FACTOR) * FACTOR
        w_bar = math.ceil(width * beta / FACTOR) * FACTOR
    return h_bar, w_bar


def grid_thw(width: int, height: int) -> list[int]:
    """``image_grid_thw`` of one image: one frame, its patches down and across."""
    h_bar, w_bar = smart_resize(height, width)
    return [1, h_bar // PATCH, w_bar // PATCH]


def tokens_of_grid(grid: list[int]) -> int:
    """Prompt tokens of an image from its ``image_grid_thw`` (the 2x2 merge)."""
    t, h, w = grid
    return t * h * w // (MERGE * MERGE)


def image_tokens(width: int, height: int) -> int:
    return tokens_of_grid(grid_thw(width, height))


def png_size(data_url: str) -> tuple[int, int]:
    """(width, height) from the IHDR of a base64 PNG data URL."""
    payload = data_url.split(",", 1)[1]
    head = base64.b64decode(payload[:32])
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        raise ValueError("not a PNG data URL")
    width, height = struct.unpack(">II", head[16:24])
    return int(width), int(height)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


_PIXELS: dict[tuple[int, int], bytes] = {}


def png(width: int, height: int, seed: int) -> bytes:
    """A valid grey RGB PNG of this size, its bytes made unique by ``seed`` (a text chunk), so that every
    image gets its own content uuid. The pixels are compressed once per size."""
    if (width, height) not in _PIXELS:
        row = b"\x00" + b"\x80" * (3 * width)
        _PIXELS[width, height] = zlib.compress(row * height, 9)
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"tEXt", b"seed\x00" + str(seed).encode())
        + _chunk(b"IDAT", _PIXELS[width, height])
        + _chunk(b"IEND", b"")
    )


def png_data_url(width: int, height: int, seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(width, height, seed)).decode()
