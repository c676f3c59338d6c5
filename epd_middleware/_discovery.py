"""Who may be called: a pool's members are its static URLs plus every address its ``dns+http://NAME:PORT``
names resolve to (A and AAAA; a Kubernetes headless Service has one record per ready pod).

Where a lifespan runs, names are looked up again every ``dns_refresh_interval`` seconds in the
background; where none does, the first request awaits the first lookup (bounded by ``dns_timeout``) and
later lookups run beside the requests that notice the answer is old, never in their way. A failed lookup
keeps the last good answer; an empty one (no records, or no such name) means no members from that name,
and the snapshot says which of the two it was: they call for different fixes.

A name the hosts file (/etc/hosts) holds is answered from it, as the system resolver answers it (glibc's
and musl's "files" before "dns"): dnspython reads only resolv.conf, so ``dns+http://localhost:8001`` or a
name from a pod's hostAliases would otherwise never resolve. Every other name is asked of DNS with
dnspython, given the running anyio backend explicitly (its default backend is chosen once per process).
"""

from __future__ import annotations

import ipaddress
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
import dns.asyncbackend
import dns.asyncresolver
import dns.exception
import dns.nameserver
import dns.resolver

from ._addresses import parse_nameserver
from ._logs import logger
from ._metrics import Stats
from ._pool import ServerPool

__all__ = ["HOSTS_FILE", "Discovery", "DnsName", "hosts_entries"]

# Read again on every refresh: a container's hosts file is written when it starts, a host's may change.
HOSTS_FILE = "/etc/hosts"
# Why an answer holds no address (the snapshot's "empty_answer"): the name does not exist (NXDOMAIN: a
# mistyped name, or, as Kubernetes' DNS specification has it, a headless Service without ready pods), or
# it exists with no A or AAAA record (NOERROR without an answer: not a Service's name).
NXDOMAIN, NODATA = "nxdomain", "nodata"


