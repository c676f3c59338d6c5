"""The scheduler protocol: which encoders and prefill server llm-d's endpoint picker chose for a request,
and whether the middleware may call them.

A target named by a header is used only if it is a member of the encoder (or prefill) pool, exact host
and port, or the allowlist (``scheduler_allow``) admits it. The check runs before any connection is
opened. A forged encoder entry is dropped (the request is served as if it were absent); a forged
prefill target is refused with 403, since the request said where its KV cache must come from.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._addresses import parse_allowlist, split_host_port
from ._llmd import ENCODER_HOSTS_HEADER, PREFILLER_HEADER, header_values
from ._logs import logger
from ._metrics import Stats
from .errors import ForbiddenTarget

__all__ = ["NO_ROUTE", "Route", "Scheduler"]


@dataclass(frozen=True, slots=True)
class Route:
    """Where one request's work goes, when a scheduler said: encoders in its order (empty: the pool
    decides), and the prefill server (None: the pool decides, if there is one)."""

    encoders: tuple[str, ...] = ()
    prefill: str | None = None


NO_ROUTE = Route()


class Scheduler:
    """Reads llm-d's headers into a :class:`Route`, keeping what the allowlist and the pools admit."""

    def __init__(
        self,
        allow: Sequence[str],
        scheme: str,
        encoder_members: Callable[[], frozenset[tuple[str, int]]],
        prefill_members: Callable[[], frozenset[tuple[str, int]]],
        stats: Stats,
        max_encoders: int,
    ) -> None:
        self._allow = parse_allowlist(allow)
        self._scheme = scheme
        self._encoder_members = encoder_members
        self._prefill_members = prefill_members
        self._stats = stats
        self._max_encoders = max_encoders
        self._warned_at = float("-inf")
        self._unwarned = 0

    def route(self, headers: list[tuple[bytes, bytes]]) -> Route:
        """The request's route; :class:`ForbiddenTarget` for a prefill target nobody allowed."""
        prefill: str | None = None
        named = header_values(headers, PREFILLER_HEADER)
        if named:
            target = self._target(named[0], self._prefill_members)
            if target is None:
                self._stats.forged_target("prefill")
                self._warn("refused a request whose prefill target %r is not allowed", named[0])
                raise ForbiddenTarget(
                    f"prefill target {named[0][:100]!r} is not a prefill server this server may call",
                    param=PREFILLER_HEADER.decode(),
                )
            prefill = target
        # A request cannot use more encoders than it may have media items: entries past that many
        # distinct ones are not even parsed, so a header naming thousands costs no more than that.
        encoders: dict[str, None] = {}
        seen: set[str] = set()
        for entry in header_values(headers, ENCODER_HOSTS_HEADER):
            if entry in seen:
                continue
            if len(seen) == self._max_encoders:
                self._stats.counters["scheduler_entries_ignored"] += 1
                break
            seen.add(entry)
            target = self._target(entry, self._encoder_members)
            if target is None:
                self._stats.forged_target("encoder")
                self._warn("dropped encoder %r named by the scheduler header: not allowed", entry)
            else:
                encoders[target] = None
        if prefill is None and not encoders:
            return NO_ROUTE
        return Route(tuple(encoders), prefill)

    def _warn(self, message: str, entry: str) -> None:
        """One WARNING a second at most: forged headers are a client's to send as fast as it likes, and
        the counters (epd_scheduler_forged_targets_total) have every one."""
        now = time.monotonic()
        if now - self._warned_at < 1.0:
            self._unwarned += 1
            return
        suffix = f" ({self._unwarned} more since the last such line)" if self._unwarned else ""
        logger.warning(message + "%s", entry[:100], suffix)
        self._warned_at, self._unwarned = now, 0

    def _target(self, entry: str, members: Callable[[], frozenset[tuple[str, int]]]) -> str | None:
        parsed = split_host_port(entry)
        if parsed is None:
            return None
        host, port = parsed
        if parsed not in members() and not self._allow.admits(host, port):
            return None
        return f"{self._scheme}://[{host}]:{port}" if ":" in host else f"{self._scheme}://{host}:{port}"
