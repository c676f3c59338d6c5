"""What the middleware counts and measures: in-process counters (for the status endpoint) and Prometheus
metrics, registered in ``prometheus_client``'s default registry so they appear in vLLM's own ``/metrics``.

``prometheus_client`` is in every vLLM install (elsewhere: the ``metrics`` extra); without it the
Prometheus side is a no-op, which one WARNING per process says. With several API-server processes vLLM
sets ``PROMETHEUS_MULTIPROC_DIR`` before the app is built (``vllm/v1/metrics/prometheus.py``) and serves
``/metrics`` from a ``MultiProcessCollector``:
``prometheus_client`` then writes these metrics to per-process files too, counters and histograms are
summed over processes, the in-flight gauge is summed over live processes, and the health gauge takes the
minimum (an encoder one process has ejected shows as unhealthy).

A server that leaves its pool (DNS no longer names it) takes its labelled series along. In multiprocess
mode ``prometheus_client`` cannot remove a series from the files (``remove`` only warns): its gauges are
set to values that change no aggregate and fire no alert, and its counters and histograms keep their
totals until vLLM clears the directory at its next start.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from typing import Any

from ._logs import logger

__all__ = ["ROLES", "Stats"]

# The pools of remote vLLM servers the middleware calls.
ROLES = ("encoder", "prefill")

# Seconds: fine at the low end (a parse or a rewrite takes well under a millisecond, an encoder call tens of
# milliseconds), and up to the longest a call or a stage may run by default: prefill_timeout (300 s), so
# every duration below it (encode_deadline 120 s, encoder_timeout 60 s) lands in a finite bucket, not only
# in +Inf. The alerts' bounds (deploy/kubernetes/monitoring) are bucket boundaries: 10 s, 60 s.
_LATENCY_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0),
)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class _Prometheus:
    """The metric objects, created once per process (prometheus_client refuses duplicate names)."""

    def __init__(self, prom: Any) -> None:
        self.stage_seconds = prom.Histogram(
            "epd_stage_duration_seconds",
            "Time spent per intercepted request in each middleware stage (parse, encode, rewrite, prefill).",
            ["stage"],
            buckets=_LATENCY_BUCKETS,
        )
        self.request_media_items = prom.Histogram(
            "epd_request_media_items", "Media items per encoded request.", buckets=_COUNT_BUCKETS
        )
        self.request_encoder_calls = prom.Histogram(
            "epd_request_encoder_calls", "Encoder calls per encoded request.", buckets=_COUNT_BUCKETS
        )
        self.requests = prom.Counter(
            "epd_requests",
            "Intercepted requests by outcome (encoded, passed_through, fallback, error, ...); code: the HTTP "
            "status of an error, empty for the other outcomes.",
            ["outcome", "code"],
        )
        self.reused_items = prom.Counter(
            "epd_reused_items",
            "Media items taken from the reuse cache instead of being sent to an encoder again.",
        )
        self.fallback_items = prom.Counter(
            "epd_fallback_items", "Media items left to the local engine to encode."
        )
        self.engine_retries = prom.Counter(
            "epd_engine_retries",
            "Requests run again after the local engine answered 500 before the first byte.",
        )
        self.encoder_sources = prom.Counter(
            "epd_encoder_selection",
            "Encoded requests by who chose their encoders: the scheduler's header, the pool, or nobody "
            "(every item left to the local engine).",
            ["source"],
        )
        self.forged_targets = prom.Counter(
            "epd_scheduler_forged_targets",
            "Scheduler header entries naming a server outside the pools and the allowlist (encoders "
            "dropped, prefill targets refused with 403).",
            ["role"],
        )
        self.dns_lookups = prom.Counter(
            "epd_dns_lookups",
            "Lookups of the pools' dns+http:// names, by role and outcome (ok, failed).",
            ["role", "outcome"],
        )
        self.placements = prom.Counter(
            "epd_placement",
            "Placement decisions, one per modality of a request with media to encode: where (local: the "
            "local engine encodes it; remote: an encoder) and why (policy, pd_idle, small, "
            "encoders_saturated, pd_busy, pd_prefilling, pd_load_unknown, pd_cannot_encode, large, "
            "size_unknown).",
            ["where", "why"],
        )
        self.equivalence = _EquivalenceMetrics(prom)
        self.loaded = prom.Gauge(
            "epd_middleware_info",
            "1 in every API-server process the middleware is loaded in (version: its version): a PD whose "
            "vLLM metrics show without it serves without encoder disaggregation (EPDMiddlewareNotLoaded).",
            ["version"],
            multiprocess_mode="livemax",
        )
        self.pool_members = prom.Gauge(
            "epd_pool_members",
            "Servers in a pool now (static URLs plus DNS answers), by role.",
            ["role"],
            multiprocess_mode="livemax",
        )
        self.pools = {role: _PoolMetrics(prom, role) for role in ROLES}


class _EquivalenceMetrics:
    """The equivalence probe's metrics (_equivalence.py)."""

    def __init__(self, prom: Any) -> None:
        self.checks = prom.Counter(
            "epd_equivalence_checks",
            "Equivalence probes of an encoder (E + PD against PD alone, or against the other encoders "
            "where PD cannot encode), by result: match, mismatch, disagree (no majority among encoders), "
            "unproven (no other encoder to compare with), error (a path got no answer), skipped (the "
            "engine was busy); source: canary (the built-in prompt) or traffic (a sampled real request, "
            "verify_share).",
            ["encoder", "result", "source"],
        )
        self.mismatched = prom.Gauge(
            "epd_equivalence_mismatched",
            "1 while the latest equivalence probe of the encoder (by source: canary, traffic) found its "
            "answers differ, else 0.",
            ["encoder", "source"],
            multiprocess_mode="livemax",
        )


