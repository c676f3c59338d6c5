"""The soak (issue 38, item 4): a million requests through the real middleware while faults cycle, and
every quantity that could leak sampled as it runs.

    flock /tmp/epd-heavy.lock .venv/bin/python -m benchmarks.soak --backend asyncio \\
        [--seconds 1800] [--min-requests 1000000] [--json docs/perf/soak-asyncio.json] \\
        [--plot docs/perf/soak-asyncio.png]
    .venv/bin/python -m benchmarks.soak --plot-from docs/perf/soak-asyncio.json --plot out.png

Processes, each its own, all on loopback (127.0.0.0/8 only):

- the PD server (benchmarks/soak_server.py): the real EPDMiddleware in front of a fake engine that checks
  every handle it is handed, under uvicorn with uvloop and httptools (asyncio, as vLLM serves) or
  hypercorn (trio); ``GET /soak/stats`` samples it;
- the load generator (benchmarks/soak_load.py): the request mix, each request's answer judged;
- the encoders (tests/load/soak_encoder.py, fake vLLM encoders): ``steady`` (static, always healthy),
  ``restarted`` (static, killed and started again on the same port every ``restart_every_s``, refusing
  meanwhile), ``faulty`` (static, its schedule: healthy, then slow, then failing every way in turn:
  refused, 500, hanging past encoder_timeout, garbage, dropped mid-answer), and the members of a DNS
  name the middleware looks up (``dns+http://``): every ``dns_every_s`` a new encoder starts on a fresh
  loopback address (a new pod's address) and joins the name, and half a period later the oldest leaves
  it and is killed a grace period later (a pod terminating after it left its Service's endpoints);
- the DNS server (tests/load/soak_dns.py) answering that name.

Every ``interval_s`` the orchestrator (this process) samples the server and the load generator reports
its interval: request rate, p50 and p99. The pass criteria (:func:`verdict`): no request lost, none
answered wrongly, and after ``warmup_s`` every sampled quantity flat within its bound (``BOUNDS``, each
with why it is the right one).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from epd_lab.servers import free_port
from epd_middleware._pool import OTHER_SERVERS

ROOT = Path(__file__).resolve().parent.parent
DNS_NAME = "encoders.soak.test"
UUID_KEY = "soak-" + "0123456789abcdef" * 4

# The request mix, out of 1000 (soak_load.py says what each kind is and the answer it must get). Half the
# requests carry no media, as most chat traffic; the images are small (image_bytes), so that one PD
# process on a shared 2-core machine sustains the rate a million requests in half an hour needs.
MIX = {
    "text": 470,
    "image": 250,
    "images2": 50,
    "stream": 80,
    "cut_stream": 50,
    "cut_encode": 20,
    "bad_file": 15,
    "bad_scheme": 15,
    "bad_embeds": 15,
    "bad_count": 10,
    "bad_anthropic": 15,
    "not_base64": 10,
}


@dataclass
class SoakConfig:
    backend: str = "asyncio"
    seconds: float = 1800.0
    min_requests: int = 1_000_000
    max_seconds: float = 3 * 3600.0
    concurrency: int = 32
    interval_s: float = 10.0
    warmup_s: float = 240.0
    # Samples in the first post-warm-up window and in the last one, whose medians are compared.
    window: int = 6
    mix: dict[str, int] = field(default_factory=lambda: dict(MIX))
    images: int = 3000
    hot_images: int = 300
    hot_share: float = 0.5
    image_bytes: int = 1024
    slow_images: int = 256
    cut_encode_s: float = 0.05
    marker_ms: float = 400.0
    slow_ms: float = 300.0
    restart_every_s: float = 180.0
    restart_gap_s: float = 2.0
    # The faulty encoder's cycle: healthy, slow, then every failure in turn.
    faulty_schedule: tuple[tuple[str, float], ...] = (
        ("ok", 60.0),
        ("slow", 30.0),
        ("refuse", 15.0),
        ("500", 15.0),
        ("hang", 15.0),
        ("garbage", 15.0),
        ("drop", 15.0),
    )
    dns_every_s: float = 20.0
    dns_members: int = 2
    stream_chunks: int = 4
    chunk_gap_s: float = 0.002
    idle_s: float = 6.0
    options: dict[str, Any] = field(default_factory=dict)

    def middleware_options(self, storage: str, dns: str) -> dict[str, Any]:
        options: dict[str, Any] = {
            "encoder_timeout": 1.0,
            "connect_timeout": 0.5,
            "encode_deadline": 5.0,
            "eject_cooldown": 0.5,
            "max_eject_cooldown": 5.0,
            "health_check_interval": 1.0,
            "health_check_timeout": 0.5,
            "dns_refresh_interval": 1.0,
            "dns_timeout": 0.5,
            "dns_nameservers": [dns],
            "reuse_cache_size": 1024,
            "ec_storage_path": storage,
            "check_embeddings": True,
            "uuid_key": UUID_KEY,
            "expected_model": "m",
            "max_media_items": 8,
        }
        options.update(self.options)
        return options


def short_config(backend: str) -> SoakConfig:
    """The soak of the test suite (tests/test_soak.py): every fault kind cycled within seconds, a few
    thousand requests."""
    return SoakConfig(
        backend=backend,
        seconds=30.0,
        min_requests=3000,
        max_seconds=50.0,
        concurrency=16,
        interval_s=1.0,
        warmup_s=10.0,
        window=5,
        images=600,
        hot_images=60,
        slow_images=32,
        restart_every_s=6.0,
        restart_gap_s=0.5,
        faulty_schedule=(
            ("ok", 2.0),
            ("slow", 1.0),
            ("refuse", 0.8),
            ("500", 0.8),
            ("hang", 1.5),
            ("garbage", 0.8),
            ("drop", 0.8),
        ),
        dns_every_s=3.0,
        idle_s=6.0,
        options={"reuse_cache_size": 128, "dns_refresh_interval": 0.5, "health_check_interval": 0.5},
    )


# Processes -------------------------------------------------------------------------------------------


def _python(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


class Rig:
    """The processes of one soak, and the faults done to them."""

    def __init__(self, config: SoakConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.storage = workdir / "ec"
        self.storage.mkdir(exist_ok=True)
        self.log = (workdir / "processes.log").open("ab")
        self.encoders: dict[str, subprocess.Popen[bytes]] = {}
        self.others: list[subprocess.Popen[bytes]] = []
        self.events: list[dict[str, Any]] = []
        self.dns_port = 0
        self.dns: subprocess.Popen[bytes] | None = None
        self.dns_port_members = free_port()
        self.dns_members: list[str] = []  # addresses, oldest first
        self.dns_next = 0
        self.leaving: list[tuple[float, str]] = []
        self.restart_due = float("inf")
        self.ports = {"steady": free_port(), "restarted": free_port(), "faulty": free_port()}
        self.started = time.monotonic()

    def event(self, kind: str, **detail: Any) -> None:
        self.events.append({"t": time.monotonic(), "kind": kind, **detail})

    def encoder(self, name: str, host: str, port: int, schedule: str = "ok:1", offset: float = 0.0) -> None:
        args = _python(
            "tests.load.soak_encoder",
            str(port),
            "--host",
            host,
            "--storage",
            str(self.storage),
            "--schedule",
            schedule,
            "--offset",
            f"{offset:.3f}",
            "--slow-ms",
            str(self.config.slow_ms),
            "--marker-ms",
            str(self.config.marker_ms),
        )
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != b"ready":
            raise RuntimeError(f"encoder {name} did not start ({line!r}): see {self.log.name}")
        self.encoders[name] = proc

    def kill(self, name: str) -> None:
        proc = self.encoders.pop(name)
        proc.kill()
        proc.wait()

    def start_fakes(self) -> list[str]:
        """The DNS server and the encoders; the middleware's encoder list."""
        self.dns = subprocess.Popen(
            _python("tests.load.soak_dns"),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
        )
        assert self.dns.stdout is not None
        ready, _, address = self.dns.stdout.readline().decode().strip().partition(" ")
        assert ready == "ready", "the DNS server did not start"
        self.dns_address = address
        self.encoder("steady", "127.0.0.1", self.ports["steady"])
        self.encoder("restarted", "127.0.0.1", self.ports["restarted"])
        schedule = ",".join(f"{mode}:{seconds}" for mode, seconds in self.config.faulty_schedule)
        self.encoder("faulty", "127.0.0.1", self.ports["faulty"], schedule)
        self.faulty_started = time.monotonic()
        for _ in range(self.config.dns_members):
            self.dns_join()
        return [
            *(f"http://127.0.0.1:{self.ports[name]}" for name in ("steady", "restarted", "faulty")),
            f"dns+http://{DNS_NAME}:{self.dns_port_members}",
        ]

    def publish(self) -> None:
        assert self.dns is not None
        assert self.dns.stdin is not None
        self.dns.stdin.write((json.dumps({DNS_NAME: self.dns_members}) + "\n").encode())
        self.dns.stdin.flush()

    def dns_join(self) -> None:
        """A new member on a fresh loopback address (127.0.1.1, 127.0.1.2, ...: a new pod's address)."""
        self.dns_next += 1
        address = f"127.0.{1 + self.dns_next // 250}.{1 + self.dns_next % 250}"
        self.encoder(f"dns {address}", address, self.dns_port_members)
        self.dns_members.append(address)
        self.publish()
        self.event("dns_join", address=address)

    def dns_leave(self, grace: float) -> None:
        address = self.dns_members.pop(0)
        self.publish()
        self.leaving.append((time.monotonic() + grace, address))
        self.event("dns_leave", address=address)

    def start_server(self, encoders: list[str]) -> str:
        config = self.config
        port = free_port()
        server = {
            "port": port,
            "backend": config.backend,
            "options": {
                "encoders": encoders,
                **config.middleware_options(str(self.storage), self.dns_address),
            },
            "stream_chunks": config.stream_chunks,
            "chunk_gap_s": config.chunk_gap_s,
        }
        self.server = subprocess.Popen(
            _python("benchmarks.soak_server", json.dumps(server)),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        self.others.append(self.server)
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        for _ in range(600):
            try:
                self.stats()
                return self.url
            except OSError:
                if self.server.poll() is not None:
                    break
                time.sleep(0.05)
        raise RuntimeError(f"the soak server did not start: see {self.log.name}")

    def stats(self) -> dict[str, Any]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            connection.request("GET", "/soak/stats")
            answer = connection.getresponse()
            sample: dict[str, Any] = json.loads(answer.read())
            return sample
        finally:
            connection.close()

    def start_load(self) -> tuple[subprocess.Popen[bytes], queue.Queue[dict[str, Any] | None]]:
        config = self.config
        load = {
            "url": self.url,
            "concurrency": config.concurrency,
            "seconds": config.seconds,
            "min_requests": config.min_requests,
            "max_seconds": config.max_seconds,
            "interval_s": config.interval_s,
            "mix": config.mix,
            "images": config.images,
            "hot_images": config.hot_images,
            "hot_share": config.hot_share,
            "image_bytes": config.image_bytes,
            "slow_images": config.slow_images,
            "cut_encode_s": config.cut_encode_s,
            "uuid_key": UUID_KEY,
            "max_media_items": config.middleware_options("", "")["max_media_items"],
            "seed": 38,
        }
        proc = subprocess.Popen(
            _python("benchmarks.soak_load", json.dumps(load)),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=self.log,
        )
        self.others.append(proc)
        lines: queue.Queue[dict[str, Any] | None] = queue.Queue()

        def read(stream: IO[bytes]) -> None:
            for line in stream:
                lines.put(json.loads(line))
            lines.put(None)

        assert proc.stdout is not None
        threading.Thread(target=read, args=(proc.stdout,), daemon=True).start()
        return proc, lines

    def step_faults(self, now: float, next_restart: float) -> float:
        """Do the faults due at ``now``; returns the next restart's time."""
        config = self.config
        for at, address in list(self.leaving):
            if at <= now:
                self.leaving.remove((at, address))
                self.kill(f"dns {address}")
        if now >= next_restart and "restarted" in self.encoders:
            self.kill("restarted")
            self.event("encoder_killed")
            self.restart_due = now + config.restart_gap_s
            return next_restart + config.restart_every_s
        if "restarted" not in self.encoders and now >= self.restart_due:
            self.encoder("restarted", "127.0.0.1", self.ports["restarted"])
            self.event("encoder_restarted")
        return next_restart

    def stop(self) -> None:
        for name in list(self.encoders):
            self.kill(name)
        for proc in self.others:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self.dns is not None:
            assert self.dns.stdin is not None
            self.dns.stdin.close()
            try:
                self.dns.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.dns.kill()
                self.dns.wait()
        self.log.close()


def run(config: SoakConfig, workdir: Path | None = None, progress: IO[str] | None = None) -> dict[str, Any]:
    """One soak; returns its raw results (samples, intervals, events, summary) and verdict."""
    owned = workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="epd-soak-")) if workdir is None else workdir
    rig = Rig(config, workdir)
    samples: list[dict[str, Any]] = []
    intervals: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    try:
        encoders = rig.start_fakes()
        rig.start_server(encoders)
        load, lines = rig.start_load()
        started = time.monotonic()
        next_sample = started
        next_restart = started + config.restart_every_s
        next_join = started + config.dns_every_s
        next_leave = started + config.dns_every_s * 1.5
        grace = 2 * config.middleware_options("", "")["dns_refresh_interval"] + 1.0
        while not summary:
            now = time.monotonic()
            next_restart = rig.step_faults(now, next_restart)
            if now >= next_join:
                rig.dns_join()
                next_join += config.dns_every_s
            if now >= next_leave:
                rig.dns_leave(grace)
                next_leave += config.dns_every_s
            if now >= next_sample:
                sample = rig.stats()
                sample["phase"] = "load"
                samples.append(sample)
                next_sample += config.interval_s
                if progress is not None and len(samples) % 6 == 1:
                    done = intervals[-1]["sent"] if intervals else 0
                    print(
                        f"{now - started:7.0f} s  {done:>9} requests  rss {sample['rss_mb']} MB  "
                        f"fds {sample['fds']}  tasks {sample['tasks']}  series {sample['metric_series']}",
                        file=progress,
                        flush=True,
                    )
            try:
                while True:
                    line = lines.get(timeout=0.05)
                    if line is None:
                        if not summary:
                            raise RuntimeError(
                                f"the load generator ended without a summary: see {rig.log.name}"
                            )
                        break
                    if line["type"] == "interval":
                        intervals.append(line)
                    elif line["type"] == "summary":
                        summary = line
                        break
            except queue.Empty:
                pass
        load.wait()
        # Idle: the load is over; what the middleware holds now is what it keeps.
        time.sleep(config.idle_s)
        idle = rig.stats()
        idle["phase"] = "idle"
        samples.append(idle)
        faulty_seconds = time.monotonic() - rig.faulty_started
    finally:
        rig.stop()
        if owned:
            shutil.rmtree(workdir, ignore_errors=True)
    results = {
        "config": asdict(config),
        "started": started,
        "summary": summary,
        "intervals": intervals,
        "samples": samples,
        "events": rig.events,
        "faults": fault_counts(config, rig.events, summary, faulty_seconds),
    }
    results["verdict"] = verdict(results)
    return results


