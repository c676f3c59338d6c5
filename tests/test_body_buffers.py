"""Large request bodies are read into buffers used again from request to request (_body_buffers.py): the
body read is always the bytes the client sent, a buffer is used again only when nothing can still read
it, and the pool stays within its bounds. Below the ASGI layer, then through the middleware with bodies
that arrive in pieces, as an ASGI server delivers a large one."""

from __future__ import annotations

import base64
import itertools
import json
from typing import Any

import anyio
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epd_middleware import EPDMiddleware
from epd_middleware._body_buffers import MIN_SIZE, BodyBuffers
from epd_middleware._rawjson import decode
from epd_middleware._surfaces import ParsedRequest

from .fakes import TEST_UUID_KEY, FakeEncoders, FakeEngine, chat_body, image

E0 = "http://enc-0:8001"


def pieces_of(data: bytes, cuts: list[int]) -> list[bytes]:
    edges = sorted({0, len(data), *(cut % (len(data) + 1) for cut in cuts)})
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def read(buffers: BodyBuffers, pieces: list[bytes]) -> bytearray:
    filling = buffers.filling(sum(map(len, pieces)))
    assert filling is not None
    for piece in pieces:
        filling.add(piece)
    return filling.body()


# --- the pool, below the ASGI layer ------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    bodies=st.lists(
        st.tuples(st.integers(MIN_SIZE, 3 * MIN_SIZE), st.lists(st.integers(0, 4 * MIN_SIZE), max_size=6)),
        min_size=1,
        max_size=6,
    )
)
def test_a_body_read_into_a_used_buffer_is_exactly_what_was_sent(bodies: list[tuple[int, list[int]]]) -> None:
    buffers = BodyBuffers()
    for number, (size, cuts) in enumerate(bodies):
        data = bytes((number * 7 + i) % 251 for i in range(size))
        body = read(buffers, pieces_of(data, cuts))
        assert body == data
        buffers.give_back(body)


def test_a_buffer_is_used_again_once_given_back() -> None:
    buffers = BodyBuffers()
    first = read(buffers, [b"a" * MIN_SIZE, b"b" * MIN_SIZE])
    buffers.give_back(first)
    assert len(buffers) == 1
    second = read(buffers, [b"c" * (MIN_SIZE + 10), b"d" * (MIN_SIZE - 10)])
    assert second is first
    assert second == b"c" * (MIN_SIZE + 10) + b"d" * (MIN_SIZE - 10)
    assert len(buffers) == 0


def test_a_buffer_a_view_still_reads_is_never_used_again() -> None:
    buffers = BodyBuffers()
    text = b'{"url": "' + b"A" * (3 * MIN_SIZE) + b'"}'
    body = read(buffers, pieces_of(text, [100, 5000]))
    kept = decode(body)["url"]  # a msgspec.Raw view of the buffer, as a sampled request keeps one
    assert isinstance(kept, msgspec.Raw)
    buffers.give_back(body)
    assert len(buffers) == 0
    other = read(buffers, [b"B" * len(text)])
    assert other is not body
    assert bytes(kept) == b'"' + b"A" * (3 * MIN_SIZE) + b'"'


def test_small_and_oversized_bodies_take_no_buffer() -> None:
    buffers = BodyBuffers(max_bytes=4 * MIN_SIZE)
    assert buffers.filling(MIN_SIZE - 1) is None
    assert buffers.filling(4 * MIN_SIZE + 1) is None


def test_the_pool_keeps_at_most_its_count_and_its_bytes() -> None:
    by_count = BodyBuffers(max_buffers=2)
    held = [read(by_count, [b"x" * MIN_SIZE]) for _ in range(3)]
    for body in held:
        by_count.give_back(body)
    assert len(by_count) == 2
    by_bytes = BodyBuffers(max_bytes=3 * MIN_SIZE)
    held = [read(by_bytes, [b"x" * (2 * MIN_SIZE)]) for _ in range(2)]
    for body in held:
        by_bytes.give_back(body)
    assert len(by_bytes) == 1
    assert by_bytes.held_bytes <= 3 * MIN_SIZE


