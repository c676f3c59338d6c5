"""The only module that talks to encoders: planned calls in, handles (or typed errors) out.

It owns everything about encoders as a group: the round-robin cursor, passive health (consecutive
failures eject an encoder for a cool-down that doubles while it keeps failing), active health probes,
the bound on calls in flight per encoder, and failover of a failed call to another encoder within the
request's deadline. Each call catches its own failure; the caller decides (fallback policy) what a
failed call means for the request.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec

from .config import EPDConfig
from .errors import (
    RETRYABLE_STATUSES,
    EncoderBadReply,
    EncoderError,
    EncoderRejected,
    EncoderStatusError,
    EncoderTimeout,
    EncoderUnavailable,
)
from .handles import Handle, ItemKey, match_reply
from .logs import logger
from .metrics import Stats
from .plan import EncoderCall
from .protocol import EC_TRANSFER_PARAMS, EXAMPLE_CONNECTOR_FILE
from .transport import HTTPError, Transport

__all__ = ["EncodeOutcome", "EncoderPool"]


_decode_reply = msgspec.json.Decoder().decode
_JSON = "application/json"
_MAX_DETAIL = 300


@dataclass
class _Health:
    failures: int = 0
    ejected_until: float = 0.0
    cooldown: float = 0.0
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class EncodeOutcome:
    """What the encoders gave for one request: handles, and the calls that failed for good."""

    handles: dict[ItemKey, Handle]
    failed: tuple[tuple[EncoderCall, EncoderError], ...] = ()


@dataclass
class EncoderPool:
    """The encoders, their health and their limits. One per middleware (so one per API-server process)."""

    config: EPDConfig
    stats: Stats = field(default_factory=Stats)
    _health: dict[str, _Health] = field(init=False)
    _limiters: dict[str, anyio.CapacityLimiter] = field(init=False, default_factory=dict)
    _next: int = field(init=False, default=0)
    pending: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._health = {url: _Health() for url in self.config.encoders}
        for url in self.config.encoders:
            self.stats.encoder_health(url, True)

    @property
    def urls(self) -> tuple[str, ...]:
        return self.config.encoders

    # --- selection -------------------------------------------------------------------------------

    def available(self, now: float) -> tuple[str, ...]:
        """Encoders not ejected at ``now``; an ejected one comes back for a trial when its cool-down ends."""
        return tuple(url for url, health in self._health.items() if health.ejected_until <= now)

    def reserve(self, count: int, among: int) -> int:
        """Claim ``count`` consecutive slots of the round-robin cursor over ``among`` encoders.

        No await between the read and the write, so concurrent requests on one event loop never get the
        same slots. Each API-server process has its own pool and cursor.
        """
        start = self._next
        self._next = (start + count) % max(among, 1)
        return start

    def failover_target(self, tried: Sequence[str], now: float) -> str | None:
        """The next available encoder not yet tried for this call."""
        candidates = [url for url in self.available(now) if url not in tried]
        if not candidates:
            return None
        return candidates[self.reserve(1, len(candidates)) % len(candidates)]

    # --- health ----------------------------------------------------------------------------------

    def record_success(self, url: str) -> None:
        health = self._health[url]
        if health.ejected_until:
            logger.info("encoder %s is back", url)
            self.stats.encoder_health(url, True)
        health.failures = 0
        health.ejected_until = 0.0
        health.cooldown = 0.0

    def record_failure(self, url: str, now: float, reason: str) -> None:
        health = self._health[url]
        health.failures += 1
        if health.failures >= self.config.eject_after and health.ejected_until <= now:
            config = self.config
            health.cooldown = min(health.cooldown * 2 or config.eject_cooldown, config.max_eject_cooldown)
            health.ejected_until = now + health.cooldown
            self.stats.encoder_health(url, False)
            logger.warning(
                "encoder %s ejected for %.1f s after %d failures in a row (last: %s)",
                url,
                health.cooldown,
                health.failures,
                reason,
            )

    def snapshot(self, now: float) -> dict[str, dict[str, Any]]:
        """Health and load of every encoder, for status pages and tests."""
        return {
            url: {
                "healthy": health.ejected_until <= now,
                "consecutive_failures": health.failures,
                "ejected_for_s": max(0.0, health.ejected_until - now),
                "in_flight": health.in_flight,
            }
            for url, health in self._health.items()
        }

    async def probe(self, client: Transport, headers: Mapping[str, str]) -> None:
        """GET /health on every encoder once, concurrently; brings recovered encoders back."""

        async def one(url: str) -> None:
            try:
                with anyio.fail_after(self.config.health_check_timeout):
                    status, _ = await client.request("GET", f"{url}/health", headers=headers)
                ok = status == 200
                reason = f"health check HTTP {status}"
            except TimeoutError:
                ok, reason = False, "health check timed out"
            except HTTPError as exc:
                ok, reason = False, f"health check failed: {exc.reason}"
            if ok:
                self.record_success(url)
            else:
                self.record_failure(url, anyio.current_time(), reason)

        async with anyio.create_task_group() as group:
            for url in self.urls:
                group.start_soon(one, url)

    async def probe_forever(self, client: Transport, headers: Mapping[str, str]) -> None:
        interval = self.config.health_check_interval
        if interval <= 0:
            return
        while True:
            await anyio.sleep(interval)
            await self.probe(client, headers)

    # --- calls -----------------------------------------------------------------------------------

    def _limiter(self, url: str) -> anyio.CapacityLimiter:
        # Created on first use: anyio primitives belong to the event loop that runs the app.
        limiter = self._limiters.get(url)
        if limiter is None:
            limiter = self._limiters[url] = anyio.CapacityLimiter(self.config.max_inflight_per_encoder)
        return limiter

    async def encode(
        self,
        client: Transport,
        calls: Sequence[EncoderCall],
        bodies: Sequence[bytes],
        headers: Sequence[Mapping[str, str]],
        *,
        storage: str | None,
        stop_at_first_failure: bool,
    ) -> EncodeOutcome:
        """Run every call concurrently, each with failover, all within the request's encode deadline.

        A call that the encoder rejected as a bad request (400, 404, 413, 422 ...) is raised at once. With
        ``stop_at_first_failure`` the first call that failed for good is raised and its siblings are
        cancelled; otherwise failed calls are returned for the fallback policy to handle.
        """
        results: list[dict[ItemKey, Handle]] = [{} for _ in calls]
        failures: dict[int, EncoderError] = {}
        rejected: list[EncoderError] = []

        async def run(index: int, siblings: anyio.CancelScope | None) -> None:
            try:
                results[index] = await self._call_with_failover(
                    client, calls[index], bodies[index], headers[index], storage
                )
            except EncoderError as exc:
                failures[index] = exc
                if not exc.retryable:
                    rejected.append(exc)
                if siblings is not None and (not exc.retryable or stop_at_first_failure):
                    siblings.cancel()

        with anyio.move_on_after(self.config.encode_deadline) as deadline:
            if len(calls) == 1:
                await run(0, None)  # the common case: no task to spawn
            else:
                async with anyio.create_task_group() as group:
                    for index in range(len(calls)):
                        group.start_soon(run, index, group.cancel_scope)
        if rejected:
            raise rejected[0]
        if deadline.cancelled_caught:
            for index, call in enumerate(calls):
                if not results[index] and index not in failures:
                    failures[index] = EncoderTimeout(
                        call.encoder,
                        f"the request's encode deadline of {self.config.encode_deadline:g} s passed",
                    )
        if failures and stop_at_first_failure:
            raise failures[min(failures)]
        handles = {key: handle for result in results for key, handle in result.items()}
        return EncodeOutcome(handles, tuple((calls[index], failures[index]) for index in sorted(failures)))

    async def _call_with_failover(
        self,
        client: Transport,
        call: EncoderCall,
        body: bytes,
        headers: Mapping[str, str],
        storage: str | None,
    ) -> dict[ItemKey, Handle]:
        tried: list[str] = []
        encoder: str | None = call.encoder
        last: EncoderError | None = None
        while encoder is not None and len(tried) < self.config.max_attempts:
            tried.append(encoder)
            started = time.perf_counter()
            try:
                handles = await self._call_once(client, encoder, call, body, headers)
                if storage is not None:
                    _check_stored(encoder, handles, storage)
            except EncoderError as exc:
                self.stats.encoder_call(encoder, exc.outcome, time.perf_counter() - started)
                if not exc.retryable:
                    raise
                last = exc
                now = anyio.current_time()
                self.record_failure(encoder, now, exc.reason)
                failed, encoder = encoder, self.failover_target(tried, now)
                if encoder is not None:
                    self.stats.failover(failed)
                logger.warning(
                    "%s%s", exc.message, f"; retrying on {encoder}" if encoder else "; no encoder left to try"
                )
                continue
            self.stats.encoder_call(encoder, "ok", time.perf_counter() - started)
            self.record_success(encoder)
            return handles
        assert last is not None
        raise last

    async def _call_once(
        self,
        client: Transport,
        encoder: str,
        call: EncoderCall,
        body: bytes,
        headers: Mapping[str, str],
    ) -> dict[ItemKey, Handle]:
        health = self._health[encoder]
        timeout = self.config.encoder_timeout
        try:
            with anyio.fail_after(timeout):
                async with self._limiter(encoder):
                    health.in_flight += 1
                    self.stats.in_flight(encoder, 1)
                    try:
                        status, content = await client.request(
                            "POST",
                            f"{encoder}/v1/chat/completions",
                            body,
                            {"content-type": _JSON, **headers},
                        )
                    finally:
                        health.in_flight -= 1
                        self.stats.in_flight(encoder, -1)
        except TimeoutError:
            raise EncoderTimeout(encoder, f"no answer within {timeout:g} s") from None
        except HTTPError as exc:
            raise EncoderUnavailable(encoder, exc.reason) from None
        except Exception as exc:
            # A bug in a custom transport must cost this call, not the server: the client gets a clear
            # error (or a failover), the log gets the traceback.
            logger.exception("unexpected error calling encoder %s", encoder)
            raise EncoderUnavailable(encoder, f"unexpected {type(exc).__name__}") from None
        if status != 200:
            detail = _error_detail(content)
            if status >= 500 or status in RETRYABLE_STATUSES:
                if status >= 500 and detail:
                    # Server errors may carry internals: the log gets them, the client does not.
                    logger.warning("encoder %s answered HTTP %d: %s", encoder, status, detail)
                raise EncoderStatusError(encoder, status, "" if status >= 500 else detail)
            if 400 <= status < 500:
                raise EncoderRejected(encoder, status, detail)
            raise EncoderStatusError(encoder, status)
        try:
            reply = _decode_reply(content)
        except msgspec.DecodeError:
            raise EncoderBadReply(encoder, "the answer is not JSON") from None
        if not isinstance(reply, dict):
            raise EncoderBadReply(encoder, "the answer is not a JSON object")
        return match_reply(encoder, call.items, reply.get(EC_TRANSFER_PARAMS))


def _check_stored(encoder: str, handles: Mapping[ItemKey, Handle], storage: str) -> None:
    """Every reported embedding must be where the local connector will look, or the engine would fail.

    A stat per handle on the connector's (local or shared) file system: microseconds, so it runs on the
    event loop rather than paying a thread hop.
    """
    for handle in handles.values():
        mm_hash = handle.mm_hash
        if not mm_hash or "/" in mm_hash or "\\" in mm_hash or mm_hash in (".", ".."):
            raise EncoderBadReply(encoder, f"reported hash {mm_hash!r} is not a valid file name")
        if not os.path.exists(os.path.join(storage, mm_hash, EXAMPLE_CONNECTOR_FILE)):
            raise EncoderBadReply(encoder, f"the embedding of {mm_hash!r} is not in the shared storage")


def _error_detail(content: bytes) -> str:
    """The encoder's own error message when it sent an OpenAI-style body, cut short."""
    try:
        reply: Any = _decode_reply(content)
        message = reply["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return ""
    return str(message)[:_MAX_DETAIL]
