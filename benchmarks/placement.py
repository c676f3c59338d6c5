"""Where to encode: ``placement`` remote, local and adaptive side by side, with the real EPDMiddleware
in the loop and the GPUs simulated by loopback fakes (issue 30, point 4).

    .venv/bin/python -m benchmarks.placement [--quick] [--json OUT] [--plot PNG]

The rig, every process on 127.0.0.1:
- **Encoders**: ``tests/load/fake_encoder_server.py`` processes with one slot each (an encoder runs one
  batch at a time; a call waits for the slot in arrival order: the encoder's queue), a fixed time per
  call outside the slot, and an encode time per vision token plus a fixed part in the slot; each answers
  ``image_grid_thw`` for the image's real size as vLLM's Qwen2.5-VL processor does.
- **The PD**: ``tests/load/fake_pd_engine.py`` under uvicorn with EPDMiddleware in front, one process per
  policy, every policy on the same encoders. One simulated GPU runs the steps: decode one token of every
  running request, chunked prefill, and any local encode inside the step (so every running request's
  next token waits for it); media that came as references costs its load in an extra step. The engine
  tells the middleware its unfinished requests through ``Host(engine_load=...)``, as vLLM's
  ``engine_client.get_num_unfinished_requests()`` does.
- **The load**: open loop, Poisson arrivals, streaming chat completions; TTFT and TPOT measured here,
  from the stream, per request.

Parameters (the GPU's; placement-costs.md in the design notes lists the sources, quoted here):

- vision tokens per image: Qwen2.5-VL's ``smart_resize``, 28 px a token side (448x448 -> 256,
  1024x1024 -> 1369). Hugging Face's image processor, preprocessor_config.json (min 3,136, max 12,845,056
  pixels).
- ViT time: 60 us a vision token. One 1080p image (2691 tokens) in at most 167 ms end to end on an H100
  (vllm#41267): (167 - 4) / 2691 = 61 us, an upper bound. The 4-image figure (466-524 ms on an H20,
  resolution not stated; LMSYS blog, EPD in SGLang) agrees for images of ~2,000 tokens.
- ViT fixed part: 4 ms a batch (the launch; 3-5 ms, placement-costs.md).
- encoder call: 20 ms fixed, outside the encoder's slot: an encoder round trip is 18-22 ms even on a
  cache hit (vllm#56242).
- encoders: 1, running one batch at a time (non-preemptive; placement-costs.md): 1 E + 1 PD, the
  project demo's deployment (``--encoders`` for more).
- decode step: 11.9 ms fixed (Qwen2.5-7B BF16, batch 1, A100-80G, vLLM 0.6.3: QwenLM's speed
  benchmark), plus 80 ns per context token of each running request (the same table: 12.4 ms at 6k
  context, 14.2 ms at 30k; (14.2 - 11.9) / 30k = 77 ns, (12.4 - 11.9) / 6k = 83 ns).
- prefill: 46 us a prompt token (126 ms for 2718 tokens on an H100, vllm#41267).
- embedding: 7,168 bytes a token (3584 x 2, bf16; Qwen2.5-VL-7B config.json), over a 20 GB/s link (RDMA:
  ~500 MB in ~25 ms, sglang#19575) after a 0.41 ms setup (a batched read of 16 KiB objects, p50,
  vllm#56242).
- step budget: 8192 tokens (the prefill chunk, and the encoder's budget), 1024 running requests at most:
  vLLM 0.32's defaults for the API server on H100/H200 (engine/arg_utils.py).
- a request: the chat template and a 64-character question (32 text tokens), 64 output tokens: the
  benchmark's choice.

Every time above is multiplied by ``--time-factor`` (default 2; the link rate divided by it) so that the
rig's own CPU (HTTP, the middleware, 2 cores shared by every process) stays small beside the simulated
GPU time; the figures are reported divided by it again (model time; offered load multiplied by it).

The sweep: two mixes (1 image of 448x448, 256 vision tokens; 4 images of 448x448, 672x672, 1024x1024
and 1280x720, 3,397 vision tokens), load points from idle to past the saturation of both single
policies (fractions of the larger of the estimated capacities of ``remote``, its encoder's, and
``local``, its PD's), the three policies interleaved at each point (A B C, then C B A), the same
arrivals and images for each; the middle point of each mix is run again at the end, on another draw
of its arrivals and images, to measure the run's noise. Writes
docs/perf/placement.json and docs/perf/placement.png, and prints the table of docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httptools
import httpx

from epd_lab.servers import free_port
from tests.load.fake_pd_engine import TEMPLATE_TOKENS, GPUCosts
from tests.load.vision_tokens import image_tokens, png_data_url

ROOT = Path(__file__).resolve().parents[1]
OUT_JSON = ROOT / "docs" / "perf" / "placement.json"
OUT_PLOT = ROOT / "docs" / "perf" / "placement.png"
E2E_LOCK = Path("/tmp/vllm-e2e.lock")
OWN_LOCK = Path("/tmp/placement-bench.lock")

POLICIES = ("remote", "local", "adaptive")

# The GPU, in seconds at time factor 1 (the table of the module docstring).
COSTS = GPUCosts(
    step_fixed_s=11.9e-3,
    context_token_s=80e-9,
    prefill_token_s=46e-6,
    vit_fixed_s=4e-3,
    vit_token_s=60e-6,
    load_setup_s=0.41e-3,
    link_bytes_per_s=20e9,
    embedding_bytes_per_token=3584 * 2,
    step_token_budget=8192,
    max_num_seqs=1024,
)
ENCODER_CALL_S = 20e-3
ENCODER_SLOTS = 1
QUESTION = "Describe what this picture shows, in one short paragraph, please."  # 64 characters
MAX_TOKENS = 64

MIXES: dict[str, list[tuple[int, int]]] = {
    "1 image 448x448": [(448, 448)],
    "4 images, mixed sizes": [(448, 448), (672, 672), (1024, 1024), (1280, 720)],
}


@dataclass(frozen=True)
class Plan:
    """How long and where a sweep runs."""

    fractions: tuple[float, ...]
    seconds: dict[str, float]  # arrivals per cell, by mix (wall time)
    repeat: bool


FULL = Plan((0.1, 0.3, 0.55, 0.8, 1.1), {"1 image 448x448": 10, "4 images, mixed sizes": 22}, True)
QUICK = Plan((0.15, 0.6, 1.1), {"1 image 448x448": 3, "4 images, mixed sizes": 4}, False)


# --- the workload ----------------------------------------------------------------------------------


def text_tokens() -> int:
    return TEMPLATE_TOKENS + math.ceil(len(QUESTION) / 4)


def capacities(mix: str, encoders: int) -> dict[str, float]:
    """Requests a second each policy could take at most (time factor 1): ``remote`` is bound by its
    encoders' time (or the PD's prefill and decode, whichever is less), ``local`` by the PD doing
    everything. Estimates from the costs alone, to place the load points; the step's fixed time, shared
    by every request of a step, is left out (the PD saturates somewhat earlier)."""
    sizes = MIXES[mix]
    vision = sum(image_tokens(w, h) for w, h in sizes)
    prompt = vision + text_tokens()
    c = COSTS
    decode = MAX_TOKENS * (prompt + MAX_TOKENS / 2) * c.context_token_s
    prefill = prompt * c.prefill_token_s
    encode = c.vit_fixed_s + vision * c.vit_token_s
    pd_remote = prefill + decode + c.load_s(vision)
    pd_local = prefill + decode + encode
    encoder = encoders * ENCODER_SLOTS / encode
    return {
        "encoders": encoder,
        "pd_remote": 1 / pd_remote,
        "remote": min(encoder, 1 / pd_remote),
        "local": 1 / pd_local,
    }


def request_body(sizes: list[tuple[int, int]], seed: int) -> bytes:
    parts: list[dict[str, Any]] = [
        {"type": "image_url", "image_url": {"url": png_data_url(w, h, seed * 16 + i)}}
        for i, (w, h) in enumerate(sizes)
    ]
    parts.append({"type": "text", "text": QUESTION})
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    return json.dumps(body).encode()


# --- the client ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    sent: float
    status: int = 0
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.tokens == MAX_TOKENS


class _Stream:
    """httptools callbacks: every SSE event but [DONE] is a token, stamped when its bytes arrived."""

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.buffer = b""
        self.now = 0.0
        self.complete = False

    def on_body(self, body: bytes) -> None:
        self.buffer += body
        *events, self.buffer = self.buffer.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: ") and event != b"data: [DONE]":
                if self.outcome.first is None:
                    self.outcome.first = self.now
                self.outcome.last = self.now
                self.outcome.tokens += 1
            elif not event.startswith(b"data: "):
                self.outcome.error = event[:300].decode(errors="replace")

    def on_message_complete(self) -> None:
        self.complete = True


async def stream_request(port: int, body: bytes) -> Outcome:
    outcome = Outcome(time.perf_counter())
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()
    protocol = _Stream(outcome)
    parser = httptools.HttpResponseParser(protocol)
    try:
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(head + body)
            while not protocol.complete:
                try:
                    data = await stream.receive(262144)
                except anyio.EndOfStream:
                    break
                protocol.now = time.perf_counter()
                parser.feed_data(data)
        outcome.status = parser.get_status_code()
        if outcome.status != 200 and outcome.error is None:
            outcome.error = protocol.buffer[:300].decode(errors="replace")
    except (OSError, anyio.BrokenResourceError, httptools.HttpParserError) as exc:
        outcome.error = repr(exc)
    return outcome


# --- one cell --------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank, as the other benchmarks of the project."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def delta(after: Any, before: Any) -> Any:
    """Numbers subtracted leaf by leaf (counters over one cell); anything else as it is after."""
    if isinstance(after, dict):
        return {key: delta(value, (before or {}).get(key)) for key, value in after.items()}
    if isinstance(after, (int, float)) and not isinstance(after, bool) and isinstance(before, (int, float)):
        return after - before
    return after


def placement_of(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the status page says about placement over one cell: the decisions taken in it (where and
    why), the thresholds, and the live signals as the cell ended."""
    section = after.get("placement") or {}
    decisions = delta(section.get("decisions") or {}, (before.get("placement") or {}).get("decisions"))
    return {
        "decisions": {key: value for key, value in decisions.items() if value},
        "thresholds": section.get("thresholds"),
        "at_end": {key: section.get(key) for key in ("pd_load", "encoders", "encoders_saturated")},
    }


