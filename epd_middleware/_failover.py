"""How one call fails over among the servers of a pool: the first server, then others while the call
fails in a way another server may not. Each try is made by :func:`._upstream.post_once`; each failure is
judged (:mod:`._blame`: the server, the request, or nobody at fault) and recorded in the pool's health;
a server's ejection is confirmed before it happens (:func:`._probes.confirm_failing`).

Blame runs both ways. A failure that looks like the request's own (a 4xx, 501, a refused client key) is
one server's word, and a broken server can say it of every request: where the pool doubts that server
(:meth:`._pool.ServerPool.doubts`: its share of such answers is high; its canary then fails, or the share
stands out from the other servers'), the call goes to another server, whose answer settles it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

import anyio

from ._blame import Ledger, Verdict
from ._canary import Canary
from ._http import body_size
from ._logs import logger
from ._pool import Health, ServerPool
from ._probes import confirm_failing, proves_healthy
from ._tracing import call_span, inject, record
from ._upstream import Attempt, DeadlinePassed, post_once
from .errors import UpstreamError, UpstreamUnavailable
from .transport import Transport

__all__ = ["call"]

T = TypeVar("T")

# Verdicts that fail a call over without a server's fault yet: a doubted answer, a refused client key.
_NOT_YET_ANYONES = frozenset({"doubted", "credentials"})
# Verdicts that count towards a server's ejection.
_COUNTED = frozenset({"server", "unmasked"})


async def call(
    pool: ServerPool,
    transport: Transport,
    first: str,
    path: str,
    attempt: Callable[[str], Attempt[T]],
    headers: Mapping[str, str],
    preferred: Sequence[str] = (),
    deadline: float | None = None,
    ledger: Ledger | None = None,
    canary: Canary | None = None,
    traced: bool = False,
    attempts: int | None = None,
) -> T:
    """POST to ``first``, then to other servers while the call fails in a way another server may not
    (up to ``max_attempts`` servers): ``preferred`` in order, then available members round-robin. A
    failure the request is at fault for (``ledger``: all of the request's failures, judged together)
    is raised at once; the last failure is raised when no server is left;
    :class:`~._upstream.DeadlinePassed` once ``deadline`` (event-loop time) has passed, whatever the
    attempt. ``attempt(server)`` makes each try afresh (its body, and how its answer is read);
    ``canary``: the call that proves a server healthy on its own besides its /health (an encoder's
    canary encode); ``attempts``: at most this many servers (None: the pool's ``max_attempts``; 1: the
    answer is ``first``'s own, as the equivalence probe needs)."""
    over = _Failover(pool, transport, path, attempt, headers, preferred, deadline, ledger or Ledger(), canary)
    over.traced = traced
    over.attempts = attempts or pool.policy.max_attempts
    return await over.run(first)


class _Failover(Generic[T]):
    """One call over the servers of a pool: what it tried and why each failed."""

    __slots__ = (
        "attempt",
        "attempts",
        "canary",
        "deadline",
        "headers",
        "ledger",
        "opinion",
        "path",
        "pool",
        "preferred",
        "traced",
        "transport",
        "tried",
        "why",
    )

    def __init__(
        self,
        pool: ServerPool,
        transport: Transport,
        path: str,
        attempt: Callable[[str], Attempt[T]],
        headers: Mapping[str, str],
        preferred: Sequence[str],
        deadline: float | None,
        ledger: Ledger,
        canary: Canary | None,
    ) -> None:
        self.pool, self.transport, self.path = pool, transport, path
        self.attempt, self.headers, self.preferred = attempt, headers, preferred
        self.deadline, self.ledger, self.canary = deadline, ledger, canary
        self.traced = False
        self.attempts = pool.policy.max_attempts
        # The second opinion this call's next try gives on a doubted answer, where it asked for one.
        self.opinion: _Opinion | None = None
        self.tried: list[str] = []
        self.why: list[tuple[str, str]] = []  # each failed try, for the error when none is left

    async def run(self, first: str) -> T:
        try:
            return await self._over_servers(first)
        finally:
            if self.opinion is not None:  # asked for, and no try left to give it: others go on
                self.opinion.set()

    async def _over_servers(self, first: str) -> T:
        pool = self.pool
        server: str | None = first
        last: UpstreamError | None = None
        while server is not None and len(self.tried) < self.attempts:
            if self.deadline is not None and anyio.current_time() >= self.deadline:
                raise DeadlinePassed
            self.tried.append(server)
            if not await pool.models.admits(self.transport, server, self.deadline):
                last = self._not_used(server)
                server = self._next()
                continue
            # This try may be the second opinion on a doubted answer: once it is judged, the requests
            # waiting for that opinion go on.
            opinion, self.opinion = self.opinion, None
            try:
                try:
                    result = await self._try(server)
                except UpstreamError as exc:
                    last, blame = await self._failed(server, exc)  # raises the request's own answer
                else:
                    await self._contradicted()
                    return result
            finally:
                if opinion is not None:
                    opinion.set()
            # A doubted answer goes to the server whose word is the most trusted: another with a high
            # share of such answers is no independent witness.
            failed, server = server, self._next(most_trusted=blame == "doubted")
            if server is not None:
                pool.stats.failover(pool.role, pool.label(failed))
            # A retry of an answer doubted, or of a client key refused, is no trouble of a server's yet
            # (a bad request's own line says it): a warning comes if the next server unmasks it.
            logger.log(
                logging.DEBUG if blame in _NOT_YET_ANYONES else logging.WARNING,
                "%s%s",
                last.logged,
                f"; retrying on {server}" if server else f"; no {pool.role} left to try",
            )
        assert last is not None
        raise self._none_left(last)

    async def _try(self, server: str) -> T:
        """One try on ``server``: its answer read, or the typed failure (counted in the call stats)."""
        pool = self.pool
        label = pool.label(server)
        started = time.perf_counter()
        this = self.attempt(server)
        try:
            with call_span(self.traced, pool.role, server, len(self.tried), this.body) as span:
                sent = self.headers
                if self.traced:
                    sent = dict(self.headers)
                    inject(self.traced, sent)  # the server's own spans join this call's
                try:
                    reply = await post_once(
                        self.transport,
                        server,
                        self.path,
                        this.body,
                        sent,
                        role=pool.role,
                        label=label,
                        capacity=pool.record(server).capacity,
                        call_timeout=pool.policy.timeout,
                        deadline=self.deadline,
                        stats=pool.stats,
                    )
                    result = this.read(server, reply)
                except UpstreamError as exc:
                    status = getattr(exc, "status_code", None)
                    record(span, **{"epd.outcome": exc.outcome, "http.response.status_code": status})
                    raise
                record(span, **{"epd.outcome": "ok"})
        except UpstreamError as exc:
            pool.stats.call(pool.role, label, exc.outcome, time.perf_counter() - started)
            raise
        took = time.perf_counter() - started
        pool.stats.call(pool.role, label, "ok", took)
        pool.record_latency(server, took, this.work, body_size(this.body))
        pool.record_success(server)
        pool.answered(server, rejected=False)
        return result

    async def _failed(self, server: str, exc: UpstreamError) -> tuple[UpstreamError, str]:
        """Judge and record a failed try of ``server``: the failure to fail over from and who is at
        fault, or the request's own answer raised (no other server would differ)."""
        pool = self.pool
        blame, failure, retract, _, vindicate = verdict = await self._verdict(server, exc)
        pool.blamed(server, blame)
        if vindicate is not None:
            pool.vindicate(vindicate, anyio.current_time())
        if not failure.retryable:
            if retract is not None:
                pool.retract_failure(retract)
            # The answer's own line says it (one line a bad request, however fast they come).
            logger.debug("%s; the request is at fault: not tried on another %s", failure.logged, pool.role)
            raise failure from None
        self.why.append((server, failure.reason))
        if verdict.blame in _COUNTED and pool.suspect(server, anyio.current_time(), failure.reason):
            await confirm_failing(pool, self.transport, server, self.canary)
        return failure, blame

    async def _verdict(self, server: str, exc: UpstreamError) -> Verdict:
        """Who is at fault for ``exc``: the ledger's verdict, settled by the server's own health where
        the request failed the same way elsewhere, and doubted where the pool does not take the
        server's word that the request is at fault."""
        pool, ledger, call = self.pool, self.ledger, id(self)
        verdict = ledger.judge(server, exc, call)
        if verdict.blame == "suspect":  # failed as on another server: the request's fault if this one is well
            healthy = await proves_healthy(pool, self.transport, server, self.canary) is None
            return ledger.settle(server, exc, server_healthy=healthy)
        if verdict.blame == "request" and (verdict.doubtable or verdict.vindicate is not None):
            pool.answered(server, rejected=True)  # its word that the request is at fault
        if verdict.vindicate is not None and pool.doubts(server, anyio.current_time())[0]:
            # It agrees with the doubted server, but its own word is doubted too: two servers broken
            # alike are no evidence against the request. A third says, where there is one.
            if self._may_try_another():
                return ledger.doubt(server, verdict._replace(vindicate=None), call)
            return verdict._replace(vindicate=None)
        if not verdict.doubtable:
            return verdict
        if verdict.blame == "credentials":
            # A client key one server refuses may be one its key list lacks: another server says.
            more = self._may_try_another()
            return ledger.doubt(server, verdict, call) if more else verdict
        doubted, stands_out = pool.doubts(server, anyio.current_time())
        if not doubted:
            return verdict
        problem = await proves_healthy(pool, self.transport, server, self.canary)
        if problem is not None:
            # It cannot do its job on its own either: the answer was its own failure.
            logger.warning("%s %s: %s, and %s", pool.role, server, verdict.error.logged, problem)
            return ledger.unmask(server, _own_failure(verdict.error, problem))
        if not (stands_out and self._may_try_another()):
            return verdict
        health = pool.record(server)
        while (under_way := health.second_opinion) is not None:
            # Another request's second opinion on this server's answers is under way: one for all.
            await under_way.wait()
            if health.vindicated_until > anyio.current_time():
                return verdict
        self.opinion = _Opinion(health)
        return ledger.doubt(server, verdict, call)

    async def _contradicted(self) -> None:
        """The call succeeded: every server whose answer to it was doubted gave its own failure."""
        pool = self.pool
        for server, verdict in self.ledger.contradicted(pool.role, id(self)):
            pool.blamed(server, verdict.blame)
            logger.warning(
                "%s %s answered %s, but another %s served the request: %s",
                pool.role,
                server,
                verdict.error.reason,
                pool.role,
                "its own failure"
                if verdict.blame == "unmasked"
                else "counted against nobody (the request's media is fetched by URL, whose host may "
                "answer each server otherwise)",
            )
            if verdict.blame == "unmasked" and pool.suspect(
                server, anyio.current_time(), verdict.error.reason
            ):
                await confirm_failing(pool, self.transport, server, self.canary)

    def _not_used(self, server: str) -> UpstreamError:
        """A server the model gate did not admit: not its failure, it is not one of ours (another model,
        or it did not say)."""
        health = self.pool.known(server)
        served = health.served if health is not None else ""
        failure = UpstreamUnavailable(
            server, f"not used: {served or 'it did not say what it serves'}", role=self.pool.role
        )
        self.why.append((server, failure.reason))
        return failure

    def _next(self, *, most_trusted: bool = False) -> str | None:
        if len(self.tried) >= self.attempts:
            return None
        if most_trusted:
            return self.pool.most_trusted(self.tried, anyio.current_time(), self.preferred)
        return self.pool.failover_target(self.tried, anyio.current_time(), self.preferred)

    def _may_try_another(self) -> bool:
        pool = self.pool
        return len(self.tried) < self.attempts and pool.has_other(
            self.tried, anyio.current_time(), self.preferred
        )

    def _none_left(self, last: UpstreamError) -> UpstreamError:
        """The error when no server is left: the request's own answer where the ledger holds one (vLLM's
        words, not the servers tried), else the last failure, naming every server tried."""
        last = self.ledger.final(last, id(self))
        if last.retryable and len(self.why) > 1:
            last.tried(self.why)
        return last


class _Opinion:
    """A second opinion on a server's doubted answer, under way: the requests doubting the same server
    meanwhile wait for it rather than each paying a call (a proof of health is shared alike)."""

    __slots__ = ("done", "health")

    def __init__(self, health: Health) -> None:
        self.health = health
        self.done = health.second_opinion = anyio.Event()

    def set(self) -> None:
        if self.health.second_opinion is self.done:
            self.health.second_opinion = None
        self.done.set()


def _own_failure(answer: UpstreamError, problem: str) -> UpstreamError:
    """A server's "client fault" answer, shown to be its own failure (its canary failed as well)."""
    return UpstreamUnavailable(answer.server, f"{answer.reason}; and {problem}", role=answer.role)
