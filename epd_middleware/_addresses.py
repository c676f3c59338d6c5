"""Addresses as operators and schedulers write them: ``host:port`` entries, server URLs, DNS servers, and
the scheduler allowlist's networks. Pure parsing, no I/O; the configuration checks its values with these
functions, and the pool, discovery and the scheduler read them the same way.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = [
    "Allowlist",
    "masked",
    "parse_allowlist",
    "parse_nameserver",
    "port_number",
    "split_host_port",
    "url_host_port",
]


def masked(text: str) -> str:
    """``text`` as a message or a log line may show it: a URL's userinfo (``user:password@``: everything
    from after the first ``://`` to the last ``@``, or from the start without a scheme) becomes ``...``.
    It reads no URL syntax, so it masks in text that is no URL at all (a space, no host, no scheme, a
    password holding '/', '?' or '#'), which is where a message names one."""
    at = text.rfind("@")
    if at < 0:
        return text
    scheme_end = text.find("://")
    start = scheme_end + 3 if 0 <= scheme_end < at else 0
    return f"{text[:start]}...{text[at:]}"


def split_host_port(entry: str) -> tuple[str, int] | None:
    """``ip:port``, ``[v6]:port`` or ``host:port`` -> (host, port); None when it is none of them."""
    if entry.startswith("["):
        host, bracket, rest = entry[1:].partition("]")
        if not bracket or not rest.startswith(":"):
            return None
        port_text = rest[1:]
    else:
        host, colon, port_text = entry.rpartition(":")
        if not colon or ":" in host:
            return None
    port = port_number(port_text)
    if port is None:
        return None
    host = host.lower()
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.fullmatch(host):
            return None
    else:
        if entry.startswith("[") != (address.version == 6):
            return None  # IPv6 only in brackets, IPv4 never
        host = str(address)  # one spelling per address
    return host, port


def port_number(text: str) -> int | None:
    """A TCP port written in ASCII digits (1-65535), else None. ``str.isdigit`` alone is not enough: it
    is true of superscripts and other scripts' digits (``"80\u00b2"``), which ``int`` refuses or reads."""
    if not (text.isascii() and text.isdigit()) or len(text) > 5:
        return None
    port = int(text)
    return port if 0 < port < 65536 else None


_HOSTNAME = re.compile(
    r"(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*\.?"
)


def url_host_port(url: str) -> tuple[str, int]:
    """(host, port) of a server URL, spelled as :func:`split_host_port` spells a header entry."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = (parts.hostname or "").lower()
    with contextlib.suppress(ValueError):
        host = str(ipaddress.ip_address(host))
    return host, port


def parse_nameserver(entry: str) -> tuple[str, int]:
    """``host:port`` / ``[v6]:port`` of a DNS server (an IP address); ValueError otherwise."""
    parsed = split_host_port(entry.strip())
    if parsed is None:
        raise ValueError(f"DNS server {masked(entry)!r} is not ip:port or [v6]:port")
    try:
        ipaddress.ip_address(parsed[0])
    except ValueError:
        raise ValueError(f"DNS server {masked(entry)!r} must be an IP address") from None
    return parsed


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Allowlist:
    """Networks (any port, or one port) and exact (host, port) entries."""

    networks: tuple[tuple[Network, int | None], ...] = ()
    exact: frozenset[tuple[str, int]] = frozenset()

    def admits(self, host: str, port: int) -> bool:
        if (host, port) in self.exact:
            return True
        if not self.networks:
            return False
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False  # a network admits addresses, never names
        return any(address in network and allowed in (None, port) for network, allowed in self.networks)


def parse_allowlist(entries: Sequence[str]) -> Allowlist:
    """``10.0.0.0/8``, ``10.0.0.0/8:8001``, ``[fd00::/8]:8001``, ``fd00::/8``, ``10.1.2.3:8001``,
    ``[fd00::1]:8001``, ``enc-0.pool:8001``. ValueError names an entry that is none of these."""
    networks: list[tuple[Network, int | None]] = []
    exact: set[tuple[str, int]] = set()
    for entry in (item.strip() for item in entries):
        if "/" in entry:
            text, port = entry, None
            if entry.startswith("[") and "]:" in entry:
                text, _, port_text = entry[1:].partition("]:")
                port = _port(port_text, entry)
            elif entry.count(":") == 1:  # IPv4 network with a port; an IPv6 one has several colons
                text, _, port_text = entry.partition(":")
                port = _port(port_text, entry)
            try:
                networks.append((ipaddress.ip_network(text, strict=False), port))
            except ValueError:
                raise ValueError(f"scheduler_allow entry {masked(entry)!r} is not a network") from None
            continue
        target = split_host_port(entry)
        if target is None:
            raise ValueError(
                f"scheduler_allow entry {masked(entry)!r} is neither a network (10.0.0.0/8, 10.0.0.0/8:8001) "
                "nor ip:port / [v6]:port / host:port"
            )
        exact.add(target)
    return Allowlist(tuple(networks), frozenset(exact))


def _port(text: str, entry: str) -> int:
    port = port_number(text)
    if port is None:
        raise ValueError(f"scheduler_allow entry {masked(entry)!r} has no valid port")
    return port
