"""The encode stage: planned calls in, handles (or typed errors) out.

Every call goes to the encoder the plan chose and fails over within the encoder pool
(:mod:`epd_middleware.pool`); all calls of a request run concurrently within its encode deadline. Each
call catches its own failure; the caller decides (fallback policy) what a failed call means for the
request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from .errors import UpstreamBadReply, UpstreamError, UpstreamTimeout
from .handles import Handle, ItemKey, match_reply
from .plan import EncoderCall
from .pool import ServerPool
from .protocol import CHAT_COMPLETIONS_PATH, EC_TRANSFER_PARAMS, embedding_stored, example_connector_file
from .transport import Body, Transport
from .upstream import Attempt, DeadlinePassed

__all__ = ["EncodeOutcome", "EncoderRequest", "encode"]


@dataclass(frozen=True, slots=True)
class EncoderRequest:
    """One try of an encoder call: its body, and the Mooncake transfer id of each item it carries
    (None without push)."""

    body: Body
    transfer_ids: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class EncodeOutcome:
    """What the encoders gave for one request: handles, and the calls that failed for good."""

    handles: dict[ItemKey, Handle]
    failed: tuple[tuple[EncoderCall, UpstreamError], ...] = ()


async def encode(
    pool: ServerPool,
    client: Transport,
    calls: Sequence[EncoderCall],
    request_of: Callable[[EncoderCall], EncoderRequest],
    headers: Sequence[Mapping[str, str]],
    *,
    deadline: float,
    storage: str | None,
    expected: Mapping[ItemKey, str] | None = None,
    stop_at_first_failure: bool,
) -> EncodeOutcome:
    """Run every call concurrently, each with failover, all within ``deadline`` seconds.

    ``request_of`` builds a call's body afresh for every try. ``expected``: the identifier the engine
    will give an item, where known; a reply that reports another hash for it is a bad reply (the encoder
    derives hashes otherwise than this server: another model path, hasher or ``--media-io-kwargs``), and
    so is one whose embedding is not in ``storage``. A call that an encoder rejected as a bad
    request (400, 404, 413, 422 ...) is raised at once. With ``stop_at_first_failure`` the first call
    that failed for good is raised and its siblings are cancelled; otherwise failed calls are returned
    for the fallback policy to handle.
    """
    results: list[dict[ItemKey, Handle]] = [{} for _ in calls]
    failures: dict[int, UpstreamError] = {}
    rejected: list[UpstreamError] = []

    async def run(index: int, siblings: anyio.CancelScope | None) -> None:
        call = calls[index]

        def attempt() -> Attempt[dict[ItemKey, Handle]]:
            request = request_of(call)
            return Attempt(
                request.body,
                lambda server, reply: _handles(server, call, request, reply, storage, expected or {}),
            )

        try:
            results[index] = await pool.call(
                client,
                call.encoder,
                CHAT_COMPLETIONS_PATH,
                attempt,
                headers[index],
                call.preferred,
                deadline=ends,
            )
            return
        except DeadlinePassed:
            failure: UpstreamError = UpstreamTimeout(
                call.encoder, f"the request's encode deadline of {deadline:g} s passed"
            )
        except UpstreamError as exc:
            failure = exc
        failures[index] = failure
        if not failure.retryable:
            rejected.append(failure)
        if siblings is not None and (not failure.retryable or stop_at_first_failure):
            siblings.cancel()

    if not calls:  # everything reused, or no encoder (the local policy): nothing to wait for
        return EncodeOutcome({})
    # Each call carries the deadline into its own cancel scope (pool.py) rather than one more scope
    # around them all here.
    ends = anyio.current_time() + deadline
    if len(calls) == 1:
        await run(0, None)  # the common case: no task to spawn
    else:
        async with anyio.create_task_group() as group:
            for index in range(len(calls)):
                group.start_soon(run, index, group.cancel_scope)
    if rejected:
        raise rejected[0]
    if failures and stop_at_first_failure:
        raise failures[min(failures)]
    handles = {key: handle for result in results for key, handle in result.items()}
    return EncodeOutcome(handles, tuple((calls[index], failures[index]) for index in sorted(failures)))


def _handles(
    server: str,
    call: EncoderCall,
    request: EncoderRequest,
    reply: dict[str, Any],
    storage: str | None,
    expected: Mapping[ItemKey, str],
) -> dict[ItemKey, Handle]:
    handles = match_reply(server, call.items, reply.get(EC_TRANSFER_PARAMS))
    for key, handle in handles.items():
        identifier = expected.get(key)
        if identifier is not None and handle.mm_hash != identifier:
            raise UpstreamBadReply(
                server,
                f"reported hash {handle.mm_hash[:80]!r} for an item this server identifies as "
                f"{identifier[:80]!r} (the encoder derives hashes otherwise: another model path, "
                "--mm-hasher-algorithm or --media-io-kwargs)",
            )
    if storage is not None:
        _check_stored(server, handles, storage)
    if request.transfer_ids is not None:
        # The encoder pushes each item under the transfer id it was sent; the local engine claims the
        # push by that id, so the id travels with the item's handle.
        for item, transfer_id in zip(call.items, request.transfer_ids, strict=True):
            key = (item.modality, item.uuid)
            if key in handles:
                handles[key] = dataclasses.replace(handles[key], transfer_id=transfer_id)
    return handles


def _check_stored(encoder: str, handles: Mapping[ItemKey, Handle], storage: str) -> None:
    """Every reported embedding must be where the local connector will look, or the engine would fail.

    A stat per handle on the connector's (local or shared) file system: microseconds, so it runs on the
    event loop rather than paying a thread hop.
    """
    for handle in handles.values():
        mm_hash = handle.mm_hash
        if example_connector_file(storage, mm_hash) is None:
            raise UpstreamBadReply(encoder, f"reported hash {mm_hash[:80]!r} is not a valid file name")
        if not embedding_stored(storage, mm_hash):
            raise UpstreamBadReply(encoder, f"the embedding of {mm_hash[:80]!r} is not in the shared storage")
