"""The encoder calls of one request: planned calls in, handles (or typed errors) out.

Every call goes to the encoder the plan chose and fails over within the encoder pool
(:mod:`epd_middleware._pool`); all calls of a request run concurrently within its encode deadline. Each
call catches its own failure; the caller decides (fallback policy) what a failed call means for the
request.
"""

from __future__ import annotations

import dataclasses
import uuid as uuid_module
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

import anyio

from . import _failover as failover
from ._blame import Ledger
from ._canary import Canary
from ._handles import Handle, ItemKey, match_reply
from ._plan import EncoderCall
from ._pool import ServerPool
from ._protocol import (
    CHAT_COMPLETIONS_PATH,
    EC_CONSUMER_ZMQ,
    EC_ITEM_TRANSFER_ID,
    EC_ITEMS,
    EC_TRANSFER_PARAMS,
    MODEL,
    embedding_stored,
    plain_file_name,
)
from ._rawjson import text_of
from ._surfaces import ParsedRequest, Surface, choices_aborted
from ._upstream import Attempt, DeadlinePassed
from .errors import UpstreamBadReply, UpstreamError, UpstreamStopping, UpstreamTimeout
from .transport import Body, Transport

__all__ = ["EncodeJob", "EncodeOutcome", "EncoderRequest", "encode"]


@dataclass(frozen=True, slots=True)
class EncoderRequest:
    """One try of an encoder call: its body, and the Mooncake transfer id of each item it carries
    (None without push)."""

    body: Body
    transfer_ids: tuple[str, ...] | None = None


class EncodeJob(NamedTuple):
    """One request's encoder calls and what they are held to (a tuple: made once per request, it costs
    a tuple's construction, not a frozen dataclass's attribute by attribute)."""

    surface: Surface
    request: ParsedRequest
    calls: tuple[EncoderCall, ...]
    # Per call, the headers it is sent with (its request id, the key).
    headers: tuple[Mapping[str, str], ...]
    # Seconds all calls may take together, retries included.
    deadline: float
    # Mooncake push: the ZMQ address the encoders push to (None: they store embeddings).
    push_to: str | None = None
    # Where the local connector keeps embeddings as files, to check each reported one is there.
    storage: str | None = None
    # The identifier the engine will give an item, where known: a reply reporting another hash for it
    # is a bad reply (the encoder derives hashes otherwise: another model path, hasher or
    # --media-io-kwargs).
    expected: Mapping[ItemKey, str] = MappingProxyType({})
    # The first call that failed for good fails the request and cancels its siblings (the 'error'
    # policy); otherwise failed calls are returned for the 'local' policy.
    stop_at_first_failure: bool = True
    # Fields over every encoder body (the request's session id where no header carries it).
    extra_fields: Mapping[str, Any] = MappingProxyType({})
    # The request's failed calls, judged together (_blame.py).
    ledger: Ledger | None = None
    # The call that confirms an encoder's ejection besides its /health (_canary.py); None: /health alone.
    canary: Canary | None = None
    # Why an item the encoder gives no handle for cannot stay raw for the engine (a Mooncake consumer's
    # engine would wait for its push): such an answer is then a bad one. None: it stays raw.
    raw_blocked: str | None = None
    # vLLM traces: each call gets its span, and passes the trace on (_tracing.py).
    traced: bool = False
    # Each item's vision tokens where known (_placement.item_tokens): the work its call asks for.
    work: Mapping[ItemKey, int | None] = MappingProxyType({})
    # Each call's answer is its own encoder's, no failover (the equivalence probe tests that encoder).
    pinned: bool = False


@dataclass(frozen=True, slots=True)
class EncodeOutcome:
    """What the encoders gave for one request: handles, and the calls that failed for good."""

    handles: dict[ItemKey, Handle]
    failed: tuple[tuple[EncoderCall, UpstreamError], ...] = ()
    # The encoder that answered each call (after any failover), in the calls' order; "" where none did.
    answered: tuple[str, ...] = ()


