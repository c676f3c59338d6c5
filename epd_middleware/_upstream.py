"""One call to one server, as the pool's failover makes it: the capacity it waits for, one bound for its
own timeout and the caller's deadline, what the answer's status means, the answer decoded, and the
answer bound to its request. No choice of server and no health here: :mod:`._pool` does those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
import msgspec

from ._logs import logger
from ._metrics import Stats
from ._protocol import REQUEST_ID_HEADER, foreign_answer_id
from .errors import (
    RETRYABLE_STATUSES,
    RequestNotSendable,
    UpstreamBadReply,
    UpstreamBusy,
    UpstreamRejected,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
    VllmError,
)
from .transport import Body, HTTPError, Transport, UnsendableRequest

__all__ = ["MAX_ANSWER_DEPTH", "Attempt", "Capacity", "DeadlinePassed", "post_once", "within_depth"]

T = TypeVar("T")

_decode_reply = msgspec.json.Decoder().decode
_JSON = "application/json"
_REQUEST_ID = REQUEST_ID_HEADER.decode()
_MAX_DETAIL = 300
# vLLM's answers are a few levels deep (choices, usage, handles with metadata); far deeper is broken.
MAX_ANSWER_DEPTH = 64


class DeadlinePassed(Exception):
    """The caller's deadline (a request's ``encode_deadline``) passed during a call: no server is blamed
    and no further server is tried."""


@dataclass(frozen=True, slots=True)
class Attempt(Generic[T]):
    """One try of a call: the body to POST, and how to read the server's JSON object answer.

    Built afresh for every try, so a retry on another server never reuses what belonged to the failed
    one (Mooncake transfer ids, say). ``read`` raises :class:`UpstreamBadReply` for an unusable answer,
    which fails the try over to another server like any failure of the server's: that is why the reading
    is handed to the pool rather than done by the caller after it.
    """

    body: Body
    read: Callable[[str, dict[str, Any]], T]
    # The work the call asks of the server (an encoder call's vision tokens), by which its latency is
    # compared with the fastest call of its size (_pool.record_latency); None: not known.
    work: int | None = None


class Capacity:
    """How many calls one server may have in flight from this process, and how many it has."""

    __slots__ = ("_limit", "_limiter", "in_flight")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        # Made on first use: anyio primitives belong to the event loop that runs the app.
        self._limiter: anyio.CapacityLimiter | None = None
        self.in_flight = 0

    @property
    def idle(self) -> bool:
        """No call in flight and none waiting for a slot."""
        return self.in_flight == 0 and (self._limiter is None or not self._limiter.statistics().tasks_waiting)

    @property
    def limit(self) -> int:
        return self._limit

    def take_now(self) -> bool:
        """Take a free slot without the checkpoint ``acquire`` makes (a trip round the event loop);
        False when every slot is taken."""
        limiter = self._limiter
        if limiter is None:
            limiter = self._limiter = anyio.CapacityLimiter(self._limit)
        if limiter.available_tokens < 1:
            # Asked first rather than caught: anyio before 4.14.2 lets trio's own WouldBlock out of
            # acquire_nowait on trio, not anyio's.
            return False
        try:
            limiter.acquire_nowait()
        except anyio.WouldBlock:
            return False
        self.in_flight += 1
        return True

    async def wait(self) -> None:
        """Take a slot once one is free, in turn."""
        assert self._limiter is not None  # take_now came first
        await self._limiter.acquire()
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        assert self._limiter is not None
        self._limiter.release()


async def post_once(
    transport: Transport,
    server: str,
    path: str,
    body: Body,
    headers: Mapping[str, str],
    *,
    role: str,
    label: str,
    capacity: Capacity | None,
    call_timeout: float,
    deadline: float | None,
    stats: Stats,
) -> dict[str, Any]:
    """POST ``body`` to ``server``: its JSON object answer, or the typed failure of this try
    (:class:`~epd_middleware.errors.UpstreamError`; :class:`DeadlinePassed` when the caller's
    ``deadline``, event-loop time, came first). ``label``: the server in metrics.

    The call's own timeout runs from when it has a slot on the server: time spent waiting behind this
    process's other calls is not the server's (:class:`~epd_middleware.errors.UpstreamBusy` when no slot
    came free within a timeout's length, the deadline bounding the wait too). ``capacity`` None: a probe
    of the server's own health (the canary), which takes no slot: the slots bound the clients' calls, and
    a probe that waited behind them would judge the server by this process's own queue."""
    if capacity is not None and not capacity.take_now():
        await _wait_for_a_slot(server, role, capacity, call_timeout, deadline)
    # One bare cancel scope bounds the call by its own timeout and by the caller's deadline: a cancel
    # scope is the costliest thing a call does on the event loop (a timer, task-state lookups), and
    # ``fail_after`` inside ``move_on_after`` made two per request, each behind generator context
    # managers.
    limit = anyio.current_time() + call_timeout
    by_deadline = deadline is not None and deadline < limit
    bound = anyio.CancelScope(deadline=min(limit, deadline) if deadline is not None else limit)
    try:
        with bound:
            stats.in_flight(role, label, 1)
            try:
                status, content = await transport.request(
                    "POST", f"{server}{path}", body, {"content-type": _JSON, **headers}
                )
            finally:
                if capacity is not None:
                    capacity.release()
                stats.in_flight(role, label, -1)
        if bound.cancelled_caught:
            if by_deadline:
                raise DeadlinePassed
            raise TimeoutError
    except TimeoutError:
        raise UpstreamTimeout(server, f"no answer within {call_timeout:g} s", role=role) from None
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
    reply = answer_of(server, role, status, content)
    request_id = headers.get(_REQUEST_ID)
    if request_id is not None and (other := foreign_answer_id(path, request_id, reply)) is not None:
        # Another request's answer (a server or a proxy before it mixed up its connections): its
        # handles must never reach this request's engine, and no idle connection there is trusted.
        await transport.drop_idle(server)
        stats.foreign_answer(role, label)
        logger.warning("%s %s answered request %s with the answer of %s", role, server, request_id, other)
        raise UpstreamBadReply(server, f"the answer belongs to another request ({other})", role=role)
    return reply


async def _wait_for_a_slot(
    server: str, role: str, capacity: Capacity, call_timeout: float, deadline: float | None
) -> None:
    until = anyio.current_time() + call_timeout
    by_deadline = deadline is not None and deadline <= until
    with anyio.CancelScope(deadline=deadline if by_deadline and deadline is not None else until) as waiting:
        await capacity.wait()
    if waiting.cancelled_caught:
        if by_deadline:
            raise DeadlinePassed
        raise UpstreamBusy(
            server,
            f"its {capacity.limit} slot(s) stayed taken by this server's other calls for {call_timeout:g} s",
            role=role,
        )


def answer_of(server: str, role: str, status: int, content: bytes) -> dict[str, Any]:
    """What a server's answer means: its JSON object for a 200, else the failure its status says
    (retryable, or a rejection of the request itself), with vLLM's own error where it sent one: who is
    at fault is judged from it (:mod:`._blame`)."""
    if status != 200:
        detail = vllm_error(content)
        if status >= 500 or status in RETRYABLE_STATUSES:
            raise UpstreamStatusError(server, status, detail, role=role)
        if 400 <= status < 500:
            raise UpstreamRejected(server, status, detail, role=role)
        # 1xx, another 2xx, 3xx: no answer and no error, so nothing it says is about the request (never
        # a status to hand a client, as a failure "the same" on two servers would be).
        raise UpstreamBadReply(server, f"HTTP {status}, which is no answer", role=role)
    try:
        reply = _decode_reply(content)
    except (msgspec.DecodeError, RecursionError):
        # Nested past what this stack decodes counts as not JSON: a failed try of this server.
        raise UpstreamBadReply(server, "the answer is not JSON", role=role) from None
    if not isinstance(reply, dict):
        raise UpstreamBadReply(server, "the answer is not a JSON object", role=role)
    # Its handles go into the engine's body: an answer too deep to be written again must fail here, as
    # this server's bad answer, not later as the request's. Counting brackets (C speed) spares the walk
    # for every answer that cannot be that deep.
    if content.count(b"[") + content.count(b"{") > MAX_ANSWER_DEPTH and not within_depth(
        reply, MAX_ANSWER_DEPTH
    ):
        raise UpstreamBadReply(server, "the answer nests too deeply", role=role)
    return reply


def vllm_error(content: bytes) -> VllmError | None:
    """The server's own error when it sent vLLM's (OpenAI's) shape, its message cut short."""
    try:
        error: Any = _decode_reply(content)["error"]
        message = error["message"]
    except (msgspec.DecodeError, RecursionError, KeyError, TypeError):
        return None
    if not isinstance(error, dict):
        return None
    kind, param = error.get("type"), error.get("param")
    return VllmError(
        str(message)[:_MAX_DETAIL],
        kind[:_MAX_DETAIL] if isinstance(kind, str) else None,
        param[:_MAX_DETAIL] if isinstance(param, str) else None,
    )


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
