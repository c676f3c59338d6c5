"""ECExampleConnector against ECMooncakeConnector on the same machine, in one run: two E + PD pairs
(the middleware in each PD through the endpoint plugin) started side by side, the same requests sent to
one pair and then the other, in rounds ordered A B B A so that drift in this shared machine's speed
falls on both. Per cell (concurrency x images per request): the PD's request latency (median) and
throughput (requests per second over the cell), the ratio Mooncake / shared files, and where vLLM says
the PD's time went (its own per-request histograms: queue, i.e. waiting for the embedding to arrive and
load; prefill, which includes ECExampleConnector's file read; decode), which separate the connector's
part from the decode time that CPU contention between the servers on this machine makes vary.

    EPD_VLLM_PYTHON=... .venv/bin/python -m benchmarks.connectors [--rounds 2] [--requests 8]

Every request carries images no other request had (no cache hit on either side). The Mooncake PD loads
the lab's V1-runner shim (without it an idle PD never loads a pushed embedding). Writes
docs/perf/connectors.json with ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from epd_lab import servers as lab
from epd_lab.seed import SQUARES, data_url, png_rgba, seed_request

_distinct = itertools.count()


def distinct_image() -> str:
    """An image no earlier call returned: the squares moved by a different (dx, dy) each time (dx stays
    where the rightmost square still fits in its rows)."""
    index = next(_distinct)
    dx, dy = index % 120, (index // 120) % 400
    return data_url(png_rgba(squares=[((x + dx, y + dy), color) for (x, y), color in SQUARES]))


PHASES = {
    "queue": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
}


def phase_totals(server: lab.VLLMServer) -> dict[str, tuple[float, float]]:
    """vLLM's (sum, count) of each phase histogram on the server, from its /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    totals = {}
    for phase, name in PHASES.items():
        found = [
            float(re.search(rf"^{re.escape(name)}_{part}(?:{{[^}}]*}})? (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
            for part in ("sum", "count")
        ]
        totals[phase] = (found[0], found[1])
    return totals


async def cell(server: lab.VLLMServer, images: int, concurrency: int, requests: int) -> dict[str, Any]:
    bodies = [
        seed_request(lab.SERVED_MODEL, images=[distinct_image() for _ in range(images)])
        for _ in range(requests)
    ]
    latencies: list[float] = []
    limiter = anyio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(body: dict[str, Any]) -> None:
            async with limiter:
                start = time.perf_counter()
                response = await client.post(f"{server.url}/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text
                latencies.append(time.perf_counter() - start)

        before = phase_totals(server)
        started = time.perf_counter()
        async with anyio.create_task_group() as group:
            for body in bodies:
                group.start_soon(one, body)
        wall = time.perf_counter() - started
        after = phase_totals(server)
    phases = {phase: [after[phase][i] - before[phase][i] for i in (0, 1)] for phase in PHASES}
    return {"latencies": latencies, "wall": wall, "phases": phases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="A B B A blocks per cell")
    parser.add_argument("--requests", type=int, default=8, help="requests per cell and connector per round")
    parser.add_argument("--gap", type=float, default=1.5, help="seconds of quiet before each cell")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    python, model = lab.prepared()
    with tempfile.TemporaryDirectory(prefix="epd-connectors-") as tmp:
        root = Path(tmp)
        storage, logs = root / "ec", root / "logs"
        storage.mkdir()
        pairs: dict[str, lab.VLLMServer] = {}
        servers: list[lab.VLLMServer] = []
        for connector in ("example", "mooncake"):
            encoder = lab.encoder_server(
                python, model, logs, storage, f"encoder-{connector}", connector=connector
            )
            pd = lab.pd_server(
                python, model, logs, storage, [encoder.url], name=f"pd-{connector}", connector=connector
            )
            pairs[connector] = pd
            servers += [encoder, pd]
        lab.start_all(servers, timeout=900)
        results: dict[str, dict[str, list[dict[str, Any]]]] = {}
        try:
            for images, concurrency in ((1, 1), (4, 1), (1, 8), (4, 8)):
                name = f"{images} image(s), concurrency {concurrency}"
                runs: dict[str, list[dict[str, Any]]] = {"example": [], "mooncake": []}
                for order in [("example", "mooncake", "mooncake", "example")] * args.rounds:
                    for connector in order:
                        time.sleep(args.gap)
                        runs[connector].append(
                            anyio.run(cell, pairs[connector], images, concurrency, args.requests)
                        )
                results[name] = runs
                print(summary(name, runs), flush=True)
        finally:
            lab.stop_all(servers)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


def summary(name: str, runs: dict[str, list[dict[str, Any]]]) -> str:
    figures = {}
    for connector, cells in runs.items():
        latency = statistics.median(value for run in cells for value in run["latencies"])
        throughput = sum(len(run["latencies"]) for run in cells) / sum(run["wall"] for run in cells)
        figures[connector] = (latency, throughput)
    (el, et), (ml, mt) = figures["example"], figures["mooncake"]
    lines = [
        f"{name:28} latency p50 example {el * 1000:7.0f} ms  mooncake {ml * 1000:7.0f} ms  "
        f"ratio {ml / el:4.2f} | throughput example {et:5.2f}/s  mooncake {mt:5.2f}/s  ratio {mt / et:4.2f}"
    ]
    for phase in PHASES:
        means = {}
        for connector, cells in runs.items():
            total = sum(run["phases"][phase][0] for run in cells)
            count = sum(run["phases"][phase][1] for run in cells)
            means[connector] = total / count * 1000 if count else float("nan")
        lines.append(
            f"{'':28}   vLLM {phase:7} mean example {means['example']:7.1f} ms  "
            f"mooncake {means['mooncake']:7.1f} ms"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
