"""Load over real loopback sockets: fake encoders in their own processes, the PD app (fake engine +
EPDMiddleware) served by hypercorn on the test's own event loop (asyncio or trio), and an httpx load
generator. Used by tests/test_load.py and benchmarks/fault_injection.py."""

from __future__ import annotations

import base64
import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
from hypercorn.config import Config as HypercornConfig
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from epd_lab.servers import free_port
from epd_middleware import EPDMiddleware

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def encoder_processes(faulty: int, healthy: int, phase: float = 0.4) -> Iterator[list[str]]:
    """Start fake encoders; the first ``faulty`` cycle through every fault. Yields their URLs."""
    procs: list[subprocess.Popen[bytes]] = []
    urls: list[str] = []
    try:
        for index in range(faulty + healthy):
            port = free_port()
            args = [sys.executable, "-m", "tests.load.fake_encoder_server", str(port)]
            if index < faulty:
                args += ["--faults", str(phase)]
            proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE)
            procs.append(proc)
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == b"ready"
            urls.append(f"http://127.0.0.1:{port}")
        yield urls
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def verifying_engine() -> Starlette:
    """Answers 200 with ``verified`` true when the body is what a correct middleware hands the engine:
    every image a metadata-only reference whose handle sits in ec_transfer_params, or (fallback) the
    original image with its uuid."""

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        params = body.get("ec_transfer_params") or {}
        verified, fallback = True, False
        for message in body["messages"]:
            if not isinstance(message["content"], list):
                continue
            for part in message["content"]:
                if part["type"] == "image_embeds":
                    verified &= (
                        part["uuid"] in params and params[part["uuid"]]["metadata"] == part["image_embeds"]
                    )
                elif part["type"] == "image_url":
                    fallback = True
                    verified &= bool(part.get("uuid")) and part["image_url"]["url"].startswith(
                        "data:image/png"
                    )
        return JSONResponse({"verified": verified, "fallback": fallback})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def request_body(seed: int, size: int = 20_000) -> bytes:
    data = base64.b64encode(bytes((seed * 7919 + i * 31) % 251 for i in range(size))).decode()
    return json.dumps(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                        {"type": "text", "text": "Describe."},
                    ],
                }
            ],
            "max_tokens": 8,
        }
    ).encode()


@asynccontextmanager
async def serve(app: Any, backend: str) -> AsyncIterator[str]:
    """Serve ``app`` with hypercorn on this event loop (lifespan included); yields its URL."""
    port = free_port()
    config = HypercornConfig()
    config.bind = [f"127.0.0.1:{port}"]
    config.loglevel = "WARNING"
    config.accesslog = None
    config.errorlog = None
    config.keep_alive_timeout = 30
    stop = anyio.Event()
    if backend == "trio":
        from hypercorn.trio import serve as hypercorn_serve
    else:
        from hypercorn.asyncio import serve as hypercorn_serve  # type: ignore[assignment]
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: hypercorn_serve(app, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient() as client:
            for _ in range(200):
                try:
                    await client.get(f"{url}/health")
                    break
                except httpx.TransportError:
                    await anyio.sleep(0.02)
        try:
            yield url
        finally:
            stop.set()


@dataclass
class LoadResult:
    sent: int = 0
    verified: int = 0
    fallback: int = 0
    errors: dict[int, int] = field(default_factory=dict)
    unclear_errors: int = 0
    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0

    def pct(self, q: float) -> float:
        values = sorted(self.latencies)
        return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "answered_correctly": self.verified,
            "fallback": self.fallback,
            "errors_by_status": dict(sorted(self.errors.items())),
            "errors_without_clear_json": self.unclear_errors,
            "p50_ms": round(self.pct(0.5), 2),
            "p99_ms": round(self.pct(0.99), 2),
            "max_ms": round(max(self.latencies, default=0) * 1000, 2),
            "throughput_rps": round(self.sent / self.wall, 1) if self.wall else 0,
        }


async def generate_load(url: str, requests: int, concurrency: int, distinct: int = 50) -> LoadResult:
    bodies = [request_body(seed) for seed in range(distinct)]
    result = LoadResult()
    next_index = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def worker() -> None:
            nonlocal next_index
            while next_index < requests:
                index = next_index
                next_index += 1
                start = time.perf_counter()
                response = await client.post(
                    f"{url}/v1/chat/completions",
                    content=bodies[index % distinct],
                    headers={"content-type": "application/json"},
                )
                result.latencies.append(time.perf_counter() - start)
                result.sent += 1
                if response.status_code == 200:
                    payload = response.json()
                    result.verified += bool(payload["verified"])
                    result.fallback += bool(payload["fallback"])
                else:
                    result.errors[response.status_code] = result.errors.get(response.status_code, 0) + 1
                    try:
                        error = response.json()["error"]
                        clear = bool(error["message"]) and error["code"] == response.status_code
                    except (ValueError, KeyError, TypeError):
                        clear = False
                    result.unclear_errors += not clear

        start = time.perf_counter()
        async with anyio.create_task_group() as group:
            for _ in range(concurrency):
                group.start_soon(worker)
        result.wall = time.perf_counter() - start
    return result


_OUR_CODE = ("/epd_middleware/", "/httpx/", "/httpcore/")


def middleware_tasks() -> int:
    """Running tasks whose code is the middleware's or its HTTP client's (the server's own per-connection
    tasks are not ours to count)."""
    count = 0
    for task in anyio.get_running_tasks():
        code = getattr(task.coro, "cr_code", None)
        filename = code.co_filename if code is not None else ""
        count += any(part in filename for part in _OUR_CODE)
    return count


def open_sockets() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # an fd closed while listing
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def run_scenario(
    backend: str,
    encoders: list[str],
    *,
    requests: int,
    concurrency: int,
    rounds: int = 1,
    **options: Any,
) -> dict[str, Any]:
    """Serve the app with the middleware, run ``rounds`` of load, and report results and leaks."""
    gc.collect()
    sockets_before, tasks_before = open_sockets(), middleware_tasks()
    app = EPDMiddleware(verifying_engine(), encoders=encoders, **options)
    rounds_out: list[dict[str, Any]] = []
    rss: list[float] = []
    async with serve(app, backend) as url:
        tasks_serving = middleware_tasks()
        for _ in range(rounds):
            result = await generate_load(url, requests, concurrency)
            rounds_out.append(result.summary())
            gc.collect()
            rss.append(rss_mb())
        await anyio.sleep(0.2)
        tasks_after_load = middleware_tasks()
    await anyio.sleep(0.2)
    gc.collect()
    return {
        "backend": backend,
        "rounds": rounds_out,
        "encoder_health": app.pipeline.encoders.snapshot(anyio.current_time()),
        "counters": dict(app.pipeline.counters),
        "leaks": {
            "tasks_left_after_load": tasks_after_load - tasks_serving,
            "tasks_left_after_shutdown": middleware_tasks() - tasks_before,
            "middleware_tasks_while_serving_idle": tasks_serving,
            "sockets_left_after_shutdown": open_sockets() - sockets_before,
            "rss_growth_mb_after_first_round": round(rss[-1] - rss[0], 1) if len(rss) > 1 else None,
        },
    }
