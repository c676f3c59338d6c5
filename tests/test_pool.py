"""The server pool and its failover below the ASGI layer: :class:`ServerPool`, ``_failover.call``,
``_upstream.post_once``, the model gate and the health probes, against a :class:`FakeTransport`, on
asyncio and trio.

Each test says one rule of how a call picks, tries, blames and leaves servers; times are fractions of a
second and nothing asserts how long anything took.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from epd_middleware import ConnectionLost, UnsendableRequest
from epd_middleware import _failover as failover
from epd_middleware._compat import Expectation
from epd_middleware._http import body_size
from epd_middleware._pool import _MAX_STRANGERS, OTHER_SERVERS, PoolPolicy, ServerPool, no_server_left
from epd_middleware._probes import probe, probe_forever
from epd_middleware._upstream import MAX_ANSWER_DEPTH, Attempt, DeadlinePassed, answer_of, within_depth
from epd_middleware.errors import (
    RequestNotSendable,
    UpstreamBadReply,
    UpstreamRejected,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)

from .fake_transport import (
    MODEL,
    Call,
    FakeTransport,
    after,
    answer_bytes,
    answer_json,
    answer_status,
    hang,
    in_turn,
    models_answer,
    refuse,
    vllm,
)

pytestmark = pytest.mark.anyio

E0, E1, E2, E3 = (f"http://enc-{n}:8001" for n in range(4))
STRANGER = "http://10.0.0.9:8001"
CHAT = "/v1/chat/completions"
REQUEST_ID = "req-1"
BODY = {"model": MODEL, "messages": []}


def pool_of(*members: str, **policy: Any) -> ServerPool:
    policy.setdefault("timeout", 5.0)
    pool = ServerPool("encoder", PoolPolicy(**policy))
    pool.set_members(members)
    return pool


def own_answer(call: Call) -> tuple[int, bytes]:
    """A vLLM answer to this very request (its id is the request's), saying who answered."""
    return 200, json.dumps({"id": f"chatcmpl-{call.request_id}", "server": call.server}).encode()


def read(server: str, reply: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return server, reply


async def call(
    pool: ServerPool,
    transport: FakeTransport,
    first: str = E0,
    *,
    request_id: str | None = REQUEST_ID,
    path: str = CHAT,
    preferred: tuple[str, ...] = (),
    deadline: float | None = None,
) -> tuple[str, dict[str, Any]]:
    """One call of the pool: the server that answered and its answer."""
    headers = {"x-request-id": request_id} if request_id is not None else {}
    return await failover.call(
        pool,
        transport,
        first,
        path,
        lambda server: Attempt(json.dumps(BODY).encode(), read),
        headers,
        preferred,
        deadline,
    )


def failures(pool: ServerPool, url: str) -> int:
    health = pool.known(url)
    assert health is not None
    return health.failures


def nested(depth: int) -> bytes:
    """A JSON object ``depth`` objects deep."""
    return ('{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)).encode()


# --- failover ----------------------------------------------------------------------------------------


async def test_a_call_fails_over_from_a_server_that_refuses_connections_to_the_next_member() -> None:
    pool = pool_of(E0, E1)
    transport = FakeTransport({E0: refuse(), E1: own_answer})
    server, reply = await call(pool, transport)
    assert (server, reply["server"]) == (E1, E1)
    assert [c.server for c in transport.calls] == [E0, E1]
    # Both tries sent the same request, with the request id and the content type.
    assert [c.json for c in transport.calls] == [BODY, BODY]
    assert transport.calls[0].headers == {"content-type": "application/json", "x-request-id": REQUEST_ID}
    assert (failures(pool, E0), failures(pool, E1)) == (1, 0)
    counters = pool.stats.counters
    assert counters["encoder_calls_unavailable"] == 1
    assert counters["encoder_failovers"] == 1
    assert counters["encoder_calls_ok"] == 1


async def test_a_call_fails_over_to_its_preferred_servers_before_the_other_members() -> None:
    pool = pool_of(E0, E1, E2)
    transport = FakeTransport({E0: refuse(), E1: own_answer, E2: own_answer})
    server, _ = await call(pool, transport, preferred=(E2,))
    assert server == E2
    assert [c.server for c in transport.calls] == [E0, E2]


@pytest.mark.parametrize("status", [400, 404, 413, 422])
async def test_a_rejection_of_the_request_itself_is_raised_at_once_without_failover(status: int) -> None:
    """No other server would answer a bad request otherwise, and the server is not to blame."""
    pool = pool_of(E0, E1)
    transport = FakeTransport({E0: answer_status(status, "bad mm_processor_kwargs"), E1: own_answer})
    with pytest.raises(UpstreamRejected) as info:
        await call(pool, transport)
    assert info.value.status == status
    assert info.value.server == E0
    assert not info.value.retryable
    assert "bad mm_processor_kwargs" in info.value.message
    assert [c.server for c in transport.calls] == [E0]
    assert failures(pool, E0) == 0
    assert pool.stats.counters["encoder_calls_rejected"] == 1
    assert pool.stats.counters["encoder_failovers"] == 0


@pytest.mark.parametrize("status", [500, 502, 503, 429, 401, 403, 408])
async def test_server_errors_and_statuses_about_the_server_fail_over_and_count_a_failure(status: int) -> None:
    pool = pool_of(E0, E1)
    transport = FakeTransport({E0: answer_status(status), E1: own_answer})
    server, _ = await call(pool, transport)
    assert server == E1
    assert failures(pool, E0) == 1
    assert pool.stats.counters["encoder_calls_status"] == 1


def test_a_server_errors_own_message_stays_out_of_the_error_and_a_429s_is_kept() -> None:
    """A 5xx body may carry the server's internals: it goes to the log, never into the client's error."""
    internals = json.dumps({"error": {"message": "EngineCore died at 0xdead"}}).encode()
    with pytest.raises(UpstreamStatusError) as info:
        answer_of(E0, "encoder", 500, internals)
    assert info.value.status_code == 500
    assert "EngineCore" not in info.value.message
    with pytest.raises(UpstreamStatusError, match="slow down") as busy:
        answer_of(E0, "encoder", 429, json.dumps({"error": {"message": "slow down"}}).encode())
    assert busy.value.retryable


@pytest.mark.parametrize("max_attempts", [1, 2, 3])
async def test_max_attempts_bounds_the_servers_one_call_tries(max_attempts: int) -> None:
    pool = pool_of(E0, E1, E2, E3, max_attempts=max_attempts, eject_after=10)
    transport = FakeTransport({url: answer_status(500) for url in (E0, E1, E2, E3)})
    with pytest.raises(UpstreamStatusError) as info:
        await call(pool, transport)
    tried = [c.server for c in transport.posts()]
    assert tried[0] == E0
    assert len(tried) == len(set(tried)) == max_attempts
    assert info.value.server == tried[-1]  # the last failure is the one raised


async def test_the_failover_counter_counts_only_the_retries_made() -> None:
    """Before: the last allowed attempt's failure counted a failover (and logged "retrying on ...")
    that never came."""
    pool = pool_of(E0, E1, max_attempts=1)
    transport = FakeTransport({E0: answer_status(500), E1: own_answer})
    with pytest.raises(UpstreamStatusError):
        await call(pool, transport)
    assert [c.server for c in transport.calls] == [E0]
    assert pool.stats.counters["encoder_failovers"] == 0


async def test_a_call_with_no_server_left_to_try_raises_its_last_failure() -> None:
    pool = pool_of(E0, E1, max_attempts=5)
    transport = FakeTransport({E0: answer_status(500), E1: refuse()})
    with pytest.raises(UpstreamUnavailable) as info:
        await call(pool, transport)
    assert info.value.server == E1
    assert [c.server for c in transport.calls] == [E0, E1]  # each member once, however many attempts


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"<html>oops</html>", "not JSON"),
        (b"[1, 2, 3]", "not a JSON object"),
        (b'"text"', "not a JSON object"),
        (nested(MAX_ANSWER_DEPTH + 1), "nests too deeply"),
    ],
    ids=["not-json", "a-list", "a-string", "too-deep"],
)
async def test_an_answer_that_is_not_a_json_object_of_bounded_depth_is_a_bad_reply_that_fails_over(
    content: bytes, reason: str
) -> None:
    pool = pool_of(E0, E1)
    transport = FakeTransport({E0: answer_bytes(content), E1: own_answer})
    server, _ = await call(pool, transport)
    assert server == E1
    assert failures(pool, E0) == 1
    assert pool.stats.counters["encoder_calls_bad_reply"] == 1
    with pytest.raises(UpstreamBadReply, match=reason):
        answer_of(E0, "encoder", 200, content)


