"""The seed experiment's request: one 800x600 RGBA PNG with four coloured squares, the seed's prompt,
temperature 0, seed 42. The PNG is written with zlib alone, so no imaging library is needed here."""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

PROMPT = "Describe the objects and their colors in this image in one short sentence."
NON_DEFAULT_OPTIONS: dict[str, Any] = {
    "mm_processor_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 50176}},
    "media_io_kwargs": {"image": {"rgba_background_color": [0, 0, 0]}},
}
SQUARES = [
    ((80, 60), (255, 0, 0, 255)),
    ((480, 60), (0, 200, 0, 255)),
    ((80, 340), (0, 0, 255, 255)),
    ((480, 340), (255, 220, 0, 160)),
]


def png_rgba(width: int = 800, height: int = 600, squares: Any = SQUARES, side: int = 200) -> bytes:
    """An RGBA PNG: transparent background (so the RGBA background option matters), coloured squares."""
    rows = []
    for y in range(height):
        row = bytearray(width * 4)
        for (x0, y0), color in squares:
            # A square moved past the right edge is cut there: a slice past the row's end would lengthen
            # the row, and the PNG would not decode (every shift over 120 sent vLLM a broken image).
            visible = min(x0 + side, width) - x0
            if y0 <= y < y0 + side and visible > 0:
                row[x0 * 4 : (x0 + visible) * 4] = bytes(color) * visible
        rows.append(b"\x00" + bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"".join(rows), 6))
        + chunk(b"IEND", b"")
    )


def seed_image(shift: int = 0) -> str:
    """The seed image as a data URL, or a variant with its squares moved by ``shift`` pixels (a distinct
    image, so a distinct cache key)."""
    squares = [((x + shift, y + shift), color) for (x, y), color in SQUARES]
    return data_url(png_rgba(squares=squares))


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def seed_request(
    model: str, images: list[str] | None = None, options: dict[str, Any] | None = None, **fields: Any
) -> dict[str, Any]:
    images = images if images is not None else [data_url(png_rgba())]
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    content.append({"type": "text", "text": PROMPT})
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "seed": 42,
        "max_tokens": 16,
        **(options or {}),
        **fields,
    }
