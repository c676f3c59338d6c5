"""A fleet on loopback: fake encoders as "pods" on their own 127.0.0.x addresses (one port), a DNS server
whose records are the headless Service's answer, PD processes with the middleware (found encoders by
DNS, llm-d scheduler mode), and a front that plays the gateway and llm-d's endpoint picker: it picks a
PD process, names a live encoder in x-encoder-hosts-ports, and now and then forges a target. A canary
listener sits on the address forged entries name: any connection to it is a call to a forged target.

During the load the fleet changes as a Kubernetes one does: an encoder is added (a new pod becomes
ready), one is removed gracefully (out of DNS first, stopped after), one is killed (stopped first, out
of DNS a moment later), and the DNS server stops answering for a while.

Used by tests/test_fleet.py (asserts) and benchmarks/fleet.py (figures).
"""

from __future__ import annotations

import base64
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from epd_lab.servers import free_port
from epd_middleware._http import HTTPClient
from tests.dns_server import DNSServer, dns_server

ROOT = Path(__file__).resolve().parents[2]
NAME = "epd-encoder.fleet.svc.cluster.local"
CANARY = "127.0.0.99"  # where forged entries point: nothing may ever connect here
FIRST = ["127.0.0.41", "127.0.0.42", "127.0.0.43"]
ADDED = "127.0.0.44"


def image_body(seed: int, size: int = 20_000) -> bytes:
    data = base64.b64encode(bytes((seed * 7919 + i * 31) % 251 for i in range(size))).decode()
    part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": [part, {"type": "text", "text": "Hi"}]}]}
    ).encode()


@dataclass
class Outcome:
    kind: str  # "scheduled", "pool", "forged encoder", "forged prefill"
    status: int
    verified: bool
    seconds: float
    # The header named a real encoder whose DNS membership was changing while the request was made: a PD
    # may not have learned of it yet (added) or may have forgotten it already (removed), and drops it.
    named_unsettled: bool = False


@dataclass
class Fleet:
    backend: str
    port: int
    dns: DNSServer
    encoders: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ready: list[str] = field(default_factory=list)  # what the headless Service answers
    live: list[str] = field(default_factory=list)  # what the "endpoint picker" believes is up
    # Encoders whose DNS membership is changing: added until every PD process has it as a member,
    # removed from the moment they leave DNS (requests naming them may still be on their way).
    unsettled: set[str] = field(default_factory=set)
    pds: list[str] = field(default_factory=list)
    pd_procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    canary_connections: int = 0
    events: list[str] = field(default_factory=list)
    final_counts: dict[str, int] = field(default_factory=dict)

    # --- encoders (pods) -------------------------------------------------------------------------------

    def start_encoder(self, address: str) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.load.fake_encoder_server", str(self.port), "--host", address],
            cwd=ROOT,
            stdout=subprocess.PIPE,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready"
        self.encoders[address] = proc

    def stop_encoder(self, address: str, *, kill: bool) -> None:
        self.final_counts[address] = self._items(address)
        proc = self.encoders[address]
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        proc.wait()

    def _items(self, address: str) -> int:
        with urllib.request.urlopen(f"http://{address}:{self.port}/stats", timeout=2) as answer:
            return int(json.load(answer)["items"])

    def publish(self) -> None:
        """The headless Service's answer: every encoder that runs and is not on its way out."""
        self.dns.records[NAME] = list(self.ready)

    # --- PD processes --------------------------------------------------------------------------------

    def start_pds(self, count: int, **options: str) -> None:
        environment = {
            **os.environ,
            "EPD_ENCODERS": f"dns+http://{NAME}:{self.port}",
            "EPD_DNS_NAMESERVERS": self.dns.address,
            "EPD_DNS_REFRESH_INTERVAL": "0.3",
            "EPD_DNS_TIMEOUT": "0.3",
            "EPD_SCHEDULER": "llm-d",
            "EPD_ENCODER_TIMEOUT": "2",
            "EPD_CONNECT_TIMEOUT": "0.5",
            "EPD_EJECT_COOLDOWN": "0.5",
            "EPD_MAX_EJECT_COOLDOWN": "2",
            "EPD_HEALTH_CHECK_INTERVAL": "0.5",
            "EPD_HEALTH_CHECK_TIMEOUT": "0.3",
            "EPD_CHECK_EMBEDDINGS": "false",
            **{f"EPD_{key.upper()}": value for key, value in options.items()},
        }
        for _ in range(count):
            port = free_port()
            self.pd_procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.fleet.pd_server", str(port), self.backend],
                    cwd=ROOT,
                    env=environment,
                    # The middleware's warnings (forged targets, DNS outage) are the point of the run:
                    # shown with EPD_FLEET_LOGS=1, silent otherwise.
                    stderr=None if os.environ.get("EPD_FLEET_LOGS") else subprocess.DEVNULL,
                )
            )
            self.pds.append(f"http://127.0.0.1:{port}")

    async def wait_ready(self) -> None:
        client = HTTPClient(connect_timeout=1)
        with anyio.fail_after(60):
            for url in self.pds:
                while True:
                    try:
                        status, body = await client.request("GET", f"{url}/epd/status")
                        if status == 200 and json.loads(body)["encoders"]:
                            break
                    except Exception:  # not listening yet
                        pass
                    await anyio.sleep(0.1)
        await client.aclose()

    async def members(self) -> list[set[str]]:
        """The addresses of each PD process's encoder pool members, as it knows them now."""
        return [
            {
                url.removeprefix("http://").rsplit(":", 1)[0]
                for url, known in status["encoders"].items()
                if known["member"]
            }
            for status in await self.statuses()
        ]

    async def wait_until(self, agreed: Callable[[list[set[str]]], bool]) -> None:
        """Until the PD processes' members are ``agreed``: a PD process learns the Service's answer at its
        next good lookup, however long lookups keep failing before that (bounded: a hang fails the test)."""
        with anyio.fail_after(60):
            while True:
                if agreed(await self.members()):
                    return
                await anyio.sleep(0.1)

    async def statuses(self) -> list[dict[str, Any]]:
        client = HTTPClient(connect_timeout=1)
        try:
            return [json.loads((await client.request("GET", f"{url}/epd/status"))[1]) for url in self.pds]
        finally:
            await client.aclose()

    async def served(self) -> dict[str, int]:
        """Items each encoder encoded: those still running now, the others when they were stopped."""
        counts = dict(self.final_counts)
        for address, proc in self.encoders.items():
            if proc.poll() is None:
                counts[address] = await anyio.to_thread.run_sync(self._items, address)
        return dict(sorted(counts.items()))

    def stop(self) -> None:
        for proc in [*self.pd_procs, *self.encoders.values()]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@asynccontextmanager
