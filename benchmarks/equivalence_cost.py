"""What the equivalence probe costs PD: throughput under load with probes running and without, side by
side on the same servers (real vLLM, CPU build, the lab's tiny model), interleaved rounds.

One encoder and one PD with the plugin (ECExampleConnector). A closed loop of ``--concurrency`` clients
sends the seed request with a new image each time. In "probing" rounds the benchmark asks PD for a probe
run (``POST /epd/status/equivalence``) every ``--every`` seconds, as the schedule would at that
interval; in "off" rounds it asks for none. The cost at any other interval follows from the cost of one
run (the throughput lost per run): at the default of the shipped manifests (600 s) it is that loss
spread over 600 s.

    EPD_VLLM_PYTHON=... .venv/bin/python -m benchmarks.equivalence_cost [--rounds 3] [--seconds 60]

Parameters and their sources: the servers are epd_lab's (``--dtype float32``, ``--enforce-eager``,
128 MiB of KV cache); the probe is the middleware's own (2 variants, 4 tokens, one PD-alone and one
E + PD request per variant and encoder); the load is the e2e seed request (one 800 x 600 image, 16
tokens out, greedy). On 2 cores the servers and the load generator share the CPU: the ratio is what is
reported, never an absolute rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from epd_lab import servers as lab
from epd_lab.seed import seed_image, seed_request

OUT = Path(__file__).resolve().parent.parent / "docs" / "perf" / "equivalence_cost.json"


def load_round(
    url: str, seconds: float, concurrency: int, start: int, probe_every: float | None
) -> dict[str, Any]:
    """One round: completed requests per second, and the probe runs made during it."""
    done = [0]
    stop = time.monotonic() + seconds
    lock = threading.Lock()
    counter = [start]

    def client() -> None:
        with httpx.Client(timeout=300) as http:
            while time.monotonic() < stop:
                with lock:
                    counter[0] += 1
                    index = counter[0]
                body = seed_request(lab.SERVED_MODEL, images=[seed_image(index % 97 + 1000 + index // 97)])
                response = http.post(f"{url}/v1/chat/completions", json=body)
                if response.status_code == 200 and time.monotonic() < stop:
                    with lock:
                        done[0] += 1

    runs = []
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    began = time.monotonic()
    if probe_every is not None:
        with httpx.Client(timeout=300) as http:
            next_at = began
            while time.monotonic() < stop:
                if time.monotonic() >= next_at:
                    report = http.post(f"{url}/epd/status/equivalence").json()
                    runs.append(report.get("ok"))
                    next_at += probe_every
                time.sleep(0.2)
    for thread in threads:
        thread.join()
    return {"rps": done[0] / seconds, "probe_runs": len(runs), "probe_results": runs, "next": counter[0]}


def summarize(rounds: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """The cost from interleaved rounds: each probing round against the mean of the off rounds beside
    it (throughput drifts over a run as the servers warm up; neighbours share the drift), the median of
    those ratios, and what one run costs in seconds of the whole server's capacity: (1 - ratio) over the
    runs per second; at an interval I that is a share of (seconds per run) / I."""
    ratios = []
    for index, entry in enumerate(rounds):
        if entry["mode"] != "probing":
            continue
        beside = [
            rounds[i]["rps"]
            for i in (index - 1, index + 1)
            if 0 <= i < len(rounds) and rounds[i]["mode"] == "off"
        ]
        ratios.append(round(entry["rps"] / statistics.mean(beside), 3))
    ratio = statistics.median(ratios)
    runs_per_second = statistics.mean(
        entry["probe_runs"] / seconds for entry in rounds if entry["mode"] == "probing"
    )
    seconds_per_run = (1 - ratio) / runs_per_second if runs_per_second else 0.0
    return {
        "pair_ratios": ratios,
        "ratio": ratio,
        "probe_runs_per_second": runs_per_second,
        "capacity_seconds_per_run": seconds_per_run,
        "share_at_600_s": seconds_per_run / 600,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--every", type=float, default=15.0, help="seconds between probe runs when probing")
    args = parser.parse_args()
    python, model = lab.prepared()
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as tmp:
        root = Path(tmp)
        storage, logs = root / "ec", root / "logs"
        storage.mkdir()
        encoder = lab.encoder_server(python, model, logs, storage)
        # The probe's own load rule would skip every run under this load (it waits while the engine has
        # 4 unfinished requests): the bound is raised so that each asked-for run is made.
        pd = lab.pd_server(
            python, model, logs, storage, [encoder.url], extra_env={"EPD_EQUIVALENCE_MAX_PD_LOAD": "64"}
        )
        lab.start_all([encoder, pd], timeout=900)
        rounds: list[dict[str, Any]] = []
        try:
            index = 0
            load_round(pd.url, 10, args.concurrency, index, None)  # warm-up, not reported
            for _ in range(args.rounds):
                for mode in ("off", "probing"):
                    result = load_round(
                        pd.url,
                        args.seconds,
                        args.concurrency,
                        index,
                        args.every if mode == "probing" else None,
                    )
                    index = result.pop("next")
                    rounds.append({"mode": mode, **result})
                    print(json.dumps(rounds[-1]), flush=True)
            page = httpx.get(f"{pd.url}/epd/status", timeout=30).json()["equivalence"]
        finally:
            lab.stop_all([encoder, pd])
    summary = {
        "parameters": vars(args),
        "rounds": rounds,
        **summarize(rounds, args.seconds),
        "probe_cost_on_the_status_page": page["cost"],
    }
    OUT.write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"probing every {args.every:g} s against off, pair by pair: ratios {summary['pair_ratios']}, "
        f"median {summary['ratio']:.3f}; one run costs {summary['capacity_seconds_per_run']:.2f} s of the "
        f"server's capacity, {summary['share_at_600_s']:.2%} of it at the 600 s interval"
    )


if __name__ == "__main__":
    main()