def test_an_answer_as_deep_as_the_limit_is_taken() -> None:
    assert isinstance(answer_of(E0, "encoder", 200, nested(MAX_ANSWER_DEPTH)), dict)
    assert within_depth({"a": [1, {}]}, 3)
    assert not within_depth({"a": [1, {}]}, 2)
    assert within_depth(7, 0)


async def test_each_try_is_built_afresh_and_its_reading_may_refuse_the_answer() -> None:
    """``Attempt.read`` raising a bad reply fails the try over like any failure of the server's."""
    pool = pool_of(E0, E1)
    transport = FakeTransport({E0: own_answer, E1: own_answer})
    bodies: list[bytes] = []

    def attempt(server: str) -> Attempt[str]:
        body = f'{{"try": {len(bodies)}}}'.encode()
        bodies.append(body)

        def picky(server: str, reply: dict[str, Any]) -> str:
            if server == E0:
                raise UpstreamBadReply(server, "no handles for the items sent")
            return server

        return Attempt(body, picky)

    answered = await failover.call(pool, transport, E0, CHAT, attempt, {"x-request-id": REQUEST_ID})
    assert answered == E1
    assert [c.json for c in transport.calls] == [{"try": 0}, {"try": 1}]
    assert failures(pool, E0) == 1


async def test_a_broken_connection_or_a_bug_in_the_transport_costs_the_call_not_the_request() -> None:
    def lost(call: Call) -> tuple[int, bytes]:
        raise ConnectionLost("connection closed before a complete answer")

    def buggy(call: Call) -> tuple[int, bytes]:
        raise RuntimeError("a bug in a custom transport")

    pool = pool_of(E0, E1, E2)
    transport = FakeTransport({E0: lost, E1: buggy, E2: own_answer})
    server, _ = await call(pool, transport)
    assert server == E2
    # One request costs at most one server one failure (issue 29): E1's is not counted.
    assert (failures(pool, E0), failures(pool, E1)) == (1, 0)
    assert pool.stats.counters["encoder_calls_unavailable"] == 2
    assert pool.stats.counters["encoder_failures_blamed_server"] == 1
    assert pool.stats.counters["encoder_failures_blamed_capped"] == 1


