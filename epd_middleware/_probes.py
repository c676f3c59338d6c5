"""Active health: every ``health_check_interval`` seconds each member of a pool is asked ``GET /health``
(a recovered server comes back, a silent one counts a failure), and, while the servers must serve this
server's model, those not known to serve it are asked what they serve again.
"""

from __future__ import annotations

from collections.abc import Mapping

import anyio

from ._logs import logger
from ._pool import ServerPool
from .transport import HTTPError, Transport, UnsendableRequest

__all__ = ["probe", "probe_forever"]


async def probe(pool: ServerPool, transport: Transport, headers: Mapping[str, str]) -> None:
    """GET /health on every member once, concurrently; brings recovered servers back."""

    async def one(url: str) -> None:
        try:
            with anyio.fail_after(pool.policy.health_check_timeout):
                status, _ = await transport.request("GET", f"{url}/health", headers=headers)
            ok = status == 200
            reason = f"health check HTTP {status}"
        except TimeoutError:
            ok, reason = False, "health check timed out"
        except (HTTPError, UnsendableRequest) as exc:
            ok, reason = False, f"health check failed: {exc.reason}"
        except Exception as exc:
            # A bug in a custom transport costs this probe, not the lifespan's probing of every server.
            logger.exception("unexpected error probing %s %s", pool.role, url)
            ok, reason = False, f"health check failed: unexpected {type(exc).__name__}"
        if ok:
            pool.record_success(url)
        else:
            pool.record_failure(url, anyio.current_time(), reason)

    async with anyio.create_task_group() as group:
        for url in pool.members:
            group.start_soon(one, url)
    if pool.models.expectation is not None:
        await pool.models.check(transport, (), headers, recheck=True)


async def probe_forever(pool: ServerPool, transport: Transport, headers: Mapping[str, str]) -> None:
    interval = pool.policy.health_check_interval
    if interval <= 0:
        return
    while True:
        await anyio.sleep(interval)
        if pool.members:
            await probe(pool, transport, headers)
