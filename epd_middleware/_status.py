"""The status page (``GET /epd/status``, behind the API keys): this process's view of its encoders and
prefill servers, DNS names, counters, and what it does or refuses because of the server it runs in."""

from __future__ import annotations

import os
from typing import Any

import anyio

from ._compat import Expectation
from ._equivalence import Equivalence
from ._pipeline import Pipeline
from .config import EPDConfig
from .host import Host

__all__ = ["status_page"]


def status_page(pipeline: Pipeline, host: Host, equivalence: Equivalence | None = None) -> dict[str, Any]:
    now = anyio.current_time()
    return {
        # Every API-server process has its own middleware state (--api-server-count).
        "pid": os.getpid(),
        "encoders": pipeline.encoders.snapshot(now),
        "prefill": pipeline.prefill.snapshot(now),
        "dns": {
            discovery.pool.role: discovery.snapshot()
            for discovery in pipeline.discoveries
            if discovery.dynamic
        },
        "pending_requests": pipeline.pending,
        "counters": dict(pipeline.counters),
        "embedding_storage_checked": host.storage,
        "client_references": _reference_status(host),
        "media_policy": _media_policy_status(host),
        "unguarded_routes": list(host.unguarded_routes),
        # What this server serves, as its encoders must serve it (`check --pd` reads it).
        "model": _model(pipeline.expectation or host.expectation),
        "model_runner": host.model_runner,
        "known_problems": host.known_problems,
        "handle_reuse": pipeline.reuse_status(host),
        "placement": pipeline.placement.status(host),
        # Whether E + PD answers what PD alone would, per encoder (_equivalence.py).
        "equivalence": equivalence.status(host) if equivalence is not None else None,
        # Whether media uuids are keyed by the fleet's secret (shared by every PD given it) or by this
        # process's own key (no encoded media shared with other processes).
        "uuid_key": "configured" if pipeline.uuid_key.shared else "this process's own",
        "config": pipeline.config.model_dump(mode="json", exclude=_SECRETS),
    }


def _model(expectation: Expectation | None) -> dict[str, Any] | None:
    if expectation is None:
        return None
    return {"names": sorted(expectation.names), "root": expectation.root}


# The options that hold keys (hidden from repr too): never on the page.
_SECRETS = {name for name, field in EPDConfig.model_fields.items() if not field.repr}


def _reference_status(host: Host) -> dict[str, Any]:
    """Whether metadata-only parts a client writes itself are checked (and how far), or refused."""
    storage, rule = host.storage, host.identifiers
    if storage is None:
        return {
            "checked": False,
            "why_not": "no embedding storage to look in (only ECExampleConnector with check_embeddings): "
            "every such part is refused with 400",
        }
    return {
        "checked": True,
        "storage": storage,
        "with_options": rule.derives_options,
        "why_not_with_options": None
        if rule.derives_options
        else rule.unknown_because
        or "outside vLLM the model path is not known: such parts with per-request options are refused",
    }


def _media_policy_status(host: Host) -> dict[str, Any] | None:
    policy = host.media_policy
    if policy is None:
        return None
    return {
        "allowed_media_domains": list(policy.allowed_domains) or None,
        "local_files": policy.local_root is not None,
        # vLLM 0.33's VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES, kept across encoder calls (null: none).
        "decode_budget_bytes": host.media_decode_budget,
    }