class _PoolMetrics:
    """The metrics of one pool of servers: encoders (label ``encoder``) or prefill servers (``prefill``)."""

    def __init__(self, prom: Any, role: str) -> None:
        self.call_seconds = prom.Histogram(
            f"epd_{role}_call_duration_seconds",
            f"Duration of one {role} call, by {role} and outcome.",
            [role, "outcome"],
            buckets=_LATENCY_BUCKETS,
        )
        self.failovers = prom.Counter(
            f"epd_{role}_failovers",
            f"{role.capitalize()} calls retried on another server, by the {role} that failed.",
            [role],
        )
        self.foreign_answers = prom.Counter(
            f"epd_{role}_foreign_answers",
            f"Answers of a {role} that belonged to another request (refused; the call failed over).",
            [role],
        )
        self.failures = prom.Counter(
            f"epd_{role}_failures",
            f"Failed {role} calls by who was at fault: server (counted towards its ejection), request "
            "(vLLM's answer to bad input, the request's media failing to load, or the same failure on "
            "another server), credentials (the client's own key refused), capped (not counted: the "
            "request had cost another server a failure already), none (no slot free here), retracted "
            "(counted, then taken back as the request's), media (the request's own media could not be "
            "fetched there: not counted, tried on another).",
            [role, "blame"],
        )
        self.ejection_checks = prom.Counter(
            f"epd_{role}_ejection_checks",
            f"Confirmations before ejecting a {role} that failed eject_after calls in a row (its /health "
            "and a canary encode): ejected, or kept (it was healthy: the failures were its requests').",
            [role, "result"],
        )
        self.healthy = prom.Gauge(
            f"epd_{role}_healthy",
            f"1 when the {role} server takes traffic, 0 while ejected.",
            [role],
            multiprocess_mode="livemin",
        )
        self.model_ok = prom.Gauge(
            f"epd_{role}_model_ok",
            f"1 when the {role} server serves this server's model (GET /v1/models), 0 when it serves "
            "another or did not answer: it is not used.",
            [role],
            multiprocess_mode="livemin",
        )
        self.in_flight = prom.Gauge(
            f"epd_{role}_in_flight",
            f"{role.capitalize()} calls in flight.",
            [role],
            multiprocess_mode="livesum",
        )
        # Every metric with a series per server, and what a departed server's gauges are set to where
        # series cannot be removed: no call in flight, no traffic taken, and 1 for model_ok (the
        # minimum's neutral value: no "serves another model" for a server that is gone).
        self.per_server = (
            self.call_seconds,
            self.failovers,
            self.foreign_answers,
            self.failures,
            self.ejection_checks,
            self.healthy,
            self.model_ok,
            self.in_flight,
        )
        self.departed_values = ((self.in_flight, 0), (self.healthy, 0), (self.model_ok, 1))


