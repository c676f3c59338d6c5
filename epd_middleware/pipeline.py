"""One request's path, top to bottom: body -> media parts -> plan -> encoder calls -> handles -> new body."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from .config import EPDConfig
from .encoders import EncoderPool, call_encoders
from .handles import part_metadata, transfer_params
from .plan import media_items, plan_calls
from .protocol import REQUEST_ID_HEADER
from .surfaces import openai_chat as chat

__all__ = ["Pipeline"]

_REQUEST_ID = REQUEST_ID_HEADER.decode()


@dataclass(frozen=True, slots=True)
class Pipeline:
    """Everything a request needs that outlives it: configuration, encoders and their cursor."""

    config: EPDConfig
    pool: EncoderPool

    def parse(self, body: bytes) -> chat.ChatRequest | None:
        """The request's media parts, or None when the body passes to the engine unchanged.

        Cheap for bodies without media: a byte scan, no JSON parse.
        """
        if not chat.may_hold_media(body):
            return None
        request = chat.parse(body)
        if request is None or not request.media:
            return None
        return request

    async def prepare(self, request: chat.ChatRequest, client: httpx.AsyncClient, request_id: str) -> bytes:
        """The body the local engine should see, with the handles of the encoded media.

        Raises :class:`~epd_middleware.errors.EncoderError` when the media could not be encoded.
        """
        config = self.config

        items, uuids = media_items(
            request.media,
            trust_client_uuid=config.trust_client_uuid,
            salt=request.cache_salt,
            encoder_part=chat.encoder_part,
        )
        calls = plan_calls(items, self.pool.urls, self.pool.reserve(len(items)), config.max_batch_size)

        handles = await call_encoders(
            client,
            calls,
            [chat.encoder_body(request, [item.part for item in call.items]) for call in calls],
            headers=[{_REQUEST_ID: f"{request_id}-enc{index}"} for index in range(len(calls))],
            call_timeout=config.encoder_timeout,
        )

        keys = [(part.modality, uuid) for part, uuid in zip(request.media, uuids, strict=True)]
        metadata = part_metadata(
            keys, handles, rewrite=config.rewrite, keep_raw=request.referenced_modalities
        )
        return chat.rewritten_body(request, uuids, metadata, transfer_params(handles))