@dataclass(frozen=True, slots=True)
class DnsName:
    """One ``dns+http(s)://NAME:PORT`` entry of a pool."""

    url: str
    scheme: str
    name: str
    port: int

    @classmethod
    def parse(cls, url: str) -> DnsName:
        parts = urlsplit(url)
        assert parts.scheme.startswith("dns+")
        assert parts.port is not None
        return cls(url, parts.scheme.removeprefix("dns+"), parts.hostname or "", parts.port)

    def member(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address
        return f"{self.scheme}://{host}:{self.port}"


@dataclass
class _NameState:
    addresses: tuple[str, ...] = ()
    resolved_at: float | None = None  # monotonic time of the last good answer
    last_error: str | None = None
    failures: int = 0
    empty: str | None = None  # NXDOMAIN or NODATA where the last good answer held no address


@dataclass
class Discovery:
    """Keeps one pool's members equal to its static URLs plus what its DNS names resolve to."""

    pool: ServerPool
    urls: tuple[str, ...]
    refresh_interval: float
    timeout: float
    nameservers: tuple[str, ...] = ()
    stats: Stats = field(default_factory=Stats)
    static: tuple[str, ...] = field(init=False)
    names: tuple[DnsName, ...] = field(init=False)
    _states: dict[str, _NameState] = field(init=False, default_factory=dict)
    _first: anyio.Event | None = field(init=False, default=None)
    _refreshing: bool = field(init=False, default=False)
    _in_background: bool = field(init=False, default=False)
    _last_refresh: float = field(init=False, default=float("-inf"))

    def __post_init__(self) -> None:
        self.static = tuple(url for url in self.urls if not url.startswith("dns+"))
        self.names = tuple(DnsName.parse(url) for url in self.urls if url.startswith("dns+"))
        self._states = {name.url: _NameState() for name in self.names}
        self.pool.set_members(self.static)

    @property
    def dynamic(self) -> bool:
        return bool(self.names)

    # --- when to look up -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Look the names up now and then every ``refresh_interval`` seconds, until cancelled (the
        lifespan's task)."""
        if not self.names:
            return
        self._in_background = True
        try:
            while True:
                await self.refresh()
                await anyio.sleep(self.refresh_interval)
        finally:
            self._in_background = False

    async def ready(self) -> None:
        """Wait (at most ``timeout`` seconds) for the first answer, where no lookup finished yet: until
        then the pool has no members from DNS, and nothing to serve with."""
        if not self.names or self._last_refresh > float("-inf"):
            return
        if self._first is None:
            self._first = anyio.Event()
        with anyio.move_on_after(self.timeout):
            if self._refreshing:
                await self._first.wait()
            else:
                await self.refresh()

    def refresh_soon(self, group: anyio.abc.TaskGroup) -> None:
        """Where no lifespan looks names up, start a lookup in ``group`` when the answer is older than
        ``refresh_interval``: the request that noticed goes on with the answer it has."""
        if (
            self.names
            and not self._in_background
            and not self._refreshing
            and time.monotonic() - self._last_refresh >= self.refresh_interval
        ):
            group.start_soon(self._refresh_beside)

    async def _refresh_beside(self) -> None:
        # Shielded: the request's own scope is cancelled when it ends or its client leaves, and a lookup
        # cut short every time would never finish. Bounded by the lookups' own timeouts (A, then AAAA).
        with anyio.CancelScope(shield=True), anyio.move_on_after(2 * self.timeout + 1):
            await self.refresh()

    # --- looking up ----------------------------------------------------------------------------------

    async def refresh(self) -> None:
        """Look every name up once (concurrently) and make the pool's members match."""
        if self._refreshing:
            return
        self._refreshing = True
        try:
            resolver = self._resolver()
            # The running library's name as anyio itself learns it: sniffio where installed (trio always
            # brings it), asyncio otherwise. dnspython's sniff() asks the same way, uncached, unlike its
            # default backend, which is chosen once per process.
            backend = dns.asyncbackend.get_backend(dns.asyncbackend.sniff())
            hosts = await hosts_entries()
            async with anyio.create_task_group() as group:
                for name in self.names:
                    group.start_soon(self._look_up, resolver, backend, name, hosts.get(name.name.rstrip(".")))
            members = list(self.static)
            for name in self.names:
                members.extend(name.member(address) for address in self._states[name.url].addresses)
            self.pool.set_members(tuple(dict.fromkeys(members)))
        finally:
            self._refreshing = False
            self._last_refresh = time.monotonic()
            if self._first is not None:
                self._first.set()

    def _resolver(self) -> dns.asyncresolver.Resolver:
        resolver = dns.asyncresolver.Resolver(configure=not self.nameservers)
        if self.nameservers:
            resolver.nameservers = [
                dns.nameserver.Do53Nameserver(host, port)
                for host, port in (parse_nameserver(entry) for entry in self.nameservers)
            ]
        resolver.lifetime = self.timeout
        return resolver

    async def _look_up(
        self,
        resolver: dns.asyncresolver.Resolver,
        backend: Any,
        name: DnsName,
        in_hosts: tuple[str, ...] | None,
    ) -> None:
        state = self._states[name.url]
        role = self.pool.role
        addresses: list[str] = list(in_hosts or ())
        empty: str | None = None
        try:
            for rdtype in ("A", "AAAA") if in_hosts is None else ():
                answer = await resolver.resolve(
                    name.name, rdtype, search=True, raise_on_no_answer=False, backend=backend
                )
                addresses.extend(sorted(str(record) for record in answer))
            empty = None if addresses else NODATA
        except dns.resolver.NXDOMAIN:
            addresses, empty = [], NXDOMAIN  # the name has no records at all: no members from it
        except (dns.exception.DNSException, OSError) as exc:
            state.failures += 1
            state.last_error = f"{type(exc).__name__}: {str(exc)[:200]}"
            self.stats.dns_lookup(role, "failed")
            logger.warning(
                "%s DNS name %s: lookup failed (%s); keeping its last answer %s",
                role,
                name.name,
                state.last_error,
                list(state.addresses),
            )
            return
        self.stats.dns_lookup(role, "ok")
        found = tuple(dict.fromkeys(addresses))
        if found != state.addresses or state.resolved_at is None:
            logger.info("%s DNS name %s: %s", role, name.name, list(found) or "no addresses")
        state.addresses = found
        state.resolved_at = time.monotonic()
        state.last_error = None
        state.empty = empty

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Per DNS name: the addresses in use, the age of that answer, why it is empty (``nxdomain``,
        ``nodata``, or None), the last failure."""
        now = time.monotonic()
        return {
            name.url: {
                "addresses": list(state.addresses),
                "answer_age_s": None if state.resolved_at is None else round(now - state.resolved_at, 3),
                "empty_answer": state.empty,
                "failed_lookups": state.failures,
                "last_error": state.last_error,
            }
            for name, state in ((name, self._states[name.url]) for name in self.names)
        }


async def hosts_entries(path: str | None = None) -> dict[str, tuple[str, ...]]:
    """The hosts file's addresses by name (lower case): IPv4 before IPv6, each sorted, every line that
    names it (as glibc returns them all). An unreadable file holds nothing: DNS answers every name."""
    try:
        text = await anyio.Path(HOSTS_FILE if path is None else path).read_text(errors="replace")
    except OSError:
        return {}
    found: dict[str, set[ipaddress.IPv4Address | ipaddress.IPv6Address]] = {}
    for line in text.splitlines():
        fields = line.partition("#")[0].split()
        if len(fields) < 2:
            continue
        if "%" in fields[0]:
            continue  # a scoped IPv6 address (fe80::1%eth0) is no member URL's host
        try:
            address = ipaddress.ip_address(fields[0])
        except ValueError:
            continue
        for alias in fields[1:]:
            found.setdefault(alias.lower().rstrip("."), set()).add(address)
    return {
        alias: tuple(str(a) for a in sorted(addresses, key=lambda a: (a.version, a)))
        for alias, addresses in found.items()
    }
