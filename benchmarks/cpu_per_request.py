"""CPU time per request in each process of the perf rig, at concurrency 16: where the work goes.

    .venv/bin/python -m benchmarks.cpu_per_request [--rounds N] [--scale K] [--baseline CHECKOUT]

Runs the fake encoder, the bare engine and the engine with EPDMiddleware as in ``benchmarks.perf``, sends
the same 1-image and 8-image requests the direct way (load generator -> encoder, then the rewritten
request -> engine), through the middleware, and through the rig's three in-engine floors (the relay, the
least an in-engine design can do; the checked relay, which also parses, checks and hashes; the rewrite
floor, which does every step of the middleware's work and nothing around them: ``benchmarks.servers``),
and reads each process's user + system CPU time from /proc before and after. On a machine whose cores
are all busy, throughput is bounded by the total. With ``--rounds`` above 1 the five paths run in
interleaved rounds and each figure is the median over rounds (this machine's speed drifts by 10-20%
within minutes: side by side in one run is what compares). ``--baseline`` adds one more path, the
middleware of another checkout of the project (``git worktree add /tmp/before <commit>``) in its own
engine process, in the same interleaved rounds: a change's cost, measured against what it replaced.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from pathlib import Path

import anyio

from epd_middleware._http import HTTPClient

from .perf import Case, Rig, chat_request, direct, load, noise_png, poster, prepare_direct

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_of(pid: int) -> float:
    """The user + system CPU seconds process ``pid`` has used (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine since boot, from /proc/stat (idle and iowait are not
    busy); the difference of two readings gives the machine's busy share over the time between."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def own_cpu() -> float:
    """The user + system CPU seconds this process has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def main(rounds: int, baseline: Path | None, scale: int) -> None:
    rig = Rig()
    try:
        encoder, engine = rig.start("encoder"), rig.start("engine")
        epd = rig.start("engine+epd", encoder)
        relay = rig.start("engine+relay", encoder)
        checked = rig.start("engine+checked", encoder)
        rewrite = rig.start("engine+rewrite", encoder)
        older = rig.start("engine+epd", encoder, cwd=baseline) if baseline else None
        for url in (engine, epd, relay, checked, rewrite, *([older] if older else [])):
            await rig.wait(url)
        pids = {
            "encoder": rig.procs[0].pid,
            "engine": rig.procs[1].pid,
            "engine+epd": rig.procs[2].pid,
            "engine+relay": rig.procs[3].pid,
            "engine+checked": rig.procs[4].pid,
            "engine+rewrite": rig.procs[5].pid,
        }
        if older:
            pids["engine+epd before"] = rig.procs[6].pid
        client = HTTPClient(connect_timeout=5)
        print(f"{'body':9} {'path':7} {'req/s':>6}  CPU ms per request by process")
        for images in (1, 8):
            case = Case(f"{images} image", chat_request([noise_png(150_000, 10 + i) for i in range(images)]))
            await prepare_direct(case, encoder, client)
            requests = (1200 if images == 1 else 300) * scale // rounds
            assert case.encoder_body is not None
            paths = {
                "direct": direct(encoder, engine, case),
                "epd": poster(epd, case.body),
                "relay": poster(relay, case.encoder_body),
                "checked": poster(checked, case.encoder_body),
                "rewrite": poster(rewrite, case.body),
            }
            if older:
                paths["before"] = poster(older, case.body)
            measured: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
            for _ in range(rounds):
                for name, send in paths.items():
                    before = {key: cpu_of(pid) for key, pid in pids.items()}
                    own, started = own_cpu(), time.perf_counter()
                    await load(send, requests, 16)
                    wall = time.perf_counter() - started
                    per = {key: (cpu_of(pid) - before[key]) / requests * 1000 for key, pid in pids.items()}
                    per["load generator"] = (own_cpu() - own) / requests * 1000
                    per["req/s"] = requests / wall
                    measured[name].append(per)
            for name, samples in measured.items():
                per = {key: statistics.median(sample[key] for sample in samples) for key in samples[0]}
                rate = per.pop("req/s")
                shares = ", ".join(f"{key} {value:.2f}" for key, value in per.items() if value >= 0.005)
                print(f"{case.name:9} {name:7} {rate:6.0f}  {shares}; total {sum(per.values()):.2f}")
    finally:
        rig.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--baseline", type=Path, default=None, help="another checkout to measure beside this one"
    )
    parser.add_argument("--scale", type=int, default=1, help="requests per figure, times this")
    arguments = parser.parse_args()
    anyio.run(main, arguments.rounds, arguments.baseline, arguments.scale)
