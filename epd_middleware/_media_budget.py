"""vLLM's budget of decoded media per request, kept when a request's media is split over encoders.

vLLM 0.33 charges every image it decodes for one request ``width * height * 4`` bytes against
``VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES`` (``multimodal/media/image.py`` ``load_bytes``,
``multimodal/media/base.py`` ``MediaDecodedBudget``) and refuses the request once the total passes it.
Split over several encoder calls, each encoder charges only its share, so E + PD would accept what a
single instance refuses. The PD never decodes the media itself (it gets metadata-only references), so
the middleware sums what it can know before any call: the size an image's own header gives, for images
sent inline (base64 data URLs in PNG, JPEG, GIF, WebP or BMP). Remote URLs, video and audio only add to
what vLLM would charge, so a request whose known images alone pass the budget is surely refused by a
single instance too, and is refused here with vLLM's status (400) and words. Data URLs are read as vLLM
reads them (``MediaConnector.load_from_url``, ``_load_data_url``): every image vLLM would decode counts.
"""

from __future__ import annotations

import base64
import binascii
import struct
from collections.abc import Sequence

from ._rawjson import Raw, raw_text
from ._surfaces import MediaPart

__all__ = ["decoded_image_bytes", "image_size", "known_decoded_bytes"]

_DATA = b"data:"
# vLLM decodes what follows the first comma when the media type before it ends in ";base64" (its text
# after the last ";" is "base64", as written).
_BASE64 = b";base64"
# Base64 characters decoded at most to find a JPEG's frame header (after its EXIF and other segments),
# and segments walked at most: real files have a handful before it. Bounded, because this runs on the
# event loop: a crafted file of thousands of empty segments costs one walk of _MAX_SEGMENTS, and an image
# whose size stays unknown is only not counted (never refused for it).
_PREFIXES = (4096, 65536, 262144)
_MAX_SEGMENTS = 64
# GIF blocks (extensions and their data sub-blocks) walked at most before the first frame (a real file
# has a handful).
_MAX_GIF_BLOCKS = 256
# What _jpeg says when the frame header may lie past the bytes decoded so far.
_MORE = (-1, -1)
_JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xD9)})
_JPEG_FRAMES = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})


def known_decoded_bytes(media: Sequence[MediaPart]) -> int:
    """What vLLM would charge at least for decoding these items: the images whose size is known."""
    total = 0
    for item in media:
        if item.modality == "image" and item.url is not None:
            total += decoded_image_bytes(item.url) or 0
    return total


def decoded_image_bytes(url: str | Raw) -> int | None:
    """``width * height * 4`` of an inline image whose header says its size; None when not known."""
    size = image_size(url)
    return size[0] * size[1] * 4 if size is not None else None


def image_size(url: str | Raw) -> tuple[int, int] | None:
    """``(width, height)`` of an inline image whose header says its size; None when not known."""
    payload = _base64_payload(url)
    if payload is None:
        return None
    for size in _PREFIXES:
        head = _decoded_prefix(payload, size)
        if head is None:
            return None
        found = _dimensions(head)
        if found is _MORE and len(payload) > size:
            continue  # a JPEG whose frame header lies past this prefix
        if found is None or found is _MORE:
            return None
        return found
    return None


def _base64_payload(url: str | Raw) -> bytes | None:
    """The start of the base64 vLLM decodes from a data URL (at most the longest prefix ever decoded
    here), whatever case its scheme is in, whatever its media type says or holds; None for a URL vLLM
    does not decode as base64 data."""
    end = _PREFIXES[-1]
    if isinstance(url, Raw):
        text = raw_text(url)
        head = bytes(text[: 256 + end])
        if head[: len(_DATA)].lower() != _DATA:
            return None
        comma = head.find(b",", len(_DATA))
        if comma < 0 and len(text) > len(head):
            # A media type longer than a real one ever is: looked for in a copy of the whole URL.
            comma = bytes(text).find(b",", len(head))
        start = comma - len(_BASE64)
        if start < len(_DATA) or text[start:comma] != _BASE64:
            return None
        return bytes(text[comma + 1 : comma + 1 + end])
    if url[: len(_DATA)].lower() != "data:":
        return None
    comma = url.find(",", len(_DATA))
    if comma - len(_BASE64) < len(_DATA) or not url.endswith(";base64", len(_DATA), comma):
        return None
    return url[comma + 1 : comma + 1 + end].encode("utf-8", "surrogatepass")