async def test_a_request_that_cannot_be_written_is_raised_at_once_and_blames_no_server() -> None:
    def unsendable(call: Call) -> tuple[int, bytes]:
        raise UnsendableRequest("a header value holds a line break")

    pool = pool_of(E0, E1)
    transport = FakeTransport({E0: unsendable, E1: own_answer})
    with pytest.raises(RequestNotSendable) as info:
        await call(pool, transport)
    assert info.value.status == 400
    assert [c.server for c in transport.calls] == [E0]
    assert failures(pool, E0) == 0


# --- answers bound to their request -------------------------------------------------------------------


async def test_an_answer_for_another_request_is_refused_and_the_servers_idle_connections_dropped() -> None:
    """A server (or a proxy before it) that mixed up its connections must never hand this request another
    request's handles."""
    pool = pool_of(E0, E1)
    transport = FakeTransport(
        {E0: answer_json({"id": "chatcmpl-req-2", "ec_transfer_params": {}}), E1: own_answer}
    )
    server, reply = await call(pool, transport)
    assert (server, reply["id"]) == (E1, f"chatcmpl-{REQUEST_ID}")
    assert transport.dropped == [E0]
    assert pool.stats.counters["encoder_foreign_answers"] == 1
    assert pool.stats.counters["encoder_calls_bad_reply"] == 1
    assert failures(pool, E0) == 1


@pytest.mark.parametrize(
    ("answer", "path", "request_id"),
    [
        ({"id": f"chatcmpl-{REQUEST_ID}"}, CHAT, REQUEST_ID),
        ({"id": "cmpl-someone-else"}, CHAT, REQUEST_ID),
        ({"id": 7}, CHAT, REQUEST_ID),
        ({}, CHAT, REQUEST_ID),
        ({"id": "chatcmpl-req-2"}, "/v1/responses", REQUEST_ID),
        ({"id": "chatcmpl-req-2"}, CHAT, None),
    ],
    ids=["its-own-id", "not-vllms-form", "not-a-string", "no-id", "responses-are-not-bound", "no-request-id"],
)
async def test_an_answer_that_cannot_be_told_to_be_anothers_is_taken(
    answer: dict[str, Any], path: str, request_id: str | None
) -> None:
    pool = pool_of(E0, E1)
    transport = FakeTransport({E0: answer_json(answer), E1: own_answer})
    server, reply = await call(pool, transport, path=path, request_id=request_id)
    assert (server, reply) == (E0, answer)
    assert transport.dropped == []
    assert pool.stats.counters["encoder_foreign_answers"] == 0


# --- time ----------------------------------------------------------------------------------------------


async def test_the_callers_deadline_passing_raises_deadline_passed_and_blames_no_server() -> None:
    hanging = hang()
    pool = pool_of(E0, E1, timeout=10.0, eject_after=1)
    transport = FakeTransport({E0: hanging, E1: own_answer})
    with pytest.raises(DeadlinePassed):
        await call(pool, transport, deadline=anyio.current_time() + 0.05)
    assert [c.server for c in transport.calls] == [E0]  # no other server tried
    assert hanging.cancelled == transport.calls  # the call in flight was cancelled, not left behind
    assert failures(pool, E0) == 0
    assert pool.available(anyio.current_time()) == (E0, E1)
    assert not [name for name in pool.stats.counters if name.startswith("encoder_calls_")]


async def test_a_deadline_passed_before_the_call_sends_nothing() -> None:
    pool = pool_of(E0)
    transport = FakeTransport({E0: own_answer})
    with pytest.raises(DeadlinePassed):
        await call(pool, transport, deadline=anyio.current_time() - 1)
    assert transport.calls == []


