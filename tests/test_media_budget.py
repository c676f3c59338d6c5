"""vLLM 0.33's per-request budget of decoded media, kept when the media is split over encoders: the
sizes image headers give (checked against Pillow's ``Image.size`` for PNG, baseline and progressive JPEG
with a 60 KB EXIF block, GIF, lossy, lossless and alpha WebP, BMP, at 1x1 to 16383x7, in the vLLM
environment), and the refusal before any encoder call."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import msgspec
import pytest

from epd_lab.seed import png_rgba
from epd_middleware import Host
from epd_middleware._media_budget import decoded_image_bytes

from .fakes import FakeEncoders, FakeEngine, build_app, chat_body, image
from .test_topologies import image_block, messages_body, post

pytestmark = pytest.mark.anyio


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def jpeg(width: int, height: int, exif: int = 0) -> bytes:
    app1 = b"\xff\xe1" + struct.pack(">H", exif + 2) + b"\x00" * exif if exif else b""
    app0 = b"\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    sof = b"\xff\xc2\x00\x11\x08" + struct.pack(">HH", height, width) + b"\x03" + b"\x00" * 9
    return b"\xff\xd8" + app0 + app1 + sof + b"\xff\xda\x00\x08" + b"\x00" * 64 + b"\xff\xd9"


def gif(
    screen: tuple[int, int], frame: tuple[int, int], offset: tuple[int, int] = (0, 0), comment: bytes = b""
) -> bytes:
    """A GIF of one frame (a global colour table, a graphic control extension, a comment of 255-byte
    sub-blocks, then the frame at ``offset``)."""
    head = b"GIF89a" + struct.pack("<HH", *screen) + b"\x80\x00\x00" + b"\x00\x00\x00\xff\xff\xff"
    notes = b"".join(
        bytes([len(comment[i : i + 255])]) + comment[i : i + 255] for i in range(0, len(comment), 255)
    )
    extensions = b"!\xf9\x04\x00\x00\x00\x00\x00" + (b"!\xfe" + notes + b"\x00" if comment else b"")
    frame_block = b"," + struct.pack("<HHHH", *offset, *frame) + b"\x00" + b"\x02\x02\x44\x01\x00"
    return head + extensions + frame_block + b";"


HEADERS = [
    (png_rgba(40, 30), 40 * 30 * 4),
    # A screen of 640 x 480 with no frame in it ("GIF89a", the size, zeros) is no image Pillow opens
    # (UnidentifiedImageError): its size is not known, below.
    (gif((640, 480), (640, 480)), 640 * 480 * 4),
    (b"BM" + b"\x00" * 12 + struct.pack("<Iii", 40, 300, -200) + b"\x00" * 30, 300 * 200 * 4),
    (
        b"RIFF\x00\x00\x00\x00WEBPVP8X"
        + b"\x00" * 8
        + (99).to_bytes(3, "little")
        + (49).to_bytes(3, "little"),
        5000 * 4,
    ),
    (jpeg(1920, 1080), 1920 * 1080 * 4),
    (jpeg(4000, 3000, exif=60000), 4000 * 3000 * 4),  # the frame header comes after 60 KB of EXIF
    # Pillow grows a GIF's logical screen to hold its first frame (issue 35: a screen of 1 x 1 with a
    # frame of 600 x 500 was counted 1 x 1, placed as small and passed the budget). Pillow 13 gives
    # these sizes: (600, 500), (610, 520), (800, 600), (600, 500).
    (gif((1, 1), (600, 500)), 600 * 500 * 4),
    (gif((1, 1), (600, 500), offset=(10, 20)), 610 * 520 * 4),
    (gif((800, 600), (10, 10)), 800 * 600 * 4),
    (gif((1, 1), (600, 500), comment=b"x" * 3000), 600 * 500 * 4),
]


@pytest.mark.parametrize(("data", "expected"), HEADERS)
def test_the_decoded_size_is_read_from_the_image_header(data: bytes, expected: int) -> None:
    url = data_url(data)
    assert decoded_image_bytes(url) == expected
    assert decoded_image_bytes(msgspec.Raw(json.dumps(url).encode())) == expected  # as the parser keeps it


@pytest.mark.parametrize(
    "url",
    [
        "https://example.com/cat.png",
        "data:image/png,rawbytes",
        data_url(b"not an image at all" * 10),
        "data:image/png;base64,!!!!",
        data_url(jpeg(10, 10)[:24]),  # cut inside the frame header
        data_url(b"GIF89a" + struct.pack("<HH", 640, 480) + b"\x00" * 20),  # no frame
        data_url(b"GIF89a" + struct.pack("<HH", 640, 480) + b"\x00\x00\x00;"),  # the trailer, no frame
    ],
)
def test_an_image_whose_size_is_not_known_counts_nothing(url: str) -> None:
    assert decoded_image_bytes(url) is None


PNG_800x600 = base64.b64encode(png_rgba(800, 600)).decode()  # 1,920,000 bytes decoded


async def test_a_request_over_the_budget_is_refused_before_any_encoder_call() -> None:
    encoders, engine = FakeEncoders(["http://enc-0:8001", "http://enc-1:8001"]), FakeEngine()
    app, _ = build_app(encoders, engine, host=Host(media_decode_budget=5_000_000), max_batch_size=1)
    response = await post(app, chat_body(*(image(PNG_800x600) for _ in range(3))))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"].startswith(
        "Request decoded media exceeds VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES=5000000"
    )
    assert "5760000 bytes" in error["message"]
    assert error["param"] == "messages"
    assert encoders.calls == []
    assert engine.received == []


async def test_a_request_within_the_budget_or_of_one_item_is_encoded() -> None:
    for budget, count in ((6_000_000, 3), (1_000_000, 1)):
        encoders, engine = FakeEncoders(["http://enc-0:8001"]), FakeEngine()
        app, _ = build_app(encoders, engine, host=Host(media_decode_budget=budget))
        response = await post(app, chat_body(*(image(PNG_800x600) for _ in range(count))))
        assert response.status_code == 200, response.text  # one item: its encoder applies the budget
        assert len(encoders.calls) == 1


async def test_without_a_budget_nothing_is_refused() -> None:
    encoders, engine = FakeEncoders(["http://enc-0:8001"]), FakeEngine()
    app, _ = build_app(encoders, engine, host=Host())
    assert (await post(app, chat_body(*(image(PNG_800x600) for _ in range(3))))).status_code == 200


async def test_messages_over_the_budget_are_refused_in_anthropic_s_words() -> None:
    encoders, engine = FakeEncoders(["http://enc-0:8001"]), FakeEngine()
    app, _ = build_app(encoders, engine, host=Host(media_decode_budget=5_000_000))
    data = base64.b64encode(png_rgba(800, 600)).decode()
    body: dict[str, Any] = messages_body(*(image_block(data) for _ in range(3)))
    response = await post(app, body, path="/v1/messages")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert encoders.calls == []


def test_a_crafted_jpeg_costs_a_bounded_walk_and_counts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of empty segments before any frame header: at most 256 KiB of base64 is decoded and
    64 segments walked per prefix (this runs on the event loop), and the image is not counted."""
    from epd_middleware import _media_budget

    decoded: list[int] = []
    real = _media_budget._decoded_prefix

    def recording(payload: bytes, size: int) -> bytes | None:
        decoded.append(size)
        return real(payload, size)

    monkeypatch.setattr(_media_budget, "_decoded_prefix", recording)
    crafted = b"\xff\xd8" + b"\xff\xe0\x00\x02" * (1 << 18)
    assert decoded_image_bytes(data_url(crafted)) is None
    assert max(decoded) <= 262144
    many = b"\xff\xd8" + b"\xff\xe0\x00\x02" * 70 + jpeg(10, 10)[2:]  # a frame header after 70 segments
    assert decoded_image_bytes(data_url(many)) is None  # past the walk: not counted, never refused


