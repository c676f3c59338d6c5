"""A pool of remote vLLM servers of one role (encoders, prefill servers): who is in it, how healthy each
is, and which to try next.

It owns what every pool needs and nothing about what the calls carry: its members (set by
:mod:`._discovery`), the round-robin cursor, passive health (consecutive failures eject a server for a
cool-down that doubles while it keeps failing) and each server's capacity. How a call fails over is
:mod:`._failover`, one try of it :mod:`._upstream`, active health :mod:`._probes`; whether a server serves
this server's model is the pool's :class:`~._compat.ModelGate`. The encoder and prefill stages build the
bodies and read the replies; :mod:`._selection` and :mod:`._scheduler` say which servers a call should
try.

Calls may also go to servers that are not members (a scheduler named them): they get health and limits
like members, and are forgotten once idle.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from ._addresses import url_host_port
from ._compat import UNUSABLE, ModelGate
from ._logs import logger
from ._metrics import Stats
from ._upstream import Capacity
from .errors import NoHealthyUpstream

__all__ = ["OTHER_SERVERS", "PoolPolicy", "ServerPool"]

# Model verdicts that make a server unhealthy: it serves another model, or it did not say what it serves.
_NOT_HEALTHY = frozenset({"mismatch", "unreachable"})
# The metrics label of servers outside the pool (named by a scheduler header).
OTHER_SERVERS = "other"
# Health records kept for servers that are not members (named by a scheduler) before idle ones are
# forgotten: bounds the memory a stream of distinct targets can take.
_MAX_STRANGERS = 1024
# Members that left the pool remembered (their URLs, the oldest forgotten first): the record of one is
# dropped once idle, at a membership update, however its last calls' ends made it again.
_MAX_DEPARTED = 4096
# How much each earlier answer weighs against the next in a server's share of "client fault" answers
# (about the last 10 answers count), the share at which it is doubted, and by how much it must exceed
# the other members' mean share to stand out from them.
_ANSWER_DECAY = 0.9
_DOUBTED_SHARE = 0.5
_STANDS_OUT_BY = 0.25
# A share over fewer answers than this (decayed: about the last four) is noise, no standing out.
_FEW_ANSWERS = 3.0
# "Client fault" answers in a row that are worth its canary whatever its share.
_STREAK = 3
# How long a vindication holds where health probes are off (as a proof of health does).
_VINDICATION_HOLDS_S = 5.0


@dataclass(frozen=True, slots=True)
class PoolPolicy:
    """What a pool is told: how long one call may take, how far it fails over, how many calls one server
    takes at once, when a failing server is ejected and for how long, and how servers are probed."""

    timeout: float
    max_attempts: int = 3
    max_inflight: int = 64
    eject_after: int = 3
    eject_cooldown: float = 2.0
    max_eject_cooldown: float = 60.0
    health_check_interval: float = 5.0
    health_check_timeout: float = 2.0


class Proof:
    """A proof of a server's health under way (:func:`._probes.proves_healthy`): every request that needs
    one meanwhile waits for it rather than making its own (a client's concurrent requests would otherwise
    cost the server a canary each)."""

    __slots__ = ("done", "finished", "problem", "with_canary")

    def __init__(self, with_canary: bool) -> None:
        self.with_canary = with_canary
        self.done = anyio.Event()
        # False when it was cancelled before it said anything (its caller left): waiters try again.
        self.finished = False
        self.problem: str | None = None


@dataclass
class Health:
    """One server's record: its failures and ejection, its calls in flight, its model verdict."""

    capacity: Capacity
    failures: int = 0
    ejected_until: float = 0.0
    cooldown: float = 0.0
    # Whether it serves this server's model (_compat.py): unchecked, ok, mismatch, unreachable.
    model: str = "unchecked"
    served: str = ""
    # The model names it serves (GET /v1/models), where asked.
    names: frozenset[str] = frozenset()
    last_failure: str = ""
    # Its ejection is being confirmed (_probes.confirm_failing): the calls that fail meanwhile only count.
    confirming: bool = False
    # Until when it is known healthy on its own (_probes.proves_healthy), and whether a canary said so.
    proven_until: float = 0.0
    proven_by_canary: bool = False
    proof: Proof | None = None
    # Its own canary encode failed while /health passed: its encoding is broken, which /health does not
    # see, so only a call that succeeds (or a canary that passes) brings it back, not /health.
    encode_broken: bool = False
    # Failed calls by who was at fault (_blame.BLAMES), and ejections the confirmation averted.
    blamed: Counter[str] = field(default_factory=Counter)
    kept: int = 0
    # Its successful calls' recent latency (a moving average, in seconds), and how much slower than the
    # fastest call of their size they have been lately (a moving average of the ratio): the waiting it
    # adds now (_placement.py). Calls compare within a size class (the vision tokens they ask for and
    # their bytes, each by powers of two), so a large call is never taken for a slow small one.
    latency: float = 0.0
    slowdown: float = 0.0
    # When its slowdown was last measured (time.monotonic()): a verdict no call renews goes stale.
    slowdown_at: float = 0.0
    fastest: dict[tuple[int, int], float] = field(default_factory=dict)
    # Its recent answers (decayed counts): all of them, and those that said the request was at fault
    # (a 4xx, 501). A server whose share of the latter stands out may be hiding its own failure behind
    # "the client's fault" (_failover.py doubts it); until ``vindicated_until`` such answers of its are
    # trusted again: another server said the same of the request.
    answers: float = 0.0
    rejections: float = 0.0
    vindicated_until: float = 0.0
    # Its "client fault" answers in a row: a server that breaks after long service keeps a share under
    # half for several answers (the earlier successes weigh), but not a streak.
    rejected_streak: int = 0
    # Set once the second opinion on its doubted answers under way is in (_failover.py): others wait.
    second_opinion: anyio.Event | None = None
    # Why it is out of the pool because its answers differ from PD's own (the equivalence probe, with
    # equivalence_eject); empty: they do not. Only a probe that matches again brings it back.
    inequivalent: str = ""
    # The load vLLM reports for it (GET /load under --enable-server-load-tracking); None: not reported.
    server_load: int | None = None
    # False once it answered that it tracks no load: not asked again.
    load_tracked: bool = True

    def problem(self, now: float) -> str | None:
        """Why the server is not healthy at ``now`` (ejected, another model, no answer about its model),
        or None when it is."""
        if self.ejected_until > now:
            return (
                f"ejected for {self.ejected_until - now:.1f} s more after {self.failures} failures in a row"
                f" (last: {self.last_failure})"
            )
        if self.inequivalent:
            return f"out of the pool: {self.inequivalent}"
        if self.model == "mismatch":
            return f"serves another model: {self.served}"
        if self.model == "unreachable":
            return f"did not say what it serves: {self.served}"
        return None