def fault_counts(
    config: SoakConfig, events: list[dict[str, Any]], summary: dict[str, Any], faulty_seconds: float
) -> dict[str, Any]:
    """What was done to the middleware, counted."""
    kinds = Counter(event["kind"] for event in events)
    by_kind = Counter(summary.get("by_kind", {}))
    phases: Counter[str] = Counter()
    cycle = sum(seconds for _, seconds in config.faulty_schedule)
    at = 0.0
    while at < faulty_seconds:
        for mode, seconds in config.faulty_schedule:
            if at < faulty_seconds:
                phases[mode] += 1
            at += seconds
        if cycle <= 0:
            break
    bad = {
        kind: sum(n for key, n in by_kind.items() if key.startswith(kind + ":"))
        for kind in MIX
        if kind.startswith("bad_") or kind == "not_base64"
    }
    return {
        "encoder_restarts": kinds["encoder_restarted"],
        "encoder_kills": kinds["encoder_killed"],
        "faulty_phases": dict(phases),
        "dns_joins": kinds["dns_join"],
        "dns_leaves": kinds["dns_leave"],
        "client_cuts_mid_stream": by_kind["cut_stream:cut"],
        "client_cuts_in_encode": by_kind["cut_encode:cut"],
        "bad_media_requests": bad,
    }


