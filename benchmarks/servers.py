"""The processes of the performance rig, each on its own loopback port.

    python -m benchmarks.servers engine PORT
    python -m benchmarks.servers engine+epd PORT ENCODER_URL[,ENCODER_URL...]
    python -m benchmarks.servers proxy PORT ENGINE_URL ENCODER_URL[,...]
    python -m benchmarks.servers engine+relay PORT ENCODER_URL
    python -m benchmarks.servers engine+checked PORT ENCODER_URL
    python -m benchmarks.servers engine+rewrite PORT ENCODER_URL

``engine`` stands for vLLM's API server at its cheapest: it reads the body and answers a small JSON.
``engine+epd`` is the same app with EPDMiddleware inside it (the in-process architecture); ``proxy`` is a
separate forwarding hop built with the same libraries (EPDMiddleware in front of a forwarder that sends
the rewritten request to the engine over one more HTTP round trip), which is how proxies deploy today.
``engine+relay`` is the least any design inside the engine process can do: it receives the body, relays
it unchanged to the encoder (the load generator sends it the encoder's request), and runs the engine app
on the same bytes once the encoder answered. No parsing, hashing or rewriting: what it costs over the
direct floor is the price of the architecture, not of an implementation of it. ``engine+checked`` is the
relay plus what no design may leave out: the body parsed with every long string checked as JSON text
where it lies (the package's ``_rawjson.decode``) and each long string hashed (BLAKE3, the content uuid
both sides must agree on). What the middleware costs over it is its pipeline, not its checks.
``engine+rewrite`` does every step the middleware's work is made of and nothing around them: the same
checked parse (the package's chat surface), the content uuids, the encoder's body built from the media
parts, the call, the answer read and its handles matched to the items, the engine's body written with the
handles, the engine run; with the package's own functions, so that each step costs what it costs in the
middleware. No failover, pool, metrics, ledger, disconnect watch, retry or log: the floor of a design
that rewrites both bodies, as the middleware (and the reference proxy) must.
All run under uvicorn with uvloop and httptools, as vLLM does.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import blake3
import msgspec
import uvicorn

from epd_middleware import EPDMiddleware, _rawjson
from epd_middleware._handles import match_reply, part_metadata, transfer_params
from epd_middleware._http import Body as HTTPBody
from epd_middleware._http import HTTPClient
from epd_middleware._plan import MediaItem, UuidKey, media_items
from epd_middleware._surfaces import ParsedRequest, encode_fields
from epd_middleware._surfaces import openai_chat as chat

ANSWER = (
    b'{"id":"chatcmpl-bench","object":"chat.completion",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}]}'
)


async def engine(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                # As vLLM's API server does at the end of start-up (freeze_gc_heap): the start-up heap is
                # left out of the collector's full collections, which would otherwise pause the server.
                gc.collect()
                gc.freeze()
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(ANSWER)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": ANSWER})


async def read_body(receive: Any) -> bytes:
    chunks = []
    more = True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def forwarder(engine_url: str) -> Any:
    client = HTTPClient(connect_timeout=5)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await engine(scope, receive, send)
            return
        status, body = await client.request(
            "POST", engine_url + scope["path"], await read_body(receive), {"content-type": "application/json"}
        )
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def relay(encoder_url: str, checked: bool = False) -> Any:
    client = HTTPClient(connect_timeout=5)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await engine(scope, receive, send)
            return
        body = await read_body(receive)
        if checked and body:  # the rig's readiness probe is a GET without one
            for raw in _raws(_rawjson.decode(body)):
                blake3.blake3(raw).digest(length=16)
        status, _ = await client.request(
            "POST", encoder_url + scope["path"], body, {"content-type": "application/json"}
        )
        assert status == 200, status
        await engine(scope, replaying(body, receive), send)

    return app


def replaying(body: bytes, receive: Any) -> Any:
    """The engine app's ``receive``: ``body`` whole, then whatever the server says next."""
    replayed = False

    async def replay() -> dict[str, Any]:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return dict(await receive())

    return replay


def encoder_request(
    request: ParsedRequest, uuid_key: UuidKey
) -> tuple[tuple[MediaItem, ...], tuple[str, ...], HTTPBody]:
    """The middleware's first steps for a chat request: its items under their content uuids, and the
    encoder's body (pieces, the media strings where they arrived)."""
    items, uuids = media_items(
        request.media, trust_client_uuid=False, salt=None, pin_uuid=True, uuid_key=uuid_key
    )
    return items, uuids, chat.SURFACE.encoder_body(request, [item.part for item in items])


def engine_request(
    encoder: str, request: ParsedRequest, items: Sequence[MediaItem], uuids: Sequence[str], reply: bytes
) -> bytes:
    """The middleware's last steps: the encoder's answer matched to the items, and the engine's body with
    every part a reference and the handles in ``ec_transfer_params``."""
    handles = match_reply(encoder, items, _rawjson.decode(reply)["ec_transfer_params"])
    parts = [(part.modality, uuid) for part, uuid in zip(request.media, uuids, strict=True)]
    metadata = part_metadata(parts, handles, rewrite=True)
    return encode_fields(chat.engine_fields(request, uuids, metadata, transfer_params(handles)))


def rewriter(encoder_url: str, uuid_key: UuidKey | None = None) -> Any:
    client = HTTPClient(connect_timeout=5)
    key = uuid_key or UuidKey()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":  # the rig's readiness probe
            await engine(scope, receive, send)
            return
        request = chat.parse(await read_body(receive))
        assert request is not None
        assert request.media
        items, uuids, body = encoder_request(request, key)
        status, reply = await client.request(
            "POST", encoder_url + scope["path"], body, {"content-type": "application/json"}
        )
        assert status == 200, status
        rewritten = engine_request(encoder_url, request, items, uuids, reply)
        await engine(scope, replaying(rewritten, receive), send)

    return app


def _raws(value: Any) -> Iterator[msgspec.Raw]:
    """The long strings of a decoded body (``msgspec.Raw``), wherever they are."""
    if isinstance(value, msgspec.Raw):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _raws(item)
    elif isinstance(value, list):
        for item in value:
            yield from _raws(item)


def main() -> None:
    role, port = sys.argv[1], int(sys.argv[2])
    options = {"health_check_interval": 0, "max_body_bytes": 256 * 1024 * 1024, "max_media_items": 256}
    # More middleware options for one run (benchmarks.multiturn: the storage to check, reuse on or off).
    options.update(json.loads(os.environ.get("EPD_BENCH_OPTIONS", "{}")))
    if role == "engine":
        app: Any = engine
    elif role == "engine+epd":
        app = EPDMiddleware(engine, encoders=sys.argv[3].split(","), **options)
    elif role == "engine+relay":
        app = relay(sys.argv[3])
    elif role == "engine+checked":
        app = relay(sys.argv[3], checked=True)
    elif role == "engine+rewrite":
        app = rewriter(sys.argv[3])
    elif role == "proxy":
        app = EPDMiddleware(forwarder(sys.argv[3]), encoders=sys.argv[4].split(","), **options)
    else:
        raise SystemExit(f"unknown role {role}")
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )


if __name__ == "__main__":
    main()