@dataclass
class ServerPool:
    """The servers of one role, their health and their limits. One per middleware, so one per
    API-server process."""

    role: str
    policy: PoolPolicy
    stats: Stats = field(default_factory=Stats)
    members: tuple[str, ...] = field(init=False, default=())
    # (host, port) of every member, as a scheduler header would name it
    member_addresses: frozenset[tuple[str, int]] = field(init=False, default=frozenset())
    models: ModelGate = field(init=False)
    _member_set: frozenset[str] = field(init=False, default=frozenset())
    _health: dict[str, Health] = field(init=False, default_factory=dict)
    # Servers out of the pool for answers that differ from PD's own (bar): kept by URL, so that one
    # leaving the DNS answer and coming back (its health record forgotten) is still out.
    _barred: dict[str, str] = field(init=False, default_factory=dict)
    _departed: dict[str, None] = field(init=False, default_factory=dict)
    _next: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.models = ModelGate(self, self.policy.health_check_timeout)

    def set_members(self, urls: Sequence[str]) -> None:
        """Make ``urls`` the members: new ones take traffic at once, vanished ones get no new calls
        (calls in flight finish), survivors keep their health."""
        members = tuple(dict.fromkeys(urls))
        # Departed members whose calls have ended since (DNS answers come every refresh interval): a
        # record kept for each would list every address a rollout replaced, up to the strangers' bound.
        for url in [url for url in self._health if url in self._departed]:
            self._forget_if_idle(url)
        if members == self.members:
            return
        old = self._member_set
        self.members, self._member_set = members, frozenset(members)
        self.member_addresses = frozenset(url_host_port(url) for url in members)
        for url in members:
            if url not in old:
                self._departed.pop(url, None)
                self.export_health(url)
        for url in old - self._member_set:
            self.stats.forget(self.role, url)
            self._departed[url] = None
            if len(self._departed) > _MAX_DEPARTED:
                del self._departed[next(iter(self._departed))]
            self._forget_if_idle(url)
        self.stats.pool_size(self.role, len(members))
        if old:
            logger.info(
                "%s pool: %d member(s)%s%s",
                self.role,
                len(members),
                f"; added {sorted(self._member_set - old)}" if self._member_set - old else "",
                f"; removed {sorted(old - self._member_set)}" if old - self._member_set else "",
            )

    def is_member(self, url: str) -> bool:
        return url in self._member_set

    def export_health(self, url: str) -> None:
        """The member's ``epd_<role>_healthy``: up, and not known to serve another model or to be silent
        about it."""
        if url in self._member_set:
            health = self.record(url)
            # Ejected until record_success (a probe or a call) brings it back, whatever the clock says.
            healthy = (
                not health.ejected_until and not health.inequivalent and health.model not in _NOT_HEALTHY
            )
            self.stats.health(self.role, url, healthy)

    def problems(self, now: float) -> list[str]:
        """Why each member that is not healthy is not, one ``url: why`` each."""
        return [f"{url}: {problem}" for url in self.members if (problem := self._health[url].problem(now))]

    def record(self, url: str) -> Health:
        """The health record of ``url``, made on first use (members and strangers alike)."""
        health = self._health.get(url)
        if health is None:
            if len(self._health) - len(self.members) >= _MAX_STRANGERS:
                for stranger in [u for u in self._health if u not in self._member_set]:
                    self._forget_if_idle(stranger)
            health = self._health[url] = Health(Capacity(self.policy.max_inflight))
            health.inequivalent = self._barred.get(url, "")
        return health

    def known(self, url: str) -> Health | None:
        """The health record of ``url`` if it has one."""
        return self._health.get(url)

    def records(self) -> Iterable[Health]:
        return self._health.values()

    def _forget_if_idle(self, url: str) -> None:
        health = self._health.get(url)
        if health is not None and health.capacity.idle and url not in self._member_set:
            del self._health[url]

    # Choosing ----------------------------------------------------------------------------------------

    def available(self, now: float) -> tuple[str, ...]:
        """Members not ejected at ``now`` and not known to serve another model (one not checked yet is
        checked by its first call); an ejected one comes back for a trial when its cool-down ends."""
        health = self._health
        return tuple(
            url
            for url in self.members
            if health[url].ejected_until <= now
            and health[url].model not in UNUSABLE
            and not health[url].inequivalent
        )

    def in_flight_by_server(self) -> dict[str, int]:
        """Calls in flight per member (from this process)."""
        health = self._health
        return {url: health[url].capacity.in_flight for url in self.members}

    def usable(self, url: str, now: float) -> bool:
        """``url`` is not ejected at ``now`` and serves this server's model (members and strangers
        alike)."""
        health = self._health.get(url)
        if health is None:
            return url not in self._barred
        return health.ejected_until <= now and health.model not in UNUSABLE and not health.inequivalent

    def reserve(self, count: int, among: int) -> int:
        """Claim ``count`` consecutive slots of the round-robin cursor over ``among`` servers.

        No await between the read and the write, so concurrent requests on one event loop never get the
        same slots. Each API-server process has its own pool and cursor.
        """
        start = self._next
        self._next = (start + count) % max(among, 1)
        return start

    def pick(self, now: float, preferred: Sequence[str] = ()) -> str | None:
        """The first of ``preferred`` that is not ejected, else the next available member in
        round-robin order; None when every one is ejected."""
        return self.failover_target((), now, preferred)

    def failover_target(self, tried: Sequence[str], now: float, preferred: Sequence[str] = ()) -> str | None:
        """The next server not yet tried for this call: the first usable one of ``preferred`` (the
        call's own order), else the next available member in round-robin order."""
        for url in preferred:
            if url not in tried and self.usable(url, now):
                return url
        candidates = [url for url in self.available(now) if url not in tried]
        if not candidates:
            return None
        return candidates[self.reserve(1, len(candidates)) % len(candidates)]

    # Health ------------------------------------------------------------------------------------------

    def record_latency(self, url: str, seconds: float, work: int | None = None, size: int = 0) -> None:
        """A successful call's duration, the ``work`` it asked for (an encoder call's vision tokens) and
        its body's ``size`` in bytes: the moving averages (the last calls weigh most) of its latency
        and, where its work is known, of its slowdown over the fastest call of its size class. The
        class is both, each by powers of two: a flat 1000 x 1000 PNG of a few kilobytes is much work in
        few bytes, a 56 x 56 one padded with megabytes after its end little work in many, and neither is
        a slow call of the small photos' class. A call of unknown work does not weigh in."""
        health = self.record(url)
        health.latency = seconds if not health.latency else 0.8 * health.latency + 0.2 * seconds
        if work is None:
            return
        health.slowdown_at = time.monotonic()
        size_class = (work.bit_length(), size.bit_length())
        fastest = min(health.fastest.get(size_class, seconds), seconds)
        health.fastest[size_class] = fastest
        ratio = seconds / fastest if fastest > 0 else 1.0
        health.slowdown = ratio if not health.slowdown else 0.8 * health.slowdown + 0.2 * ratio

    def answered(self, url: str, *, rejected: bool) -> None:
        """One answer of ``url`` to a call: ``rejected`` when it said the request was at fault."""
        health = self.record(url)
        health.answers = health.answers * _ANSWER_DECAY + 1.0
        health.rejections = health.rejections * _ANSWER_DECAY + rejected
        health.rejected_streak = health.rejected_streak + 1 if rejected else 0

    def rejection_share(self, url: str) -> float | None:
        """The share of ``url``'s recent answers that said the request was at fault (None: no answer
        yet)."""
        health = self._health.get(url)
        if health is None or health.answers <= 0:
            return None
        return health.rejections / health.answers

    def doubts(self, url: str, now: float) -> tuple[bool, bool]:
        """Whether a "client fault" answer of ``url`` is to be doubted: its share of them is at least
        half of a few answers or more, or it gave a few in a row (and it was not vindicated lately),
        which is worth its canary (one a while); and whether that share also stands out from the other
        members' (their mean, over a few answers each), which is worth a second server's call."""
        share, health = self.rejection_share(url), self.record(url)
        if share is None or health.vindicated_until > now:
            return False, False
        if health.rejected_streak < _STREAK and (share < _DOUBTED_SHARE or health.answers < _FEW_ANSWERS):
            return False, False  # a share under half, or of so few answers, is no evidence yet
        others = [
            self.record(member).rejections / answers
            for member in self.members
            if member != url and (answers := self.record(member).answers) >= _FEW_ANSWERS
        ]
        return True, bool(others) and share >= sum(others) / len(others) + _STANDS_OUT_BY

    def vindicate(self, url: str, now: float) -> None:
        """Another server gave the answer ``url`` was doubted for: the request's fault after all. Its
        answers are trusted for a health-check interval (one second call a while, however many bad
        requests follow), and that answer leaves its share."""
        health = self.record(url)
        interval = self.policy.health_check_interval
        health.vindicated_until = now + (interval if interval > 0 else _VINDICATION_HOLDS_S)
        # The answer shown to be the request's leaves the share; the rest of it stays, so a server that
        # also fails honest requests is doubted again once the vindication ends.
        health.rejections = max(0.0, health.rejections - 1.0)
        health.rejected_streak = 0

    def most_trusted(self, tried: Sequence[str], now: float, preferred: Sequence[str] = ()) -> str | None:
        """The server not yet tried (of ``preferred`` and the available members) whose share of "client
        fault" answers is the lowest (none yet counts as none): where a doubted answer is tried
        (round-robin's next may be broken alike)."""
        usable = [url for url in preferred if url not in tried and self.usable(url, now)]
        candidates = [
            *usable,
            *(url for url in self.available(now) if url not in tried and url not in usable),
        ]
        if not candidates:
            return None
        return min(candidates, key=lambda url: self.rejection_share(url) or 0.0)

    def has_other(self, tried: Sequence[str], now: float, preferred: Sequence[str] = ()) -> bool:
        """Whether :meth:`failover_target` would find a server not yet tried (without taking a turn of
        the round-robin cursor)."""
        return any(url not in tried and self.usable(url, now) for url in preferred) or any(
            url not in tried for url in self.available(now)
        )

    def record_success(self, url: str, *, health_check: bool = False) -> None:
        """A successful call, or (``health_check``) a passing ``/health``, which says nothing of a
        server whose own canary encode failed: that one stays out until its cool-down ends, and its
        cool-down keeps doubling."""
        health = self.record(url)
        if health_check and health.encode_broken:
            return
        health.encode_broken = False
        back = bool(health.ejected_until)
        if back:
            logger.info("%s %s is back", self.role, url)
            if self.models.expectation is not None:
                health.model = "unchecked"  # it may have come back as another server
        health.failures = 0
        health.ejected_until = 0.0
        health.cooldown = 0.0
        if back:
            self.export_health(url)

    def record_failure(self, url: str, now: float, reason: str) -> None:
        """Count a failure that is evidence of itself (a failed health check, no answer about the model):
        ``eject_after`` in a row eject the server."""
        if self.suspect(url, now, reason):
            self.eject(url, now)

    def suspect(self, url: str, now: float, reason: str) -> bool:
        """Count a failed call the server was blamed for (:mod:`._blame`). True when that makes
        ``eject_after`` in a row and the server is not out already: its ejection is to be confirmed
        independently first (:func:`._probes.confirm_failing`, then :meth:`eject` or :meth:`keep`)."""
        health, policy = self.record(url), self.policy
        health.failures += 1
        health.last_failure = reason
        return health.failures >= policy.eject_after and health.ejected_until <= now and not health.confirming

    def retract_failure(self, url: str) -> None:
        """Take back a failure counted against ``url``: the request was at fault after all."""
        health = self.known(url)
        if health is not None and health.failures > 0:
            health.failures -= 1
        self.blamed(url, "retracted")

    def blamed(self, url: str, blame: str) -> None:
        """Count one failed call of ``url`` by who was at fault (:data:`._blame.BLAMES`)."""
        self.record(url).blamed[blame] += 1
        self.stats.blame(self.role, self.label(url), blame)

    def eject(self, url: str, now: float, why: str = "") -> None:
        """Take ``url`` out for a cool-down that doubles while it keeps failing."""
        health, policy = self.record(url), self.policy
        health.cooldown = min(health.cooldown * 2 or policy.eject_cooldown, policy.max_eject_cooldown)
        health.ejected_until = now + health.cooldown
        health.proven_until = 0.0
        self.export_health(url)
        self.stats.ejection_check(self.role, self.label(url), "ejected")
        logger.warning(
            "%s %s ejected for %.1f s after %d failures in a row (last: %s)%s",
            self.role,
            url,
            health.cooldown,
            health.failures,
            health.last_failure,
            f"; {why}" if why else "",
        )

    def bar(self, url: str, why: str) -> None:
        """Take ``url`` out of the pool until :meth:`unbar`: its answers differ from PD's own
        (:mod:`._equivalence`), which no health check sees."""
        health = self.record(url)
        health.inequivalent = self._barred[url] = why
        self.export_health(url)

    def unbar(self, url: str) -> None:
        if self._barred.pop(url, None) is None:
            return
        health = self.known(url)
        if health is not None:
            health.inequivalent = ""
            self.export_health(url)
        logger.warning("%s %s back in the pool: its answers match again", self.role, url)

    def keep(self, url: str, why: str) -> None:
        """``url`` failed ``eject_after`` calls in a row but proved itself healthy: the failures were
        its requests' doing, so it stays, its count starting again."""
        health = self.record(url)
        logger.warning(
            "%s %s failed %d calls in a row (last: %s) but %s: kept in the pool",
            self.role,
            url,
            health.failures,
            health.last_failure,
            why,
        )
        health.failures = 0
        health.kept += 1
        self.stats.ejection_check(self.role, self.label(url), "kept")

    def snapshot(self, now: float) -> dict[str, dict[str, Any]]:
        """Health and load of every server known (``member``: in the pool, else named by a scheduler or
        leaving the pool), for status pages and tests."""
        return {
            url: {
                "member": url in self._member_set,
                "healthy": (problem := health.problem(now)) is None,
                "why_not": problem,
                "consecutive_failures": health.failures,
                "ejected_for_s": max(0.0, health.ejected_until - now),
                "failures_by_blame": dict(health.blamed),
                "rejected_share": round(health.rejections / health.answers, 3) if health.answers else None,
                "ejections_averted": health.kept,
                "in_flight": health.capacity.in_flight,
                "model": {
                    "state": health.model,
                    "served": health.served,
                    # This server's names it does not serve: requests for them go under one it does.
                    "aliases_mapped": sorted(self.models.unserved_aliases(url)),
                },
            }
            for url, health in self._health.items()
        }

    def label(self, url: str) -> str:
        """The server's label in metrics: its URL for members, one shared value for the rest. A client
        can name any target the allowlist admits (a whole network), and a series per target would grow
        without bound (in every API-server process's files, with ``PROMETHEUS_MULTIPROC_DIR``)."""
        return url if url in self._member_set else OTHER_SERVERS