async def test_a_server_that_does_not_answer_within_the_timeout_fails_as_a_timeout_and_counts_a_failure() -> (
    None
):
    hanging = hang()
    pool = pool_of(E0, E1, timeout=0.05)
    transport = FakeTransport({E0: hanging, E1: own_answer})
    server, _ = await call(pool, transport)
    assert server == E1
    assert len(hanging.cancelled) == 1
    assert failures(pool, E0) == 1
    assert pool.stats.counters["encoder_calls_timeout"] == 1

    alone = pool_of(E0, timeout=0.05)
    with pytest.raises(UpstreamTimeout) as info:
        await call(alone, FakeTransport({E0: hang()}))
    assert info.value.status == 504
    assert f"encoder {E0} failed: no answer within 0.05 s" in info.value.logged
    assert info.value.message == "an encoder failed: no answer within 0.05 s"  # no address for clients
    assert failures(alone, E0) == 1


# --- capacity ------------------------------------------------------------------------------------------


async def test_max_inflight_bounds_the_calls_in_flight_to_one_server_and_the_next_waits_its_turn() -> None:
    pool = pool_of(E0, max_inflight=2)
    gates: list[anyio.Event] = []
    in_flight = peak = 0

    async def held(request: Call) -> tuple[int, bytes]:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        gate = anyio.Event()
        gates.append(gate)
        try:
            await gate.wait()
        finally:
            in_flight -= 1
        return own_answer(request)

    transport = FakeTransport({E0: held})
    answered: list[str] = []

    async def one(n: int) -> None:
        _, reply = await call(pool, transport, request_id=f"r{n}")
        answered.append(reply["id"])

    capacity = pool.record(E0).capacity
    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            for n in range(3):
                group.start_soon(one, n)
            await anyio.wait_all_tasks_blocked()
            assert len(gates) == 2  # the third call waits for a slot, not sent
            assert capacity.in_flight == 2
            assert not capacity.idle
            gates[0].set()
            await anyio.wait_all_tasks_blocked()
            assert len(gates) == 3  # a slot freed: the waiting call goes
            for gate in gates:
                gate.set()
    assert sorted(answered) == ["chatcmpl-r0", "chatcmpl-r1", "chatcmpl-r2"]
    assert peak == 2
    assert capacity.idle


async def test_time_spent_waiting_for_a_slot_is_not_the_servers_and_does_not_eject_it() -> None:
    """Each call is answered within the timeout; the second one only waited for the first's slot first
    (max_inflight_per_encoder: "further calls wait (within the deadline)"). Before: the timeout ran
    during the wait, so this process's own queueing timed a call out and ejected the server."""
    pool = pool_of(E0, max_inflight=1, timeout=0.5, eject_after=1)
    transport = FakeTransport({E0: after(0.3, own_answer)})
    outcomes: list[str] = []

    async def one(n: int) -> None:
        try:
            await call(pool, transport, request_id=f"r{n}")
            outcomes.append("ok")
        except UpstreamTimeout:
            outcomes.append("timeout")

    async with anyio.create_task_group() as group:
        for n in range(2):
            group.start_soon(one, n)
    assert outcomes == ["ok", "ok"]
    assert failures(pool, E0) == 0


# --- passive health: ejection --------------------------------------------------------------------------


def test_consecutive_failures_eject_a_server_for_a_cool_down_that_doubles_up_to_the_longest() -> None:
    pool = pool_of(E0, E1, eject_after=2, eject_cooldown=1.0, max_eject_cooldown=3.0)
    health = pool.record(E0)
    pool.record_failure(E0, 100.0, "HTTP 500")
    assert pool.available(100.0) == (E0, E1)  # one failure in a row is not enough
    pool.record_failure(E0, 100.0, "HTTP 500")
    assert pool.available(100.0) == (E1,)
    assert pool.snapshot(100.0)[E0]["healthy"] is False
    assert health.ejected_until == 101.0

    pool.record_failure(E0, 100.5, "HTTP 500")  # a failure while ejected does not lengthen it
    assert health.ejected_until == 101.0
    assert pool.available(101.0) == (E0, E1)  # cool-down over: back for a trial

    pool.record_failure(E0, 101.0, "HTTP 500")  # the trial failed: twice as long
    assert (health.cooldown, health.ejected_until) == (2.0, 103.0)
    pool.record_failure(E0, 103.0, "HTTP 500")  # doubled, but never past the longest
    assert (health.cooldown, health.ejected_until) == (3.0, 106.0)
    pool.record_failure(E0, 106.0, "HTTP 500")
    assert (health.cooldown, health.ejected_until) == (3.0, 109.0)


