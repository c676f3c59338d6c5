"""End-to-end latency on real vLLM (CPU build, tiny model): E + PD and E + P + D with the middleware
against the same request to a single instance. Reported, not asserted: on a 2-core machine the
servers share the cores, and a vLLM CPU worker stays busy for about a second after each answer, so
requests are spaced out.

    EPD_VLLM_PYTHON=... .venv/bin/python -m benchmarks.real_vllm [--requests 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from epd_lab import servers as lab
from epd_lab.seed import NON_DEFAULT_OPTIONS, seed_image, seed_request


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--gap", type=float, default=1.5, help="seconds between requests")
    args = parser.parse_args()
    python, model = lab.prepared()
    with tempfile.TemporaryDirectory(prefix="epd-bench-") as tmp:
        root = Path(tmp)
        storage, kv = root / "ec", root / "kv"
        storage.mkdir()
        kv.mkdir()
        logs = root / "logs"
        encoder = lab.encoder_server(python, model, logs, storage)
        single = lab.single_server(python, model, logs)
        pd = lab.pd_server(python, model, logs, storage, [encoder.url])
        prefill = lab.pd_server(
            python, model, logs, storage, [encoder.url], via="none", name="prefill", kv=("kv_producer", kv)
        )
        decode = lab.pd_server(
            python,
            model,
            logs,
            storage,
            [encoder.url],
            name="decode",
            extra_env={"EPD_PREFILL": prefill.url},
            kv=("kv_consumer", kv),
        )
        deployments = {"single": single, "E + PD (epd)": pd, "E + P + D (epd)": decode}
        servers = [single, encoder, pd, prefill, decode]
        lab.start_all(servers, timeout=900)
        results: dict[str, dict[str, list[float]]] = {}
        try:
            for label, options in (("default", None), ("non-default", NON_DEFAULT_OPTIONS)):
                times: dict[str, list[float]] = {name: [] for name in deployments}
                for index in range(args.requests):
                    # A new image each time (a cache hit would flatter E + PD), the same one for both.
                    body = seed_request(lab.SERVED_MODEL, images=[seed_image(index * 3)], options=options)
                    for name, server in deployments.items():
                        time.sleep(args.gap)
                        start = time.perf_counter()
                        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
                        assert response.status_code == 200, response.text
                        times[name].append(time.perf_counter() - start)
                results[label] = times
        finally:
            lab.stop_all(servers)
    print(f"{'options':12} {'deployment':16} {'p50 ms':>8} {'min ms':>8} {'max ms':>8}")
    for label, times in results.items():
        for name, values in times.items():
            print(
                f"{label:12} {name:16} {statistics.median(values) * 1000:8.1f} "
                f"{min(values) * 1000:8.1f} {max(values) * 1000:8.1f}"
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