# --- issue 29 item 9: data URLs as vLLM reads them ---------------------------------------------------

LONG_PARAMETERS = "image/png;" + "name=value;" * 40  # past the 256 characters once searched
# How vLLM reads a data URL (``MediaConnector.load_from_url`` and ``_load_data_url``): the scheme in any
# case; the media type up to the first comma, whose text after its last ";" must be "base64" exactly;
# the rest is the base64 it decodes, whatever the media type says.
SPELLINGS = {
    "upper-case scheme": lambda data: f"DATA:image/png;base64,{data}",
    "mixed-case scheme": lambda data: f"Data:image/png;base64,{data}",
    "long media-type parameters": lambda data: f"data:{LONG_PARAMETERS};base64,{data}",
    "very long media-type parameters": lambda data: f"data:image/png;p={'v' * 300_000};base64,{data}",
    "another media type": lambda data: f"data:text/plain;base64,{data}",
    "no media type": lambda data: f"data:;base64,{data}",
    "base64 twice": lambda data: f"data:image/png;base64;base64,{data}",
}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_every_data_url_vllm_decodes_is_counted(spelling: str) -> None:
    """issue 29 item 9: only ``data:`` in lower case, with ``;base64,`` in its first 256 characters, was
    read; vLLM decodes every spelling here."""
    url = SPELLINGS[spelling](base64.b64encode(png_rgba(40, 30)).decode())
    assert decoded_image_bytes(url) == 40 * 30 * 4
    assert decoded_image_bytes(msgspec.Raw(json.dumps(url).encode())) == 40 * 30 * 4


