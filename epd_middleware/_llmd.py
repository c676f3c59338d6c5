"""What the middleware knows of llm-d's wire protocol and labels, in one place (as :mod:`._protocol` is for
vLLM's).

Sources in llm-d/llm-d-router: ``pkg/common/routing/common.go`` (header names), ``pkg/epp/framework/
plugins/scheduling/profilehandler/disagg/disagg_profile_handler.go`` (``PreRequest``: the endpoint
picker writes every endpoint of the encode profile, joined by ",", and the first of the prefill
profile, each as ``net.JoinHostPort``: ``ip:port``, IPv6 as ``[addr]:port``), ``pkg/sidecar/proxy/``
(the routing sidecar reads one header line or several, splits a single line on ",", trims each entry,
takes the first prefill target, and deletes these headers before the model server sees the request).
The gateway does not remove them from a client's request (the endpoint picker only sets headers), so a
client can send them: every target must pass the allowlist (:mod:`._scheduler`).
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ENCODER_HOSTS_HEADER",
    "KV_CACHE_SOURCE_HEADER",
    "PREFILLER_HEADER",
    "SCHEDULER_HEADERS",
    "header_values",
]

ENCODER_HOSTS_HEADER: Final = b"x-encoder-hosts-ports"
PREFILLER_HEADER: Final = b"x-prefiller-host-port"
# Set for P2P prefix-cache pulls, which the encoder path does not wire; removed like the others.
KV_CACHE_SOURCE_HEADER: Final = b"x-kv-cache-source-host-port"
SCHEDULER_HEADERS: Final = frozenset({ENCODER_HOSTS_HEADER, PREFILLER_HEADER, KV_CACHE_SOURCE_HEADER})


def header_values(headers: list[tuple[bytes, bytes]], name: bytes) -> list[str]:
    """Every comma-separated entry of every ``name`` header line, trimmed, empty ones left out."""
    entries: list[str] = []
    for key, value in headers:
        if key == name:
            entries.extend(
                entry for entry in (item.strip() for item in value.decode("latin-1").split(",")) if entry
            )
    return entries