@dataclass
class Cell:
    mix: str
    policy: str
    fraction: float
    rate: float  # model requests a second
    repeat: bool = False
    outcomes: list[Outcome] = field(default_factory=list)
    started: float = 0.0  # perf_counter
    window: float = 0.0  # seconds of arrivals (wall)
    wall: float = 0.0  # to the last answer
    status_before: dict[str, Any] = field(default_factory=dict)
    status_after: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    encoders: dict[str, Any] = field(default_factory=dict)

    def summary(self, factor: float) -> dict[str, Any]:
        ok = [o for o in self.outcomes if o.ok]
        ttft = [(o.first - o.sent) / factor * 1000 for o in ok if o.first is not None]
        tpot = [
            (o.last - o.first) / (o.tokens - 1) / factor * 1000
            for o in ok
            if o.first is not None and o.last is not None and o.tokens > 1
        ]
        errors: dict[str, int] = {}
        for o in self.outcomes:
            if not o.ok:
                key = f"{o.status} {o.error or ''}"[:160]
                errors[key] = errors.get(key, 0) + 1

        def ms(value: float | None) -> float | None:
            return round(value, 1) if value is not None else None

        engine = self.engine
        busy = engine.get("busy_s", 0.0)
        return {
            "mix": self.mix,
            "policy": self.policy,
            "load_fraction": self.fraction,
            "offered_rps": round(self.rate, 3),
            # The rate this cell's draw of Poisson arrivals came to.
            "arrived_rps": round(len(self.outcomes) / (self.window / factor), 3) if self.window else 0,
            "repeat": self.repeat,
            "sent": len(self.outcomes),
            "ok": len(ok),
            "errors": errors,
            "ttft_mean_ms": ms(sum(ttft) / len(ttft)) if ttft else None,
            "ttft_p50_ms": ms(percentile(ttft, 0.5)),
            "ttft_p99_ms": ms(percentile(ttft, 0.99)),
            "tpot_p50_ms": ms(percentile(tpot, 0.5)),
            "tpot_p99_ms": ms(percentile(tpot, 0.99)),
            # As vLLM's benchmark_serving: completed requests over the time to the last answer.
            "throughput_rps": round(len(ok) / (self.wall / factor), 3) if self.wall else 0,
            # Requests served at the rate they came: those whose first token came within the arrival
            # window, over the window (below the offered rate: the policy did not keep up).
            "first_token_rps": round(
                sum(1 for o in ok if o.first is not None and o.first - self.started <= self.window)
                / (self.window / factor),
                3,
            )
            if self.window
            else 0,
            "pd_gpu": {
                "busy_fraction": round(busy / self.wall, 3) if self.wall else None,
                "encode_share": round(engine.get("encode_s", 0) / busy, 3) if busy else None,
                "prefill_share": round(engine.get("prefill_s", 0) / busy, 3) if busy else None,
                # The engine's part of the TTFT (arrival at the engine to the first token), mean.
                "engine_ttft_mean_ms": round(
                    engine["first_token_s"] / engine["first_tokens"] / factor * 1000, 1
                )
                if engine.get("first_tokens")
                else None,
                # The load the middleware reads (the engine's unfinished requests), mean over the cell.
                "unfinished_mean": round(engine.get("unfinished_s", 0) / self.wall, 1) if self.wall else None,
                "requests_with_local_media": engine.get("local_requests"),
                "requests_with_references": engine.get("reference_requests"),
            },
            "encoder_items": self.encoders,
            "placement": placement_of(self.status_before, self.status_after),
        }


