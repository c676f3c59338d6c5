"""The soak's load generator (benchmarks/soak.py), in a process of its own: asyncio with uvloop, raw
keep-alive HTTP/1.1 connections framed by httptools (llhttp), so that its own cost per request stays a
small share of the machine's.

    python -m benchmarks.soak_load CONFIG_JSON

CONFIG_JSON: ``url`` (the PD server), ``concurrency`` (connections, each one request at a time),
``seconds`` and ``min_requests`` (it stops sending once both are reached, or at ``max_seconds``),
``interval_s`` (one report line a interval), ``mix`` (kind -> weight, out of the sum), ``images``
(distinct images), ``hot_images`` (the share of image picks from the first ``hot`` images, which the reuse
cache then holds), ``image_bytes``, ``slow_images``, ``cut_encode_s``, ``uuid_key``, ``max_media_items``,
``seed``.

Every request is one of these kinds, each with the answer it must get:

- ``text``: a chat request without media: 200, the engine saw no image;
- ``image``, ``images2``: one or two images: 200, each image handed to the engine as the reference of
  the uuid this process computes for it (benchmarks/soak_server.py checks it), none raw;
- ``stream``: ``image`` with ``stream`` true, read to ``[DONE]``: the same verdict, as the first event;
- ``cut_stream``: a streamed request (an image or text, in turn) cut by the client after its first two
  events;
- ``cut_encode``: an image the soak's encoders answer late (tests/load/soak_encoder.py's marker), cut
  by the client ``cut_encode_s`` after sending, while the middleware waits for the encoder;
- ``bad_file``, ``bad_scheme``, ``bad_embeds``, ``bad_count``: media the middleware must refuse itself
  (a file:// URL without --allowed-local-media-path, an ftp:// URL, an image_embeds part the client wrote,
  one image more than max_media_items): 4xx, an OpenAI error whose code is the status;
- ``bad_anthropic``: a file:// image on ``/v1/messages``: 4xx, an Anthropic error;
- ``not_base64``: a data URL that is not base64, which only an encoder judges: vLLM's own answer, 501
  "Only base64 data URLs are supported for now.", as a single vLLM instance answers it.

Outcomes: ``ok`` (the answer it must get), ``failed`` (a request with good media answered 502, 503 or
504 with a clear error: a failure the middleware owns up to), ``wrong`` (any other answer), ``cut`` (cut
by this client on purpose), ``lost`` (no complete answer: the connection closed, or nothing within
``timeout_s``). Each interval's line: requests finished by outcome and kind, statuses, answered
requests' p50 and p99; the last line, the totals and the first wrong or lost answers.
"""

from __future__ import annotations

import asyncio  # noqa: TID251 (a load generator on uvloop, not the package)
import base64
import json
import random
import sys
import time
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httptools
import msgspec
import uvloop

from epd_middleware._plan import UuidKey, content_uuid

_encode = msgspec.json.encode
_decode = msgspec.json.decode
NOT_BASE64 = "Only base64 data URLs are supported for now."
GOOD = ("text", "image", "images2", "stream", "cut_stream", "cut_encode")
BAD_OPENAI = ("bad_file", "bad_scheme", "bad_embeds", "bad_count")
KINDS = (*GOOD, *BAD_OPENAI, "bad_anthropic", "not_base64")
HONEST_FAILURES = (502, 503, 504)


class Lost(Exception):
    pass


