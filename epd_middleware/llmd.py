"""What the middleware knows of llm-d's wire protocol and labels, in one place (as :mod:`.protocol` is for
vLLM's).

Sources in llm-d/llm-d-router: ``pkg/common/routing/common.go`` (header names), ``pkg/epp/framework/
plugins/scheduling/profilehandler/disagg/disagg_profile_handler.go`` (``PreRequest``: the endpoint
picker writes every endpoint of the encode profile, joined by ",", and the first of the prefill
profile, each as ``net.JoinHostPort``: ``ip:port``, IPv6 as ``[addr]:port``), ``pkg/sidecar/proxy/``
(the routing sidecar reads one header line or several, splits a single line on ",", trims each entry,
takes the first prefill target, and deletes these headers before the model server sees the request).
The gateway does not remove them from a client's request (the endpoint picker only sets headers), so a
client can send them: every target must pass the allowlist (:mod:`.scheduler`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
from typing import Final
from urllib.parse import urlsplit

__all__ = [
    "ENCODER_HOSTS_HEADER",
    "EPP_PLUGIN_TYPES",
    "KV_CACHE_SOURCE_HEADER",
    "PREFILLER_HEADER",
    "ROLES",
    "ROLE_LABEL",
    "SCHEDULER_HEADERS",
    "header_values",
    "port_number",
    "split_host_port",
    "url_host_port",
]

ENCODER_HOSTS_HEADER: Final = b"x-encoder-hosts-ports"
PREFILLER_HEADER: Final = b"x-prefiller-host-port"
# Set for P2P prefix-cache pulls, which the encoder path does not wire; removed like the others.
KV_CACHE_SOURCE_HEADER: Final = b"x-kv-cache-source-host-port"
SCHEDULER_HEADERS: Final = frozenset({ENCODER_HOSTS_HEADER, PREFILLER_HEADER, KV_CACHE_SOURCE_HEADER})

# Pod label that tells the endpoint picker's filters (encode-filter, prefill-filter, decode-filter)
# which role a pod of the InferencePool plays (``pkg/epp/framework/plugins/scheduling/filter/bylabel/
# roles.go``: encode-filter takes encode; prefill-filter prefill and prefill-decode; decode-filter decode
# and prefill-decode).
ROLE_LABEL: Final = "llm-d.ai/role"
ROLES: Final = ("encode", "prefill", "decode", "prefill-decode")

# Endpoint-picker plugin types llm-d registers (``cmd/epp/runner/runner.go`` and the plugins' READMEs)
# that an E/PD or E/P/D configuration uses: the manifests in deploy/kubernetes name no others.
EPP_PLUGIN_TYPES: Final = frozenset(
    {
        "encode-filter",
        "prefill-filter",
        "decode-filter",
        "always-disagg-multimodal-decider",
        "always-disagg-pd-decider",
        "prefix-based-pd-decider",
        "disagg-profile-handler",
        "single-profile-handler",
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "prefix-cache-scorer",
        "approx-prefix-cache-producer",
        "mm-embeddings-cache-producer",
        "mm-embeddings-cache-scorer",
        "max-score-picker",
        "random-picker",
        "weighted-random-picker",
    }
)


def header_values(headers: list[tuple[bytes, bytes]], name: bytes) -> list[str]:
    """Every comma-separated entry of every ``name`` header line, trimmed, empty ones left out."""
    entries: list[str] = []
    for key, value in headers:
        if key == name:
            entries.extend(
                entry for entry in (item.strip() for item in value.decode("latin-1").split(",")) if entry
            )
    return entries


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