def _request_labels(outcome: str) -> tuple[str, str]:
    """The ``outcome`` and ``code`` labels of a request outcome: ``error_502`` is ``("error", "502")``,
    any other ``(outcome, "")``."""
    kind, _, code = outcome.partition("_")
    if kind == "error" and code.isdigit():
        return kind, code
    return outcome, ""


_prometheus: _Prometheus | None = None
_loaded = False
# Departed servers remembered per Stats (see Stats._departed).
_MAX_DEPARTED = 4096


def _multiprocess() -> bool:
    """Whether metrics live in per-process files (prometheus_client's own test, in ``remove``)."""
    return "PROMETHEUS_MULTIPROC_DIR" in os.environ or "prometheus_multiproc_dir" in os.environ


def _metrics() -> _Prometheus | None:
    global _prometheus, _loaded
    if not _loaded:
        _loaded = True
        try:
            import prometheus_client
        except ImportError:
            # Once per process: an operator who expects epd_* series in /metrics (a plain Starlette app
            # installed without the extra; vLLM always has it) learns why there are none.
            logger.warning(
                "epd: prometheus_client is not installed, so the epd_* metrics are off; "
                "install it (pip install prometheus_client), or the package with its metrics extra: "
                "pip install 'epd-middleware[metrics] @ git+https://github.com/epd-middleware/epd-middleware'"
            )
            return None
        _prometheus = _Prometheus(prometheus_client)
    return _prometheus


