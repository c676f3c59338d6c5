"""Fault injection under load: the figures of docs/resilience.md.

    .venv/bin/python -m benchmarks.fault_injection [--requests 2000] [--concurrency 64] [--json out.json]

Fake encoders in their own processes on loopback (one cycles through every fault: refused connections,
500s, hangs past the timeout, garbage, connections dropped mid-response), the PD app (a verifying fake
engine behind EPDMiddleware) served by hypercorn, on asyncio and on trio. Runs, side by side in one run:
no faults (3 healthy encoders), one faulty of 3, every encoder down with fallback "local", and with
"error". Reports correctness, errors, p50/p99 latency, throughput and leaks.
"""

from __future__ import annotations

import argparse
import json
import logging

import anyio

from epd_lab.servers import free_port
from tests.load.harness import encoder_processes, run_scenario

OPTIONS = {
    "encoder_timeout": 1.0,
    "eject_cooldown": 0.1,
    "max_eject_cooldown": 0.3,
    "health_check_interval": 0.5,
    "health_check_timeout": 0.3,
}


async def scenarios(backend: str, requests: int, concurrency: int) -> dict[str, object]:
    out: dict[str, object] = {}
    with encoder_processes(faulty=1, healthy=3) as urls:
        faulty, healthy = urls[0], urls[1:]
        out["no faults, 3 encoders"] = await run_scenario(
            backend, healthy, requests=requests, concurrency=concurrency, **OPTIONS
        )
        out["1 of 3 encoders failing every way"] = await run_scenario(
            backend, [faulty, *healthy[:2]], requests=requests, concurrency=concurrency, rounds=2, **OPTIONS
        )
    down = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    for policy in ("local", "error"):
        out[f"every encoder down, on_encoder_failure={policy}"] = await run_scenario(
            backend,
            down,
            requests=requests // 4,
            concurrency=concurrency,
            on_encoder_failure=policy,
            encode_deadline=2.0,
            **OPTIONS,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.disable(logging.WARNING)  # thousands of expected failover warnings
    results = {}
    for backend in ("asyncio", "trio"):
        results[backend] = anyio.run(scenarios, backend, args.requests, args.concurrency, backend=backend)
    header = (
        f"{'backend':8} {'scenario':48} {'sent':>5} {'correct':>7} {'fallbk':>6} {'errors':>14} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'rps':>6}  leaks"
    )
    print(header)
    for backend, per_backend in results.items():
        for name, scenario in per_backend.items():
            for index, round_ in enumerate(scenario["rounds"]):  # type: ignore[index]
                label = name if index == 0 else f"{name} (round {index + 1})"
                leaks = scenario["leaks"]  # type: ignore[index]
                print(
                    f"{backend:8} {label:48} {round_['sent']:>5} {round_['answered_correctly']:>7} "
                    f"{round_['fallback']:>6} {json.dumps(round_['errors_by_status']):>14} "
                    f"{round_['p50_ms']:>8} {round_['p99_ms']:>8} {round_['throughput_rps']:>6}  "
                    f"tasks {leaks['tasks_left_after_load']}/{leaks['tasks_left_after_shutdown']}, "
                    f"sockets {leaks['sockets_left_after_shutdown']}, "
                    f"rss +{leaks['rss_growth_mb_after_first_round']} MB"
                )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)


if __name__ == "__main__":
    main()