class Connection(asyncio.Protocol):
    """One keep-alive connection, one request at a time; the answer framed by httptools."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.open = False
        self.status = 0
        self.body: list[bytes] = []
        self.events = 0
        self.want_events = 0
        self.done: asyncio.Future[None] = loop.create_future()
        self.enough: asyncio.Future[None] = loop.create_future()
        self.keep_alive = True

    def start(self, want_events: int = 0) -> None:
        self.status, self.body, self.events, self.want_events = 0, [], 0, want_events
        self.done = self.loop.create_future()
        self.enough = self.loop.create_future()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport, self.open = transport, True  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"unparsable answer: {exc}")

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self._fail("connection closed before a complete answer")

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        if self.want_events and not self.enough.done():
            self.events += body.count(b"\n\n")
            if self.events >= self.want_events:
                self.enough.set_result(None)

    def on_message_complete(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
        if not self.enough.done():
            self.enough.set_result(None)

    def _fail(self, why: str) -> None:
        for future in (self.done, self.enough):
            if not future.done():
                future.set_exception(Lost(why))
                future.exception()  # retrieved: a cut request never awaits it

    def abort(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.abort()


@dataclass
class Media:
    """The images and the uuids the middleware gives them (its content uuid under the soak's key)."""

    urls: list[str]
    uuids: list[str]
    slow: list[str]

    @classmethod
    def make(cls, config: dict[str, Any]) -> Media:
        rng = random.Random(config["seed"])
        key = UuidKey(config["uuid_key"])
        size = config["image_bytes"]
        urls, uuids = [], []
        for _ in range(config["images"]):
            # 0x89, as a PNG starts: never the soak encoder's late marker (b"SLOW")
            data = b"\x89" + rng.randbytes(size - 1)
            url = "data:image/png;base64," + base64.b64encode(data).decode()
            urls.append(url)
            uuids.append(content_uuid("image", (url,), None, key))
        slow = [
            "data:image/png;base64," + base64.b64encode(b"SLOW" + rng.randbytes(size - 4)).decode()
            for _ in range(config["slow_images"])
        ]
        return cls(urls, uuids, slow)


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def chat(parts: list[dict[str, Any]], *, stream: bool = False, expect: list[str] | None = None) -> bytes:
    content = [*parts, {"type": "text", "text": "Describe."}]
    if expect is not None:
        content.append({"type": "text", "text": "soak-expect:" + ",".join(expect)})
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    if stream:
        body["stream"] = True
    return _encode(body)


@dataclass
class Request:
    kind: str
    path: str
    body: bytes
    stream: bool = False
    images: int = 0


class Builder:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.media = Media.make(config)
        self.rng = random.Random(config["seed"] + 1)
        weights = config["mix"]
        unknown = set(weights) - set(KINDS)
        if unknown:
            raise SystemExit(f"unknown kinds {sorted(unknown)}")
        # One block of 1000 requests in the mix's proportions, shuffled once: every kind recurs evenly.
        total = sum(weights.values())
        block = [kind for kind, weight in weights.items() for _ in range(round(1000 * weight / total))]
        random.Random(config["seed"] + 2).shuffle(block)
        self.block = block

    def pick(self) -> int:
        config = self.config
        if self.rng.random() < config["hot_share"]:
            return self.rng.randrange(config["hot_images"])
        return self.rng.randrange(len(self.media.urls))

    def request(self, index: int) -> Request:
        kind = self.block[index % len(self.block)]
        media = self.media
        if kind == "text":
            return Request(kind, "/v1/chat/completions", chat([], expect=[]))
        if kind in ("image", "stream"):
            pick = self.pick()
            body = chat([image_part(media.urls[pick])], stream=kind == "stream", expect=[media.uuids[pick]])
            return Request(kind, "/v1/chat/completions", body, stream=kind == "stream", images=1)
        if kind == "images2":
            picks = [self.pick(), self.pick()]
            parts = [image_part(media.urls[pick]) for pick in picks]
            return Request(
                kind, "/v1/chat/completions", chat(parts, expect=[media.uuids[p] for p in picks]), images=2
            )
        if kind == "cut_stream":
            if index % 2:
                return Request(kind, "/v1/chat/completions", chat([], stream=True, expect=[]), stream=True)
            pick = self.pick()
            body = chat([image_part(media.urls[pick])], stream=True, expect=[media.uuids[pick]])
            return Request(kind, "/v1/chat/completions", body, stream=True, images=1)
        if kind == "cut_encode":
            url = media.slow[index % len(media.slow)]
            body = chat(
                [image_part(url)],
                expect=[content_uuid("image", (url,), None, UuidKey(self.config["uuid_key"]))],
            )
            return Request(kind, "/v1/chat/completions", body, images=1)
        if kind == "bad_file":
            return Request(kind, "/v1/chat/completions", chat([image_part(f"file:///etc/soak-{index}.png")]))
        if kind == "bad_scheme":
            return Request(
                kind, "/v1/chat/completions", chat([image_part(f"ftp://127.0.0.1/soak-{index}.png")])
            )
        if kind == "bad_embeds":
            part = {
                "type": "image_embeds",
                "image_embeds": {"image_grid_thw": [1, 2, 2]},
                "uuid": f"forged-{index}",
            }
            return Request(kind, "/v1/chat/completions", chat([part]))
        if kind == "bad_count":
            url = media.urls[index % 16]
            parts = [image_part(url)] * (self.config["max_media_items"] + 1)
            return Request(kind, "/v1/chat/completions", chat(parts))
        if kind == "bad_anthropic":
            block = {"type": "image", "source": {"type": "url", "url": f"file:///etc/soak-{index}.png"}}
            messages = {
                "model": "m",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": [block, {"type": "text", "text": "Describe."}]}],
            }
            return Request(kind, "/v1/messages", _encode(messages))
        assert kind == "not_base64"
        return Request(kind, "/v1/chat/completions", chat([image_part(f"data:image/png,soak-{index}")]))


def judge(request: Request, status: int, body: bytes) -> tuple[str, str]:
    """(outcome, why) of a complete answer to ``request``."""
    kind = request.kind
    payload: Any
    try:
        payload = _decode(body) if not request.stream or status != 200 else None
    except msgspec.DecodeError:
        return "wrong", "answer is not JSON"
    if kind in GOOD:
        if status == 200:
            verdict = payload if payload is not None else _first_event(body)
            if verdict is None:
                return "wrong", "no verdict event"
            if (
                verdict.get("verified")
                and verdict.get("images") == request.images
                and verdict.get("raw") == 0
            ):
                if request.stream and not body.endswith(b"data: [DONE]\n\n"):
                    return "wrong", "stream did not end with [DONE]"
                return "ok", ""
            return "wrong", f"engine verdict {verdict}"
        if status in HONEST_FAILURES and _clear_openai(payload, status):
            return "failed", f"{status}: {payload['error']['message'][:200]}"
        return "wrong", f"status {status}"
    if kind in BAD_OPENAI:
        if 400 <= status < 500 and _clear_openai(payload, status):
            return "ok", ""
        return "wrong", f"status {status}"
    if kind == "bad_anthropic":
        error = payload.get("error") if isinstance(payload, dict) else None
        if (
            400 <= status < 500
            and payload.get("type") == "error"
            and isinstance(error, dict)
            and error.get("type") == "invalid_request_error"
            and error.get("message")
        ):
            return "ok", ""
        return "wrong", f"status {status}"
    assert kind == "not_base64"
    if status == 501 and _clear_openai(payload, 501) and payload["error"]["message"] == NOT_BASE64:
        return "ok", ""
    return "wrong", f"status {status}"


def _clear_openai(payload: Any, status: int) -> bool:
    error = payload.get("error") if isinstance(payload, dict) else None
    return isinstance(error, dict) and bool(error.get("message")) and error.get("code") == status


def _first_event(body: bytes) -> dict[str, Any] | None:
    first = body.split(b"\n\n", 1)[0]
    if not first.startswith(b"data: "):
        return None
    try:
        event = _decode(first[6:])
    except msgspec.DecodeError:
        return None
    return event if isinstance(event, dict) else None


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)

    def add(self, kind: str, outcome: str, status: int, latency: float | None) -> None:
        self.outcomes[outcome] += 1
        self.by_kind[f"{kind}:{outcome}"] += 1
        if status:
            self.statuses[str(status)] += 1
        if latency is not None:
            self.latencies.append(latency)

    def report(self) -> dict[str, Any]:
        values = sorted(self.latencies)

        def pct(q: float) -> float | None:
            return round(values[min(len(values) - 1, int(q * len(values)))] * 1000, 2) if values else None

        return {
            "finished": sum(self.outcomes.values()),
            "outcomes": dict(self.outcomes),
            "by_kind": dict(self.by_kind),
            "statuses": dict(self.statuses),
            "p50_ms": pct(0.5),
            "p99_ms": pct(0.99),
        }


