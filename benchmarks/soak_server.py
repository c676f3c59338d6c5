"""The soak's PD server (benchmarks/soak.py): the real EPDMiddleware in front of a fake engine that checks
what it is handed, in a process of its own, under the ASGI server of its backend: uvicorn with uvloop and
httptools on asyncio (as vLLM serves), hypercorn on trio.

    python -m benchmarks.soak_server CONFIG_JSON

CONFIG_JSON: ``port``, ``backend`` (asyncio or trio), ``options`` (EPDMiddleware keywords),
``stream_chunks`` and ``chunk_gap_s`` (a streamed answer's chunks after the first, and the pause before
each). Prints ``ready`` once it serves.

``GET /soak/stats`` (answered in front of the middleware, never seen by it) is the soak's sample of this
process: resident memory and open descriptors (/proc), the event loop's tasks (asyncio's all_tasks,
trio's task tree, through anyio), the connections in the middleware's HTTP pools, the Prometheus series,
the reuse cache's entries, and the sizes of the middleware's other per-server tables. Reading private
attributes is the rig's business: nothing of it is the package's interface.

The engine (``/v1/chat/completions``) answers 200 with ``verified``: every image reached it as a
metadata-only reference (``image_embeds``) whose uuid is in ``ec_transfer_params`` with the same
metadata, and is the uuid the load generator computed for that image of that request (its text part
``soak-expect:UUID,...``), in order: a handle of another request's image, or of another image, is caught
here. ``images`` and ``raw`` say how many references and raw images it saw. With ``stream`` true the same
verdict is the first chunk of an event stream. Anything reaching ``/v1/messages`` is wrong (the soak sends
that surface only media the middleware must refuse): it answers 200 ``reached_engine``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import sys
import time
from collections import Counter
from typing import Any, cast

import anyio
import msgspec
from starlette.types import ASGIApp

from epd_middleware import EPDConfig, EPDMiddleware, Host
from epd_middleware._media_policy import MediaPolicy

_decode = msgspec.json.decode
_encode = msgspec.json.encode
EXPECT = "soak-expect:"
_OURS = "epd_middleware."


class Engine:
    """The fake engine: checks the handles, answers at once or streams."""

    def __init__(self, stream_chunks: int, chunk_gap_s: float) -> None:
        self.stream_chunks = stream_chunks
        self.chunk_gap_s = chunk_gap_s
        self.seen: Counter[str] = Counter()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            await _answer(send, 200, b"{}")
            return
        body = await _read(receive)
        if body is None:
            return
        if path == "/v1/messages":
            self.seen["reached_engine"] += 1
            await _answer(send, 200, b'{"reached_engine": true}')
            return
        if path != "/v1/chat/completions":
            await _answer(send, 404, b'{"error": {"message": "not found", "code": 404}}')
            return
        request = _decode(body)
        verdict = check(request)
        self.seen["requests"] += 1
        self.seen["verified" if verdict["verified"] else "unverified"] += 1
        if not request.get("stream"):
            await _answer(send, 200, _encode(verdict))
            return
        headers = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": _event(verdict), "more_body": True})
        for index in range(self.stream_chunks):
            await anyio.sleep(self.chunk_gap_s)
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{index}"}}]}
            await send({"type": "http.response.body", "body": _event(chunk), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while (await receive())["type"] != "lifespan.shutdown":
            # As vLLM's API server at the end of its start-up (freeze_gc_heap): the start-up heap is left
            # out of the collector's full collections.
            gc.collect()
            gc.freeze()
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})


def check(request: dict[str, Any]) -> dict[str, Any]:
    params = request.get("ec_transfer_params") or {}
    uuids: list[str] = []
    expected: list[str] = []
    verified, raw = True, 0
    for message in request["messages"]:
        if not isinstance(message["content"], list):
            continue
        for part in message["content"]:
            kind = part.get("type")
            if kind == "image_embeds":
                uuid = part.get("uuid")
                entry = params.get(uuid)
                verified &= entry is not None and entry.get("metadata") == part["image_embeds"]
                uuids.append(uuid)
            elif kind == "image_url":
                raw += 1
            elif kind == "text" and part["text"].startswith(EXPECT):
                expected = [uuid for uuid in part["text"][len(EXPECT) :].split(",") if uuid]
    verified &= uuids == expected and raw == 0
    return {"verified": verified, "images": len(uuids), "raw": raw}


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encode(payload) + b"\n\n"


async def _read(receive: Any) -> bytes | None:
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


async def _answer(send: Any, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# The sample ------------------------------------------------------------------------------------------


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def descriptors() -> tuple[int, int]:
    """(open descriptors, of which sockets)."""
    fds = sockets = 0
    for fd in os.listdir("/proc/self/fd"):
        fds += 1
        with contextlib.suppress(OSError):  # closed while listing
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return fds, sockets


def tasks() -> tuple[Counter[str], int]:
    """(running tasks, of which the middleware's own: those it started, named by anyio after their
    function): asyncio's all_tasks, or trio's task tree from its root, as anyio lists them."""
    names = Counter((task.name or "").rsplit(" ", 1)[0] for task in anyio.get_running_tasks())
    ours = sum(count for name, count in names.items() if name.startswith(_OURS))
    return names, ours


def metric_series() -> tuple[Counter[str], int, Counter[str]]:
    """(series of each epd_* metric, series of the whole default registry, the epd_encoder_* series of
    each value of the ``encoder`` label): every sample a scrape would carry."""
    ours: Counter[str] = Counter()
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return ours, 0, Counter()
    total = 0
    servers: Counter[str] = Counter()
    for metric in REGISTRY.collect():
        count = len(metric.samples)
        total += count
        if metric.name.startswith("epd_"):
            ours[metric.name] += count
            if metric.name.startswith("epd_encoder_"):
                servers.update(sample.labels.get("encoder", "") for sample in metric.samples)
    del servers[""]
    return ours, total, servers


def sample(app: EPDMiddleware, engine: Engine) -> dict[str, Any]:
    pipeline = app.pipeline
    client = app._transports._owned  # the built-in HTTP client, owned for the app's life
    origins = dict(client._origins) if client is not None else {}
    fds, sockets = descriptors()
    names, our_tasks = tasks()
    epd_series, all_series, labelled = metric_series()
    stats = pipeline.stats
    pool = pipeline.encoders
    return {
        "t": time.monotonic(),  # the system's clock, which the orchestrator reads too (not trio's own)
        "rss_mb": round(rss_mb(), 2),
        "fds": fds,
        "sockets": sockets,
        "tasks": sum(names.values()),
        "middleware_tasks": our_tasks,
        "pool_idle_connections": sum(len(origin.idle) for origin in origins.values()),
        "pool_origins": len(origins),
        "metric_series": sum(epd_series.values()),
        "metric_series_by_name": dict(epd_series),
        "series_by_encoder": dict(labelled),
        "member_urls": list(pool.members),
        "registry_series": all_series,
        "reuse_entries": len(pipeline.reuse),
        "reuse_hits": pipeline.reuse.hits,
        "members": len(pool.members),
        "health_records": len(pool._health),
        "stats_children": len(stats._children),
        "departed": len(stats._departed),
        "gc_objects": len(gc.get_objects()),
        "engine": dict(engine.seen),
        "counters": dict(stats.counters),
        "task_names": dict(names.most_common(12)),
    }


class WithStats:
    """``GET /soak/stats`` in front of the middleware; everything else goes to it."""

    def __init__(self, app: EPDMiddleware, engine: Engine) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/soak/stats":
            await _answer(send, 200, json.dumps(sample(self.app, self.engine)).encode())
            return
        await self.app(scope, receive, send)


def build(config: dict[str, Any]) -> WithStats:
    engine = Engine(config.get("stream_chunks", 4), config.get("chunk_gap_s", 0.002))
    options = EPDConfig.of_options(config["options"])
    # As a vLLM server without --allowed-media-domains or --allowed-local-media-path tells the
    # middleware (Host.of_vllm): any http(s) host, no local file. Outside vLLM no policy is known.
    host = dataclasses.replace(Host.outside(options), media_policy=MediaPolicy())
    return WithStats(EPDMiddleware(cast(ASGIApp, engine), config=options, host=host), engine)


def main() -> None:
    config = json.loads(sys.argv[1])
    app = build(config)
    port = config["port"]
    print("ready", flush=True)
    if config["backend"] == "asyncio":
        import uvicorn

        uvicorn.run(
            app,
            host="127.0.0.1",
            port=port,
            loop="uvloop",
            http="httptools",
            log_level="warning",
            access_log=False,
            lifespan="on",
        )
        return
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve

    hypercorn = Config()
    hypercorn.bind = [f"127.0.0.1:{port}"]
    hypercorn.accesslog = None
    hypercorn.loglevel = "WARNING"
    # hypercorn's default, and uvicorn's (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE): 5 s
    hypercorn.keep_alive_timeout = 5
    trio.run(serve, cast(Any, app), hypercorn)


if __name__ == "__main__":
    main()
