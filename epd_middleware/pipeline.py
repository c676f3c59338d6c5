"""One request's path, top to bottom: body -> media parts -> plan -> encoder calls -> handles -> new body."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import anyio

from .config import EPDConfig
from .encoders import EncoderPool
from .errors import NoHealthyEncoder, Overloaded, TooManyMediaItems
from .handles import part_metadata, transfer_params
from .logs import logger
from .metrics import Stats
from .plan import media_items, plan_calls
from .protocol import REQUEST_ID_HEADER
from .surfaces import openai_chat as chat
from .transport import Transport

__all__ = ["Pipeline"]


_REQUEST_ID = REQUEST_ID_HEADER.decode()


@dataclass
class Pipeline:
    """Everything a request needs that outlives it: configuration, the encoder pool, statistics."""

    config: EPDConfig
    stats: Stats = field(default_factory=Stats)
    pool: EncoderPool = field(init=False)

    def __post_init__(self) -> None:
        self.pool = EncoderPool(self.config, self.stats)

    @property
    def counters(self) -> Counter[str]:
        return self.stats.counters

    def parse(self, body: bytes) -> chat.ChatRequest | None:
        """The request's media parts, or None when the body passes to the engine unchanged.

        Cheap for bodies without media: a byte scan, no JSON parse.
        """
        if not chat.may_hold_media(body):
            return None
        started = time.perf_counter()
        request = chat.parse(body)
        if request is None or not request.media:
            return None
        self.stats.stage("parse", time.perf_counter() - started)
        return request

    async def prepare(
        self,
        request: chat.ChatRequest,
        client: Transport,
        request_id: str,
        *,
        storage: str | None = None,
        authorization: str | None = None,
    ) -> bytes | None:
        """The body the local engine should see, with the handles of the encoded media; None when the
        original body should go to the engine unchanged after all (it cannot be serialised again).

        Raises an :class:`~epd_middleware.errors.EPDError` when the request must be answered with an
        error instead (limits, overload, encoders failing under the 'error' policy).
        """
        config, pool = self.config, self.pool
        if len(request.media) > config.max_media_items:
            raise TooManyMediaItems(len(request.media), config.max_media_items)
        if pool.pending >= config.max_pending_requests:
            raise Overloaded(
                f"{pool.pending} requests are already waiting for encoders; retry later", config.retry_after
            )
        pool.pending += 1
        try:
            return await self._encode_and_rewrite(request, client, request_id, storage, authorization)
        except chat.Unusable:
            self.stats.request("passed_through")
            return None
        finally:
            pool.pending -= 1

    async def _encode_and_rewrite(
        self,
        request: chat.ChatRequest,
        client: Transport,
        request_id: str,
        storage: str | None,
        authorization: str | None,
    ) -> bytes:
        config, pool = self.config, self.pool
        items, uuids = media_items(
            request.media,
            trust_client_uuid=config.trust_client_uuid,
            salt=request.cache_salt,
            encoder_part=chat.encoder_part,
        )
        local = config.on_encoder_failure == "local"
        encoders = pool.available(anyio.current_time())
        if not encoders and not local:
            raise NoHealthyEncoder("every encoder is failing its calls; retry later", config.retry_after)
        calls = (
            plan_calls(items, encoders, pool.reserve(len(items), len(encoders)), config.max_batch_size)
            if encoders
            else ()
        )

        auth = authorization if config.forward_authorization else None
        if auth is None:
            auth = config.encoder_authorization
        headers = []
        for index in range(len(calls)):
            call_headers = {_REQUEST_ID: f"{request_id}-enc{index}"}
            if auth is not None:
                call_headers["authorization"] = auth
            headers.append(call_headers)

        started = time.perf_counter()
        outcome = await pool.encode(
            client,
            calls,
            [chat.encoder_body(request, [item.part for item in call.items]) for call in calls],
            headers,
            storage=storage,
            stop_at_first_failure=not local,
        )
        encoded = time.perf_counter()
        self.stats.stage("encode", encoded - started)
        fallen = 0
        if outcome.failed or not calls:
            # Only under the 'local' policy: those items go to the engine as the media the client sent.
            fallen = sum(len(call.items) for call, _ in outcome.failed) if calls else len(items)
            reason = outcome.failed[0][1].message if outcome.failed else "no encoder is available"
            self.stats.fallback(fallen)
            logger.warning(
                "request %s: %d media item(s) left to the local engine: %s", request_id, fallen, reason
            )

        keys = [(part.modality, uuid) for part, uuid in zip(request.media, uuids, strict=True)]
        metadata = part_metadata(
            keys, outcome.handles, rewrite=config.rewrite, keep_raw=request.referenced_modalities
        )
        body = chat.rewritten_body(request, uuids, metadata, transfer_params(outcome.handles))
        rewritten = time.perf_counter()
        self.stats.stage("rewrite", rewritten - encoded)
        if not fallen:
            self.stats.encoded(len(items), len(calls))
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                "request %s: %d media item(s), %d encoder call(s) to %s; encode %.1f ms, rewrite %.2f ms%s",
                request_id,
                len(items),
                len(calls),
                ", ".join(sorted({call.encoder for call in calls})) or "none",
                (encoded - started) * 1000,
                (rewritten - encoded) * 1000,
                f"; {fallen} left to the local engine" if fallen else "",
            )
        return body
