"""Multi-turn chats with handle reuse on and off, on the perf rig (fake encoder and engine processes).

    .venv/bin/python -m benchmarks.multiturn [--turns 10] [--conversations 6] [--image-kb 200]

Each conversation has ``--turns`` turns; every turn resends the whole chat with one new image (about
``--image-kb`` KB of base64) in the new user message, as chat clients do. The fake encoder writes each
embedding where ECExampleConnector would, and the middleware checks it there, so reuse is on where it
would be in a real deployment. Measured per turn, side by side in one run (variants interleaved turn by
turn): bytes and calls that reached the encoder per request, p50 latency through the middleware with
reuse on and off, and the engine alone given the same client body (the single-instance floor for
receiving that body); "added" is the middleware's p50 minus the engine-alone p50. At concurrency 1 the
conversations run one after another; at concurrency 16, 16 conversations send each turn together.
Writes docs/perf/multiturn.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from epd_middleware._http import HTTPClient

from .perf import Rig, noise_png

OUT = Path(__file__).resolve().parents[1] / "docs" / "perf" / "multiturn.json"
VARIANTS = ("reuse on", "reuse off", "reuse on, client uuids", "engine alone")
MIDDLEWARE_VARIANTS = VARIANTS[:3]


def turn_body(images: list[str], turn: int, uuids: bool = False) -> bytes:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    for index in range(turn):
        content: list[dict[str, Any]] = [{"type": "text", "text": f"What is new in this picture ({index})?"}]
        part: dict[str, Any] = {"type": "image_url", "image_url": {"url": images[index]}}
        if uuids:  # the client names its media (trust_client_uuid): nothing to hash
            part["uuid"] = f"conversation-image-{abs(hash(images[index][-64:]))}"
        content.append(part)
        messages.append({"role": "user", "content": content})
        if index < turn - 1:
            messages.append({"role": "assistant", "content": f"Answer {index}."})
    return json.dumps({"model": "bench", "messages": messages, "temperature": 0, "max_tokens": 16}).encode()


async def stats(client: HTTPClient, encoder: str) -> dict[str, int]:
    status, body = await client.request("GET", f"{encoder}/stats")
    assert status == 200
    result: dict[str, int] = json.loads(body)
    return result


async def run(args: argparse.Namespace, concurrency: int, rig: Rig, urls: dict[str, str]) -> dict[str, Any]:
    conversations = max(args.conversations, concurrency)
    base = 1000 * concurrency
    images = [
        [noise_png(args.image_kb * 750, base + 100 * c + t) for t in range(args.turns)]
        for c in range(conversations)
    ]
    clients = [HTTPClient(connect_timeout=5) for _ in range(concurrency)]
    probe = HTTPClient(connect_timeout=5)
    latency: dict[tuple[str, int], list[float]] = {}
    sent: dict[tuple[str, int], dict[str, int]] = {}

    async def send(variant: str, body: bytes, client: HTTPClient, turn: int) -> None:
        started = time.perf_counter()
        status, _ = await client.request(
            "POST", f"{urls[variant]}/v1/chat/completions", body, {"content-type": "application/json"}
        )
        assert status == 200, status
        latency.setdefault((variant, turn), []).append(time.perf_counter() - started)

    # Warm every variant first (connections, allocator, caches) with images the run never sends.
    warm = [noise_png(args.image_kb * 750, 900_000 + index) for index in range(2)]
    for variant in VARIANTS:
        for turn in (1, 2):
            for client in clients:
                await send(variant, turn_body(warm, turn, uuids=variant.endswith("uuids")), client, 0)
    groups = [list(range(start, start + concurrency)) for start in range(0, conversations, concurrency)]
    for group in groups:
        for turn in range(1, args.turns + 1):
            for variant in VARIANTS:
                before = await stats(probe, urls["encoder"])
                async with anyio.create_task_group() as wave:
                    for slot, conversation in enumerate(group):
                        body = turn_body(images[conversation], turn, uuids=variant.endswith("uuids"))
                        wave.start_soon(send, variant, body, clients[slot], turn)
                after = await stats(probe, urls["encoder"])
                totals = sent.setdefault((variant, turn), {"requests": 0, "bytes": 0, "items": 0, "n": 0})
                for key in ("requests", "bytes", "items"):
                    totals[key] += after[key] - before[key]
                totals["n"] += len(group)
    for client in (*clients, probe):
        await client.aclose()
    rows = []
    for turn in range(1, args.turns + 1):
        engine = statistics.median(latency[("engine alone", turn)]) * 1000
        row: dict[str, Any] = {"turn": turn, "engine_alone_p50_ms": round(engine, 2)}
        for variant in MIDDLEWARE_VARIANTS:
            totals = sent[(variant, turn)]
            p50 = statistics.median(latency[(variant, turn)]) * 1000
            row[variant] = {
                "encoder_kb_per_request": round(totals["bytes"] / totals["n"] / 1024, 1),
                "encoder_calls_per_request": round(totals["requests"] / totals["n"], 2),
                "items_encoded_per_request": round(totals["items"] / totals["n"], 2),
                "p50_ms": round(p50, 2),
                "added_ms": round(p50 - engine, 2),
            }
        rows.append(row)
    return {"concurrency": concurrency, "conversations": conversations, "turns": rows}


def table(result: dict[str, Any]) -> str:
    lines = [
        f"concurrency {result['concurrency']} ({result['conversations']} conversations); per variant: "
        "encoder KB per request, encoder calls per request, p50 ms, added ms over the engine alone",
        f"{'turn':>4} | {'reuse on':^29} | {'reuse off':^29} | {'reuse on, client uuids':^29} | engine",
    ]
    for row in result["turns"]:
        cells = []
        for variant in MIDDLEWARE_VARIANTS:
            v = row[variant]
            cells.append(
                f"{v['encoder_kb_per_request']:>7} {v['encoder_calls_per_request']:>4} "
                f"{v['p50_ms']:>7} {v['added_ms']:>7}"
            )
        lines.append(f"{row['turn']:>4} | " + " | ".join(cells) + f" | {row['engine_alone_p50_ms']:>6}")
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> None:
    rig = Rig()
    with tempfile.TemporaryDirectory() as storage:
        try:
            encoder = rig.start("encoder", "--storage", storage)
            engine = rig.start("engine")
            on = rig.start(
                "engine+epd", encoder, env={"EPD_BENCH_OPTIONS": json.dumps({"ec_storage_path": storage})}
            )
            off = rig.start(
                "engine+epd",
                encoder,
                env={"EPD_BENCH_OPTIONS": json.dumps({"ec_storage_path": storage, "reuse_handles": False})},
            )
            for url in (engine, on, off):
                await rig.wait(url)
            uuids = rig.start(
                "engine+epd",
                encoder,
                env={
                    "EPD_BENCH_OPTIONS": json.dumps({"ec_storage_path": storage, "trust_client_uuid": True})
                },
            )
            await rig.wait(uuids)
            urls = {
                "encoder": encoder,
                "reuse on": on,
                "reuse off": off,
                "reuse on, client uuids": uuids,
                "engine alone": engine,
            }
            results = [await run(args, concurrency, rig, urls) for concurrency in (1, 16)]
        finally:
            rig.stop()
    for result in results:
        print(table(result))
        print()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--image-kb", type=int, default=200)
    anyio.run(main, parser.parse_args(), backend="asyncio", backend_options={"use_uvloop": True})