class Stats:
    """One middleware's counters, mirrored into Prometheus when it is installed.

    Labelled children are looked up once and kept: ``labels()`` costs a lock and a dict of tuples on
    every call, and these are on the request path.
    """

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self._prom = _metrics()
        self._children: dict[tuple[object, ...], Any] = {}
        # Servers that left their pool, as (role, label), oldest first: their series are gone, and what a
        # call still in flight to one reports when it ends stays out (it would bring them back for good).
        self._departed: dict[tuple[str, str], None] = {}
        # Calls in flight per (role, label), exported or not: a server back in its pool shows the
        # calls from before it left that still run.
        self._in_flight: Counter[tuple[str, str]] = Counter()

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request(self, outcome: str) -> None:
        """Counts a request's outcome: ``error_502`` in the counters, ``outcome="error", code="502"`` in
        Prometheus (one label per dimension, so a query can sum the errors or pick the 5xx)."""
        self.counters[outcome] += 1
        if self._prom is not None:
            self._child(self._prom.requests, *_request_labels(outcome)).inc()

    def stage(self, stage: str, seconds: float) -> None:
        if self._prom is not None:
            self._child(self._prom.stage_seconds, stage).observe(seconds)

    def encoded(self, items: int, calls: int) -> None:
        self.request("encoded")
        if self._prom is not None:
            self._prom.request_media_items.observe(items)
            self._prom.request_encoder_calls.observe(calls)

    def reused(self, items: int) -> None:
        self.counters["reused_items"] += items
        if self._prom is not None:
            self._prom.reused_items.inc(items)

    def fallback(self, items: int) -> None:
        self.counters["fallback_items"] += items
        self.request("fallback")
        if self._prom is not None:
            self._prom.fallback_items.inc(items)

    def engine_retry(self) -> None:
        self.counters["engine_retries"] += 1
        if self._prom is not None:
            self._prom.engine_retries.inc()

    def engine_retry_skipped(self) -> None:
        """A 500 after the whole push wait, passed on rather than retried (on the status page; vLLM's own
        metrics count the failed request)."""
        self.counters["engine_retries_skipped_after_push_wait"] += 1

    def call(self, role: str, server: str, outcome: str, seconds: float) -> None:
        self.counters[f"{role}_calls_{outcome}"] += 1
        if self._prom is not None and (role, server) not in self._departed:
            self._child(self._prom.pools[role].call_seconds, server, outcome).observe(seconds)

    def failover(self, role: str, server: str) -> None:
        self.counters[f"{role}_failovers"] += 1
        if self._prom is not None and (role, server) not in self._departed:
            self._child(self._prom.pools[role].failovers, server).inc()

    def blame(self, role: str, server: str, blame: str) -> None:
        self.counters[f"{role}_failures_blamed_{blame}"] += 1
        if self._prom is not None and (role, server) not in self._departed:
            self._child(self._prom.pools[role].failures, server, blame).inc()

    def ejection_check(self, role: str, server: str, result: str) -> None:
        self.counters[f"{role}_ejections_{result}"] += 1
        if self._prom is not None and (role, server) not in self._departed:
            self._child(self._prom.pools[role].ejection_checks, server, result).inc()

    def foreign_answer(self, role: str, server: str) -> None:
        self.counters[f"{role}_foreign_answers"] += 1
        if self._prom is not None and (role, server) not in self._departed:
            self._child(self._prom.pools[role].foreign_answers, server).inc()

    def placement(self, where: str, why: str) -> None:
        self.counters[f"placement_{where}_{why}"] += 1
        if self._prom is not None:
            self._child(self._prom.placements, where, why).inc()

    def loaded(self, version: str) -> None:
        """The middleware is loaded in this process (its series exists from the start, before any
        request or pool member)."""
        if self._prom is not None:
            self._child(self._prom.loaded, version).set(1)

    def equivalence(self, encoder: str, result: str, source: str = "canary") -> None:
        self.counters[
            f"equivalence_{result}" if source == "canary" else f"equivalence_{source}_{result}"
        ] += 1
        if self._prom is not None:
            self._child(self._prom.equivalence.checks, encoder, result, source).inc()
            if result != "skipped":
                mismatched = 1 if result == "mismatch" else 0
                self._child(self._prom.equivalence.mismatched, encoder, source).set(mismatched)

    def encoder_source(self, source: str) -> None:
        self.counters[f"encoders_chosen_by_{source}"] += 1
        if self._prom is not None:
            self._child(self._prom.encoder_sources, source).inc()

    def forged_target(self, role: str) -> None:
        self.counters[f"forged_{role}_targets"] += 1
        if self._prom is not None:
            self._child(self._prom.forged_targets, role).inc()

    def dns_lookup(self, role: str, outcome: str) -> None:
        self.counters[f"{role}_dns_lookups_{outcome}"] += 1
        if self._prom is not None:
            self._child(self._prom.dns_lookups, role, outcome).inc()

    def pool_size(self, role: str, members: int) -> None:
        if self._prom is not None:
            self._child(self._prom.pool_members, role).set(members)

    def model_check(self, role: str, server: str, ok: bool) -> None:
        """A member's model verdict (the pool exports none for other servers)."""
        if self._prom is not None:
            self._rejoined(role, server)
            self._child(self._prom.pools[role].model_ok, server).set(1 if ok else 0)

    def forget(self, role: str, server: str) -> None:
        """A server left the pool: every series labelled with it goes (calls, failovers, foreign answers,
        failures by blame, ejection checks, health, model, in flight), and stays gone until the pool
        exports its health again (it is back). A gauge would otherwise keep its last value for ever, and
        the others grow with every address a DNS name ever had."""
        if self._prom is None:
            return
        self._departed[(role, server)] = None
        if len(self._departed) > _MAX_DEPARTED:
            # Every address a DNS name ever had would stay here; the oldest left long ago, and its
            # calls, bounded by their timeouts, have ended.
            del self._departed[next(iter(self._departed))]
        pool = self._prom.pools[role]
        if _multiprocess():
            for metric, value in pool.departed_values:
                child = self._children.get((id(metric), server))
                if child is not None:
                    child.set(value)
            return
        for metric in pool.per_server:
            for key in [key for key in self._children if key[:2] == (id(metric), server)]:
                del self._children[key]
                with contextlib.suppress(KeyError):
                    metric.remove(*key[1:])

    def health(self, role: str, server: str, healthy: bool) -> None:
        """A member's health (the pool exports none for other servers, and a joining member's first)."""
        if self._prom is not None:
            self._rejoined(role, server)
            self._child(self._prom.pools[role].healthy, server).set(1 if healthy else 0)

    def in_flight(self, role: str, server: str, delta: int) -> None:
        if self._prom is None:
            return
        key = (role, server)
        count = self._in_flight[key] + delta
        if count:
            self._in_flight[key] = count
        else:
            del self._in_flight[key]
        if key not in self._departed:
            self._child(self._prom.pools[role].in_flight, server).inc(delta)

    def _rejoined(self, role: str, server: str) -> None:
        """A departed server whose health or model is exported is a member again: its series come back,
        the in-flight gauge with the calls from before it left that still run."""
        key = (role, server)
        if key in self._departed:
            assert self._prom is not None
            del self._departed[key]
            if self._in_flight[key]:
                self._child(self._prom.pools[role].in_flight, server).set(self._in_flight[key])