class Load:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        parts = urlsplit(config["url"])
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.builder = Builder(config)
        self.next_index = 0
        self.stop_at: float | None = None
        self.interval = Tally()
        self.total = Tally()
        self.examples: list[dict[str, Any]] = []
        # Every answered request's latency (ms), for the run's own percentiles: 4 bytes each.
        self.latencies = array("f")
        self.started = time.monotonic()
        self.connects = 0

    def emit(self, line: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()

    def record(self, request: Request, outcome: str, status: int, latency: float | None, why: str) -> None:
        self.interval.add(request.kind, outcome, status, latency)
        if latency is not None:
            self.latencies.append(latency * 1000)
        self.total.add(request.kind, outcome, status, None)
        if outcome in ("wrong", "lost", "failed") and len(self.examples) < 50:
            self.examples.append(
                {
                    "t": round(time.monotonic() - self.started, 1),
                    "kind": request.kind,
                    "outcome": outcome,
                    "status": status,
                    "why": why,
                }
            )

    def sending(self) -> bool:
        config = self.config
        elapsed = time.monotonic() - self.started
        if elapsed >= config.get("max_seconds", float("inf")):
            return False
        return bool(elapsed < config["seconds"] or self.next_index < config["min_requests"])

    async def connect(self, loop: asyncio.AbstractEventLoop) -> Connection:
        self.connects += 1
        _, protocol = await loop.create_connection(lambda: Connection(loop), self.host, self.port)
        return protocol

    async def worker(self) -> None:
        loop = asyncio.get_running_loop()
        connection: Connection | None = None
        timeout = self.config.get("timeout_s", 30.0)
        head = f"host: {self.host}:{self.port}\r\ncontent-type: application/json\r\n"
        while self.sending():
            index = self.next_index
            self.next_index += 1
            request = self.builder.request(index)
            if connection is None or not connection.open:
                connection = await self.connect(loop)
            live = connection
            cutting = request.kind in ("cut_stream", "cut_encode")
            connection.start(want_events=2 if request.kind == "cut_stream" else 0)
            message = (
                f"POST {request.path} HTTP/1.1\r\n{head}content-length: {len(request.body)}\r\n\r\n".encode()
                + request.body
            )
            sent = time.monotonic()
            assert connection.transport is not None
            connection.transport.write(message)
            try:
                if request.kind == "cut_stream":
                    await asyncio.wait_for(asyncio.shield(connection.enough), timeout)
                    if not connection.done.done():
                        connection.abort()
                        self.record(request, "cut", connection.status, None, "")
                        connection = None
                        continue
                elif request.kind == "cut_encode":
                    done, _ = await asyncio.wait([connection.done], timeout=self.config["cut_encode_s"])
                    if not done:
                        connection.abort()
                        self.record(request, "cut", 0, None, "")
                        connection = None
                        continue
                await asyncio.wait_for(asyncio.shield(connection.done), timeout)
            except Lost as exc:
                self.record(request, "lost", live.status, None, str(exc))
                live.abort()
                connection = None
                continue
            except asyncio.TimeoutError:
                self.record(request, "lost", live.status, None, f"no answer within {timeout} s")
                live.abort()
                connection = None
                continue
            latency = time.monotonic() - sent
            body = b"".join(connection.body)
            outcome, why = judge(request, connection.status, body)
            if outcome == "wrong":
                why = f"{why}; body {body[:300]!r}"
            self.record(request, outcome, connection.status, latency if not cutting else None, why)
            if not connection.keep_alive:
                connection.abort()
                connection = None
        if connection is not None:
            connection.abort()

    async def reporter(self) -> None:
        interval = self.config["interval_s"]
        next_at = self.started + interval
        while True:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            now = time.monotonic()
            tally, self.interval = self.interval, Tally()
            self.emit(
                {"type": "interval", "t": now, "seconds": interval, "sent": self.next_index, **tally.report()}
            )
            next_at += interval

    async def run(self) -> None:
        self.emit({"type": "start", "t": self.started})
        reporter = asyncio.ensure_future(self.reporter())
        await asyncio.gather(*(self.worker() for _ in range(self.config["concurrency"])))
        reporter.cancel()
        ended = time.monotonic()
        last = self.interval.report()
        summary = self.total.report()
        ordered = sorted(self.latencies)

        def pct(q: float) -> float | None:
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2) if ordered else None

        summary.update(p50_ms=pct(0.5), p99_ms=pct(0.99), p999_ms=pct(0.999), max_ms=pct(1.0))
        self.emit(
            {
                "type": "summary",
                "t": ended,
                "seconds": round(ended - self.started, 1),
                "sent": self.next_index,
                "connects": self.connects,
                "last_interval": last,
                **summary,
                "examples": self.examples,
            }
        )


def main() -> None:
    config = json.loads(sys.argv[1])
    uvloop.install()
    asyncio.run(Load(config).run())


if __name__ == "__main__":
    main()
