"""A pool of remote vLLM servers of one role (encoders, prefill servers) and how calls to them fail over.

It owns what every pool needs and nothing about what the calls carry: its members (set by
:mod:`.discovery`), the round-robin cursor, passive health (consecutive failures eject a server for a
cool-down that doubles while it keeps failing), active health probes, the bound on calls in flight per
server, and failover of a failed call to another server. The encoder and prefill stages build the bodies
and read the replies; :mod:`.selection` and :mod:`.scheduler` say which servers a call should try.

Calls may also go to servers that are not members (a scheduler named them): they get health and limits
like members, and are forgotten once idle.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import msgspec

from .compat import Expectation, check_models
from .config import EPDConfig
from .errors import (
    RETRYABLE_STATUSES,
    RequestNotSendable,
    UpstreamBadReply,
    UpstreamError,
    UpstreamRejected,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from .llmd import url_host_port
from .logs import logger
from .metrics import Stats
from .protocol import REQUEST_ID_HEADER, foreign_answer_id
from .transport import Body, HTTPError, Transport, UnsendableRequest

__all__ = ["OTHER_SERVERS", "Attempt", "DeadlinePassed", "ServerPool"]

T = TypeVar("T")

_decode_reply = msgspec.json.Decoder().decode
_JSON = "application/json"
_REQUEST_ID = REQUEST_ID_HEADER.decode()
_MAX_DETAIL = 300


@dataclass
class _Health:
    failures: int = 0
    ejected_until: float = 0.0
    cooldown: float = 0.0
    in_flight: int = 0
    # Whether it serves this server's model (compat.py): unchecked, ok, mismatch, unreachable.
    model: str = "unchecked"
    served: str = ""


@dataclass(frozen=True, slots=True)
class Attempt(Generic[T]):
    """One try of a call: the body to POST, and how to read the server's JSON object answer.

    Built afresh for every try, so a retry on another server never reuses what belonged to the failed
    one (Mooncake transfer ids, say). ``read`` raises :class:`UpstreamBadReply` for an unusable answer.
    """

    body: Body
    read: Callable[[str, dict[str, Any]], T]


@dataclass
class _Check:
    """A model check in progress: done when it ended, ``finished`` when it reached a verdict."""

    done: anyio.Event = field(default_factory=anyio.Event)
    finished: bool = False


class DeadlinePassed(Exception):
    """The caller's deadline (a request's ``encode_deadline``) passed during a call: no server is blamed
    and no further server is tried."""


# vLLM's answers are a few levels deep (choices, usage, handles with metadata); far deeper is broken.
MAX_ANSWER_DEPTH = 64
# The metrics label of servers outside the pool (named by a scheduler header).
OTHER_SERVERS = "other"
# Health records kept for servers that are not members (named by a scheduler) before idle ones are
# forgotten: bounds the memory a stream of distinct targets can take.
_MAX_STRANGERS = 1024
# Model states (compat.py) that keep a server from being chosen; one that did not answer is asked again
# by its next call (a fleet starts in any order: a PD server is often up before its encoders).
_UNUSABLE_MODEL = frozenset({"mismatch"})
# Model states that make a call ask the server first.
_ASK = frozenset({"unchecked", "unreachable"})


@dataclass
class ServerPool:
    """The servers of one role, their health and their limits. One per middleware, so one per
    API-server process."""

    role: str
    config: EPDConfig
    timeout: float
    stats: Stats = field(default_factory=Stats)
    members: tuple[str, ...] = field(init=False, default=())
    # (host, port) of every member, as a scheduler header would name it
    member_addresses: frozenset[tuple[str, int]] = field(init=False, default=frozenset())
    _member_set: frozenset[str] = field(init=False, default=frozenset())
    _health: dict[str, _Health] = field(init=False, default_factory=dict)
    _limiters: dict[str, anyio.CapacityLimiter] = field(init=False, default_factory=dict)
    _next: int = field(init=False, default=0)
    # What a usable server must serve (compat.py); None: not known, every server is taken as it is.
    expectation: Expectation | None = field(init=False, default=None)
    # Headers of the pool's own GETs (health, models): the encoder key, when one is set.
    check_headers: Mapping[str, str] = field(init=False, default_factory=dict)
    _checking: dict[str, _Check] = field(init=False, default_factory=dict)

    # --- membership --------------------------------------------------------------------------------

    def set_members(self, urls: Sequence[str]) -> None:
        """Make ``urls`` the members: new ones take traffic at once, vanished ones get no new calls
        (calls in flight finish), survivors keep their health."""
        members = tuple(dict.fromkeys(urls))
        if members == self.members:
            return
        old = self._member_set
        self.members, self._member_set = members, frozenset(members)
        self.member_addresses = frozenset(url_host_port(url) for url in members)
        for url in members:
            if url not in old:
                self._health.setdefault(url, _Health())
                self.stats.health(self.role, url, self._health[url].ejected_until == 0.0)
        for url in old - self._member_set:
            self.stats.forget(self.role, url)
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

    def _record(self, url: str) -> _Health:
        health = self._health.get(url)
        if health is None:
            if len(self._health) - len(self.members) >= _MAX_STRANGERS:
                for stranger in [u for u in self._health if u not in self._member_set]:
                    self._forget_if_idle(stranger)
            health = self._health[url] = _Health()
        return health

    def _forget_if_idle(self, url: str) -> None:
        health = self._health.get(url)
        limiter = self._limiters.get(url)
        if (
            health is not None
            and health.in_flight == 0
            and url not in self._member_set
            and (limiter is None or not limiter.statistics().tasks_waiting)
        ):
            del self._health[url]
            self._limiters.pop(url, None)

    # --- selection -------------------------------------------------------------------------------

    def available(self, now: float) -> tuple[str, ...]:
        """Members not ejected at ``now`` and not known to serve another model (one not checked yet is
        checked by its first call); an ejected one comes back for a trial when its cool-down ends."""
        health = self._health
        return tuple(
            url
            for url in self.members
            if health[url].ejected_until <= now and health[url].model not in _UNUSABLE_MODEL
        )

    def in_flight_by_server(self) -> dict[str, int]:
        """Calls in flight per member (from this process)."""
        health = self._health
        return {url: health[url].in_flight for url in self.members}

    def usable(self, url: str, now: float) -> bool:
        """``url`` is not ejected at ``now`` and serves this server's model (members and strangers
        alike)."""
        health = self._health.get(url)
        return health is None or (health.ejected_until <= now and health.model not in _UNUSABLE_MODEL)

    # --- models ------------------------------------------------------------------------------------

    def expect(self, expectation: Expectation) -> None:
        """From now on a server is used only once it was seen to serve ``expectation``."""
        if expectation != self.expectation:
            self.expectation = expectation
            for health in self._health.values():
                health.model = "unchecked"

    async def _serves_the_model(self, client: Transport, server: str, deadline: float | None) -> bool:
        """Whether ``server`` may take a call: asked first if it never was (one check at a time per
        server; concurrent calls wait for it). The check counts against the caller's ``deadline``
        (:class:`DeadlinePassed`); a check cut short by another caller's deadline gives no verdict, so a
        waiter asks itself."""
        if self.expectation is None:
            return True
        if self._record(server).model not in _ASK:
            return self._record(server).model == "ok"
        with anyio.CancelScope(deadline=math.inf if deadline is None else deadline) as scope:
            while self._record(server).model in _ASK:
                running = self._checking.get(server)
                if running is not None:
                    await running.done.wait()
                    if running.finished:
                        break
                    continue
                self._checking[server] = check = _Check()
                try:
                    await self.check_models(client, [server], self.check_headers)
                    check.finished = True
                finally:
                    del self._checking[server]
                    check.done.set()
                break
        if scope.cancelled_caught:
            raise DeadlinePassed
        # The record may have gone meanwhile (a stranger forgotten to make room): no verdict, not used.
        health = self._health.get(server)
        return health is not None and health.model == "ok"

    async def check_models(
        self, client: Transport, urls: Sequence[str], headers: Mapping[str, str], *, recheck: bool = False
    ) -> None:
        """Ask ``urls`` (``recheck``: and every member not known to match) what they serve, concurrently,
        within the health-check timeout each; a change of verdict is logged once and exported. A server
        that does not answer counts a failure, as a failed call would."""
        expectation = self.expectation
        if recheck:
            urls = [*urls, *(url for url in self.members if self._health[url].model != "ok")]

        async def one(url: str) -> None:
            result = await check_models(client, url, expectation, headers, self.config.health_check_timeout)
            health = self._record(url)
            changed = (health.model, health.served) != (result.state, result.served)
            health.model, health.served = result.state, result.served
            if result.state == "unreachable":
                # As a failed call: a server that keeps not answering is ejected, and not asked again
                # by every request while it is.
                self.record_failure(url, anyio.current_time(), result.served)
            if url in self._member_set:
                self.stats.model_check(self.role, url, result.state == "ok")
            if not changed:
                return
            wanted = expectation.describe() if expectation else "?"
            if result.state == "ok":
                logger.info("%s %s serves %s", self.role, url, result.served)
            elif result.state == "mismatch":
                logger.warning(
                    "%s %s is not used: it serves %s (this server serves %s)",
                    self.role,
                    url,
                    result.served,
                    wanted,
                )
            else:
                logger.warning(
                    "%s %s did not say what it serves (%s); it is asked again before its next call",
                    self.role,
                    url,
                    result.served,
                )

        async with anyio.create_task_group() as group:
            for url in dict.fromkeys(urls):
                group.start_soon(one, url)

    def mismatched(self) -> list[tuple[str, str]]:
        """Members that answered with another model, and what they serve."""
        return [
            (url, self._health[url].served) for url in self.members if self._health[url].model == "mismatch"
        ]

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

    # --- health ----------------------------------------------------------------------------------

    def record_success(self, url: str) -> None:
        health = self._record(url)
        if health.ejected_until:
            logger.info("%s %s is back", self.role, url)
            if url in self._member_set:
                self.stats.health(self.role, url, True)
            if self.expectation is not None:
                health.model = "unchecked"  # it may have come back as another server
        health.failures = 0
        health.ejected_until = 0.0
        health.cooldown = 0.0

    def record_failure(self, url: str, now: float, reason: str) -> None:
        health = self._record(url)
        health.failures += 1
        if health.failures >= self.config.eject_after and health.ejected_until <= now:
            config = self.config
            health.cooldown = min(health.cooldown * 2 or config.eject_cooldown, config.max_eject_cooldown)
            health.ejected_until = now + health.cooldown
            if url in self._member_set:
                self.stats.health(self.role, url, False)
            logger.warning(
                "%s %s ejected for %.1f s after %d failures in a row (last: %s)",
                self.role,
                url,
                health.cooldown,
                health.failures,
                reason,
            )

    def snapshot(self, now: float) -> dict[str, dict[str, Any]]:
        """Health and load of every server known (``member``: in the pool, else named by a scheduler or
        leaving the pool), for status pages and tests."""
        return {
            url: {
                "member": url in self._member_set,
                "healthy": health.ejected_until <= now,
                "consecutive_failures": health.failures,
                "ejected_for_s": max(0.0, health.ejected_until - now),
                "in_flight": health.in_flight,
                "model": {"state": health.model, "served": health.served},
            }
            for url, health in self._health.items()
        }

    async def probe(self, client: Transport, headers: Mapping[str, str]) -> None:
        """GET /health on every server once, concurrently; brings recovered servers back."""

        async def one(url: str) -> None:
            try:
                with anyio.fail_after(self.config.health_check_timeout):
                    status, _ = await client.request("GET", f"{url}/health", headers=headers)
                ok = status == 200
                reason = f"health check HTTP {status}"
            except TimeoutError:
                ok, reason = False, "health check timed out"
            except (HTTPError, UnsendableRequest) as exc:
                ok, reason = False, f"health check failed: {exc.reason}"
            if ok:
                self.record_success(url)
            else:
                self.record_failure(url, anyio.current_time(), reason)

        async with anyio.create_task_group() as group:
            for url in self.members:
                group.start_soon(one, url)
        if self.expectation is not None:
            await self.check_models(client, (), headers, recheck=True)

    async def probe_forever(self, client: Transport, headers: Mapping[str, str]) -> None:
        interval = self.config.health_check_interval
        if interval <= 0:
            return
        while True:
            await anyio.sleep(interval)
            if self.members:
                await self.probe(client, headers)

    # --- calls -----------------------------------------------------------------------------------

    def _label(self, url: str) -> str:
        """The server's label in metrics: its URL for members, one shared value for the rest. A client
        can name any target the allowlist admits (a whole network), and a series per target would grow
        without bound (in every API-server process's files, with ``PROMETHEUS_MULTIPROC_DIR``)."""
        return url if url in self._member_set else OTHER_SERVERS

    def _limiter(self, url: str) -> anyio.CapacityLimiter:
        # Created on first use: anyio primitives belong to the event loop that runs the app.
        limiter = self._limiters.get(url)
        if limiter is None:
            limiter = self._limiters[url] = anyio.CapacityLimiter(self.config.max_inflight_per_encoder)
        return limiter

    async def call(
        self,
        client: Transport,
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
        left; :class:`DeadlinePassed` once ``deadline`` (event-loop time) has passed, whatever the
        attempt."""
        tried: list[str] = []
        server: str | None = first
        last: UpstreamError | None = None
        while server is not None and len(tried) < self.config.max_attempts:
            if deadline is not None and anyio.current_time() >= deadline:
                raise DeadlinePassed
            tried.append(server)
            if not await self._serves_the_model(client, server, deadline):
                # Not the server's failure: it is not one of ours (another model, or it did not say).
                health = self._health.get(server)
                served = health.served if health is not None else ""
                last = UpstreamUnavailable(
                    server, f"not used: {served or 'it did not say what it serves'}", role=self.role
                )
                server = self.failover_target(tried, anyio.current_time(), preferred)
                continue
            label = self._label(server)
            started = time.perf_counter()
            try:
                result = await self._call_once(client, server, label, path, attempt(), headers, deadline)
            except UpstreamError as exc:
                self.stats.call(self.role, label, exc.outcome, time.perf_counter() - started)
                if not exc.retryable:
                    raise
                last = exc
                now = anyio.current_time()
                self.record_failure(server, now, exc.reason)
                server = self.failover_target(tried, now, preferred)
                if server is not None:
                    self.stats.failover(self.role, label)
                logger.warning(
                    "%s%s",
                    exc.message,
                    f"; retrying on {server}" if server else f"; no {self.role} left to try",
                )
                continue
            self.stats.call(self.role, label, "ok", time.perf_counter() - started)
            self.record_success(server)
            return result
        assert last is not None
        raise last

    async def _call_once(
        self,
        client: Transport,
        server: str,
        label: str,
        path: str,
        attempt: Attempt[T],
        headers: Mapping[str, str],
        deadline: float | None,
    ) -> T:
        role, health, timeout = self.role, self._record(server), self.timeout
        # One bare cancel scope bounds the call by its own timeout and by the caller's deadline: a cancel
        # scope is the costliest thing a call does on the event loop (a timer, task-state lookups), and
        # ``fail_after`` inside ``move_on_after`` made two per request, each behind generator context
        # managers.
        limit = anyio.current_time() + timeout
        by_deadline = deadline is not None and deadline < limit
        bound = anyio.CancelScope(deadline=min(limit, deadline) if deadline is not None else limit)
        try:
            with bound:
                limiter = self._limiter(server)
                try:
                    # Free capacity is taken without the checkpoint ``acquire`` makes (a trip round the
                    # event loop); a full server is waited for, in turn.
                    limiter.acquire_nowait()
                except anyio.WouldBlock:
                    await limiter.acquire()
                health.in_flight += 1
                self.stats.in_flight(role, label, 1)
                try:
                    status, content = await client.request(
                        "POST", f"{server}{path}", attempt.body, {"content-type": _JSON, **headers}
                    )
                finally:
                    health.in_flight -= 1
                    self.stats.in_flight(role, label, -1)
                    limiter.release()
            if bound.cancelled_caught:
                if by_deadline:
                    raise DeadlinePassed
                raise TimeoutError
        except TimeoutError:
            raise UpstreamTimeout(server, f"no answer within {timeout:g} s", role=role) from None
        except DeadlinePassed:
            raise
        except HTTPError as exc:
            raise UpstreamUnavailable(server, exc.reason, role=role) from None
        except UnsendableRequest as exc:
            raise RequestNotSendable(server, exc.reason, role=role) from None
        except Exception as exc:
            # A bug in a custom transport must cost this call, not the server: the client gets a clear
            # error (or a failover), the log gets the traceback.
            logger.exception("unexpected error calling %s %s", role, server)
            raise UpstreamUnavailable(server, f"unexpected {type(exc).__name__}", role=role) from None
        if status != 200:
            detail = _error_detail(content)
            if status >= 500 or status in RETRYABLE_STATUSES:
                if status >= 500 and detail:
                    # Server errors may carry internals: the log gets them, the client does not.
                    logger.warning("%s %s answered HTTP %d: %s", role, server, status, detail)
                raise UpstreamStatusError(server, status, "" if status >= 500 else detail, role=role)
            if 400 <= status < 500:
                raise UpstreamRejected(server, status, detail, role=role)
            raise UpstreamStatusError(server, status, role=role)
        try:
            reply = _decode_reply(content)
        except (msgspec.DecodeError, RecursionError):
            # Nested past what this stack decodes counts as not JSON: a failed try of this server.
            raise UpstreamBadReply(server, "the answer is not JSON", role=role) from None
        if not isinstance(reply, dict):
            raise UpstreamBadReply(server, "the answer is not a JSON object", role=role)
        # Its handles go into the engine's body: an answer too deep to be written again must fail here,
        # as this server's bad answer, not later as the request's. Counting brackets (C speed) spares
        # the walk for every answer that cannot be that deep.
        if content.count(b"[") + content.count(b"{") > MAX_ANSWER_DEPTH and not within_depth(
            reply, MAX_ANSWER_DEPTH
        ):
            raise UpstreamBadReply(server, "the answer nests too deeply", role=role)
        request_id = headers.get(_REQUEST_ID)
        if request_id is not None and (other := foreign_answer_id(path, request_id, reply)) is not None:
            # Another request's answer (a server or a proxy before it mixed up its connections): its
            # handles must never reach this request's engine, and no idle connection there is trusted.
            await client.drop_idle(server)
            self.stats.foreign_answer(role, label)
            logger.warning("%s %s answered request %s with the answer of %s", role, server, request_id, other)
            raise UpstreamBadReply(server, f"the answer belongs to another request ({other})", role=role)
        return attempt.read(server, reply)


def _error_detail(content: bytes) -> str:
    """The server's own error message when it sent an OpenAI-style body, cut short."""
    try:
        reply: Any = _decode_reply(content)
        message = reply["error"]["message"]
    except (msgspec.DecodeError, RecursionError, KeyError, TypeError):
        return ""
    return str(message)[:_MAX_DETAIL]


def within_depth(value: Any, limit: int) -> bool:
    """Whether a decoded JSON value nests at most ``limit`` containers deep (level by level, not by
    recursion: it may not)."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        deeper: list[Any] = []
        for node in level:
            for child in node.values() if isinstance(node, dict) else node:
                if isinstance(child, (dict, list)):
                    deeper.append(child)
        if not deeper:
            return True
        level = deeper
    return not level
