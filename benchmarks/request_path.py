"""The request path against its targets, before and after a change, side by side in one run.

    .venv/bin/python -m benchmarks.request_path [--baseline CHECKOUT] [--rounds 7] [--scale 1]
                                                [--json docs/perf/request_path.json]
    .venv/bin/python -m benchmarks.request_path --plot-from docs/perf/request_path.json

The perf rig of ``benchmarks.perf`` (fake encoder and engine processes on loopback under uvicorn + uvloop
+ httptools, as vLLM runs; the load generator in this process), narrowed to what issue 38 item 2 set
targets for: a chat request with 1 and with 8 images of 150 KB (random-noise PNGs stored uncompressed,
~200 KB of base64 each), at concurrency 1 (p50 latency added over the direct floor) and 16 (throughput
against the floor). Variants, interleaved in rotating order in every round:

- direct: the floor (the load generator calls the encoder, then sends the engine the rewritten body);
- relay: the least an in-engine design can do (receive, relay to the encoder unchanged, run the engine);
- checked: the relay plus the checks and the hash no design may drop (every long string checked as JSON
  text, each hashed with BLAKE3): the floor of an in-engine design that does what the middleware must;
- rewrite: the checked relay's work plus every other step the middleware's work is made of (the encoder's
  body built, the answer read and matched, the engine's body written) and nothing around them: the floor
  of a design that rewrites both bodies;
- epd: this checkout's middleware in the engine process;
- before: with ``--baseline``, the middleware of another checkout (``git worktree add /tmp/before main``)
  in an engine process of its own, beside this one in the same rounds;
- proxy: a separate forwarding hop (this checkout's middleware in front of a forwarder).

Each figure is the median over rounds of the per-round figure against the floor of the same round (this
2-core machine's speed drifts by 10-20% within minutes). Targets (issue 38): 8 images add at most 2.5 ms
at c1 and reach at least 0.8x the floor's throughput at c16; 1 image at most 1 ms and 0.9x.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from epd_middleware._http import HTTPClient

from .perf import Case, Rig, chat_request, compare, direct, noise_png, poster, prepare_direct, summary

TARGETS = {
    "1 image": {"c1_added_ms": 1.0, "c16_ratio": 0.9},
    "8 images": {"c1_added_ms": 2.5, "c16_ratio": 0.8},
}


async def run(baseline: Path | None, rounds: int, scale: float) -> dict[str, Any]:
    rig = Rig()
    results: dict[str, Any] = {"rounds": rounds, "baseline": str(baseline) if baseline else None}
    try:
        encoder = rig.start("encoder")
        engine = rig.start("engine")
        epd = rig.start("engine+epd", encoder)
        relay = rig.start("engine+relay", encoder)
        checked = rig.start("engine+checked", encoder)
        rewrite = rig.start("engine+rewrite", encoder)
        proxy = rig.start("proxy", engine, encoder)
        before = rig.start("engine+epd", encoder, cwd=baseline) if baseline else None
        for url in (engine, epd, relay, checked, rewrite, proxy, *([before] if before else [])):
            await rig.wait(url)
        setup = HTTPClient(connect_timeout=5)
        cases = [
            Case("1 image", chat_request([noise_png(150_000, 1)])),
            Case("8 images", chat_request([noise_png(150_000, 10 + i) for i in range(8)])),
        ]
        for case in cases:
            await prepare_direct(case, encoder, setup)
        await setup.aclose()

        def variants(case: Case) -> dict[str, Callable[[HTTPClient], Any]]:
            assert case.encoder_body is not None
            out = {
                "direct": direct(encoder, engine, case),
                "relay": poster(relay, case.encoder_body),
                "checked": poster(checked, case.encoder_body),
                "rewrite": poster(rewrite, case.body),
                "epd": poster(epd, case.body),
                "proxy": poster(proxy, case.body),
            }
            if before:
                out["before"] = poster(before, case.body)
            return out

        for concurrency, requests in ((1, 400), (16, 1200)):
            for case in cases:
                n = max(50, int(requests * scale / (4 if case.name == "8 images" else 1)))
                measured = await compare(variants(case), requests=n, concurrency=concurrency, rounds=rounds)
                key = f"c{concurrency} {case.name}"
                results[key] = summary(measured, "direct")
                print(f"{key:12} {json.dumps(results[key])}", flush=True)
    finally:
        rig.stop()
    return results


def table(results: dict[str, Any]) -> str:
    """The markdown table: per body, c1 added p50 over the floor and c16 throughput against it."""
    names = [
        name
        for name in ("epd", "before", "relay", "checked", "rewrite", "proxy")
        if name in results["c1 1 image"]
    ]
    head = "| body | target | " + " | ".join(f"c1 {n} / c16 {n}" for n in names) + " |"
    lines = [head, "|" + "---|" * (2 + len(names))]
    for body, target in TARGETS.items():
        c1, c16 = results[f"c1 {body}"], results[f"c16 {body}"]
        cells = [f"+{c1[n]['p50_added_ms']:.2f} ms / {c16[n]['throughput_ratio']:.2f}x" for n in names]
        goal = f"<= +{target['c1_added_ms']} ms / >= {target['c16_ratio']}x"
        lines.append(f"| {body} | {goal} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Bars: p50 added over the floor at c1, and throughput against the floor at c16, per body and
    variant, with the targets as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [
        name
        for name in ("before", "epd", "relay", "checked", "rewrite", "proxy")
        if name in results["c1 1 image"]
    ]
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for axis, (key, field, label) in zip(
        axes,
        (
            ("c1", "p50_added_ms", "p50 added over the direct floor, c1 (ms)"),
            ("c16", "throughput_ratio", "throughput / floor, c16"),
        ),
        strict=True,
    ):
        for offset, body in enumerate(TARGETS):
            values = [results[f"{key} {body}"][name][field] for name in names]
            positions = [offset * (len(names) + 1) + index for index in range(len(names))]
            axis.bar(positions, values, color=[f"C{index}" for index in range(len(names))])
            target = TARGETS[body]["c1_added_ms" if key == "c1" else "c16_ratio"]
            axis.hlines(target, positions[0] - 0.5, positions[-1] + 0.5, colors="k", linestyles="dashed")
        axis.set_xticks([offset * (len(names) + 1) + (len(names) - 1) / 2 for offset in range(len(TARGETS))])
        axis.set_xticklabels(list(TARGETS))
        axis.set_title(label, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{index}") for index in range(len(names))]
    figure.legend(handles, names, loc="upper center", ncol=len(names))
    figure.text(0.5, 0.01, "dashed: issue 38's targets", ha="center", fontsize=8)
    figure.subplots_adjust(top=0.82, bottom=0.1)
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout, measured beside")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--scale", type=float, default=1.0, help="requests per round, times this")
    parser.add_argument("--json", type=Path, default=None, help="write the results here (and a PNG beside)")
    parser.add_argument("--plot-from", type=Path, default=None, help="only draw the table and plot of a JSON")
    args = parser.parse_args()
    if args.plot_from:
        results = json.loads(args.plot_from.read_text())
        plot(results, args.plot_from.with_suffix(".png"))
        print(table(results))
        return
    results = anyio.run(run, args.baseline, args.rounds, args.scale, backend_options={"use_uvloop": True})
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
        plot(results, args.json.with_suffix(".png"))


if __name__ == "__main__":
    main()