# The bounds ------------------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


@dataclass(frozen=True)
class Bound:
    """How much a quantity may grow from the first post-warm-up window to the last, and why."""

    quantity: str
    why: str
    absolute: float = 0.0  # allowed growth of the median, in the quantity's unit
    per_request: float = 0.0  # and per request served between the two windows
    spread: bool = False  # or the first window's own spread (max - min), if larger
    cap: str | None = None  # a configured maximum no sample may pass

    def allowed(self, first: list[float], requests: int) -> float:
        allowed = self.absolute + self.per_request * requests
        if self.spread and first:
            allowed = max(allowed, max(first) - min(first))
        return allowed


BOUNDS = (
    Bound(
        "rss_mb",
        "allocator noise: pymalloc frees an arena (256 KiB) only when its last object goes, and glibc "
        "returns freed heap to the system only from its top, so a process serving the same work at the "
        "same rate wanders by a few MB. 8 MB and no more, whatever the number of requests: over the full "
        "run's millions of requests that catches a leak of a few bytes a request (one small object in a "
        "thousand requests), over the test's tens of thousands one of a few hundred bytes a request.",
        absolute=8.0,
    ),
    Bound(
        "fds",
        "every descriptor of the server is a socket (clients, encoders, DNS) or one of a fixed few; "
        "their number follows the requests in flight, so the last window may be where the first "
        "window's own spread put it, plus 8; one socket leaked per failover, restart or membership "
        "change would add hundreds.",
        absolute=8.0,
        spread=True,
    ),
    Bound(
        "tasks",
        "a task per request in flight (the server's) and per member (the middleware's probes): the "
        "same as descriptors, within the first window's spread plus 8.",
        absolute=8.0,
        spread=True,
    ),
    Bound(
        "pool_idle_connections",
        "the idle connections wait in the client's pools for at most 4 s, so their number follows the "
        "recent concurrency of the calls: within the first window's spread plus 4.",
        absolute=4.0,
        spread=True,
    ),
    Bound(
        "pool_origins",
        "one entry per server called lately (members, and a departed one until its connections "
        "retire): the members come and go, the count must not follow every address DNS ever gave; "
        "within the first window's spread plus 2.",
        absolute=2.0,
        spread=True,
    ),
    Bound(
        "health_records",
        "the encoder pool's health records: one per member, one per server a call still runs on after it "
        "left, and none for a server gone for a DNS refresh interval with its calls ended; the count "
        "must not follow every address DNS ever gave: within the first window's spread plus 2.",
        absolute=2.0,
        spread=True,
    ),
    Bound(
        "metric_series",
        "the labels' values are a finite set (roles, outcomes, blames, stages) times the members, and a "
        "member that leaves takes its series along: the first window's spread is one member's series "
        "(the DNS answer holds 2 or 3), and what the warm-up's whole fault cycle left unseen (a rare "
        "outcome or blame of a static encoder, the one 'other' label of a call to a server that had just "
        "left) is part of that finite set, which the per-server checks bound.",
        spread=True,
    ),
    Bound(
        "reuse_entries",
        "the reuse cache is an LRU of reuse_cache_size entries: full after warm-up, and never more.",
        cap="reuse_cache_size",
    ),
)