def test_a_success_brings_an_ejected_server_back_and_its_next_ejection_starts_short_again() -> None:
    pool = pool_of(E0, E1, eject_after=1, eject_cooldown=1.0, max_eject_cooldown=8.0)
    health = pool.record(E0)
    for now in (0.0, 1.0, 3.0):
        pool.record_failure(E0, now, "refused")
    assert health.cooldown == 4.0
    pool.record_success(E0)
    assert pool.available(3.5) == (E0, E1)
    assert (health.failures, health.cooldown, health.ejected_until) == (0, 0.0, 0.0)
    pool.record_failure(E0, 10.0, "refused")
    assert (health.cooldown, health.ejected_until) == (1.0, 11.0)


async def test_calls_that_keep_failing_eject_the_server_and_a_call_that_succeeds_brings_it_back() -> None:
    pool = pool_of(E0, E1, eject_after=2, eject_cooldown=60.0)
    transport = FakeTransport({E0: refuse(), E1: own_answer})
    for _ in range(2):
        assert (await call(pool, transport, E0))[0] == E1
    now = anyio.current_time()
    assert pool.available(now) == (E1,)
    assert pool.pick(now) == E1
    assert pool.snapshot(now)[E0]["consecutive_failures"] == 2

    transport.servers[E0] = own_answer  # it recovers; a call named for it (a scheduler's) succeeds
    assert (await call(pool, transport, E0))[0] == E0
    assert pool.available(anyio.current_time()) == (E0, E1)
    assert pool.snapshot(anyio.current_time())[E0]["healthy"] is True


def test_pick_gives_none_when_every_member_is_ejected() -> None:
    pool = pool_of(E0, E1, eject_after=1, eject_cooldown=5.0)
    pool.record_failure(E0, 0.0, "x")
    pool.record_failure(E1, 0.0, "x")
    assert pool.pick(1.0) is None
    assert pool.pick(5.0) in (E0, E1)


async def test_a_503_for_a_pool_that_is_all_ejected_says_when_its_first_server_comes_back() -> None:
    """Before: the 503 for "every encoder is failing" carried ``Retry-After: retry_after`` (1 s by
    default) while the encoders stayed ejected for 28 s more, so a client that obeyed it was refused
    again 28 times. Now Retry-After is the seconds until the soonest member's ejection ends, rounded up,
    never below ``retry_after``; a server that serves another model has no end to wait for."""
    pool = pool_of(E0, E1, E2)
    now = anyio.current_time()
    pool.record(E0).ejected_until = now + 40.5
    pool.record(E1).ejected_until = now + 27.2  # the first to come back
    pool.record(E2).model = "mismatch"
    assert pool.pick(now) is None
    assert no_server_left(pool, "encoder", 1).headers() == [(b"retry-after", b"28")]
    # retry_after stays the floor: a cool-down shorter than it, or none at all, gives retry_after.
    assert no_server_left(pool, "encoder", 30).headers() == [(b"retry-after", b"30")]
    pool.record(E1).ejected_until = now + 0.2
    assert no_server_left(pool, "encoder", 1).headers() == [(b"retry-after", b"1")]
    pool.record(E0).ejected_until = pool.record(E1).ejected_until = 0.0
    pool.record(E0).model = pool.record(E1).model = "mismatch"
    assert no_server_left(pool, "encoder", 3).headers() == [(b"retry-after", b"3")]
    assert no_server_left(pool_of(), "encoder", 2).headers() == [(b"retry-after", b"2")]


# --- which model a server serves -----------------------------------------------------------------------


async def test_a_server_that_serves_another_model_is_not_used_and_not_blamed() -> None:
    pool = pool_of(E0, E1)
    pool.models.expect(Expectation(frozenset({MODEL})))
    transport = FakeTransport({E0: vllm(own_answer, models=["another-model"]), E1: vllm(own_answer)})
    server, _ = await call(pool, transport, E0)
    assert server == E1
    assert [(c.method, c.path) for c in transport.to(E0)] == [("GET", "/v1/models")]  # asked, never used
    now = anyio.current_time()
    assert pool.available(now) == (E1,)
    assert pool.models.mismatched() == [(E0, "another-model (another-model)")]
    assert pool.snapshot(now)[E0]["model"] == {
        "state": "mismatch",
        "served": "another-model (another-model)",
        "aliases_mapped": [],
    }
    assert failures(pool, E0) == 0


async def test_a_call_whose_every_server_serves_another_model_says_what_they_serve() -> None:
    pool = pool_of(E0)
    pool.models.expect(Expectation(frozenset({MODEL})))
    transport = FakeTransport({E0: vllm(own_answer, models=["another-model"])})
    with pytest.raises(UpstreamUnavailable, match="not used: another-model"):
        await call(pool, transport, E0)
    assert transport.to(E0, method="POST") == []


