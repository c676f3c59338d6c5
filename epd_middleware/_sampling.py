"""The sampled check on real traffic (``verify_share``): which requests the equivalence probe re-runs
with their own prompt and media, and the two probe requests made of each.

Real media finds what the canary cannot: a size, a format or an option the canary lacks. A request
answered 200 is taken with probability ``verify_share`` and handed over without waiting: at most one
is checked at a time (one offered meanwhile is dropped, counted), so the client's own request is never
delayed, and the media held is one request's at most, dropped once checked. Only chat completions with
media are taken (their answer has logprobs the comparison reads).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._protocol import CACHE_SALT
from ._surfaces import ParsedRequest, Surface, encode_fields, openai_chat

__all__ = ["Sampler", "sampled_requests"]

# What a sampled request's probes override: one greedy token with its top logprobs, no stream, one
# choice, under a salt of their own; the prompt, the media and the media options stay the client's.
_ONE_TOKEN: dict[str, Any] = {
    "max_tokens": 1,
    "temperature": 0,
    "n": 1,
    "stream": False,
    "logprobs": True,
    "top_logprobs": 5,
    "ignore_eos": True,
}
# Fields that would change what the probe's answer says, or ask for more than one token's work.
_DROPPED = ("max_completion_tokens", "stream_options", "prompt_logprobs", "echo", "best_of")


def sampled_requests(request: ParsedRequest, nonce: str) -> tuple[ParsedRequest, bytes]:
    """The two probes of a sampled request: the request for the E + PD path (the media still to encode,
    under a salt of its own: the encode stage gives it uuids keyed by that salt, never the client's) and
    the body for PD alone (the media left for the engine, another salt, each part pinned to a uuid of
    its own: a client's uuid, trusted or not, would make the engine's caches give the embedding of
    whatever media was sent under it before)."""
    fields = {name: value for name, value in request.fields.items() if name not in _DROPPED}
    fields.update(_ONE_TOKEN)
    remote = dataclasses.replace(request, fields={**fields, CACHE_SALT: f"epd-verify-{nonce}-e"})
    alone = dataclasses.replace(request, fields={**fields, CACHE_SALT: f"epd-verify-{nonce}-pd"})
    uuids = [f"epd-verify-{nonce}-pd-{index}" for index in range(len(request.media))]
    local = openai_chat.SURFACE.engine_fields(alone, uuids, [None] * len(uuids), {})
    return remote, encode_fields(local, compat=request.compat)


class Sampler:
    """Takes a share of real requests for the equivalence probe (``verify_share``)."""

    def __init__(self, share: float) -> None:
        self.share = share
        self._send: MemoryObjectSendStream[ParsedRequest]
        self._receive: MemoryObjectReceiveStream[ParsedRequest]
        # No buffer: a request is handed over only while the worker waits for one, so the media held is
        # the one request under check, never a second queued behind it.
        self._send, self._receive = anyio.create_memory_object_stream[ParsedRequest](max_buffer_size=0)
        self.taken = 0
        self.dropped = 0  # taken while one waited: not checked
        self.skipped = 0  # not checked: the engine was busy, or no encoder to check
        self.checked = 0
        self._turn = 0
        self.running = False  # set by the worker: without one (no lifespan), nothing is taken

    def offer(self, surface: Surface, request: ParsedRequest) -> None:
        """A request the engine answered 200: taken for a check with probability ``share``, never
        waited for."""
        if not self.running or self.share <= 0 or surface is not openai_chat.SURFACE or not request.media:
            return
        if request.references or random.random() >= self.share:
            return
        try:
            self._send.send_nowait(request)
        except anyio.WouldBlock:
            self.dropped += 1
            return
        self.taken += 1

    async def next(self) -> ParsedRequest:
        return await self._receive.receive()

    def turn(self) -> int:
        """The next encoder's turn (the checks go round the encoders)."""
        self._turn += 1
        return self._turn - 1

    def status(self, verdicts: dict[str, Any]) -> dict[str, Any]:
        return {
            "share": self.share,
            "taken": self.taken,
            "dropped": self.dropped,
            "skipped": self.skipped,
            "checked": self.checked,
            "encoders": verdicts,
        }