def verdict(results: dict[str, Any]) -> dict[str, Any]:
    """The pass criteria, each with its figures."""
    config = results["config"]
    summary = results["summary"]
    outcomes = Counter(summary.get("outcomes", {}))
    load = [s for s in results["samples"] if s["phase"] == "load"]
    after = [s for s in load if s["t"] - results["started"] >= config["warmup_s"]]
    window = config["window"]
    checks: dict[str, Any] = {
        "no request lost": {"ok": outcomes["lost"] == 0, "lost": outcomes["lost"]},
        "no request answered wrongly": {"ok": outcomes["wrong"] == 0, "wrong": outcomes["wrong"]},
        "every request finished": {
            "ok": sum(outcomes.values()) == summary.get("sent"),
            "sent": summary.get("sent"),
            "finished": sum(outcomes.values()),
        },
        "enough samples after warm-up": {"ok": len(after) >= 2 * window, "samples": len(after)},
    }
    # A server that left its pool takes its series along (Stats.forget): every sample's encoder label
    # values are the members of the moment and "other" (the one label of servers outside the pool).
    labelled = [s for s in results["samples"] if "series_by_encoder" in s]
    if labelled:
        strays = {
            url
            for s in labelled
            for url in s["series_by_encoder"]
            if url not in s["member_urls"] and url != OTHER_SERVERS
        }
        checks["no series of a server gone"] = {
            "ok": not strays,
            "samples": len(labelled),
            "strays": sorted(strays),
        }
        # And the series of each server are bounded by the labels' finite set; the labels by the
        # members and "other".
        per_label = series_per_server()
        most = max(max(s["series_by_encoder"].values(), default=0) for s in labelled)
        labels = max(len(s["series_by_encoder"]) - len(s["member_urls"]) for s in labelled)
        checks["encoder series within the labels' finite set"] = {
            "ok": most <= per_label and labels <= 1,
            "most_series_of_one_server": most,
            "at_most": per_label,
            "labels_beyond_the_members": labels,
        }
    if len(after) >= 2 * window:
        first, last = after[:window], after[-window:]
        requests = _requests_between(results["intervals"], first[-1]["t"], last[0]["t"])
        reuse_size = config["options"].get("reuse_cache_size", 1024)
        for bound in BOUNDS:
            values_first = [float(s[bound.quantity]) for s in first]
            values_last = [float(s[bound.quantity]) for s in last]
            every = [float(s[bound.quantity]) for s in after]
            entry: dict[str, Any] = {
                "first_median": _median(values_first),
                "last_median": _median(values_last),
                "max": max(float(s[bound.quantity]) for s in load),
                "why": bound.why,
            }
            if bound.cap is not None:
                entry["cap"] = reuse_size
                entry["min_after_warmup"] = min(every)
                entry["ok"] = max(every) <= reuse_size and min(every) == reuse_size
            else:
                allowed = bound.allowed(values_first, requests)
                growth = entry["last_median"] - entry["first_median"]
                entry.update(growth=round(growth, 3), allowed=round(allowed, 3), ok=growth <= allowed)
            checks[f"{bound.quantity} flat"] = entry
    return {"ok": all(check["ok"] for check in checks.values()), "checks": checks}