class Rig:
    """The processes: encoders shared by every policy, one PD per policy."""

    def __init__(self, factor: float, encoders: int, options: dict[str, Any]) -> None:
        self.factor = factor
        self.procs: list[subprocess.Popen[bytes]] = []
        self.encoders: list[str] = []
        self.pds: dict[str, int] = {}
        costs = COSTS.scaled(factor)
        for _ in range(encoders):
            port = free_port()
            args = [
                *("--slots", str(ENCODER_SLOTS), "--grid", "qwen2.5-vl"),
                *("--call-ms", str(ENCODER_CALL_S * factor * 1000)),
                *("--encode-fixed-ms", str(costs.vit_fixed_s * 1000)),
                *("--encode-token-us", str(costs.vit_token_s * 1e6)),
                *("--model", "bench"),
            ]
            proc = self._spawn("tests.load.fake_encoder_server", str(port), *args, stdout=subprocess.PIPE)
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == b"ready"
            self.encoders.append(f"http://127.0.0.1:{port}")
        for policy in POLICIES:
            port = free_port()
            self._spawn(
                "tests.load.fake_pd_engine",
                str(port),
                *("--costs", json.dumps(asdict(costs))),
                *("--encoders", ",".join(self.encoders)),
                *("--placement", policy),
                *("--options", json.dumps(options)),
            )
            self.pds[policy] = port

    def _spawn(self, module: str, *args: str, stdout: int | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdout=stdout)
        self.procs.append(proc)
        return proc

    async def ready(self) -> None:
        async with httpx.AsyncClient() as client:
            for port in self.pds.values():
                for _ in range(400):
                    try:
                        if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await anyio.sleep(0.05)
                else:
                    raise RuntimeError(f"the PD on port {port} did not start")

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    async def snapshot(self, policy: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        base = f"http://127.0.0.1:{self.pds[policy]}"
        async with httpx.AsyncClient(timeout=10) as client:
            status = (await client.get(f"{base}/epd/status")).json()
            engine = (await client.get(f"{base}/engine/stats")).json()
            served = {url: (await client.get(f"{url}/stats")).json()["items"] for url in self.encoders}
        return status, engine, served

    async def run_cell(self, cell: Cell, seconds: float, seed: int) -> None:
        """Poisson arrivals at the cell's rate for ``seconds`` (wall time); then every answer."""
        factor = self.factor
        rng = random.Random(seed)
        # A Poisson process given its count: the offered number of arrivals, each at a uniform time in
        # the window, so that a short cell's load is the load asked for, with Poisson's bursts.
        count = round(cell.rate / factor * seconds)
        arrivals = sorted(rng.uniform(0, seconds) for _ in range(count))
        sizes = MIXES[cell.mix]
        bodies = [request_body(sizes, seed * 100_000 + index) for index in range(len(arrivals))]
        cell.status_before, engine_before, served_before = await self.snapshot(cell.policy)
        port = self.pds[cell.policy]

        async def one(body: bytes) -> None:
            cell.outcomes.append(await stream_request(port, body))

        start = anyio.current_time()
        cell.started, cell.window = time.perf_counter(), seconds
        async with anyio.create_task_group() as group:
            for offset, body in zip(arrivals, bodies, strict=True):
                await anyio.sleep_until(start + offset)
                group.start_soon(one, body)
        cell.wall = anyio.current_time() - start
        cell.status_after, engine_after, served_after = await self.snapshot(cell.policy)
        cell.engine = delta(engine_after, engine_before)
        cell.encoders = {url: served_after[url] - served_before[url] for url in served_after}
        await anyio.sleep(0.2 * factor)  # the engine's last steps and the encoders' queues gone


# --- the sweep -------------------------------------------------------------------------------------


@contextmanager
def machine_lock() -> Iterator[None]:
    """Others run real vLLM on this machine at times: wait for them, and say when we run."""
    while E2E_LOCK.exists():
        print(f"waiting: {E2E_LOCK} exists", flush=True)
        time.sleep(30)
    OWN_LOCK.write_text(f"{os.getpid()}\n")
    try:
        yield
    finally:
        OWN_LOCK.unlink(missing_ok=True)


async def sweep(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    options = json.loads(args.options)
    cells: list[Cell] = []
    for mix_index, mix in enumerate(MIXES):
        # A fresh rig per mix: what a middleware learnt of one mix (its encoders' fastest call above
        # all) does not carry into the next, so each mix's figures stand alone.
        rig = Rig(args.time_factor, args.encoders, options)
        try:
            await rig.ready()
            caps = capacities(mix, args.encoders)
            top = max(caps["remote"], caps["local"])
            runs = [
                (fraction, fraction * top, 1000 * mix_index + i, False)
                for i, fraction in enumerate(plan.fractions)
            ]
            if plan.repeat:
                # The middle point again, on another draw of its arrivals and images: the run's noise.
                fraction, rate, seed, _ = runs[len(runs) // 2]
                runs.append((fraction, rate, seed + 500, True))
            for run_index, (fraction, rate, seed, repeat) in enumerate(runs):
                order = POLICIES if run_index % 2 == 0 else tuple(reversed(POLICIES))
                for policy in order:
                    cell = Cell(mix, policy, fraction, rate, repeat)
                    began = time.monotonic()
                    await rig.run_cell(cell, plan.seconds[mix], seed=seed)
                    cells.append(cell)
                    s = cell.summary(args.time_factor)
                    print(
                        f"{mix:21} {fraction:4.2f} {rate:6.2f}/s {policy:8} {'again' if repeat else '':5} "
                        f"ok {s['ok']}/{s['sent']} ttft p50 {s['ttft_p50_ms']} p99 {s['ttft_p99_ms']} "
                        f"tpot p99 {s['tpot_p99_ms']} ({time.monotonic() - began:.0f} s)",
                        flush=True,
                    )
        finally:
            rig.stop()
    return {
        "time_factor": args.time_factor,
        "encoders": args.encoders,
        "options": options,
        "costs": asdict(COSTS),
        "encoder_call_s": ENCODER_CALL_S,
        "encoder_slots": ENCODER_SLOTS,
        "max_tokens": MAX_TOKENS,
        "mixes": {
            mix: {"sizes": sizes, "capacity_rps": capacities(mix, args.encoders)}
            for mix, sizes in MIXES.items()
        },
        "plan": asdict(plan),
        "cells": [cell.summary(args.time_factor) for cell in cells],
    }


# --- the report ------------------------------------------------------------------------------------


def adaptive_over_best(by: dict[str, dict[str, Any]]) -> float | None:
    """Adaptive's TTFT p50 over the better of remote's and local's, at one point."""
    values = [by[p]["ttft_p50_ms"] for p in POLICIES if p in by]
    if len(values) != len(POLICIES) or None in values:
        return None
    return float(by["adaptive"]["ttft_p50_ms"] / min(by["remote"]["ttft_p50_ms"], by["local"]["ttft_p50_ms"]))


def noise(cells: list[dict[str, Any]], mix: str) -> dict[str, Any] | None:
    """The run's noise at the point run twice (two draws of its arrivals and images): how far the
    paired comparison, adaptive over the better of the others, moved between the draws (the verdict's
    tolerance), and how far each policy's TTFT p50 moved."""
    again = {c["policy"]: c for c in cells if c["mix"] == mix and c["repeat"]}
    if not again:
        return None
    fraction = next(iter(again.values()))["load_fraction"]
    first = {
        c["policy"]: c
        for c in cells
        if c["mix"] == mix and not c["repeat"] and c["load_fraction"] == fraction
    }
    ratios = adaptive_over_best(first), adaptive_over_best(again)
    if None in ratios:
        return None
    moved = {
        policy: round(abs(again[policy]["ttft_p50_ms"] / first[policy]["ttft_p50_ms"] - 1), 3)
        for policy in POLICIES
    }
    return {
        "load_fraction": fraction,
        "adaptive_over_best": [round(r, 3) for r in ratios if r is not None],
        "tolerance": round(abs(ratios[0] - ratios[1]), 3),  # type: ignore[operator]
        "ttft_p50_moved": moved,
    }


def verdicts(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's "done when", per mix and point: adaptive's TTFT p50 at or below the better of remote
    and local within the noise, and its TPOT p99 at most 10% above remote's."""
    cells = [c for c in result["cells"] if not c["repeat"]]
    rows = []
    for mix in result["mixes"]:
        measured = noise(result["cells"], mix)
        tolerance = measured["tolerance"] if measured else 0.0
        for fraction in sorted({c["load_fraction"] for c in cells if c["mix"] == mix}):
            by = {c["policy"]: c for c in cells if c["mix"] == mix and c["load_fraction"] == fraction}
            if set(by) != set(POLICIES) or any(by[p]["ttft_p50_ms"] is None for p in POLICIES):
                continue
            ratio = adaptive_over_best(by)
            adaptive = by["adaptive"]
            tpot_ok = None
            if adaptive["tpot_p99_ms"] is not None and by["remote"]["tpot_p99_ms"]:
                tpot_ok = adaptive["tpot_p99_ms"] <= 1.1 * by["remote"]["tpot_p99_ms"]
            rows.append(
                {
                    "mix": mix,
                    "load_fraction": fraction,
                    "ttft_p50_ms": {p: by[p]["ttft_p50_ms"] for p in POLICIES},
                    "tpot_p99_ms": {p: by[p]["tpot_p99_ms"] for p in POLICIES},
                    "ttft_adaptive_over_best": round(ratio, 3) if ratio is not None else None,
                    "ttft_ok": ratio is not None and ratio <= 1 + tolerance,
                    "tpot_adaptive_over_remote": round(
                        adaptive["tpot_p99_ms"] / by["remote"]["tpot_p99_ms"], 3
                    )
                    if tpot_ok is not None
                    else None,
                    "tpot_ok": tpot_ok,
                    "noise": round(tolerance, 3),
                }
            )
    return rows


def table(result: dict[str, Any]) -> str:
    lines = [
        "| mix | load | offered (arrived) req/s | policy | n | TTFT p50 ms | TTFT p99 ms | TPOT p99 ms "
        "| served req/s | placed (why) | PD GPU: busy, encoding |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    mixes = list(result["mixes"])
    ordered = sorted(
        result["cells"],
        key=lambda c: (mixes.index(c["mix"]), c["repeat"], c["load_fraction"], POLICIES.index(c["policy"])),
    )
    for c in ordered:
        gpu = c["pd_gpu"]
        decisions = ", ".join(f"{key} {count}" for key, count in sorted(c["placement"]["decisions"].items()))
        load = f"{c['load_fraction']:.2f}" + (" again" if c["repeat"] else "")
        lines.append(
            f"| {c['mix']} | {load} | {c['offered_rps']:.2f} ({c['arrived_rps']:.2f}) | {c['policy']} "
            f"| {c['ok']} | {c['ttft_p50_ms']} | {c['ttft_p99_ms']} | {c['tpot_p99_ms']} "
            f"| {c['first_token_rps']:.2f} | {decisions} | {gpu['busy_fraction']}, {gpu['encode_share']} |"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mixes = list(result["mixes"])
    figure, axes = plt.subplots(1, len(mixes), figsize=(6 * len(mixes), 4.2))
    cells = [c for c in result["cells"] if not c["repeat"]]
    for axis, mix in zip(axes, mixes, strict=True):
        for policy, style in zip(POLICIES, ("o-", "s--", "^-"), strict=True):
            points = sorted(
                (c["offered_rps"], c["ttft_p50_ms"])
                for c in cells
                if c["mix"] == mix and c["policy"] == policy and c["ttft_p50_ms"] is not None
            )
            axis.plot([x for x, _ in points], [y for _, y in points], style, label=policy)
        caps = result["mixes"][mix]["capacity_rps"]
        for name, color in (("remote", "C0"), ("local", "C1")):
            axis.axvline(caps[name], color=color, linestyle=":", linewidth=1)
        axis.set_title(f"{mix} (dotted: estimated capacity)")
        axis.set_xlabel("offered load, requests/s (Poisson; model time)")
        axis.set_ylabel("TTFT p50, ms (model time)")
        axis.set_yscale("log")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 load points, short cells, no repeat")
    parser.add_argument(
        "--json", type=Path, help=f"raw figures (default {OUT_JSON.relative_to(ROOT)}; none with --quick)"
    )
    parser.add_argument(
        "--plot", type=Path, help=f"the plot (default {OUT_PLOT.relative_to(ROOT)}; none with --quick)"
    )
    parser.add_argument("--time-factor", type=float, default=2.0)
    parser.add_argument("--encoders", type=int, default=1)
    parser.add_argument("--options", default="{}", help="further EPDMiddleware options, as JSON")
    parser.add_argument(
        "--report", type=Path, help="no run: the table, verdicts and plot of a JSON written before"
    )
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    if args.report is not None:
        result = json.loads(args.report.read_text())
    else:
        with machine_lock():
            result = anyio.run(sweep, args, plan)
    result["verdicts"] = verdicts(result)
    result["noise"] = {mix: noise(result["cells"], mix) for mix in result["mixes"]}
    print(table(result))
    print(json.dumps(result["verdicts"], indent=1))
    print(json.dumps(result["noise"], indent=1))
    default = args.quick or args.report is not None
    out_json = args.json or (None if default else OUT_JSON)
    out_plot = args.plot or (None if default else OUT_PLOT)
    if out_json is not None:
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(result, indent=1) + "\n")
    if out_plot is not None:
        plot(result, out_plot)


if __name__ == "__main__":
    main()
