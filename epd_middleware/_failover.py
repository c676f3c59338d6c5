"""How one call fails over among the servers of a pool: the first server, then others while the call
fails in a way another server may not, each try made by :func:`._upstream.post_once` and recorded in the
pool's health.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import anyio

from ._logs import logger
from ._pool import ServerPool
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
) -> T:
    """POST to ``first``, then to other servers while the call fails in a way another server may not
    (up to ``max_attempts`` servers): ``preferred`` in order, then available members round-robin. A
    rejection of the request itself is raised at once; the last failure is raised when no server is
    left; :class:`~._upstream.DeadlinePassed` once ``deadline`` (event-loop time) has passed, whatever
    the attempt. ``attempt`` makes each try afresh (its body, and how its answer is read)."""
    role, stats = pool.role, pool.stats
    tried: list[str] = []
    why: list[str] = []  # each failed try, for the error when none is left
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
            why.append(f"{server}: {last.reason}")
            server = pool.failover_target(tried, anyio.current_time(), preferred)
            continue
        label = pool.label(server)
        started = time.perf_counter()
        try:
            this = attempt()
            reply = await post_once(
                transport,
                server,
                path,
                this.body,
                headers,
                role=role,
                label=label,
                capacity=pool.record(server).capacity,
                call_timeout=pool.policy.timeout,
                deadline=deadline,
                stats=stats,
            )
            result = this.read(server, reply)
        except UpstreamError as exc:
            stats.call(role, label, exc.outcome, time.perf_counter() - started)
            if not exc.retryable:
                raise
            last = exc
            why.append(f"{server}: {exc.reason}")
            now = anyio.current_time()
            if exc.blames_server:
                pool.record_failure(server, now, exc.reason)
            more = len(tried) < pool.policy.max_attempts
            server = pool.failover_target(tried, now, preferred) if more else None
            if server is not None:
                stats.failover(role, label)
            logger.warning(
                "%s%s", exc.message, f"; retrying on {server}" if server else f"; no {role} left to try"
            )
            continue
        stats.call(role, label, "ok", time.perf_counter() - started)
        pool.record_success(server)
        return result
    assert last is not None
    if len(why) > 1:
        # Every server tried, each with its reason: the last one alone would hide the others.
        last.message = f"{last.message} (tried {len(why)} {role}s: {'; '.join(why)})"
        last.args = (last.message,)
    raise last