def series_per_server() -> int:
    """The most ``epd_encoder_*`` samples one value of the ``encoder`` label can have: a call-duration
    histogram per call outcome (its buckets, +Inf, count, sum, created), failovers and foreign answers
    (total, created), failures per blame, ejection checks per result, and the three gauges. The outcomes
    and blames are the package's own (its errors' ``outcome``, _blame.BLAMES)."""
    from epd_middleware import errors
    from epd_middleware._blame import BLAMES
    from epd_middleware._metrics import _LATENCY_BUCKETS

    outcomes = {"ok"} | {
        kind.outcome
        for kind in vars(errors).values()
        if isinstance(kind, type) and issubclass(kind, errors.UpstreamError)
    }
    histogram = len(_LATENCY_BUCKETS) + 4
    return len(outcomes) * histogram + 2 + 2 + 2 * len(BLAMES) + 2 * len(("ejected", "kept")) + 3


def _requests_between(intervals: list[dict[str, Any]], start: float, end: float) -> int:
    return sum(line["finished"] for line in intervals if start < line["t"] <= end)


# Plot ------------------------------------------------------------------------------------------------

PANELS = (
    ("rss_mb", "resident memory (MB)"),
    ("fds", "open descriptors"),
    ("tasks", "running tasks"),
    ("pool_idle_connections", "idle pool connections"),
    ("pool_origins", "pool origins"),
    ("health_records", "pool health records"),
    ("metric_series", "epd_* metric series"),
    ("reuse_entries", "reuse-cache entries"),
)


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    started = results["started"]
    config = results["config"]
    samples = [s for s in results["samples"] if s["phase"] == "load"]
    intervals = results["intervals"]
    checks = results["verdict"]["checks"]
    unit = 60.0 if results["summary"].get("seconds", 0) > 600 else 1.0
    label = "minutes" if unit == 60 else "seconds"
    fig, axes = plt.subplots(len(PANELS) + 1, 1, figsize=(11, 2.1 * (len(PANELS) + 1)), sharex=True)
    rate_axis = axes[0]
    xs = [(line["t"] - started) / unit for line in intervals]
    rate_axis.plot(xs, [line["finished"] / line["seconds"] for line in intervals], color="tab:blue", lw=1)
    rate_axis.set_ylabel("requests/s", color="tab:blue")
    p99 = rate_axis.twinx()
    p99.plot(xs, [line["p99_ms"] or 0 for line in intervals], color="tab:red", lw=1)
    p99.set_ylabel("p99 (ms)", color="tab:red")
    summary = results["summary"]
    rate_axis.set_title(
        f"soak, {config['backend']}: {summary.get('finished', 0):,} requests in "
        f"{summary.get('seconds', 0) / 60:.1f} min; verdict {'PASS' if results['verdict']['ok'] else 'FAIL'}",
        fontsize=10,
    )
    sx = [(s["t"] - started) / unit for s in samples]
    for axis, (quantity, title) in zip(axes[1:], PANELS, strict=True):
        axis.plot(sx, [s[quantity] for s in samples], lw=1, color="black")
        axis.set_ylabel(title, fontsize=8)
        check = checks.get(f"{quantity} flat")
        if check is not None:
            if "allowed" in check:
                axis.axhline(check["first_median"] + check["allowed"], color="tab:green", ls="--", lw=0.8)
            elif "cap" in check:
                axis.axhline(check["cap"], color="tab:green", ls="--", lw=0.8)
        axis.set_ylim(bottom=0)
    for axis in axes:
        axis.axvspan(0, config["warmup_s"] / unit, color="0.9", zorder=0)
        for event in results["events"]:
            if event["kind"] == "encoder_killed":
                axis.axvline((event["t"] - started) / unit, color="tab:orange", lw=0.5, alpha=0.6)
    axes[-1].set_xlabel(
        f"{label} (grey: warm-up; orange: encoder restarts; dashed green: the bound after warm-up)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# The documentation's table ---------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    """The run's table, as docs/resilience.md shows it."""
    config, summary, faults = results["config"], results["summary"], results["faults"]
    outcomes = summary.get("outcomes", {})
    finished, seconds = summary.get("finished", 0), summary.get("seconds", 0)
    load = [s for s in results["samples"] if s["phase"] == "load"]
    idle = [s for s in results["samples"] if s["phase"] == "idle"]
    server = "uvicorn, uvloop, httptools" if config["backend"] == "asyncio" else "hypercorn"
    latency = ", ".join(
        f"{name} {summary.get(key)} ms"
        for name, key in (("p50", "p50_ms"), ("p99", "p99_ms"), ("p99.9", "p999_ms"), ("max", "max_ms"))
    )
    phases = ", ".join(f"{mode} {count}" for mode, count in faults["faulty_phases"].items())
    bad = ", ".join(f"{kind} {count:,}" for kind, count in faults["bad_media_requests"].items())
    cuts = f"{faults['client_cuts_mid_stream']:,} / {faults['client_cuts_in_encode']:,}"
    rate = f"{finished / max(1, seconds):,.0f}/s at concurrency {config['concurrency']}"
    rows = [
        "| | |",
        "|---|---|",
        f"| backend | {config['backend']} ({server}) |",
        f"| requests | {finished:,} in {seconds / 60:.1f} min, {rate} |",
        f"| latency of answered requests | {latency} |",
        f"| outcomes | {', '.join(f'{key} {value:,}' for key, value in sorted(outcomes.items()))} |",
        f"| encoder restarts (killed, started again on its port) | {faults['encoder_restarts']} |",
        f"| faulty encoder's phases | {phases} |",
        f"| DNS members joined / left | {faults['dns_joins']} / {faults['dns_leaves']} |",
        f"| client cuts mid-stream / in the encode stage | {cuts} |",
        f"| bad media | {bad} |",
        "",
        "| quantity | first | after warm-up (median of the first window) | last window (median) | max "
        "| at idle | bound on the growth | holds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    checks = results["verdict"]["checks"]
    for bound in BOUNDS:
        check = checks.get(f"{bound.quantity} flat")
        if check is None:
            continue
        limit = f"at most {check['cap']}, full after warm-up" if "cap" in check else f"+{check['allowed']:g}"
        rows.append(
            f"| {bound.quantity} | {load[0][bound.quantity] if load else ''} | {check['first_median']:g} | "
            f"{check['last_median']:g} | {check['max']:g} | {idle[0][bound.quantity] if idle else ''} | "
            f"{limit} | {'yes' if check['ok'] else '**no**'} |"
        )
    return "\n".join(rows)


# Command line ----------------------------------------------------------------------------------------


def report(results: dict[str, Any]) -> str:
    summary = results["summary"]
    finished, seconds = summary.get("finished", 0), summary.get("seconds", 0)
    lines = [
        f"backend {results['config']['backend']}: {finished:,} requests in {seconds:.0f} s "
        f"({finished / max(1, seconds):.0f}/s)",
        f"outcomes {summary.get('outcomes')}",
        f"faults {json.dumps(results['faults'])}",
    ]
    for name, check in results["verdict"]["checks"].items():
        figures = {key: value for key, value in check.items() if key != "why"}
        lines.append(f"{'ok  ' if check['ok'] else 'FAIL'} {name}: {json.dumps(figures)}")
    for example in summary.get("examples", [])[:10]:
        lines.append(f"  example: {example}")
    lines.append(f"verdict: {'PASS' if results['verdict']['ok'] else 'FAIL'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    parser.add_argument("--short", action="store_true", help="the test suite's soak (seconds, not minutes)")
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--min-requests", type=int)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--warmup", type=float)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--plot-from")
    parser.add_argument("--keep", help="a directory for the processes' log and the EC storage (kept)")
    args = parser.parse_args()
    if args.plot_from:
        results = json.loads(Path(args.plot_from).read_text())
        if args.plot:
            plot(results, args.plot)
        print(report(results))
        print(markdown(results))
        return
    config = short_config(args.backend) if args.short else SoakConfig(backend=args.backend)
    if args.seconds is not None:
        config.seconds = args.seconds
    if args.min_requests is not None:
        config.min_requests = args.min_requests
    if args.concurrency is not None:
        config.concurrency = args.concurrency
    if args.warmup is not None:
        config.warmup_s = args.warmup
    workdir = None
    if args.keep:
        workdir = Path(args.keep)
        workdir.mkdir(parents=True, exist_ok=True)
    results = run(config, workdir, progress=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if args.plot:
        plot(results, args.plot)
    print(report(results))
    os._exit(0 if results["verdict"]["ok"] else 1)


if __name__ == "__main__":
    main()