def no_server_left(pool: ServerPool, noun: str, retry_after: int) -> NoHealthyUpstream:
    """The answer when no server of ``pool`` can take a call: no member serves this server's model
    (which it names), or every member is failing, each with its reason (the servers' addresses in the
    log's version only). Its Retry-After is when the first ejected member comes back (rounded up), never
    less than ``retry_after``: a client told to come back sooner would only be refused again."""
    now = anyio.current_time()
    failing = [(url, problem) for url in pool.members if (problem := pool.record(url).problem(now))]
    ends = [until for url in pool.members if (until := pool.record(url).ejected_until) > now]
    if ends:
        retry_after = max(retry_after, math.ceil(min(ends) - now))
    expectation = pool.models.expectation

    def said(with_urls: bool) -> str:
        problems = "; ".join(f"{url}: {why}" if with_urls else why for url, why in failing)
        if (
            pool.members
            and expectation is not None
            and all(pool.record(url).model == "mismatch" for url in pool.members)
        ):
            return f"no {noun} serves {expectation.describe()} ({problems})"
        if not pool.members:
            return f"every {noun} is gone (the pool has no members); retry later"
        return f"every {noun} is failing its calls ({problems}); retry later"

    return NoHealthyUpstream(said(False), retry_after, internal=said(True))
