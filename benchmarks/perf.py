"""The performance benchmark of docs/performance.md.

    .venv/bin/pip install -e ".[bench]"
    .venv/bin/python -m benchmarks.perf [--quick] [--out docs/perf]

Fake encoder and engine processes on loopback (uvicorn + uvloop + httptools, like vLLM), a load
generator in this process on the built-in HTTP client. Every measurement is taken side by side in one
run, in interleaved rounds; ratios are medians of per-round ratios. Variants:

- bare: text request straight to the engine (no middleware);
- direct: the floor. The load generator calls the encoder itself, then sends the engine the
  already-rewritten body with the handles (precomputed, so the floor pays no JSON work);
- epd: the request to the engine with EPDMiddleware inside it;
- proxy: the request to a separate forwarding hop (its own process, EPDMiddleware in front of a
  forwarder) that sends the rewritten body to the engine: one more HTTP round trip;
- relay: the least any design inside the engine process can do. The engine process receives the
  encoder's request, relays it unchanged to the encoder and runs the engine app once it answered: no
  parsing, hashing or rewriting. relay over direct is the price of the architecture; epd over relay is
  the price of this implementation of it.

Also in-process (no sockets): the middleware's own cost on pass-through bodies, and memory per
in-flight request.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import struct
import subprocess
import sys
import time
import tracemalloc
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from epd_lab.servers import free_port
from epd_middleware import EPDMiddleware
from epd_middleware._http import HTTPClient
from epd_middleware._plan import UuidKey
from epd_middleware._surfaces import openai_chat as chat

from .servers import encoder_request, engine_request

ROOT = Path(__file__).resolve().parent.parent
# Keyed as the middleware keys them (a keyed BLAKE3 hash costs what the unkeyed one does).
_UUID_KEY = UuidKey()
# glibc malloc told to keep freed memory rather than give it back to the system: multi-MB request bodies
# then reuse warm pages instead of faulting in fresh ones on every request (docs/deployment.md).
TUNED_MALLOC = {"MALLOC_TRIM_THRESHOLD_": str(256 << 20), "MALLOC_MMAP_THRESHOLD_": str(256 << 20)}
OPTIONS = {"mm_processor_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 50176}}}


# --- bodies ----------------------------------------------------------------------------------------


def noise_png(raw_bytes: int, seed: int) -> str:
    """A data URL of a random-noise RGB PNG with about ``raw_bytes`` of pixels (stored, so it does not
    compress: the base64 is about 4/3 of that)."""
    side = max(8, int((raw_bytes / 3) ** 0.5))
    rng = random.Random(seed)
    rows = b"".join(b"\x00" + rng.randbytes(side * 3) for _ in range(side))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(rows, 0))
        + chunk(b"IEND", b"")
    )
    import base64

    return "data:image/png;base64," + base64.b64encode(png).decode()


def chat_request(images: list[str], options: dict[str, Any] | None = None) -> bytes:
    content: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    content.append({"type": "text", "text": "Describe the objects and their colors in this image."})
    body = {
        "model": "bench",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": content},
        ],
        "temperature": 0,
        "max_tokens": 16,
        **(options or {}),
    }
    return json.dumps(body).encode()


@dataclass
class Case:
    name: str
    body: bytes
    encoder_body: bytes | None = None  # the direct path's encoder request
    engine_body: bytes | None = None  # the direct path's rewritten request


async def prepare_direct(case: Case, encoder: str, client: HTTPClient) -> None:
    """What the middleware would send the encoder and the engine, computed once, outside the timing."""
    request = chat.parse(case.body)
    if request is None or not request.media:
        case.engine_body = case.body  # no media: the floor is the bare engine
        return
    items, uuids, pieces = encoder_request(request, _UUID_KEY)
    case.encoder_body = pieces if isinstance(pieces, bytes) else b"".join(pieces)
    status, reply = await client.request("POST", f"{encoder}/v1/chat/completions", case.encoder_body)
    assert status == 200, reply
    case.engine_body = engine_request(encoder, request, items, uuids, reply)


# --- processes -------------------------------------------------------------------------------------


class Rig:
    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
        """Start one process of the rig; ``cwd``: another checkout of the project, whose package (found
        first from its own directory) the process runs instead of this one."""
        port = free_port()
        module = "tests.load.fake_encoder_server" if args[0] == "encoder" else "benchmarks.servers"
        argv = (
            [sys.executable, "-m", module, str(port), *args[1:]]
            if args[0] == "encoder"
            else [sys.executable, "-m", module, args[0], str(port), *args[1:]]
        )
        proc = subprocess.Popen(
            argv,
            cwd=cwd or ROOT,
            stdout=subprocess.DEVNULL if args[0] != "encoder" else subprocess.PIPE,
            env={**os.environ, **env} if env else None,
        )
        self.procs.append(proc)
        if args[0] == "encoder":
            assert proc.stdout is not None
            proc.stdout.readline()
        return f"http://127.0.0.1:{port}"

    async def wait(self, url: str) -> None:
        client = HTTPClient(connect_timeout=1)
        for _ in range(300):
            try:
                await client.request("GET", url + "/health")
                await client.aclose()
                return
            except Exception:
                await anyio.sleep(0.05)
        raise RuntimeError(f"{url} did not start")

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


# --- load ------------------------------------------------------------------------------------------


@dataclass
class Sample:
    latencies: list[float]
    wall: float

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies) * 1000

    @property
    def p99(self) -> float:
        values = sorted(self.latencies)
        return values[min(len(values) - 1, int(0.99 * len(values)))] * 1000

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.wall


async def load(send: Callable[[HTTPClient], Any], requests: int, concurrency: int) -> Sample:
    latencies: list[float] = []
    remaining = requests
    clients = [HTTPClient(connect_timeout=5) for _ in range(concurrency)]

    async def worker(client: HTTPClient) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            start = time.perf_counter()
            await send(client)
            latencies.append(time.perf_counter() - start)

    for client in clients:  # warm connections
        await send(client)
    start = time.perf_counter()
    async with anyio.create_task_group() as group:
        for client in clients:
            group.start_soon(worker, client)
    wall = time.perf_counter() - start
    for client in clients:
        await client.aclose()
    return Sample(latencies, wall)


def poster(url: str, body: bytes) -> Callable[[HTTPClient], Any]:
    async def send(client: HTTPClient) -> None:
        status, _ = await client.request(
            "POST", url + "/v1/chat/completions", body, {"content-type": "application/json"}
        )
        assert status == 200, status

    return send


def direct(encoder: str, engine: str, case: Case) -> Callable[[HTTPClient], Any]:
    assert case.engine_body is not None

    async def send(client: HTTPClient) -> None:
        if case.encoder_body is not None:
            status, _ = await client.request(
                "POST",
                encoder + "/v1/chat/completions",
                case.encoder_body,
                {"content-type": "application/json"},
            )
            assert status == 200
        status, _ = await client.request(
            "POST", engine + "/v1/chat/completions", case.engine_body, {"content-type": "application/json"}
        )
        assert status == 200

    return send


async def compare(
    variants: dict[str, Callable[[HTTPClient], Any]], *, requests: int, concurrency: int, rounds: int
) -> dict[str, list[Sample]]:
    """Interleaved rounds: every variant once per round, in a rotating order."""
    results: dict[str, list[Sample]] = {name: [] for name in variants}
    names = list(variants)
    for round_ in range(rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            results[name].append(await load(variants[name], requests, concurrency))
    return results


def summary(results: dict[str, list[Sample]], floor: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, samples in results.items():
        base = results[floor]
        out[name] = {
            "p50_ms": round(statistics.median(s.p50 for s in samples), 3),
            "p99_ms": round(statistics.median(s.p99 for s in samples), 3),
            "rps": round(statistics.median(s.rps for s in samples), 1),
            "p50_added_ms": round(
                statistics.median(s.p50 - b.p50 for s, b in zip(samples, base, strict=True)), 3
            ),
            "throughput_ratio": round(
                statistics.median(s.rps / b.rps for s, b in zip(samples, base, strict=True)), 3
            ),
            "p99_over_p50": round(statistics.median(s.p99 / s.p50 for s in samples), 2),
        }
    if "relay" in results and floor != "relay":
        relay = results["relay"]
        for name in ("epd", "proxy"):
            if name in results:
                pairs = list(zip(results[name], relay, strict=True))
                out[name]["p50_added_over_relay_ms"] = round(
                    statistics.median(s.p50 - r.p50 for s, r in pairs), 3
                )
                ratios = (s.rps / r.rps for s, r in pairs)
                out[name]["throughput_vs_relay"] = round(statistics.median(ratios), 3)
    return out


# --- in-process ------------------------------------------------------------------------------------


async def in_process_pass_through(iterations: int) -> dict[str, Any]:
    """The middleware's own cost on bodies without media: ASGI calls, no sockets."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    middleware = EPDMiddleware(app, encoders=["http://127.0.0.1:9"], health_check_interval=0)
    out: dict[str, Any] = {}
    for label, size in (("1 KB", 1_000), ("100 KB", 100_000)):
        text = "word " * (size // 5)
        body = json.dumps(
            {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": 8}
        ).encode()
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }

        async def receive(body: bytes = body) -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            pass

        timings = {}
        for name, target in (("bare", app), ("epd", middleware)):
            samples = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(iterations):
                    await target(scope, receive, send)
                samples.append((time.perf_counter() - start) / iterations)
            timings[name] = statistics.median(samples)
        start = time.perf_counter()
        for _ in range(iterations):
            chat.may_hold_media(body)
        scan = (time.perf_counter() - start) / iterations
        start = time.perf_counter()
        for _ in range(max(1, iterations // 10)):
            json.loads(body)
        stdlib_parse = (time.perf_counter() - start) / max(1, iterations // 10)
        out[label] = {
            "added_us": round((timings["epd"] - timings["bare"]) * 1e6, 2),
            "media_check_us": round(scan * 1e6, 2),
            "json_parse_it_would_cost_us": round(stdlib_parse * 1e6, 2),
        }
    return out


async def in_process_memory(encoder: str, image_bytes: int, in_flight: int) -> dict[str, Any]:
    """Peak memory the middleware holds per in-flight request, as a multiple of the request body."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    middleware = EPDMiddleware(app, encoders=[encoder], health_check_interval=0, max_body_bytes=1 << 30)
    bodies = [chat_request([noise_png(image_bytes, 1000 + i)]) for i in range(in_flight)]
    gc.collect()
    tracemalloc.start()
    baseline = tracemalloc.get_traced_memory()[0]

    async def one(body: bytes) -> None:
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await anyio.sleep_forever()
            raise AssertionError

        async def send(message: dict[str, Any]) -> None:
            pass

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "root_path": "",
            "headers": [(b"content-type", b"application/json")],
        }
        await middleware(scope, receive, send)

    async with anyio.create_task_group() as group:
        for body in bodies:
            group.start_soon(one, body)
    peak = tracemalloc.get_traced_memory()[1] - baseline
    tracemalloc.stop()
    body_size = statistics.mean(len(body) for body in bodies)
    return {
        "in_flight": in_flight,
        "body_bytes": int(body_size),
        "peak_bytes_per_request": int(peak / in_flight),
        "multiple_of_body": round(peak / in_flight / body_size, 2),
    }


# --- main ------------------------------------------------------------------------------------------


async def run(quick: bool, out_dir: Path) -> dict[str, Any]:
    scale = 0.25 if quick else 1.0
    rounds = 3 if quick else 7
    rig = Rig()
    results: dict[str, Any] = {}
    try:
        encoder = rig.start("encoder")
        engine = rig.start("engine")
        epd = rig.start("engine+epd", encoder)
        proxy = rig.start("proxy", engine, encoder)
        relay = rig.start("engine+relay", encoder)
        for url in (engine, epd, proxy, relay):
            await rig.wait(url)
        setup = HTTPClient(connect_timeout=5)
        cases = [
            Case("text", chat_request([])),
            Case("1 image", chat_request([noise_png(150_000, 1)])),
            Case("8 images", chat_request([noise_png(150_000, 10 + i) for i in range(8)])),
            Case("1 image + mm_processor_kwargs", chat_request([noise_png(150_000, 2)], OPTIONS)),
            Case(
                "8 images + mm_processor_kwargs",
                chat_request([noise_png(150_000, 20 + i) for i in range(8)], OPTIONS),
            ),
        ]
        for case in cases:
            await prepare_direct(case, encoder, setup)

        def variants(case: Case) -> dict[str, Callable[[HTTPClient], Any]]:
            out = {
                "direct": direct(encoder, engine, case),
                "epd": poster(epd, case.body),
                "proxy": poster(proxy, case.body),
            }
            if case.encoder_body is None:
                out["bare"] = poster(engine, case.body)
            else:
                out["relay"] = poster(relay, case.encoder_body)
            return out

        results["pass_through_in_process"] = await in_process_pass_through(int(20000 * scale))
        for concurrency, requests in ((1, 400), (16, 1200)):
            for case in cases:
                n = int(requests * scale / (4 if "8" in case.name else 1))
                measured = await compare(
                    variants(case), requests=max(n, 50), concurrency=concurrency, rounds=rounds
                )
                results[f"c{concurrency} {case.name}"] = summary(
                    measured, "bare" if case.encoder_body is None else "direct"
                )
                print(
                    f"c={concurrency:<3} {case.name:32} {json.dumps(results[f'c{concurrency} {case.name}'])}",
                    flush=True,
                )
        # The same media cases with every server process on a glibc malloc that keeps freed memory.
        t_encoder = rig.start("encoder", env=TUNED_MALLOC)
        t_engine = rig.start("engine", env=TUNED_MALLOC)
        t_epd = rig.start("engine+epd", t_encoder, env=TUNED_MALLOC)
        t_relay = rig.start("engine+relay", t_encoder, env=TUNED_MALLOC)
        for url in (t_engine, t_epd, t_relay):
            await rig.wait(url)
        for concurrency, requests in ((1, 400), (16, 1200)):
            for case in cases[1:3]:
                tuned = Case(case.name, case.body)
                await prepare_direct(tuned, t_encoder, setup)
                n = int(requests * scale / (4 if "8" in case.name else 1))
                measured = await compare(
                    {
                        "direct": direct(t_encoder, t_engine, tuned),
                        "epd": poster(t_epd, tuned.body),
                        "relay": poster(t_relay, tuned.encoder_body or b""),
                    },
                    requests=max(n, 50),
                    concurrency=concurrency,
                    rounds=rounds,
                )
                key = f"tuned malloc c{concurrency} {case.name}"
                results[key] = summary(measured, "direct")
                print(f"{key:40} {json.dumps(results[key])}", flush=True)

        for case in cases[:3]:
            # Beside the epd, the same concurrency on the bare engine (text) or the relay (media): the
            # tail of the rig itself (two cores under the load generator and every server).
            other = (
                {"bare": poster(engine, case.body)}
                if case.encoder_body is None
                else {"relay": poster(relay, case.encoder_body)}
            )
            measured = await compare(
                {"epd": poster(epd, case.body), **other},
                requests=int(2000 * scale),
                concurrency=64,
                rounds=rounds,
            )
            results[f"c64 {case.name}"] = summary(measured, "epd")
            print(f"c=64  {case.name:32} {json.dumps(results[f'c64 {case.name}'])}", flush=True)

        sizes = {"10 KB": 7_500, "100 KB": 75_000, "1 MB": 750_000, "10 MB": 7_500_000}
        results["scale_size"] = {}
        for label, raw in sizes.items():
            case = Case(label, chat_request([noise_png(raw, 99)]))
            await prepare_direct(case, encoder, setup)
            n = max(30, int((3000 if raw < 1_000_000 else 300 if raw < 5_000_000 else 60) * scale))
            measured = await compare(
                {
                    "direct": direct(encoder, engine, case),
                    "epd": poster(epd, case.body),
                    "proxy": poster(proxy, case.body),
                    "relay": poster(relay, case.encoder_body),
                },
                requests=n,
                concurrency=1,
                rounds=rounds,
            )
            results["scale_size"][label] = summary(measured, "direct")
            print(f"size {label:8} {json.dumps(results['scale_size'][label])}", flush=True)
        results["scale_items"] = {}
        for count in (1, 4, 16, 64):
            case = Case(str(count), chat_request([noise_png(7_500, 500 + i) for i in range(count)]))
            await prepare_direct(case, encoder, setup)
            measured = await compare(
                {
                    "direct": direct(encoder, engine, case),
                    "epd": poster(epd, case.body),
                    "proxy": poster(proxy, case.body),
                    "relay": poster(relay, case.encoder_body),
                },
                requests=max(30, int(800 * scale / max(1, count // 4))),
                concurrency=1,
                rounds=rounds,
            )
            results["scale_items"][str(count)] = summary(measured, "direct")
            print(f"items {count:3} {json.dumps(results['scale_items'][str(count)])}", flush=True)
        results["memory_per_in_flight_request"] = [
            await in_process_memory(encoder, raw, 32) for raw in (150_000, 1_500_000)
        ]
        print("memory", json.dumps(results["memory_per_in_flight_request"]), flush=True)
    finally:
        rig.stop()
    return results


def plot(results: dict[str, Any], out_dir: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, xlabel in (
        (axes[0], "scale_size", "image size (base64 of random-noise PNG)"),
        (axes[1], "scale_items", "images per request (10 KB each)"),
    ):
        labels = list(results[key])
        for variant, style in (("epd", "o-"), ("proxy", "s--"), ("relay", "^:")):
            ax.plot(
                labels,
                [results[key][label][variant]["p50_added_ms"] for label in labels],
                style,
                label=variant if variant != "relay" else "relay (least any in-engine design adds)",
            )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("p50 latency added over the direct floor (ms)")
        ax.set_yscale("symlog", linthresh=0.1)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle("What the middleware adds on top of the unavoidable encoder hop (concurrency 1)")
    fig.tight_layout()
    fig.savefig(out_dir / "scale.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer requests and rounds")
    parser.add_argument("--out", default=str(ROOT / "docs" / "perf"))
    args = parser.parse_args()
    os.environ.setdefault("PYTHONHASHSEED", "0")
    out_dir = Path(args.out)
    results = anyio.run(run, args.quick, out_dir, backend="asyncio", backend_options={"use_uvloop": True})
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "perf.json").write_text(json.dumps(results, indent=1))
    plot(results, out_dir)
    print(json.dumps(results["pass_through_in_process"], indent=1))


if __name__ == "__main__":
    main()
