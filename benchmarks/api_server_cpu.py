"""CPU per request of vLLM's API-server process, on real vLLM (CPU build, tiny Qwen2-VL): a single
instance, E + PD with the middleware, and a PD without the middleware given the already-rewritten body.

    EPD_VLLM_PYTHON=... .venv/bin/python -m benchmarks.api_server_cpu [--requests 12]

The claim under test: with the metadata-only rewrite, PD's API server (middleware included) spends less
CPU per image request than a single instance's API server, which decodes and processes the pixels
itself; so the middleware costs vLLM's API server nothing net. Only the API-server process is measured
(every thread's time on CPU from /proc/PID/task/*/schedstat), not the engine core; what the process
spends while idle (its background threads), measured before each case, is taken off per second of the
request's wall time, since a request through the encoders takes longer. Each request carries new images
so no cache answers for it; 1 and 4 images, default and non-default options.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from epd_lab import servers as lab
from epd_lab.seed import NON_DEFAULT_OPTIONS, seed_image, seed_request
from epd_middleware._handles import match_reply, part_metadata, transfer_params
from epd_middleware._plan import UuidKey, media_items
from epd_middleware._surfaces import encode_fields
from epd_middleware._surfaces import openai_chat as chat

OUT = Path(__file__).resolve().parents[1] / "docs" / "perf" / "api_server_cpu.json"
_UUID_KEY = UuidKey()


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of the process, in nanoseconds' resolution (``/proc/PID/task/*/schedstat``;
    ``/proc/PID/stat`` counts in 10 ms ticks, too coarse for one request)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def idle_rate(server: lab.VLLMServer, seconds: float = 2.0) -> float:
    """CPU seconds per second the process spends with no request (its background threads)."""
    assert server.process is not None
    before = cpu_seconds(server.process.pid)
    time.sleep(seconds)
    return (cpu_seconds(server.process.pid) - before) / seconds


def rewritten(encoder: str, body: dict[str, Any]) -> dict[str, Any]:
    """What the middleware hands the engine for ``body``: encoded on ``encoder`` from here."""
    request = chat.parse(json.dumps(body).encode())
    assert request is not None
    items, uuids = media_items(
        request.media, trust_client_uuid=False, salt=None, pin_uuid=True, uuid_key=_UUID_KEY
    )
    encoder_body = b"".join(chat.SURFACE.encoder_body(request, [item.part for item in items]))
    reply = httpx.post(
        f"{encoder}/v1/chat/completions",
        content=encoder_body,
        headers={"content-type": "application/json"},
        timeout=300,
    ).json()
    handles = match_reply(encoder, items, reply["ec_transfer_params"])
    keys = [(part.modality, uuid) for part, uuid in zip(request.media, uuids, strict=True)]
    metadata = part_metadata(keys, handles, rewrite=True)
    result: dict[str, Any] = json.loads(
        encode_fields(chat.engine_fields(request, uuids, metadata, transfer_params(handles)))
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--gap", type=float, default=0.3, help="seconds between requests")
    args = parser.parse_args()
    python, model = lab.prepared()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="epd-cpu-") as tmp:
        root = Path(tmp)
        storage, logs = root / "ec", root / "logs"
        storage.mkdir()
        encoder = lab.encoder_server(python, model, logs, storage)
        single = lab.single_server(python, model, logs)
        pd = lab.pd_server(
            python, model, logs, storage, [encoder.url], extra_env={"EPD_REUSE_HANDLES": "false"}
        )
        plain = lab.pd_server(python, model, logs, storage, [encoder.url], via="none", name="pd-plain")
        servers = [single, encoder, pd, plain]
        lab.start_all(servers, timeout=900)
        shift = 0
        try:
            for images in (1, 4):
                for label, options in (("default", None), ("non-default", NON_DEFAULT_OPTIONS)):
                    case = f"{images} image{'s' if images > 1 else ''}, {label}"
                    used: dict[str, list[float]] = {"single": [], "E + PD, epd": [], "PD, rewritten body": []}
                    idle = {server.name: idle_rate(server) for server in (single, pd, plain)}
                    for _ in range(args.requests):
                        urls = [seed_image(shift + index) for index in range(images)]
                        shift = (shift + images) % 530
                        body = seed_request(lab.SERVED_MODEL, images=urls, options=options)
                        direct = rewritten(encoder.url, body)  # encoded outside the measurement
                        for name, server, payload in (
                            ("single", single, body),
                            ("E + PD, epd", pd, body),
                            ("PD, rewritten body", plain, direct),
                        ):
                            assert server.process is not None
                            time.sleep(args.gap)
                            before, started = cpu_seconds(server.process.pid), time.perf_counter()
                            response = httpx.post(
                                f"{server.url}/v1/chat/completions", json=payload, timeout=300
                            )
                            assert response.status_code == 200, response.text
                            time.sleep(0.2)  # the API server's own work after the answer (detokenizing)
                            wall = time.perf_counter() - started
                            spent = cpu_seconds(server.process.pid) - before
                            used[name].append(spent - idle[server.name] * wall)
                    results[case] = {
                        name: round(statistics.mean(values) * 1000, 1) for name, values in used.items()
                    }
                    print(case, results[case], flush=True)
        finally:
            lab.stop_all(servers)
    print(
        f"\n{'case':24} {'single':>8} {'E+PD epd':>9} {'PD rewritten':>13}   ms of API-server CPU per request"
    )
    for case, row in results.items():
        print(f"{case:24} {row['single']:8.1f} {row['E + PD, epd']:9.1f} {row['PD, rewritten body']:13.1f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"args": vars(args), "ms_per_request": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
