"""A fake vLLM encoder on a real loopback socket, in its own process, that can misbehave at the socket
level: refuse connections, answer 500, hang, answer garbage, or drop the connection mid-response.

    python -m tests.load.fake_encoder_server PORT [--faults SECONDS] [--host ADDRESS] [--storage DIR]
                                                  [--model NAME] [--call-ms MS] [--image-ms MS]
                                                  [--slots N] [--fetch-fail-ms MS]
                                                  [--encode-fixed-ms MS] [--encode-token-us US]
                                                  [--grid fixed|qwen2.5-vl]

With --faults it cycles through every fault in turn, SECONDS each, and never answers correctly.
With --storage it writes each embedding it reports where ECExampleConnector would
(DIR/<hash>/encoder_cache.safetensors). ``GET /stats`` answers what it served (requests, items, body
bytes, media failures, canary encodes). Only the standard library, so the misbehaviour is exactly what
is written here.

Media it cannot load gets vLLM 0.32's answer, as every real encoder gives it: a data URL that is not
base64 501 "Only base64 data URLs are supported for now." (NotImplementedError, at once), an image host
ending in ``.invalid`` 500 with aiohttp's "Cannot connect to host HOST:PORT ssl:default [Name or service
not known]" (InternalServerError) after --fetch-fail-ms, the time vLLM's fetch retries take. The name is
never looked up: the fake reads only the string.

Service time (all 0 by default: answers at once): --call-ms per call, concurrent (the API server's part
of a call), then, in one of --slots encode slots (the ViT: one batch at a time; the other calls wait
their turn in arrival order, the encoder's queue), --image-ms per image plus --encode-fixed-ms plus
--encode-token-us per vision token of the call's images (benchmarks/placement.py). ``--grid
qwen2.5-vl`` reports each image's ``image_grid_thw`` from its size as Qwen2.5-VL's processor computes
it (tests/load/vision_tokens.py), instead of the fixed [1, 26, 36]. ``GET /load`` answers
``{"server_load": N}`` as vLLM does under ``--enable-server-load-tracking`` (the requests being
served), and ``GET /metrics`` vLLM's ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time

from tests.load.vision_tokens import grid_thw, png_size, tokens_of_grid

FAULTS = ("refuse", "500", "hang", "garbage", "drop")
# The middleware's canary encode (epd_middleware/_canary.py), counted apart in /stats.
CANARY_UUID = "epd-canary-v1"
NOT_BASE64 = "Only base64 data URLs are supported for now."


def media_failure(body: dict) -> tuple[int, dict] | None:
    """vLLM 0.32's answer to a request whose media it cannot load (multimodal/media/connector.py
    ``_load_data_url``, aiohttp's ClientConnectorDNSError as ``_wrap_media_fetch_error`` lets it out;
    status and type from entrypoints/serve/exception_handling/error_response.py); None when it loads."""
    for part in body["messages"][0]["content"]:
        url = (part.get("image_url") or {}).get("url", "")
        if url[:5].lower() == "data:" and not url.partition(",")[0].endswith(";base64"):
            return 501, vllm_error(NOT_BASE64, "NotImplementedError", 501)
        scheme, _, rest = url.partition("://")
        host, _, port = rest.split("/", 1)[0].rpartition("@")[2].partition(":")
        if host.lower().endswith(".invalid"):
            port = port or ("443" if scheme.lower() == "https" else "80")
            said = f"Cannot connect to host {host}:{port} ssl:default [Name or service not known]"
            return 500, vllm_error(said, "InternalServerError", 500)
    return None


def vllm_error(message: str, kind: str, status: int) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def derived_hash(model: str, uuid: str, body: dict) -> str:
    factors = {k: body[k] for k in ("mm_processor_kwargs", "media_io_kwargs") if body.get(k)}
    if not factors:
        return uuid
    return hashlib.sha256(
        json.dumps({"m": model, "u": uuid, **factors}, sort_keys=True).encode()
    ).hexdigest()[:40]


def grid_of(part: dict, grid: str) -> list[int]:
    """The image's ``image_grid_thw``: the fixed one, or (qwen2.5-vl) from the size of a PNG data URL;
    media whose size is not read here gets the fixed one."""
    if grid == "fixed":
        return [1, 26, 36]
    try:
        return grid_thw(*png_size((part.get("image_url") or {}).get("url", "")))
    except (ValueError, IndexError):
        return [1, 26, 36]


def reply(body: dict, request_id: str = "random-id", grid: str = "fixed") -> bytes:
    entries = {}
    for index, part in enumerate(body["messages"][0]["content"]):
        entries[derived_hash(body["model"], part["uuid"], body)] = {
            "item_indices": [index],
            "metadata": {"image_grid_thw": grid_of(part, grid)},
        }
    answer = {"id": f"chatcmpl-{request_id}", "choices": [], "ec_transfer_params": entries}  # as vLLM's
    return json.dumps(answer).encode()


def response(status: int, payload: bytes) -> bytes:
    reason = {200: "OK", 500: "Internal Server Error", 501: "Not Implemented"}[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


class Encoder:
    def __init__(
        self,
        port: int,
        phase: float | None,
        host: str = "127.0.0.1",
        storage: str | None = None,
        cost: dict[str, float] | None = None,
    ) -> None:
        self.port = port
        self.host = host
        self.phase = phase
        self.storage = storage
        self.models = ["m", "bench", "tiny-qwen2-vl"]
        self.served = {"requests": 0, "items": 0, "bytes": 0, "canaries": 0, "501": 0, "500": 0}
        cost = cost or {}
        self.call_s = cost.get("call_ms", 0.0) / 1000
        self.image_s = cost.get("image_ms", 0.0) / 1000
        self.fetch_fail_s = cost.get("fetch_fail_ms", 0.0) / 1000
        self.encode_fixed_s = cost.get("encode_fixed_ms", 0.0) / 1000
        self.encode_token_s = cost.get("encode_token_us", 0.0) / 1e6
        self.slots = asyncio.Semaphore(int(cost.get("slots", 1)))
        self.grid = "fixed"
        self.in_flight = 0  # calls being served (GET /load)
        self.encoding = 0  # of which in a slot
        self.started = time.monotonic()
        self.server: asyncio.base_events.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    def metrics(self) -> bytes:
        labels = f'{{engine="0",model_name="{self.models[0]}"}}'
        return (
            f"vllm:num_requests_running{labels} {float(self.encoding)}\n"
            f"vllm:num_requests_waiting{labels} {float(self.in_flight - self.encoding)}\n"
        ).encode()

    def store(self, entries: dict) -> None:
        """As ECExampleConnector: the file exists when the answer goes out (a few microseconds)."""
        for mm_hash in entries:
            os.makedirs(os.path.join(self.storage or "", mm_hash), exist_ok=True)
            with open(os.path.join(self.storage or "", mm_hash, "encoder_cache.safetensors"), "wb"):
                pass

    def mode(self) -> str:
        if self.phase is None:
            return "ok"
        return FAULTS[int((time.monotonic() - self.started) / self.phase) % len(FAULTS)]

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                _, path, _ = lines[0].split(" ", 2)
                length, request_id = 0, "random-id"
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                    elif name.lower() == "x-request-id":
                        request_id = value.strip()
                body = await reader.readexactly(length) if length else b""
                if path == "/health":
                    writer.write(response(200, b"") if self.mode() == "ok" else response(500, b"{}"))
                    await writer.drain()
                    continue
                if path == "/v1/models":
                    cards = [{"id": name, "root": name} for name in self.models]
                    writer.write(response(200, json.dumps({"object": "list", "data": cards}).encode()))
                    await writer.drain()
                    continue
                if path == "/stats":
                    writer.write(response(200, json.dumps(self.served).encode()))
                    await writer.drain()
                    continue
                if path == "/load":
                    writer.write(response(200, json.dumps({"server_load": self.in_flight}).encode()))
                    await writer.drain()
                    continue
                if path == "/metrics":
                    writer.write(response(200, self.metrics()))
                    await writer.drain()
                    continue
                mode = self.mode()
                if mode == "ok":
                    request = json.loads(body)
                    failed = media_failure(request)
                    if failed is not None:
                        status, error = failed
                        self.served[str(status)] += 1
                        if status == 500:
                            await asyncio.sleep(self.fetch_fail_s)
                        writer.write(response(status, json.dumps(error).encode()))
                        await writer.drain()
                        continue
                    self.in_flight += 1
                    try:
                        await self.encode(request, len(body))
                    finally:
                        self.in_flight -= 1
                    answer = reply(request, request_id, self.grid)
                    if self.storage is not None:
                        self.store(json.loads(answer)["ec_transfer_params"])
                    writer.write(response(200, answer))
                elif mode == "500":
                    writer.write(response(500, b'{"error": {"message": "boom", "code": 500}}'))
                elif mode == "hang":
                    await asyncio.sleep(3600)
                elif mode == "garbage":
                    writer.write(response(200, b"\x00\xffnot json at all"))
                elif mode in ("drop", "refuse"):
                    full = response(200, reply(json.loads(body), request_id, self.grid))
                    writer.write(full[: len(full) // 2])
                    await writer.drain()
                    writer.transport.abort()
                    return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()

    async def encode(self, request: dict, size: int) -> None:
        parts = request["messages"][0]["content"]
        self.served["requests"] += 1
        self.served["items"] += len(parts)
        self.served["bytes"] += size
        self.served["canaries"] += any(part.get("uuid") == CANARY_UUID for part in parts)
        if self.call_s:
            await asyncio.sleep(self.call_s)
        slot_s = self.image_s * len(parts) + self.encode_fixed_s
        if self.encode_token_s:
            slot_s += self.encode_token_s * sum(tokens_of_grid(grid_of(part, self.grid)) for part in parts)
        if slot_s:
            async with self.slots:
                self.encoding += 1
                try:
                    await asyncio.sleep(slot_s)
                finally:
                    self.encoding -= 1

    async def run(self) -> None:
        listening = True
        self.server = await asyncio.start_server(
            self.serve_connection, self.host, self.port, reuse_address=True
        )
        print("ready", flush=True)
        while True:
            await asyncio.sleep(0.02)
            refusing = self.mode() == "refuse"
            if refusing and listening:
                self.server.close()
                for writer in list(self.writers):
                    writer.transport.abort()
                listening = False
            elif not refusing and not listening:
                self.server = await asyncio.start_server(
                    self.serve_connection, self.host, self.port, reuse_address=True
                )
                listening = True


if __name__ == "__main__":
    port = int(sys.argv[1])
    options = dict(zip(sys.argv[2::2], sys.argv[3::2], strict=True))
    phase = float(options["--faults"]) if "--faults" in options else None
    cost_flags = (
        "--call-ms",
        "--image-ms",
        "--slots",
        "--fetch-fail-ms",
        "--encode-fixed-ms",
        "--encode-token-us",
    )
    cost = {flag[2:].replace("-", "_"): float(options[flag]) for flag in cost_flags if flag in options}
    encoder = Encoder(port, phase, options.get("--host", "127.0.0.1"), options.get("--storage"), cost)
    if "--model" in options:
        encoder.models = [options["--model"]]
    encoder.grid = options.get("--grid", "fixed")
    asyncio.run(encoder.run())
