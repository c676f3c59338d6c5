"""The prefill stage of remote P/D: the request, with its encoder handles, is prefilled on a prefill
server (a vLLM ``kv_producer``); what P answers in ``kv_transfer_params`` tells the local engine (the
decoder, ``kv_consumer``) where to take the KV cache from.

The prefill request is the engine's request with vLLM's P/D overrides: P keeps the KV cache for a remote
decoder, answers at once (no stream) and stops after one token (each surface names its own token
limits). Calls spread over the prefill pool and
fail over like encoder calls (:mod:`epd_middleware._pool`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import anyio

from . import _failover as failover
from ._blame import Ledger
from ._context import RequestContext
from ._logs import logger
from ._metrics import Stats
from ._pool import ServerPool, no_server_left
from ._protocol import KV_TRANSFER_PARAMS, MIN_TOKENS, MODEL, PREFILL_KV_TRANSFER_PARAMS, STREAM_OPTIONS
from ._rawjson import text_of
from ._surfaces import ParsedRequest, Surface, outgoing_body
from ._upstream import Attempt
from .config import EPDConfig
from .errors import NoHealthyUpstream, UpstreamBadReply, UpstreamError
from .transport import Transport

__all__ = ["PrefillStage", "Prefilled", "decode_fields", "prefill", "prefill_fields"]


class Prefilled(NamedTuple):
    """The decode request for the local engine, and what to say of it in the request's log line."""

    fields: dict[str, Any]
    note: str | None = None


@dataclass
class PrefillStage:
    """Prefills a request on the prefill pool (a scheduler's choice first), under the fallback policy."""

    config: EPDConfig
    pool: ServerPool
    stats: Stats

    async def run(
        self, surface: Surface, request: ParsedRequest, fields: dict[str, Any], context: RequestContext
    ) -> Prefilled:
        """The decode request for the engine request ``fields`` (with its handles)."""
        blocker = surface.prefill_blocker(fields)
        if blocker is not None:
            self.stats.request("prefill_skipped")
            return Prefilled(decode_fields(fields, None), f"prefilled here: {blocker}")
        config, route = self.config, context.route
        started = time.perf_counter()
        try:
            kv_params = await prefill(
                self.pool,
                context.transport,
                surface,
                fields,
                context.call_headers("prefill"),
                retry_after=config.retry_after,
                preferred=(route.prefill,) if route.prefill else (),
                compat=request.compat,
                ledger=context.ledger,
                traced=context.host.traces,
            )
        except (UpstreamError, NoHealthyUpstream) as exc:
            rejected = isinstance(exc, UpstreamError) and not exc.retryable  # the request itself is bad
            if config.on_prefill_failure != "local" or rejected:
                raise
            self.stats.request("prefill_fallback")
            logger.warning("prefilled by the local engine: %s", exc.logged)
            return Prefilled(decode_fields(fields, None))
        elapsed = time.perf_counter() - started
        self.stats.stage("prefill", elapsed)
        if not request.media:
            self.stats.request("prefilled")
        note = f"prefill {elapsed * 1000:.1f} ms" if context.logged else None
        return Prefilled(decode_fields(fields, kv_params), note)


def prefill_fields(fields: Mapping[str, Any], surface: Surface) -> dict[str, Any]:
    """The prefill request for an engine request: a new dict, ``fields`` untouched."""
    out = dict(fields)
    out[KV_TRANSFER_PARAMS] = dict(PREFILL_KV_TRANSFER_PARAMS)
    out.update(surface.prefill_limits(fields))
    out.pop(STREAM_OPTIONS, None)  # vLLM rejects stream_options without stream
    out.pop(MIN_TOKENS, None)  # and min_tokens above max_tokens
    return out


def decode_fields(fields: Mapping[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The local (decode) request: the engine request with P's ``kv_transfer_params``, or without any
    when P gave none (a connector such as vLLM's ExampleConnector finds the KV cache by the prompt)."""
    out = dict(fields)
    if kv_transfer_params is None:
        out.pop(KV_TRANSFER_PARAMS, None)
    else:
        out[KV_TRANSFER_PARAMS] = kv_transfer_params
    return out


async def prefill(
    pool: ServerPool,
    transport: Transport,
    surface: Surface,
    fields: Mapping[str, Any],
    headers: Mapping[str, str],
    *,
    retry_after: int,
    preferred: Sequence[str] = (),
    compat: bool = False,
    ledger: Ledger | None = None,
    traced: bool = False,
) -> dict[str, Any] | None:
    """Prefill ``fields`` on the first usable ``preferred`` server (a scheduler's choice), else the
    next of the pool (failing over); P's ``kv_transfer_params``. ``compat``: the body is written as
    Python's json writes it (:attr:`~epd_middleware._surfaces.ParsedRequest.compat`)."""
    server = pool.pick(anyio.current_time(), preferred)
    if server is None:
        raise no_server_left(pool, "prefill server", retry_after)
    # Messages and Responses requests still hold their media (never rewritten): sent, not copied.
    body = outgoing_body(prefill_fields(fields, surface), compat=compat)
    model = text_of(fields.get(MODEL))

    def attempt(server: str) -> Attempt[dict[str, Any] | None]:
        # Under a name the server serves, where it lacks the request's alias of this server's.
        name = pool.models.name_for(server, model)
        sent = (
            body
            if name is None
            else outgoing_body({**prefill_fields(fields, surface), MODEL: name}, compat=compat)
        )
        return Attempt(sent, _kv_transfer_params)

    return await failover.call(
        pool,
        transport,
        server,
        surface.path,
        attempt,
        headers,
        preferred,
        ledger=ledger,
        traced=traced,
    )


def _kv_transfer_params(server: str, reply: dict[str, Any]) -> dict[str, Any] | None:
    params = reply.get(KV_TRANSFER_PARAMS)
    if params is not None and not isinstance(params, dict):
        raise UpstreamBadReply(server, "kv_transfer_params is not an object", role="prefill")
    return params