@pytest.mark.parametrize(
    ("names", "root", "state"),
    [
        ([MODEL], "/models/tiny", "ok"),
        (["alias", MODEL], "/models/tiny", "ok"),
        ([MODEL], "/models/other", "mismatch"),
        (["another-model"], "/models/tiny", "mismatch"),
    ],
)
async def test_a_server_matches_when_it_serves_one_of_the_names_under_the_model_path(
    names: list[str], root: str, state: str
) -> None:
    pool = pool_of(E0)
    pool.models.expect(Expectation(frozenset({MODEL}), "/models/tiny"))
    transport = FakeTransport({E0: vllm(models=names, root=root)})
    await pool.models.check(transport, [E0], {})
    assert pool.record(E0).model == state


async def test_concurrent_calls_to_an_unchecked_server_ask_what_it_serves_once() -> None:
    answer = anyio.Event()

    async def slow_models(request: Call) -> tuple[int, bytes]:
        await answer.wait()
        return 200, json.dumps(models_answer([MODEL])).encode()

    pool = pool_of(E0)
    pool.models.expect(Expectation(frozenset({MODEL})))
    transport = FakeTransport({E0: vllm(own_answer, models_handler=slow_models)})

    async def one(n: int) -> None:
        await call(pool, transport, request_id=f"r{n}")

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            for n in range(5):
                group.start_soon(one, n)
            await anyio.wait_all_tasks_blocked()
            assert [c.path for c in transport.calls] == ["/v1/models"]  # the others wait for its verdict
            answer.set()
    assert len(transport.to(E0, "/v1/models")) == 1
    assert len(transport.to(E0, CHAT, "POST")) == 5


async def test_a_server_that_did_not_say_what_it_serves_is_asked_again_by_its_next_call() -> None:
    """A fleet starts in any order: an encoder that is not up yet is not left out for good."""
    models = in_turn(refuse(), answer_json(models_answer([MODEL])))
    pool = pool_of(E0, E1)
    pool.models.expect(Expectation(frozenset({MODEL})))
    transport = FakeTransport({E0: vllm(own_answer, models_handler=models), E1: vllm(own_answer)})
    assert (await call(pool, transport, E0))[0] == E1
    assert pool.record(E0).model == "unreachable"
    assert failures(pool, E0) == 1  # as a failed call: one that never answers gets ejected
    assert E0 in pool.available(anyio.current_time())

    assert (await call(pool, transport, E0))[0] == E0
    assert len(transport.to(E0, "/v1/models")) == 2
    assert pool.record(E0).model == "ok"


async def test_without_an_expectation_no_server_is_asked_what_it_serves() -> None:
    pool = pool_of(E0)
    transport = FakeTransport({E0: vllm(own_answer, models=["another-model"])})
    assert (await call(pool, transport))[0] == E0
    assert transport.to(E0, "/v1/models") == []


async def test_a_server_back_from_ejection_is_asked_again_what_it_serves() -> None:
    """It may have come back as another server."""
    pool = pool_of(E0, eject_after=1)
    pool.models.expect(Expectation(frozenset({MODEL})))
    transport = FakeTransport({E0: vllm(own_answer)})
    await call(pool, transport)
    pool.record_failure(E0, anyio.current_time(), "refused")
    pool.record_success(E0)
    assert pool.record(E0).model == "unchecked"
    await call(pool, transport)
    assert len(transport.to(E0, "/v1/models")) == 2


async def test_a_new_expectation_makes_every_server_be_asked_again() -> None:
    pool = pool_of(E0)
    transport = FakeTransport({E0: vllm(own_answer)})
    pool.models.expect(Expectation(frozenset({MODEL})))
    await call(pool, transport)
    pool.models.expect(Expectation(frozenset({MODEL})))  # the same: nothing asked again
    await call(pool, transport)
    pool.models.expect(Expectation(frozenset({"another-model"})))
    with pytest.raises(UpstreamUnavailable):
        await call(pool, transport)
    assert len(transport.to(E0, "/v1/models")) == 2


# --- active health: probes -----------------------------------------------------------------------------


async def test_a_probe_brings_an_ejected_server_back_on_a_healthy_answer_and_counts_a_failure_otherwise() -> (
    None
):
    pool = pool_of(E0, E1, E2, E3, eject_after=1, eject_cooldown=60.0, health_check_timeout=0.05)
    transport = FakeTransport(
        {E0: vllm(), E1: vllm(health=answer_status(503)), E2: vllm(health=hang()), E3: refuse()}
    )
    pool.record_failure(E0, anyio.current_time(), "refused")
    assert E0 not in pool.available(anyio.current_time())

    await probe(pool, transport, {"authorization": "Bearer k"})
    snapshot = pool.snapshot(anyio.current_time())
    assert snapshot[E0]["healthy"] is True
    assert snapshot[E0]["consecutive_failures"] == 0
    for url in (E1, E2, E3):  # a 503, no answer within the probe's timeout, a refused connection
        assert snapshot[url]["consecutive_failures"] == 1
        assert snapshot[url]["healthy"] is False
    health_checks = [c for c in transport.calls if c.path == "/health"]
    assert sorted(c.server for c in health_checks) == [E0, E1, E2, E3]
    assert all(c.method == "GET" and c.headers == {"authorization": "Bearer k"} for c in health_checks)


