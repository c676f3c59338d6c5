"""CPU per call of the built-in HTTP client, beside other clients, in one run.

    .venv/bin/python -m benchmarks.http_client [--against NAME=FILE ...] [--calls N] [--rounds R]

The server is the perf rig's fake encoder (uvicorn + uvloop + httptools, another process); the caller
runs on uvloop, as inside vLLM's API server, and makes ``--calls`` sequential keep-alive calls per
round with a 200 KB body (an encoder call with one image) and with a 1 KB body (a prefill call without
media). Reported: this process's user + system CPU per call (median over interleaved rounds), and each
client's ratio to the built-in one. ``--against`` loads another client module from a file, for
before/after comparisons: ``--against before=<(git show REV:epd_middleware/_http.py)``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import resource
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx

from epd_middleware._http import HTTPClient

from .perf import Rig

Call = Callable[[str, bytes], Awaitable[None]]


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _load_client(path: str) -> Any:
    source = Path(path).read_bytes()  # also a process substitution, read once
    with tempfile.NamedTemporaryFile("wb", suffix=".py", delete=False) as file:
        file.write(source)
    spec = importlib.util.spec_from_file_location(f"_bench_client_{abs(hash(path))}", file.name)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.HTTPClient


def _ours(client_class: Any) -> Callable[[], tuple[Call, Callable[[], Awaitable[None]]]]:
    def make() -> tuple[Call, Callable[[], Awaitable[None]]]:
        client = client_class(connect_timeout=5)

        async def call(url: str, body: bytes) -> None:
            status, _ = await client.request("POST", url, body, {"content-type": "application/json"})
            assert status == 200, status

        return call, client.aclose

    return make


def _httpx() -> tuple[Call, Callable[[], Awaitable[None]]]:
    client = httpx.AsyncClient(timeout=30)

    async def call(url: str, body: bytes) -> None:
        response = await client.post(url, content=body, headers={"content-type": "application/json"})
        assert response.status_code == 200, response.status_code

    return call, client.aclose


def _encoder_body(size: int) -> bytes:
    url = "data:image/png;base64," + "A" * size
    part = {"type": "image_url", "image_url": {"url": url}, "uuid": "u0"}
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": [part]}]}).encode()


async def main(args: argparse.Namespace) -> None:
    clients: dict[str, Callable[[], tuple[Call, Callable[[], Awaitable[None]]]]] = {
        "built-in": _ours(HTTPClient)
    }
    for spec in args.against:
        name, _, path = spec.partition("=")
        clients[name] = _ours(_load_client(path))
    if args.httpx:
        clients["httpx"] = _httpx
    rig = Rig()
    try:
        encoder = rig.start("encoder")
        await rig.wait(encoder)
        url = f"{encoder}/v1/chat/completions"
        bodies = {"200 KB": _encoder_body(200_000), "1 KB": _encoder_body(1000)}
        samples: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for size, body in bodies.items():
                for name, make in clients.items():
                    call, close = make()
                    for _ in range(50):  # warm: connection, caches
                        await call(url, body)
                    started = _cpu()
                    for _ in range(args.calls):
                        await call(url, body)
                    samples.setdefault((size, name), []).append((_cpu() - started) / args.calls * 1e6)
                    await close()
        print(f"{'body':7} {'client':10} {'us CPU/call':>12} {'vs built-in':>12}")
        for size in bodies:
            base = statistics.median(samples[(size, "built-in")])
            for name in clients:
                value = statistics.median(samples[(size, name)])
                print(f"{size:7} {name:10} {value:12.1f} {value / base:11.2f}x")
    finally:
        rig.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--against", action="append", default=[], metavar="NAME=FILE")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--httpx", action="store_true", help="also measure httpx.AsyncClient")
    anyio.run(main, parser.parse_args(), backend="asyncio", backend_options={"use_uvloop": True})