async def fleet(backend: str, pds: int = 3, **options: str) -> AsyncIterator[Fleet]:
    async with dns_server() as dns:
        made = Fleet(backend, free_port(), dns)
        canary = await anyio.create_tcp_listener(local_host=CANARY, local_port=made.port)

        async def count(stream: anyio.abc.SocketStream) -> None:
            made.canary_connections += 1
            await stream.aclose()

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(canary.serve, count)
                for address in FIRST:
                    made.start_encoder(address)
                made.ready = list(FIRST)
                made.live = list(FIRST)
                made.publish()
                made.start_pds(pds, **options)
                await made.wait_ready()
                try:
                    yield made
                finally:
                    group.cancel_scope.cancel()
        finally:
            made.stop()


async def run_load(
    made: Fleet, requests: int, concurrency: int, *, rate: float, seed: int = 7
) -> tuple[list[Outcome], float]:
    """The front: ``requests`` requests, at most ``concurrency`` at once, arriving ``rate`` a second (so
    the fleet's changes fall inside the run however fast the machine), while the fleet changes at fixed
    points of the run; the last 5% wait until every PD process has learned the final Service. Returns
    every outcome and the wall time."""
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    done = 0
    progress = anyio.Event()
    next_request = 0

    def headers_for(number: int) -> tuple[str, str | None, dict[str, str]]:
        """The request's kind, the real encoder its header names (if any), and its headers."""
        slot = number % 20
        named = rng.choice(made.live)
        if slot == 0:
            forged = f"{CANARY}:{made.port},{named}:{made.port}"
            return "forged encoder", named, {"x-encoder-hosts-ports": forged}
        if slot == 1:
            return "forged prefill", None, {"x-prefiller-host-port": f"{CANARY}:{made.port}"}
        if slot in (2, 3, 4):
            return "pool", None, {}  # the picker skipped the encode stage: the pool (by affinity) decides
        return "scheduled", named, {"x-encoder-hosts-ports": f"{named}:{made.port}"}

    async def worker() -> None:
        nonlocal done, next_request, progress
        client = HTTPClient(connect_timeout=2)
        while next_request < requests:
            number = next_request
            next_request += 1
            if number >= tail:
                # The tail of the load waits for every PD process to have learned the final Service:
                # however slow DNS was, the added encoder then takes its share before the end.
                await changed.wait()
            await anyio.sleep_until(begun + number / rate)
            kind, named, headers = headers_for(number)
            unsettled = named in made.unsettled
            pd = made.pds[number % len(made.pds)]
            started = time.perf_counter()
            status, body = await client.request(
                "POST",
                f"{pd}/v1/chat/completions",
                image_body(number),
                {"content-type": "application/json", **headers},
            )
            verified = status == 200 and bool(json.loads(body).get("verified"))
            unsettled = unsettled or named in made.unsettled
            outcomes.append(Outcome(kind, status, verified, time.perf_counter() - started, unsettled))
            done += 1
            progress.set()
            progress = anyio.Event()
        await client.aclose()

    async def at(fraction: float) -> None:
        while done < fraction * requests:
            await progress.wait()

    async def settled(address: str) -> None:
        await made.wait_until(lambda members: all(address in known for known in members))
        made.unsettled.discard(address)

    async def changes() -> None:
        await at(0.2)
        await anyio.to_thread.run_sync(made.start_encoder, ADDED)  # a new pod becomes ready
        made.ready.append(ADDED)
        made.unsettled.add(ADDED)
        made.publish()
        group.start_soon(settled, ADDED)
        # The picker learns of the pod on its own (Kubernetes' API, not DNS), by then or not: a PD
        # process whose lookups time out learns of it later.
        await anyio.sleep(0.4)
        made.live.append(ADDED)
        made.events.append(f"{done}: {ADDED} added")
        await at(0.4)
        leaving = FIRST[0]  # graceful: out of the Service first, stopped after the refresh interval
        made.ready.remove(leaving)
        made.unsettled.add(leaving)
        made.publish()
        made.live.remove(leaving)
        await anyio.sleep(1.0)
        made.stop_encoder(leaving, kill=False)
        made.events.append(f"{done}: {leaving} removed (DNS first, then stopped)")
        await at(0.6)
        killed = FIRST[1]  # a crash: stopped at once, the picker and DNS learn of it a moment later
        made.stop_encoder(killed, kill=True)
        made.events.append(f"{done}: {killed} killed")
        await anyio.sleep(0.5)
        made.live.remove(killed)
        made.ready.remove(killed)
        made.unsettled.add(killed)
        made.publish()
        await at(0.75)
        made.dns.mode = "drop"  # the DNS server stops answering
        made.events.append(f"{done}: DNS down")
        await anyio.sleep(1.5)
        made.dns.mode = "ok"
        made.events.append(f"{done}: DNS back")
        await made.wait_until(lambda members: all(known == set(made.ready) for known in members))
        made.unsettled.discard(ADDED)
        changed.set()

    started = time.perf_counter()
    begun = anyio.current_time()
    changed = anyio.Event()  # the last change is made and every PD process has learned it
    tail = int(0.95 * requests)
    async with anyio.create_task_group() as group:
        group.start_soon(changes)
        async with anyio.create_task_group() as workers:
            for _ in range(concurrency):
                workers.start_soon(worker)
        group.cancel_scope.cancel()
    return outcomes, time.perf_counter() - started


def summary(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    by_kind: dict[str, Counter[str]] = {}
    for outcome in outcomes:
        label = "verified" if outcome.verified else f"HTTP {outcome.status}"
        by_kind.setdefault(outcome.kind, Counter())[label] += 1
    latencies = sorted(o.seconds for o in outcomes if o.status == 200)

    def pct(q: float) -> float:
        return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000, 1)

    return {
        "requests": len(outcomes),
        "by_kind": {kind: dict(counts) for kind, counts in sorted(by_kind.items())},
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
        "req_per_s": round(len(outcomes) / wall, 1),
    }


def pool_figures(statuses: list[dict[str, Any]]) -> dict[str, Any]:
    counters: Counter[str] = Counter()
    for status in statuses:
        counters.update(status["counters"])
    keep: Callable[[str], bool] = lambda key: any(  # noqa: E731
        word in key for word in ("forged", "dns", "chosen_by", "failovers", "fallback", "encoder_calls")
    )
    return {key: value for key, value in sorted(counters.items()) if keep(key)}
