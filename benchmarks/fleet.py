"""Figures of the fleet test at a larger size: three PD processes with the middleware (llm-d scheduler
mode, encoders found by DNS), fake encoders on their own loopback addresses, and a front playing the
gateway and the endpoint picker, while an encoder is added, one removed, one killed and DNS goes down.

    .venv/bin/python -m benchmarks.fleet [--requests N] [--rate R] [--concurrency C]

Prints, per anyio backend of the PD processes, the outcome of every kind of request, latency, the
middleware's counters summed over the PD processes, and the items each encoder encoded; writes
docs/perf/fleet.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import anyio

from tests.fleet.harness import fleet, pool_figures, run_load, summary

OUT = Path(__file__).resolve().parents[1] / "docs" / "perf" / "fleet.json"


async def one(backend: str, args: argparse.Namespace) -> dict[str, Any]:
    async with fleet(backend) as made:
        outcomes, wall = await run_load(made, args.requests, args.concurrency, rate=args.rate)
        statuses = await made.statuses()
        served = await made.served()
        return {
            **summary(outcomes, wall),
            "pools": pool_figures(statuses),
            "items_per_encoder": served,
            "connections_to_forged_targets": made.canary_connections,
            "events": made.events,
        }


async def main(args: argparse.Namespace) -> None:
    results = {backend: await one(backend, args) for backend in ("asyncio", "trio")}
    print(json.dumps(results, indent=1))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--rate", type=float, default=200)
    parser.add_argument("--concurrency", type=int, default=32)
    anyio.run(main, parser.parse_args())