def test_a_buffer_far_larger_than_the_body_is_not_taken() -> None:
    # Cut to under half its allocation, a bytearray moves to a new block: the pool makes a fresh one.
    buffers = BodyBuffers()
    large = read(buffers, [b"x" * (8 * MIN_SIZE)])
    buffers.give_back(large)
    small = read(buffers, [b"y" * MIN_SIZE])
    assert small is not large
    assert len(buffers) == 1


# --- through the middleware ---------------------------------------------------------------------------


def png(seed: int, size: int) -> str:
    return base64.b64encode(bytes((seed * 31 + i) % 256 for i in range(size))).decode()


async def call(app: Any, body: bytes, pieces: int) -> tuple[int, bytes]:
    """POST ``body`` in ``pieces`` messages with its Content-Length, as uvicorn delivers a large body."""
    size = -(-len(body) // pieces)
    messages = [
        {"type": "http.request", "body": body[i : i + size], "more_body": i + size < len(body)}
        for i in range(0, len(body), size)
    ]
    sent: list[dict[str, Any]] = []
    done = anyio.Event()

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await done.wait()  # the client stays until the answer is complete
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            done.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("pd", 80),
    }
    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def middleware(**options: Any) -> tuple[EPDMiddleware, FakeEncoders, FakeEngine]:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = EPDMiddleware(
        engine.app(), encoders=[E0], http_client=encoders.client(), uuid_key=TEST_UUID_KEY, **options
    )
    return app, encoders, engine


@pytest.mark.anyio
async def test_a_body_in_pieces_reaches_encoder_and_engine_as_one_sent_whole() -> None:
    app, encoders, engine = middleware()
    bodies = [
        json.dumps(chat_body(image(png(seed, 60_000)), image(png(seed + 9, 50_000)))).encode()
        for seed in (1, 2)
    ]
    for body in (bodies[0], bodies[1], bodies[0]):
        whole = await call(app, body, 1)
        pieced = await call(app, body, 7)
        assert whole[0] == pieced[0] == 200
    sent = [json.loads(record.body) for record in engine.received]
    assert sent[0] == sent[1]
    assert sent[2] == sent[3]
    assert sent[4] == sent[5]
    assert sent[0] != sent[2]
    # Each encoder call carried the images the client sent, whichever way the body came.
    urls = [
        part["image_url"]["url"] for call in encoders.calls for part in call.body["messages"][0]["content"]
    ]
    assert set(urls) == {
        image(png(s, n))["image_url"]["url"]
        for s, n in ((1, 60_000), (10, 50_000), (2, 60_000), (11, 50_000))
    }
    assert len(app.pipeline.bodies) == 1  # one buffer, used by every request in pieces


@pytest.mark.anyio
async def test_a_large_text_body_in_pieces_passes_to_the_engine_byte_for_byte() -> None:
    app, encoders, engine = middleware()
    body = json.dumps(chat_body(**{"user": "x" * 200_000})).replace('"Describe."', '"no media"').encode()
    status, _ = await call(app, body, 5)
    assert status == 200
    assert engine.received[0].body == body
    assert type(engine.received[0].body) is bytes
    assert encoders.calls == []


@pytest.mark.anyio
async def test_a_request_kept_after_its_answer_keeps_its_own_media_while_later_bodies_arrive() -> None:
    # As the equivalence probe keeps a sampled request (verify_share): its media are views of the body.
    app, _, engine = middleware()
    kept: list[ParsedRequest] = []
    answered = app.pipeline.engine_answered
    app.pipeline.engine_answered = lambda request, surface=None: (
        kept.append(request),
        answered(request, surface),
    )[1]  # type: ignore[method-assign]
    first = json.dumps(chat_body(image(png(3, 120_000)))).encode()
    second = json.dumps(chat_body(image(png(4, 120_000)))).encode()
    assert (await call(app, first, 4))[0] == 200
    assert len(app.pipeline.bodies) == 0  # its buffer stays with the views
    assert (await call(app, second, 4))[0] == 200
    url = kept[0].media[0].url
    assert isinstance(url, msgspec.Raw)
    assert bytes(url)[1:-1].decode() == image(png(3, 120_000))["image_url"]["url"]
    assert json.loads(engine.received[0].body) != json.loads(engine.received[1].body)
    del kept[:], url
    assert (await call(app, first, 4))[0] == 200