async def test_a_probe_asks_every_server_what_it_serves_again() -> None:
    """Those not known to serve the model, and those that did: a server restarted with fewer
    --served-model-name aliases answers 404 to a name it listed (issue 35's fourth attack: before, a
    matching server's names were never read again)."""
    pool = pool_of(E0, E1)
    pool.models.expect(Expectation(frozenset({MODEL})))
    transport = FakeTransport({E0: vllm(models=["another-model"]), E1: vllm()})
    await pool.models.check(transport, pool.members, {})
    assert pool.available(anyio.current_time()) == (E1,)

    transport.servers[E0] = vllm()  # redeployed with this server's model
    await probe(pool, transport, {})
    assert pool.available(anyio.current_time()) == (E0, E1)
    assert len(transport.to(E0, "/v1/models")) == 2
    assert len(transport.to(E1, "/v1/models")) == 2  # known to match, asked again: its names may change


async def test_probe_forever_probes_every_interval_and_never_when_the_interval_is_zero() -> None:
    idle = pool_of(E0, health_check_interval=0)
    silent = FakeTransport({E0: vllm()})
    await probe_forever(idle, silent, {})
    assert silent.calls == []

    twice = anyio.Event()
    checks: list[Call] = []

    def health(request: Call) -> tuple[int, bytes]:
        checks.append(request)
        if len(checks) == 2:
            twice.set()
        return 200, b""

    pool = pool_of(E0, health_check_interval=0.01)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(probe_forever, pool, FakeTransport({E0: vllm(health=health)}), {})
            await twice.wait()
            group.cancel_scope.cancel()
    assert len(checks) >= 2


# --- members and strangers -----------------------------------------------------------------------------


async def test_a_server_outside_the_pool_gets_health_and_limits_under_one_shared_metrics_label() -> None:
    """A scheduler may name any server the allowlist admits: a series per target would grow without
    bound."""
    pool = pool_of(E0)
    transport = FakeTransport({STRANGER: own_answer})
    assert (await call(pool, transport, STRANGER))[0] == STRANGER
    assert pool.label(STRANGER) == OTHER_SERVERS
    assert pool.label(E0) == E0
    assert not pool.is_member(STRANGER)
    assert pool.known(STRANGER) is not None
    now = anyio.current_time()
    assert pool.available(now) == (E0,)  # never chosen by the pool itself
    assert pool.snapshot(now)[STRANGER]["member"] is False


async def test_idle_strangers_are_forgotten_once_more_than_the_bound_are_known() -> None:
    pool = pool_of(E0)
    busy = "http://busy:8001"
    assert pool.record(busy).capacity.take_now()  # a call in flight: its record must stay
    strangers = [f"http://10.1.{n // 250}.{n % 250}:8001" for n in range(_MAX_STRANGERS - 1)]
    for url in strangers:
        pool.record(url)
    assert pool.known(strangers[0]) is not None

    pool.record(STRANGER)  # one more than the bound: the idle ones go
    assert all(pool.known(url) is None for url in strangers)
    assert pool.known(busy) is not None
    assert pool.known(STRANGER) is not None
    assert pool.known(E0) is not None  # members are never forgotten
    pool.record(busy).capacity.release()


def test_a_server_that_leaves_the_pool_is_forgotten_when_idle_and_survivors_keep_their_health() -> None:
    pool = pool_of(E0, E1, eject_after=1)
    pool.record_failure(E1, 0.0, "refused")
    pool.set_members((E1, E2))
    assert pool.known(E0) is None
    assert failures(pool, E1) == 1
    assert pool.available(0.0) == (E2,)
    assert pool.label(E0) == OTHER_SERVERS
    assert pool.member_addresses == frozenset({("enc-1", 8001), ("enc-2", 8001)})


async def test_a_call_that_waits_a_timeouts_length_for_a_slot_fails_over_and_blames_no_one() -> None:
    """Two calls ahead of it held E0's only slot in turn, each for its whole timeout: the third waited a
    timeout's length without sending anything, so its wait is not counted against E0 (the two calls
    that timed out there are), and it goes to another member."""
    pool = pool_of(E0, E1, max_inflight=1, timeout=0.2, eject_after=10)
    transport = FakeTransport({E0: hang(), E1: own_answer})
    answered: list[str] = []

    async def one(n: int) -> None:
        server, _ = await call(pool, transport, E0, request_id=f"r{n}")
        answered.append(f"r{n} {server}")

    async with anyio.create_task_group() as group:
        for n in range(3):
            group.start_soon(one, n)
            await anyio.sleep(0.05)
    assert sorted(answered) == [f"r{n} {E1}" for n in range(3)]
    assert [c.request_id for c in transport.calls if c.server == E0] == ["r0", "r1"]
    assert failures(pool, E0) == 2