def _decoded_prefix(payload: bytes, size: int) -> bytes | None:
    length = min(size, len(payload))
    chunk = payload[: length - length % 4]
    try:
        return base64.b64decode(chunk, validate=True)
    except (binascii.Error, ValueError):
        return None


def _dimensions(head: bytes) -> tuple[int, int] | None:
    """(width, height) as Pillow's ``Image.size`` reports them, from the first bytes of the file; None
    when they cannot be told, ``_MORE`` when a longer prefix may tell them (JPEG)."""
    if head.startswith(b"\x89PNG\r\n\x1a\n") and len(head) >= 24 and head[12:16] == b"IHDR":
        width, height = struct.unpack(">II", head[16:24])
        return width, height
    if head[:6] in (b"GIF87a", b"GIF89a") and len(head) >= 13:
        return _gif(head)
    if head.startswith(b"BM") and len(head) >= 26:
        header = struct.unpack("<I", head[14:18])[0]
        if header == 12:
            width, height = struct.unpack("<HH", head[18:22])
            return width, height
        width, height = struct.unpack("<ii", head[18:26])
        return abs(width), abs(height)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP" and len(head) >= 30:
        return _webp(head)
    if head[:2] == b"\xff\xd8":
        return _jpeg(head)
    return None


def _gif(head: bytes) -> tuple[int, int] | None:
    """A GIF's size as Pillow gives it on open (``GifImagePlugin._open``, ``_seek(0)``): its logical
    screen, grown to hold the first frame where that frame reaches past it. A screen of 1 x 1 may hold a
    frame of 600 x 500, which Pillow (and vLLM's budget) count at 600 x 500."""
    width, height = struct.unpack("<HH", head[6:10])
    flags = head[10]
    at = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # past the global colour table
    in_extension = False
    # Bounded, as the JPEG walk is: a file of thousands of one-byte blocks costs one walk of these.
    for _ in range(_MAX_GIF_BLOCKS):
        if at >= len(head):
            return _MORE
        if in_extension:  # its data sub-blocks, up to an empty one
            length = head[at]
            at += 1 + length
            in_extension = length > 0
            continue
        kind = head[at]
        if kind == 0x2C:  # the first frame's image descriptor: its extent
            if at + 9 > len(head):
                return _MORE
            x0, y0, frame_width, frame_height = struct.unpack("<HHHH", head[at + 1 : at + 9])
            return max(width, x0 + frame_width), max(height, y0 + frame_height)
        if kind == 0x3B:  # the trailer before any frame: Pillow finds no image ("image not found")
            return None
        if kind != 0x21:  # a byte Pillow does not know between blocks: it passes over it
            at += 1
            continue
        at, in_extension = at + 2, True  # an extension: its label, then its sub-blocks
    return None


def _webp(head: bytes) -> tuple[int, int] | None:
    chunk = head[12:16]
    if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", head[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        return int.from_bytes(head[24:27], "little") + 1, int.from_bytes(head[27:30], "little") + 1
    return None


def _jpeg(head: bytes) -> tuple[int, int] | None:
    at = 2
    for _ in range(_MAX_SEGMENTS):
        if at + 4 > len(head):
            return _MORE
        if head[at] != 0xFF:
            return None
        marker = head[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in _JPEG_STANDALONE:  # no length
            at += 2
            continue
        (length,) = struct.unpack(">H", head[at + 2 : at + 4])
        if marker in _JPEG_FRAMES:
            if at + 9 > len(head):
                return _MORE
            height, width = struct.unpack(">HH", head[at + 5 : at + 9])
            return width, height
        if marker in (0xD9, 0xDA) or length < 2:  # end of image, start of scan: no frame header
            return None
        at += 2 + length
    return None
