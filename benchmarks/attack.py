"""One attacking client cannot take the encoders from an honest one: the load figure of docs/resilience.md.

    .venv/bin/python -m benchmarks.attack [--seconds 60] [--json out.json] [--plot out.png]
                                          [--baseline CHECKOUT] [--attack KIND] [--scale 0.25]
    .venv/bin/python -m benchmarks.attack --plot-from A.json B.json --plot out.png

Three fake encoders (``tests.load.fake_encoder_server``, each its own process on 127.0.0.1) answer as
vLLM 0.32 does: a non-base64 data URL 501 at once, an image host ending in ``.invalid`` 500 "Cannot
connect to host ..." after vLLM's fetch retries, anything else encoded. The PD server
(``benchmarks/attack_pd.py``: a fake engine behind the real EPDMiddleware, default options, served by
hypercorn) runs in its own process too, so that the same server can run another checkout's middleware
(``--baseline``, e.g. ``git worktree add /tmp/before-fix 49619b0``) and the load generator's CPU is not
the server's. Every run starts fresh processes. Only loopback addresses are used; the ``.invalid``
names are never looked up (the fake encoder reads the string).

Runs, each ``--seconds`` long, interleaved so the machine's drift affects both alike: ``alone`` (the
honest client at concurrency 4) and ``attacked`` (the same plus one attacker: a closed loop at
concurrency 1, no think time, alternating a non-base64 data URL and an image on an unresolvable host;
``--attack not-base64`` or ``unresolvable`` sends only the one), as A B B A; with ``--baseline`` as
A B A' B' B' A' B A. Reported per run: the honest client's success rate (200 with every image handed to
the engine as an encoder's reference), p50/p99 latency of its successful requests and throughput, the
attacker's requests and the statuses they got, the encoders in the pool (healthy members in
``/epd/status``) every second and at the end, and each encoder's ``failures_by_blame`` and
``ejections_averted``; then, per checkout, attacked over alone for success rate and p50 (pooled over the
runs of each kind), PASS when both are within 10%. ``--plot-from`` draws the saved figures of several
attacks side by side (matplotlib: the ``bench`` extra).

Service times. Full-scale figures from shared/design/placement-costs.md (Qwen2.5-VL-7B class; the
A100 rows where there is one), all multiplied by ``--scale`` (default 0.25, so that a 60 s run has
~1,700 honest requests while the honest latency stays over 10x the loopback's own cost on this 2-core
machine; the ratios are what the figure is about, and they do not depend on the unit of time):

- encoder call, fixed: 20 ms, concurrent (an encoder round trip "18-22 ms even on a cache hit",
  vllm#56242);
- encoder, per image: 55 ms in one of 1 encode slot (the ViT runs one batch at a time; ~55 ms is the
  A100 compute estimate for a 1024x1024 image, 1369 vision tokens, "ViT time, by compute"). The canary
  encode (a 56x56 image, 4 tokens) is charged as a full image, which overstates it;
- encoder, unresolvable image host: 5,000 ms, no encode slot (vLLM 0.32 ``connections.py``:
  VLLM_MEDIA_FETCH_MAX_RETRIES 3 attempts, sleeping _RETRY_BACKOFF_FACTOR**attempt = 1 s then 4 s
  between them; the fetch runs in the API server, not the engine);
- encoder, non-base64 data URL: 0 ms (``_load_data_url`` raises before any work);
- engine prefill, per image: 65 ms (~46 us per token, vllm#41267 on H100, for 1369 + ~40 tokens);
- engine decode: 32 output tokens x 11.9 ms TPOT = 381 ms (A100-80G, Qwen2.5-7B, batch 1, the
  Qwen2.5 speed benchmark), concurrent requests not slowed (decode at batch 4 is memory-bound).

So an honest request costs ~521 ms at full scale, ~130 ms at 0.25. Its image is a 150 KB random-noise
PNG (about 200 KB of base64; 20 distinct images in turn). The middleware runs with its defaults
(eject_after 3, eject_cooldown 2 s, health_check_interval 5 s, max_attempts 3, encoder_timeout 60 s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from math import nan
from pathlib import Path
from typing import Any

import anyio

from epd_lab.servers import free_port
from epd_middleware._http import HTTPClient, HTTPError

from .cpu_per_request import cpu_of, machine_busy, own_cpu
from .perf import chat_request, noise_png

ROOT = Path(__file__).resolve().parent.parent
HONEST_CONCURRENCY = 4
ENCODERS = 3
WITHIN = 0.10
# Full-scale service times (seconds), before --scale; sources in the module docstring.
FULL_SCALE = {
    "encoder_call_s": 0.020,
    "encoder_image_s": 0.055,
    "encoder_slots": 1,
    "unresolvable_host_s": 1.0 + 4.0,
    "prefill_per_image_s": 0.065,
    "decode_s": 32 * 0.0119,
}
_JSON = {"content-type": "application/json"}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)


@dataclass
class Processes:
    """The fake encoders and the PD server of one run."""

    checkout: Path
    scale: float
    log: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    encoders: list[str] = field(default_factory=list)
    pd: str = ""
    middleware_file: str = ""

    def start(self) -> None:
        costs = {
            "--call-ms": FULL_SCALE["encoder_call_s"] * 1000 * self.scale,
            "--image-ms": FULL_SCALE["encoder_image_s"] * 1000 * self.scale,
            "--slots": FULL_SCALE["encoder_slots"],
            "--fetch-fail-ms": FULL_SCALE["unresolvable_host_s"] * 1000 * self.scale,
        }
        flags = [str(item) for pair in costs.items() for item in pair]
        for _ in range(ENCODERS):
            port = free_port()
            args = [sys.executable, "-m", "tests.load.fake_encoder_server", str(port), *flags]
            proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE)
            self.procs.append(proc)
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == b"ready"
            self.encoders.append(f"http://127.0.0.1:{port}")
        port = free_port()
        config = {
            "encoders": self.encoders,
            "options": {},
            "prefill_s": FULL_SCALE["prefill_per_image_s"] * self.scale,
            "decode_s": FULL_SCALE["decode_s"] * self.scale,
        }
        with self.log.open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, str(ROOT / "benchmarks" / "attack_pd.py"), str(port), json.dumps(config)],
                cwd=self.checkout,
                env={**os.environ, "PYTHONPATH": str(self.checkout)},
                stdout=subprocess.PIPE,
                stderr=log,
            )
        self.procs.append(proc)
        assert proc.stdout is not None
        ready, _, self.middleware_file = proc.stdout.readline().decode().strip().partition(" ")
        assert ready == "ready", f"the PD server did not start: see {self.log}"
        self.pd = f"http://127.0.0.1:{port}"

    async def wait(self) -> None:
        client = HTTPClient(connect_timeout=1)
        try:
            for _ in range(300):
                try:
                    await client.request("GET", self.pd + "/epd/status")
                    return
                except HTTPError:
                    await anyio.sleep(0.05)
            raise RuntimeError(f"{self.pd} did not start")
        finally:
            await client.aclose()

    def cpu(self) -> dict[str, float]:
        out = {f"encoder {index + 1}": cpu_of(proc.pid) for index, proc in enumerate(self.procs[:-1])}
        out["pd server"] = cpu_of(self.procs[-1].pid)
        out["load generator"] = own_cpu()
        return out

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def honest_bodies() -> list[bytes]:
    return [chat_request([noise_png(150_000, seed)]) for seed in range(20)]


ATTACKS = {
    "alternate": ("not base64", "unresolvable host"),
    "not-base64": ("not base64",),
    "unresolvable": ("unresolvable host",),
}


def attack_body(index: int, attack: str) -> tuple[str, bytes]:
    """The attacker's ``index``-th request: for ``alternate`` a non-base64 data URL, then an image on a
    host that does not resolve, in turn (each a fresh URL)."""
    kinds = ATTACKS[attack]
    kind = kinds[index % len(kinds)]
    if kind == "not base64":
        return kind, chat_request([f"data:image/png,not-base64-{index}"])
    return kind, chat_request([f"http://img-{index}.attacker.invalid/cat.png"])


async def status_of(client: HTTPClient, pd: str) -> dict[str, Any]:
    status, body = await client.request("GET", pd + "/epd/status")
    assert status == 200, status
    answer: dict[str, Any] = json.loads(body)
    return answer


def in_pool(status: dict[str, Any]) -> int:
    return sum(entry["member"] and entry["healthy"] for entry in status["encoders"].values())


async def one_run(
    checkout: Path, attack: str | None, seconds: float, scale: float, log: Path
) -> dict[str, Any]:
    procs = Processes(checkout, scale, log)
    try:
        procs.start()
        await procs.wait()
        return await measure(procs, attack, seconds)
    finally:
        procs.stop()


async def measure(procs: Processes, attack: str | None, seconds: float) -> dict[str, Any]:
    bodies = honest_bodies()
    url = procs.pd + "/v1/chat/completions"
    honest: list[tuple[float, float, bool]] = []  # (finished at, latency, success)
    honest_statuses: Counter[str] = Counter()
    kinds = ATTACKS[attack] if attack else ()
    attacks: dict[str, Counter[str]] = {kind: Counter() for kind in kinds}
    attack_latency: dict[str, list[float]] = {kind: [] for kind in kinds}
    pool_per_second: list[int] = []
    unhealthy_seen: dict[str, str] = {}
    clients = [HTTPClient(connect_timeout=5) for _ in range(HONEST_CONCURRENCY + 2)]
    for client in clients[:HONEST_CONCURRENCY]:  # warm connections and the middleware's first calls
        status, _ = await client.request("POST", url, bodies[0], _JSON)
        assert status == 200, status
    cpu_before, machine_before = procs.cpu(), machine_busy()
    started = time.perf_counter()
    deadline = started + seconds
    counter = iter(range(10**9))

    async def honest_worker(client: HTTPClient) -> None:
        while time.perf_counter() < deadline:
            sent = time.perf_counter()
            try:
                status, payload = await client.request(
                    "POST", url, bodies[next(counter) % len(bodies)], _JSON
                )
                ok = status == 200 and bool(json.loads(payload)["verified"])
                honest_statuses[str(status) if status != 200 or ok else "200 unverified"] += 1
            except HTTPError as exc:
                ok = False
                honest_statuses[type(exc).__name__] += 1
            now = time.perf_counter()
            honest.append((now - started, now - sent, ok))

    async def attacker(client: HTTPClient, attack: str) -> None:
        for index in range(10**9):
            if time.perf_counter() >= deadline:
                return
            kind, body = attack_body(index, attack)
            sent = time.perf_counter()
            try:
                status, _ = await client.request("POST", url, body, _JSON)
                attacks[kind][str(status)] += 1
            except HTTPError as exc:
                attacks[kind][type(exc).__name__] += 1
            attack_latency[kind].append(time.perf_counter() - sent)

    async def poller(client: HTTPClient) -> None:
        for second in range(1, int(seconds) + 1):
            await anyio.sleep(max(0.0, started + second - time.perf_counter()))
            status = await status_of(client, procs.pd)
            pool_per_second.append(in_pool(status))
            for server, entry in status["encoders"].items():
                if not entry["healthy"] and server not in unhealthy_seen:
                    unhealthy_seen[server] = f"at {second} s: {entry['why_not']}"

    async with anyio.create_task_group() as group:
        for client in clients[:HONEST_CONCURRENCY]:
            group.start_soon(honest_worker, client)
        if attack:
            group.start_soon(attacker, clients[HONEST_CONCURRENCY], attack)
        group.start_soon(poller, clients[HONEST_CONCURRENCY + 1])
    wall = time.perf_counter() - started
    cpu_after, machine_after = procs.cpu(), machine_busy()
    final = await status_of(clients[0], procs.pd)
    encoder_stats = []
    for encoder in procs.encoders:
        _, body = await clients[0].request("GET", encoder + "/stats")
        encoder_stats.append(json.loads(body))
    for client in clients:
        await client.aclose()
    return summarise(
        honest,
        honest_statuses,
        attacks if attack else None,
        attack_latency,
        pool_per_second,
        unhealthy_seen,
        final,
        encoder_stats,
        wall,
        cpu={key: round(cpu_after[key] - cpu_before[key], 2) for key in cpu_after},
        machine_busy=(machine_after[0] - machine_before[0]) / max(1, machine_after[1] - machine_before[1]),
        middleware=procs.middleware_file,
    )


def summarise(
    honest: list[tuple[float, float, bool]],
    honest_statuses: Counter[str],
    attacks: dict[str, Counter[str]] | None,
    attack_latency: dict[str, list[float]],
    pool_per_second: list[int],
    unhealthy_seen: dict[str, str],
    final: dict[str, Any],
    encoder_stats: list[dict[str, Any]],
    wall: float,
    *,
    cpu: dict[str, float],
    machine_busy: float,
    middleware: str,
) -> dict[str, Any]:
    served = [latency for _, latency, ok in honest if ok]
    per_second: list[float | None] = []
    for second in range(len(pool_per_second)):
        bucket = [latency for at, latency, ok in honest if ok and second <= at < second + 1]
        per_second.append(round(statistics.median(bucket) * 1000, 1) if bucket else None)
    encoders = list(final["encoders"].values())
    out: dict[str, Any] = {
        "middleware": middleware,
        "wall_s": round(wall, 1),
        "honest": {
            "sent": len(honest),
            "succeeded": len(served),
            "success_rate": round(len(served) / len(honest), 4) if honest else None,
            "statuses": dict(sorted(honest_statuses.items())),
            "p50_ms": _pct(served, 0.5),
            "p99_ms": _pct(served, 0.99),
            # Over the honest client's own time: the run ends when the attacker's last request does.
            "throughput_rps": round(len(served) / max(at for at, _, _ in honest), 1) if honest else 0,
            "p50_ms_per_second": per_second,
        },
        "attacker": None,
        "encoders_in_pool": {
            "at_end": in_pool(final),
            "per_second": pool_per_second,
            "fewest": min(pool_per_second, default=None),
            "seconds_with_fewer_than_all": sum(count < ENCODERS for count in pool_per_second),
            "first_seen_unhealthy": unhealthy_seen,
        },
        # Absent (null) where the checkout's status page does not have them.
        "failures_by_blame": [entry.get("failures_by_blame") for entry in encoders],
        "ejections_averted": [entry.get("ejections_averted") for entry in encoders],
        "encoder_calls": [
            {key: stats.get(key, 0) for key in ("requests", "canaries", "501", "500")}
            for stats in encoder_stats
        ],
        "cpu_s": cpu,
        "machine_cpu_busy": round(machine_busy, 3),
        "_served": served,  # taken out before the JSON is written: pooled over runs for the ratios
    }
    if attacks is not None:
        out["attacker"] = {
            kind: {
                "sent": sum(statuses.values()),
                "statuses": dict(sorted(statuses.items())),
                "p50_ms": _pct(attack_latency[kind], 0.5),
            }
            for kind, statuses in attacks.items()
        }
    return out


def pooled(runs: list[dict[str, Any]], all_latencies: dict[int, list[float]]) -> dict[str, Any]:
    sent = sum(run["honest"]["sent"] for run in runs)
    succeeded = sum(run["honest"]["succeeded"] for run in runs)
    latencies = [value for run in runs for value in all_latencies[id(run)]]
    return {
        "success_rate": round(succeeded / sent, 4) if sent else None,
        "p50_ms": _pct(latencies, 0.5),
    }


def verdict(alone: dict[str, Any], attacked: dict[str, Any]) -> dict[str, Any]:
    def ratio(key: str) -> float | None:
        if not alone[key] or attacked[key] is None:
            return None
        return round(float(attacked[key]) / float(alone[key]), 3)

    success, p50 = ratio("success_rate"), ratio("p50_ms")
    within = all(value is not None and abs(value - 1) <= WITHIN for value in (success, p50))
    return {
        "alone": alone,
        "attacked": attacked,
        "success_rate_ratio": success,
        "p50_ratio": p50,
        "verdict": "PASS" if within else "FAIL",
    }


def schedule(baseline: Path | None) -> list[tuple[str, Path, bool]]:
    this = ("this", ROOT, False), ("this", ROOT, True)
    if baseline is None:
        order = [this[0], this[1], this[1], this[0]]
    else:
        before = ("before", baseline, False), ("before", baseline, True)
        order = [this[0], this[1], before[0], before[1], before[1], before[0], this[1], this[0]]
    return order


async def run_all(
    seconds: float, scale: float, attack: str, baseline: Path | None, log: Path
) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    latencies: dict[int, list[float]] = {}
    for code, checkout, attacked in schedule(baseline):
        label = f"{code}, {'attacked' if attacked else 'alone'}"
        print(f"run {len(runs) + 1}: {label} ({seconds:g} s) ...", flush=True)
        result = await one_run(checkout, attack if attacked else None, seconds, scale, log)
        result = {"code": code, "checkout": str(checkout), "attacked": attacked, **result}
        runs.append(result)
        print_run(len(runs), label, result)
        latencies[id(result)] = result.pop("_served", [])
    summary = {}
    for code in dict.fromkeys(run["code"] for run in runs):
        mine = [run for run in runs if run["code"] == code]
        summary[code] = verdict(
            pooled([run for run in mine if not run["attacked"]], latencies),
            pooled([run for run in mine if run["attacked"]], latencies),
        )
    return {
        "seconds": seconds,
        "scale": scale,
        "attack": attack,
        "full_scale_service_times_s": FULL_SCALE,
        "honest_concurrency": HONEST_CONCURRENCY,
        "encoders": ENCODERS,
        "runs": runs,
        "summary": summary,
    }


def print_run(number: int, label: str, run: dict[str, Any]) -> None:
    honest, pool = run["honest"], run["encoders_in_pool"]
    print(
        f"  honest: {honest['succeeded']}/{honest['sent']} ok ({honest['success_rate']}), "
        f"p50 {honest['p50_ms']} ms, p99 {honest['p99_ms']} ms, {honest['throughput_rps']} req/s, "
        f"statuses {honest['statuses']}"
    )
    if run["attacker"]:
        for kind, seen in run["attacker"].items():
            print(
                f"  attacker, {kind}: {seen['sent']} sent, statuses {seen['statuses']}, "
                f"p50 {seen['p50_ms']} ms"
            )
    print(
        f"  encoders in pool: {pool['at_end']} at the end, fewest {pool['fewest']}, "
        f"{pool['seconds_with_fewer_than_all']} s with fewer than {ENCODERS}; per second {pool['per_second']}"
    )
    print(f"  failures_by_blame {run['failures_by_blame']}, ejections_averted {run['ejections_averted']}")
    print(f"  encoder calls {run['encoder_calls']}")
    print(f"  CPU s {run['cpu_s']}, machine busy {run['machine_cpu_busy']:.0%}", flush=True)


ATTACK_TITLES = {
    "alternate": "attacker: non-base64 data URL and unresolvable host in turn",
    "not-base64": "attacker: non-base64 data URLs only (its fastest rate)",
    "unresolvable": "attacker: unresolvable hosts only",
}


def plot(all_results: list[dict[str, Any]], path: Path) -> None:
    """Per attack (a column): the honest p50 per second of every run, and the encoders in the pool."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {
        ("this", False): "tab:blue",
        ("this", True): "tab:orange",
        ("before", False): "tab:green",
        ("before", True): "tab:red",
    }
    columns = len(all_results)
    fig, axes = plt.subplots(2, columns, figsize=(7 * columns, 7), sharex="col", squeeze=False)
    for column, results in enumerate(all_results):
        top, bottom = axes[0][column], axes[1][column]
        seen: dict[tuple[str, bool], int] = {}
        for run in results["runs"]:
            key = (run["code"], run["attacked"])
            seen[key] = seen.get(key, 0) + 1
            name = {"this": "this code", "before": "before the fix"}[run["code"]]
            label = f"{name}, {'attacked' if run['attacked'] else 'alone'} (run {seen[key]})"
            style = "-" if seen[key] == 1 else "--"
            p50 = [nan if value is None else value for value in run["honest"]["p50_ms_per_second"]]
            pool = run["encoders_in_pool"]["per_second"]
            top.plot(
                range(1, len(p50) + 1), p50, style, marker=".", color=colours[key], label=label, linewidth=1.1
            )
            bottom.plot(
                range(1, len(pool) + 1),
                [count + 0.04 * (seen[key] - 1) for count in pool],  # two runs of a kind side by side
                style,
                color=colours[key],
                label=label,
                linewidth=1.1,
                drawstyle="steps-post",
            )
        top.set_title(ATTACK_TITLES[results["attack"]], fontsize=10)
        top.set_ylabel("honest p50 of each second (ms),\nsuccessful requests")
        top.set_ylim(bottom=0)
        top.grid(True, alpha=0.3)
        top.legend(fontsize=7, ncol=2)
        bottom.set_ylabel("encoders in the pool")
        bottom.set_xlabel("seconds into the run")
        bottom.set_ylim(-0.2, ENCODERS + 0.4)
        bottom.set_yticks(range(ENCODERS + 1))
        bottom.grid(True, alpha=0.3)
    fig.suptitle(
        f"An honest client at concurrency {HONEST_CONCURRENCY} and one attacker at concurrency 1, "
        f"{ENCODERS} encoders (benchmarks/attack.py)",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each run")
    parser.add_argument("--scale", type=float, default=0.25, help="service times: full scale times this")
    parser.add_argument(
        "--attack",
        choices=ATTACKS,
        default="alternate",
        help="what the attacker sends (default: both in turn)",
    )
    parser.add_argument("--baseline", type=Path, help="another checkout to run the same attack on")
    parser.add_argument("--json", help="write the raw figures here")
    parser.add_argument("--plot", help="write the per-second plot here (needs matplotlib: the bench extra)")
    parser.add_argument(
        "--plot-from", nargs="+", type=Path, help="no runs: plot these --json files side by side into --plot"
    )
    args = parser.parse_args()
    if args.plot_from:
        plot([json.loads(path.read_text()) for path in args.plot_from], Path(args.plot))
        return
    with tempfile.NamedTemporaryFile(prefix="attack-pd-", suffix=".log", delete=False) as log:
        print(f"PD server logs: {log.name}")
    results = anyio.run(run_all, args.seconds, args.scale, args.attack, args.baseline, Path(log.name))
    print()
    for code, summary in results["summary"].items():
        alone, attacked = summary["alone"], summary["attacked"]
        print(
            f"{code}: success rate {alone['success_rate']} alone, {attacked['success_rate']} attacked "
            f"(x{summary['success_rate_ratio']}); p50 {alone['p50_ms']} ms alone, {attacked['p50_ms']} ms "
            f"attacked (x{summary['p50_ratio']}): {summary['verdict']} (within {WITHIN:.0%})"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if args.plot:
        plot([results], Path(args.plot))


if __name__ == "__main__":
    main()
