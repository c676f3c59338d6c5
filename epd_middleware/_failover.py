"""How one call fails over among the servers of a pool: the first server, then others while the call
fails in a way another server may not, each try made by :func:`._upstream.post_once`, each failure judged
(:mod:`._blame`: the server, the request, or nobody at fault) and recorded in the pool's health, a
server's ejection confirmed before it happens (:func:`._probes.confirm_failing`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import anyio

from ._blame import Ledger
from ._canary import Canary
from ._http import body_size
from ._logs import logger
from ._pool import ServerPool
from ._probes import confirm_failing, proves_healthy
from ._tracing import call_span, inject, record
from ._upstream import Attempt, DeadlinePassed, post_once
from .errors import UpstreamError, UpstreamUnavailable
from .transport import Transport

__all__ = ["call"]

T = TypeVar("T")


async def call(
    pool: ServerPool,
    transport: Transport,
    first: str,
    path: str,
    attempt: Callable[[], Attempt[T]],
    headers: Mapping[str, str],
    preferred: Sequence[str] = (),
    deadline: float | None = None,
    ledger: Ledger | None = None,
    canary: Canary | None = None,
    traced: bool = False,
) -> T:
    """POST to ``first``, then to other servers while the call fails in a way another server may not
    (up to ``max_attempts`` servers): ``preferred`` in order, then available members round-robin. A
    failure the request is at fault for (``ledger``: all of the request's failures, judged together)
    is raised at once; the last failure is raised when no server is left;
    :class:`~._upstream.DeadlinePassed` once ``deadline`` (event-loop time) has passed, whatever the
    attempt. ``attempt`` makes each try afresh (its body, and how its answer is read); ``canary``: the
    call that confirms a server's ejection besides its /health (an encoder's canary encode)."""
    role, stats = pool.role, pool.stats
    if ledger is None:
        ledger = Ledger()
    tried: list[str] = []
    why: list[tuple[str, str]] = []  # each failed try, for the error when none is left
    server: str | None = first
    last: UpstreamError | None = None
    while server is not None and len(tried) < pool.policy.max_attempts:
        if deadline is not None and anyio.current_time() >= deadline:
            raise DeadlinePassed
        tried.append(server)
        if not await pool.models.admits(transport, server, deadline):
            # Not the server's failure: it is not one of ours (another model, or it did not say).
            health = pool.known(server)
            served = health.served if health is not None else ""
            last = UpstreamUnavailable(
                server, f"not used: {served or 'it did not say what it serves'}", role=role
            )
            why.append((server, last.reason))
            server = pool.failover_target(tried, anyio.current_time(), preferred)
            continue
        label = pool.label(server)
        started = time.perf_counter()
        try:
            this = attempt()
            with call_span(traced, role, server, len(tried), this.body) as span:
                sent = headers
                if traced:
                    sent = dict(headers)
                    inject(traced, sent)  # the server's own spans join this call's
                try:
                    reply = await post_once(
                        transport,
                        server,
                        path,
                        this.body,
                        sent,
                        role=role,
                        label=label,
                        capacity=pool.record(server).capacity,
                        call_timeout=pool.policy.timeout,
                        deadline=deadline,
                        stats=stats,
                    )
                    result = this.read(server, reply)
                except UpstreamError as exc:
                    record(
                        span,
                        **{
                            "epd.outcome": exc.outcome,
                            "http.response.status_code": getattr(exc, "status_code", None),
                        },
                    )
                    raise
                record(span, **{"epd.outcome": "ok"})
        except UpstreamError as exc:
            stats.call(role, label, exc.outcome, time.perf_counter() - started)
            blame, failure, retract = ledger.judge(server, exc)
            if blame == "suspect":  # failed as on another server: the request's fault if this one is well
                healthy = await proves_healthy(pool, transport, server, canary) is None
                blame, failure, retract = ledger.settle(server, exc, server_healthy=healthy)
            pool.blamed(server, blame)
            if not failure.retryable:
                if retract is not None:
                    pool.retract_failure(retract)
                # The answer's own line says it (one line a bad request, however fast they come).
                logger.debug("%s; the request is at fault: not tried on another %s", failure.logged, role)
                raise failure from None
            last = failure
            why.append((server, failure.reason))
            if blame == "server" and pool.suspect(server, anyio.current_time(), failure.reason):
                await confirm_failing(pool, transport, server, canary)
            more = len(tried) < pool.policy.max_attempts
            server = pool.failover_target(tried, anyio.current_time(), preferred) if more else None
            if server is not None:
                stats.failover(role, label)
            logger.warning(
                "%s%s", failure.logged, f"; retrying on {server}" if server else f"; no {role} left to try"
            )
            continue
        took = time.perf_counter() - started
        stats.call(role, label, "ok", took)
        pool.record_latency(server, took, body_size(this.body))
        pool.record_success(server)
        return result
    assert last is not None
    last = ledger.final(last)
    if not last.retryable:
        raise last from None  # the request's own answer: vLLM's words, not the servers tried
    if len(why) > 1:
        last.tried(why)
    raise last