async def test_waiting_for_a_slot_past_the_callers_deadline_blames_no_server() -> None:
    pool = pool_of(E0, max_inflight=1, timeout=5.0, eject_after=1)
    transport = FakeTransport({E0: hang()})
    async with anyio.create_task_group() as group:
        group.start_soon(call, pool, transport, E0)
        await anyio.sleep(0.05)
        with pytest.raises(DeadlinePassed):
            await call(pool, transport, E0, request_id="r2", deadline=anyio.current_time() + 0.1)
        group.cancel_scope.cancel()
    assert failures(pool, E0) == 0


async def test_a_transport_bug_during_a_probe_counts_a_failure_and_probing_goes_on() -> None:
    """Before: the probe let the exception out, which ended the lifespan's probing of every server."""

    def broken(call: Call) -> tuple[int, bytes]:
        raise RuntimeError("a bug in a custom transport")

    pool = pool_of(E0, E1, eject_after=1)
    pool.models.expect(Expectation(frozenset({MODEL})))
    await probe(pool, FakeTransport({E0: broken, E1: vllm()}), {})
    assert failures(pool, E0) >= 1
    assert not pool.usable(E0, anyio.current_time())
    assert failures(pool, E1) == 0


async def test_a_calls_latency_is_classed_by_the_work_it_asks_not_by_its_bytes() -> None:
    """Placement compares a call with the fastest of its size (:mod:`epd_middleware._placement`): the size
    is the vision work the call asks for (``Attempt.work``, its items' tokens), by powers of two. Before
    (issue 35, item 4) it was the bytes sent, and 12 flat 1000 x 1000 PNGs of about 5 KB fell in the
    class of 56 x 56 photos: their encodes read as a slowdown past 3, and every later request went local
    as ``encoders_saturated``. A call whose work is not known (a remote image) does not weigh in."""
    pool = pool_of(E0)
    transport = FakeTransport({E0: own_answer})
    whole = json.dumps(BODY).encode()
    pieces = [whole[:10], memoryview(whole[10:])]
    for body in (whole, pieces):
        await failover.call(
            pool, transport, E0, CHAT, lambda server, body=body: Attempt(body, read, 4), {}, ()
        )
    await failover.call(pool, transport, E0, CHAT, lambda server: Attempt(whole, read, 1296), {}, ())
    health = pool.known(E0)
    assert health is not None
    assert sorted(health.fastest) == [
        ((4).bit_length(), len(whole).bit_length()),
        ((1296).bit_length(), len(whole).bit_length()),
    ]
    await failover.call(pool, transport, E0, CHAT, lambda server: Attempt(whole, read), {}, ())
    assert len(health.fastest) == 2  # unknown work: no class of its own, and no slowdown sample
    # The call span still reports the bytes sent, whole or in pieces (_tracing.py).
    assert body_size(pieces) == body_size(whole) == len(whole)


async def test_an_encoder_whose_canary_failed_is_not_brought_back_by_its_health_check() -> None:
    """/health says nothing of encoding: an encoder ejected because its own canary encode failed stays
    out until its cool-down ends, and its cool-down keeps doubling, however often /health passes; a call
    that succeeds once the cool-down is over is what brings it back."""
    from epd_middleware._canary import canary
    from epd_middleware._probes import confirm_failing

    pool = pool_of(E0, E1, eject_after=1, eject_cooldown=0.5, max_eject_cooldown=600.0)
    broken = vllm(chat=answer_status(500, "CUDA error: an illegal memory access"))
    transport = FakeTransport({E0: broken, E1: vllm()})
    check = canary(MODEL, None, None)
    pool.suspect(E0, anyio.current_time(), "HTTP 500")
    await confirm_failing(pool, transport, E0, check)
    assert E0 not in pool.available(anyio.current_time())

    await probe(pool, transport, {})  # its /health passes
    assert E0 not in pool.available(anyio.current_time())
    pool.suspect(E0, anyio.current_time(), "HTTP 500")
    await confirm_failing(pool, transport, E0, check)
    assert pool.record(E0).cooldown == 1.0  # doubled: not reset by the passing /health

    transport.servers[E0] = vllm(chat=own_answer)  # mended
    await anyio.sleep(1.1)  # the cool-down is over: the next call tries it, and its success counts
    server, _ = await call(pool, transport, E0)
    assert server == E0
    assert pool.record(E0).cooldown == 0.0
    # A server ejected for its /health alone comes back on a passing one, as before.
    pool.record_failure(E1, anyio.current_time(), "health check HTTP 503")
    assert E1 not in pool.available(anyio.current_time())
    await probe(pool, transport, {})
    assert E1 in pool.available(anyio.current_time())