@pytest.mark.parametrize(
    "url",
    [
        "data:image/png;BASE64,{data}",  # the encoding is compared as written
        "data:image/png;x=a,b;base64,{data}",  # the media type ends at the first comma
        "data:image/png,{data}",
        "data:base64,{data}",  # no ";" before it
    ],
)
def test_a_data_url_vllm_refuses_is_not_counted(url: str) -> None:
    """issue 29 item 9: what vLLM refuses to decode (it answers the request with an error of its own)
    adds nothing to the budget."""
    assert decoded_image_bytes(url.format(data=base64.b64encode(png_rgba(40, 30)).decode())) is None


@pytest.mark.parametrize("spelling", ["upper-case scheme", "long media-type parameters"])
async def test_a_request_over_the_budget_is_refused_however_its_data_urls_are_spelled(spelling: str) -> None:
    """issue 29 item 9: three images over the budget, spelled ``DATA:`` or with long media-type
    parameters, went out as three encoder calls and a 200."""
    encoders, engine = FakeEncoders(["http://enc-0:8001", "http://enc-1:8001"]), FakeEngine()
    app, _ = build_app(encoders, engine, host=Host(media_decode_budget=5_000_000), max_batch_size=1)
    part = {"type": "image_url", "image_url": {"url": SPELLINGS[spelling](PNG_800x600)}}
    response = await post(app, chat_body(part, part, part))
    assert response.status_code == 400
    assert "5760000 bytes" in response.json()["error"]["message"]
    assert encoders.calls == []


@pytest.mark.parametrize("source", ["upper-case url", "long media type"])
async def test_messages_over_the_budget_are_refused_however_their_images_are_spelled(source: str) -> None:
    """issue 29 item 9, on Messages: a ``url`` source spelled ``DATA:``, or a base64 source whose
    ``media_type`` carries long parameters (vLLM builds ``data:<media_type>;base64,<data>`` of it)."""
    encoders, engine = FakeEncoders(["http://enc-0:8001"]), FakeEngine()
    app, _ = build_app(encoders, engine, host=Host(media_decode_budget=5_000_000))
    block: dict[str, Any] = (
        {"type": "image", "source": {"type": "url", "url": SPELLINGS["upper-case scheme"](PNG_800x600)}}
        if source == "upper-case url"
        else image_block(PNG_800x600, media_type=LONG_PARAMETERS)
    )
    response = await post(app, messages_body(block, block, block), path="/v1/messages")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert encoders.calls == []
