"""Active health: every ``health_check_interval`` seconds each member of a pool is asked ``GET /health``
(a recovered server comes back, a silent one counts a failure), and, while the servers must serve this
server's model, what it serves (``GET /v1/models``: a mismatch, or names it no longer serves). And the
confirmation a server's ejection waits for after its calls failed (:func:`confirm_failing`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import anyio

from ._canary import Canary
from ._logs import logger
from ._pool import Proof, ServerPool
from ._protocol import CHAT_COMPLETIONS_PATH, LOAD_PATH, SERVER_LOAD
from ._upstream import post_once
from .errors import UpstreamError, UpstreamRejected, UpstreamStatusError
from .transport import HTTPError, Transport, UnsendableRequest

__all__ = ["confirm_failing", "probe", "probe_forever", "proves_healthy"]

# How long a server's proof of health holds where health probes are off.
_PROOF_HOLDS_S = 5.0


async def probe(
    pool: ServerPool, transport: Transport, headers: Mapping[str, str], *, ask_load: bool = False
) -> None:
    """GET /health on every member once, concurrently; brings recovered servers back. ``ask_load``: and
    ``GET /load`` of each healthy one (vLLM's load under ``--enable-server-load-tracking``), for
    placement; a server that does not track its load is not asked again."""

    async def one(url: str) -> None:
        problem = await _health_problem(pool, transport, url, headers)
        if problem is None:
            pool.record_success(url, health_check=True)
            if ask_load:
                await _ask_load(pool, transport, url, headers)
        else:
            pool.record_failure(url, anyio.current_time(), problem)

    async with anyio.create_task_group() as group:
        for url in pool.members:
            group.start_soon(one, url)
    if pool.models.expectation is not None:
        # Every member, matching or not: one restarted with fewer --served-model-name aliases answers
        # 404 to a name it listed before, and its names are what the calls to it are mapped by.
        await pool.models.check(transport, pool.members, headers)


async def _ask_load(pool: ServerPool, transport: Transport, url: str, headers: Mapping[str, str]) -> None:
    health = pool.record(url)
    if not health.load_tracked:
        return
    try:
        with anyio.fail_after(pool.policy.health_check_timeout):
            status, content = await transport.request("GET", f"{url}{LOAD_PATH}", headers=headers)
        load = json.loads(content).get(SERVER_LOAD) if status == 200 else None
    except Exception:  # a load a server cannot tell is simply not known; its health said the rest
        load = None
        status = 0
    if isinstance(load, int) and not isinstance(load, bool) and load >= 0:
        health.server_load = load
    else:
        health.server_load = None
        # vLLM without --enable-server-load-tracking answers 404: not asked again.
        health.load_tracked = status != 404


async def _health_problem(
    pool: ServerPool, transport: Transport, url: str, headers: Mapping[str, str]
) -> str | None:
    """Why ``GET /health`` says ``url`` is not healthy, or None when it answers 200 in time."""
    try:
        with anyio.fail_after(pool.policy.health_check_timeout):
            status, _ = await transport.request("GET", f"{url}/health", headers=headers)
    except TimeoutError:
        return "health check timed out"
    except (HTTPError, UnsendableRequest) as exc:
        return f"health check failed: {exc.reason}"
    except Exception as exc:
        # A bug in a custom transport costs this probe, not the lifespan's probing of every server.
        logger.exception("unexpected error probing %s %s", pool.role, url)
        return f"health check failed: unexpected {type(exc).__name__}"
    return None if status == 200 else f"health check HTTP {status}"


async def confirm_failing(
    pool: ServerPool,
    transport: Transport,
    url: str,
    canary: Canary | None = None,
) -> None:
    """``url`` failed ``eject_after`` calls in a row: eject it only if it also fails on its own, without
    any client's request (:func:`proves_healthy`); otherwise it is kept, its failures were its
    requests'. The calls that fail meanwhile only count (one confirmation at a time)."""
    health = pool.record(url)
    health.confirming = True
    try:
        problem = await proves_healthy(pool, transport, url, canary)
    finally:
        health.confirming = False
    if problem is None:
        pool.keep(url, "it answers its health check" + (" and a canary encode" if canary else ""))
    else:
        pool.eject(url, anyio.current_time(), f"confirmed: {problem}")


async def proves_healthy(
    pool: ServerPool,
    transport: Transport,
    url: str,
    canary: Canary | None = None,
) -> str | None:
    """Why ``url`` is not healthy on its own, with nothing of any client's in the calls: its ``/health``,
    then the ``canary`` call where one is given (an encoder's canary encode), each within the
    health-check timeout; None when it is. A proof holds for a health-check interval (5 s where probes
    are off), so a stream of failing requests costs the server one canary a while, not one each; and a
    proof under way is shared, so concurrent ones cost it one canary, not one each."""
    if canary is not None and not pool.is_member(url):
        # A server a scheduler named, outside the pool (a client can name any allowed address): the
        # operator's key is for members only. A refusal of the keyless canary proves nothing.
        canary = canary.keyless()
    health = pool.record(url)
    while True:
        if health.proven_until > anyio.current_time() and (canary is None or health.proven_by_canary):
            return None
        under_way = health.proof
        if under_way is None or (canary is not None and not under_way.with_canary):
            break
        await under_way.done.wait()
        if under_way.finished:
            return under_way.problem
    proof = health.proof = Proof(canary is not None)
    try:
        problem = await _health_problem(pool, transport, url, pool.models.headers)
        if problem is None and canary is not None:
            problem = await _canary_problem(pool, transport, url, canary)
            health.encode_broken = problem is not None
        if problem is None:
            interval = pool.policy.health_check_interval
            health.proven_until = anyio.current_time() + (interval if interval > 0 else _PROOF_HOLDS_S)
            health.proven_by_canary = canary is not None
        else:
            health.proven_until = 0.0
        proof.problem, proof.finished = problem, True
        return problem
    finally:
        if health.proof is proof:
            health.proof = None
        proof.done.set()


async def _canary_problem(pool: ServerPool, transport: Transport, url: str, canary: Canary) -> str | None:
    """Why the canary encode says ``url`` cannot encode, or None. An answer about the canary's key (429:
    a quota; 401, 403 to a canary that carries no key) says nothing of encoding: it proves nothing
    either way, and /health stands alone."""
    name = pool.models.name_for(url, canary.model) or canary.model
    attempt = canary.attempt(name)
    try:
        reply = await post_once(
            transport,
            url,
            CHAT_COMPLETIONS_PATH,
            attempt.body,
            canary.headers,
            role=pool.role,
            label=pool.label(url),
            # No slot, as /health takes none: a client holding every slot (slow media) must not make a
            # healthy server fail its canary for want of one.
            capacity=None,
            call_timeout=pool.policy.health_check_timeout,
            deadline=None,
            stats=pool.stats,
        )
        attempt.read(url, reply)
    except UpstreamStatusError as exc:
        if exc.status_code == _THROTTLED or (exc.status_code in _REFUSED and not canary.carries_key):
            logger.warning(
                "%s %s answered the canary encode HTTP %d, which says nothing of its encoding: its "
                "health rests on /health%s",
                pool.role,
                url,
                exc.status_code,
                "" if canary.carries_key else " (set canary_api_key for encoders that take keys)",
            )
            return None
        return f"the canary encode failed: {exc.reason}"
    except UpstreamRejected as exc:
        if not pool.models.serves(url, name):
            # A request for a name no one said is served (a client's, where this server's own names are
            # not known): the server's 404 says nothing of its encoding.
            logger.info(
                "%s %s answered the canary encode for %r HTTP %d, a name not known to be served: its "
                "health rests on /health",
                pool.role,
                url,
                name,
                exc.status_code,
            )
            return None
        return f"the canary encode failed: {exc.reason}"
    except UpstreamError as exc:
        return f"the canary encode failed: {exc.reason}"
    return None


# Answers about the canary's key, not the server's encoding: a throttle, and a refusal of no key.
_THROTTLED = 429
_REFUSED = frozenset({401, 403})


async def probe_forever(
    pool: ServerPool, transport: Transport, headers: Mapping[str, str], *, ask_load: bool = False
) -> None:
    interval = pool.policy.health_check_interval
    if interval <= 0:
        return
    while True:
        await anyio.sleep(interval)
        if pool.members:
            await probe(pool, transport, headers, ask_load=ask_load)