async def encode(pool: ServerPool, transport: Transport, job: EncodeJob) -> EncodeOutcome:
    """Run every call of ``job`` concurrently, each with failover, all within its deadline.

    A reply whose hash is not the expected identifier, or whose embedding is not in the storage, is a
    bad reply (the call fails over). A call that an encoder rejected as a bad request (400, 404, 413,
    422 ...) is raised at once. With ``stop_at_first_failure`` the first call that failed for good is
    raised and its siblings are cancelled; otherwise failed calls are returned.
    """
    calls = job.calls
    results: list[dict[ItemKey, Handle]] = [{} for _ in calls]
    answered = [""] * len(calls)
    failures: dict[int, UpstreamError] = {}
    rejected: list[UpstreamError] = []
    request_of = _requests(job)
    model = text_of(job.request.fields.get(MODEL))

    async def run(index: int, siblings: anyio.CancelScope | None) -> None:
        call = calls[index]

        work = _work(call, job.work)

        def attempt(server: str) -> Attempt[dict[ItemKey, Handle]]:
            request = request_of(call, pool.models.name_for(server, model))

            def read(server: str, reply: dict[str, Any]) -> dict[ItemKey, Handle]:
                handles = _handles(server, call, request, reply, job)
                answered[index] = server
                return handles

            return Attempt(request.body, read, work)

        try:
            results[index] = await failover.call(
                pool,
                transport,
                call.encoder,
                CHAT_COMPLETIONS_PATH,
                attempt,
                job.headers[index],
                call.preferred,
                deadline=ends,
                ledger=job.ledger,
                canary=job.canary,
                traced=job.traced,
                attempts=1 if job.pinned else None,
            )
            return
        except DeadlinePassed:
            failure: UpstreamError = UpstreamTimeout(
                call.encoder, f"the request's encode deadline of {job.deadline:g} s passed"
            )
        except UpstreamError as exc:
            failure = exc
        failures[index] = failure
        if not failure.retryable:
            rejected.append(failure)
        if siblings is not None and (not failure.retryable or job.stop_at_first_failure):
            siblings.cancel()

    if not calls:  # everything reused, or no encoder (the local policy): nothing to wait for
        return EncodeOutcome({})
    # Each call carries the deadline into its own cancel scope (_upstream.py) rather than one more scope
    # around them all here.
    ends = anyio.current_time() + job.deadline
    if len(calls) == 1:
        await run(0, None)  # the common case: no task to spawn
    else:
        async with anyio.create_task_group() as group:
            for index in range(len(calls)):
                group.start_soon(run, index, group.cancel_scope)
    if rejected:
        raise rejected[0]
    if failures and job.stop_at_first_failure:
        raise failures[min(failures)]
    handles = {key: handle for result in results for key, handle in result.items()}
    failed = tuple((calls[index], failures[index]) for index in sorted(failures))
    return EncodeOutcome(handles, failed, tuple(answered))


def _requests(job: EncodeJob) -> Callable[[EncoderCall, str | None], EncoderRequest]:
    """How each call's body is made, per try: under ``model`` where the encoder serves another of this
    server's names than the request's (:meth:`~._compat.ModelGate.name_for`)."""
    surface, request, push_to, extra = job.surface, job.request, job.push_to, job.extra_fields

    def fields(model: str | None) -> Mapping[str, Any]:
        return extra if model is None else {**extra, MODEL: model}

    if push_to is None:
        # Built once per name: every try of a call sends the same body.
        built: dict[tuple[int, str | None], EncoderRequest] = {}

        def stored(call: EncoderCall, model: str | None) -> EncoderRequest:
            key = (id(call), model)
            made = built.get(key)
            if made is None:
                made = built[key] = EncoderRequest(
                    surface.encoder_body(request, _parts(call), None, fields(model))
                )
            return made

        return stored

    def pushed(call: EncoderCall, model: str | None) -> EncoderRequest:
        # A fresh transfer id per item and per try: a push the failed encoder may have begun must never
        # be confused with the retry's.
        ids = tuple(uuid_module.uuid4().hex for _ in call.items)
        params = {EC_CONSUMER_ZMQ: push_to, EC_ITEMS: [{EC_ITEM_TRANSFER_ID: tid} for tid in ids]}
        return EncoderRequest(surface.encoder_body(request, _parts(call), params, fields(model)), ids)

    return pushed


def _work(call: EncoderCall, work: Mapping[ItemKey, int | None]) -> int | None:
    """The vision tokens ``call`` asks for, where every item's are known."""
    total = 0
    for item in call.items:
        tokens = work.get((item.modality, item.uuid))
        if tokens is None:
            return None
        total += tokens
    return total


def _parts(call: EncoderCall) -> list[Mapping[str, Any]]:
    return [item.part for item in call.items]


def _handles(
    server: str, call: EncoderCall, request: EncoderRequest, reply: dict[str, Any], job: EncodeJob
) -> dict[ItemKey, Handle]:
    if not reply.get(EC_TRANSFER_PARAMS) and choices_aborted(reply):
        raise UpstreamStopping(server)  # not "no handle, leave it raw": another encoder can run it
    handles = match_reply(server, call.items, reply.get(EC_TRANSFER_PARAMS))
    if job.raw_blocked is not None and len(handles) < len(call.items):
        raise UpstreamBadReply(
            server,
            f"no handle for {len(call.items) - len(handles)} of the {len(call.items)} item(s) it was sent, "
            "and this server's engine cannot encode them itself",
        )
    for key, handle in handles.items():
        identifier = job.expected.get(key)
        if identifier is not None and handle.mm_hash != identifier:
            raise UpstreamBadReply(
                server,
                f"reported hash {handle.mm_hash[:80]!r} for an item this server identifies as "
                f"{identifier[:80]!r} (the encoder derives hashes otherwise: another model path, "
                "--mm-hasher-algorithm or --media-io-kwargs)",
            )
    if job.storage is not None:
        _check_stored(server, handles, job.storage)
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
        if not plain_file_name(mm_hash):
            raise UpstreamBadReply(encoder, f"reported hash {mm_hash[:80]!r} is not a valid file name")
        if not embedding_stored(storage, mm_hash):
            raise UpstreamBadReply(encoder, f"the embedding of {mm_hash[:80]!r} is not in the shared storage")
