"""The text tail at concurrency 64: is p99/p50 with the middleware the middleware's, or the rig's?

    .venv/bin/python -m benchmarks.text_tail [--rounds 12]

Runs two identical bare engines and the engine with EPDMiddleware side by side, sends each the same
text-only chat request at concurrency 64 in rotating order, round after round, first on fresh processes
and again after every process served media (one-image and eight-image requests: the middleware's the
client body, the bare engines the rewritten one). A text request passes through the middleware
unparsed, so its tail can only differ by what the process carries. If the middleware's p99/p50 lies
within the spread between the two identical bare engines, the tail is the rig's. Writes
docs/perf/text_tail.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import anyio

from epd_middleware._http import HTTPClient

from .perf import ROOT, Case, Rig, chat_request, load, noise_png, poster, prepare_direct

CONCURRENCY = 64
REQUESTS = 2000


def _summary(ratios: list[float], p50s: list[float]) -> dict[str, Any]:
    quartiles = statistics.quantiles(ratios, n=4)
    return {
        "p99_over_p50_median": round(statistics.median(ratios), 2),
        "p99_over_p50_iqr": [round(quartiles[0], 2), round(quartiles[2], 2)],
        "p50_ms_median": round(statistics.median(p50s), 2),
        "p99_over_p50_by_round": [round(ratio, 2) for ratio in ratios],
    }


async def _rounds(servers: dict[str, str], body: bytes, rounds: int) -> dict[str, Any]:
    ratios: dict[str, list[float]] = {name: [] for name in servers}
    p50s: dict[str, list[float]] = {name: [] for name in servers}
    names = list(servers)
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            sample = await load(poster(servers[name], body), REQUESTS, CONCURRENCY)
            ratios[name].append(sample.p99 / sample.p50)
            p50s[name].append(sample.p50)
    return {name: _summary(ratios[name], p50s[name]) for name in names}


async def main(rounds: int) -> dict[str, Any]:
    rig = Rig()
    try:
        encoder = rig.start("encoder")
        servers = {
            "bare A": rig.start("engine"),
            "bare B": rig.start("engine"),
            "epd": rig.start("engine+epd", encoder),
        }
        for url in servers.values():
            await rig.wait(url)
        text = chat_request([])
        results: dict[str, Any] = {"concurrency": CONCURRENCY, "requests_per_round": REQUESTS}
        results["fresh"] = await _rounds(servers, text, rounds)
        client = HTTPClient(connect_timeout=5)
        for images, count in ((1, 600), (8, 150)):
            case = Case(f"{images} image", chat_request([noise_png(150_000, 10 + i) for i in range(images)]))
            await prepare_direct(case, encoder, client)
            assert case.engine_body is not None
            for name, url in servers.items():
                await load(poster(url, case.body if name == "epd" else case.engine_body), count, 16)
        await client.aclose()
        results["after media"] = await _rounds(servers, text, rounds)
        return results
    finally:
        rig.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    args = parser.parse_args()
    out = anyio.run(main, args.rounds)
    for phase in ("fresh", "after media"):
        for name, figures in out[phase].items():
            print(
                f"{phase:12} {name:7} p99/p50 median {figures['p99_over_p50_median']:.2f} "
                f"IQR {figures['p99_over_p50_iqr'][0]:.2f}-{figures['p99_over_p50_iqr'][1]:.2f} "
                f"p50 {figures['p50_ms_median']:.1f} ms"
            )
    path = ROOT / "docs" / "perf" / "text_tail.json"
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
