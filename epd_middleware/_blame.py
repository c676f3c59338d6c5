"""Who is at fault when a call to an encoder or a prefill server fails: the server, or the request.

Shared encoders belong to every client, so a failure counts against a server (towards its ejection) only
where the evidence says the server is at fault. A status alone does not: vLLM answers 500 when the image
host a client named does not resolve, and 501 to a data URL that is not base64, on every server alike.
One request's failed calls are judged together, in a :class:`Ledger`:

- **The request is at fault** where vLLM's answer says so or several servers agree:
  - a rejection (400, 404, 413, 422 ...: the server's own words about the request);
  - 501: vLLM answers it only for a ``NotImplementedError`` (``entrypoints/serve/exception_handling/
    error_response.py``), which request content raises (``multimodal/media/connector.py``
    ``_load_data_url``: "Only base64 data URLs are supported for now.");
  - a 5xx whose message names a host of the request's own media, on two servers: their fetches of it
    failed (aiohttp's "Cannot connect to host H:P ...", "Connection timeout to host URL", "500,
    message=..., url=URL"; vLLM passes those on as 500, ``multimodal/media/connector.py``
    ``_wrap_media_fetch_error``). On one server alone it is not enough: a server whose own DNS or
    egress is down says the same of every URL. So the first such failure counts against nobody
    (``media``) and the call is tried on another server; the same failure there is the request's, a
    success there was the first server's trouble; with no other server to try, the request's;
  - 401, 403 or 429 to the client's own key (``forward_authorization``), on two servers: one server's
    key list may not be rolled out yet, so the first such answer is tried on another server;
  - the same failure (status and vLLM's message, or a timeout) on a second server, which proves healthy
    on its own (its ``/health`` and a canary encode of a tiny built-in image, :mod:`._canary`; a proof
    is good for a while): two servers broken the same way are not mistaken for a bad request.
  The client then gets vLLM's own answer (status, message, type), the call goes to no further server,
  and the failure the first server was counted for is taken back.
- **Nobody** where nothing was sent (this process's own slots on the server stayed taken).
- **The server** otherwise, but a request costs at most one server one failure (``capped`` after that):
  however its failures look, one client's request cannot count against the whole pool.

Even then a server leaves the pool only once ejection is confirmed independently of the requests
(:func:`._probes.confirm_failing`: its ``/health`` and a canary encode of a tiny built-in image).

**In the other direction**, a "client fault" answer (a 4xx rejection, 501, a refused client key) is one
server's word: a broken server can say it of every request. It is *doubtable* (:attr:`Verdict.doubtable`)
and the pool decides whether to doubt it (:mod:`._failover`: the server's share of such answers stands
out, or its canary fails). A doubted answer is tried on another server (:meth:`Ledger.doubt`): the same
answer there is the request's (and vindicates the first server, :attr:`Verdict.vindicate`); a success
there says the first server's answer was its own (:meth:`Ledger.contradicted`: ``unmasked``, counted).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple
from urllib.parse import urlsplit

from ._rawjson import Raw, raw_text
from .errors import (
    RequestTimedOut,
    UpstreamError,
    UpstreamRejected,
    UpstreamStatusError,
    UpstreamTimeout,
    VllmError,
)

if TYPE_CHECKING:
    from ._surfaces import MediaPart

__all__ = ["BLAMES", "Ledger", "Verdict"]

# The evidence an UpstreamRejected made from one server's 4xx carries (errors.UpstreamRejected's default).
_SERVERS_ANSWER = "the server's answer"

# Every verdict a failed call can get, as metrics and the status page count them. ``retracted``: a
# failure first counted against a server, taken back once the same request failed the same way on another.
# ``media``: a fetch of the request's own media failed on one server, counted against nobody, tried on
# another. (``suspect`` is a verdict on the way, never counted: :meth:`Ledger.settle` turns it into one of
# these.)
# ``doubted``: a client-fault answer of a server not trusted (its share of them stands out), counted
# against nobody yet and tried on another server; ``unmasked``: a doubted answer shown to be the server's
# own failure (another server served the request, or its canary failed too), counted against it.
BLAMES = (
    "server",
    "request",
    "credentials",
    "capped",
    "none",
    "retracted",
    "media",
    "doubted",
    "unmasked",
)

# vLLM answers 501 only for a NotImplementedError, raised by what the request asks for.
_NOT_IMPLEMENTED = 501
# Statuses vLLM's AuthenticationMiddleware (and a proxy in front of it) gives to a key it refuses, and
# a gateway's answer to a key over its quota.
_CREDENTIAL_STATUSES = frozenset({401, 403, 429})
# A URL's scheme and authority sit in its first bytes; a long one is cut to this before it is parsed.
_URL_HEAD = 2048


class Verdict(NamedTuple):
    """Who is at fault for one failed call (one of :data:`BLAMES`), and the error that stands for it:
    the failure itself, or the request's own answer when the request is at fault (never retried).
    ``retract``: the server whose failure was counted for this request and is now taken back.
    ``doubtable``: the request's fault on one server's word alone (:meth:`Ledger.doubt` may try it on
    another). ``vindicate``: a server whose doubted answer this one confirmed: it told the truth."""

    blame: str
    error: UpstreamError
    retract: str | None = None
    doubtable: bool = False
    vindicate: str | None = None


class _Failed(NamedTuple):
    role: str
    server: str
    # What makes two failures "the same": status and vLLM's message, or a timeout; None: not comparable
    # (a refused connection or a bad answer is never the request's doing).
    signature: tuple[object, ...] | None
    counted: bool


class _Doubted(NamedTuple):
    role: str
    # The call (one item's or batch's failover) it belongs to: another call's success or answer, for
    # other items, says nothing of it.
    call: int
    server: str
    # The answer's status and vLLM's message (addresses and numbers in it made alike): what must be
    # the same for two servers to agree.
    said: tuple[int, str]
    # The answer as the server gave it: what the client gets if no other server says otherwise.
    answer: UpstreamError


class Ledger:
    """One request's failed calls, judged together across its encoder and prefill calls. Made per
    request; every call of it runs on one event loop, so it needs no lock."""

    __slots__ = ("_doubted", "_failed", "_hosts", "_media", "credentials_forwarded")

    def __init__(self, media: Sequence[MediaPart] = (), *, credentials_forwarded: bool = False) -> None:
        self._media = media
        self._hosts: frozenset[str] | None = None
        self._failed: list[_Failed] = []
        self._doubted: list[_Doubted] = []
        # The calls carry the client's own Authorization header (forward_authorization).
        self.credentials_forwarded = credentials_forwarded

    def judge(self, server: str, failure: UpstreamError, call: int = 0) -> Verdict:
        """The verdict on ``failure`` of ``call`` (a token of the call: its doubted answers are its own)
        to ``server``. ``suspect``: this request failed the same way on another server; whether that
        makes it the request's fault is for :meth:`settle` to say, once the server is known to be
        healthy or not on its own."""
        if not failure.retryable:
            if _said_by_server(failure) is None:
                return Verdict("request", failure)
            return self._agreed(server, Verdict("request", failure, doubtable=True), call)
        if not failure.blames_server:
            return Verdict("none", failure)
        at_fault = self._request_at_fault(failure)
        if at_fault is not None:
            return self._agreed(server, at_fault, call)
        signature = _signature(failure)
        again = signature is not None and any(
            earlier.role == failure.role and earlier.server != server and earlier.signature == signature
            for earlier in self._failed
        )
        if self._fetch_failed(failure):
            if again:  # two servers could not fetch it, naming the request's own host
                return Verdict("request", self.final(failure))
            self._failed.append(_Failed(failure.role, server, signature, False))
            return Verdict("media", failure)
        if again:
            return Verdict("suspect", failure)
        return self._count(server, failure, signature)

    def doubt(self, server: str, verdict: Verdict, call: int = 0) -> Verdict:
        """A doubtable verdict the pool does not trust: the call goes to another server, nobody counted
        yet (``credentials`` for a refused client key, else ``doubted``)."""
        answer = verdict.error
        said = _said(answer)
        self._doubted.append(_Doubted(answer.role, call, server, said, answer))
        retried = UpstreamStatusError(server, said[0], _detail(answer), role=answer.role)
        return Verdict("credentials" if verdict.blame == "credentials" else "doubted", retried)

    def contradicted(self, role: str, call: int = 0) -> list[tuple[str, Verdict]]:
        """``call`` succeeded: each server whose answer to it was doubted, and its verdict now
        (``unmasked``: its own failure, counted; ``media`` where the request fetches media by URL,
        whose host may answer each server otherwise, so the success says nothing of the first)."""
        found = [entry for entry in self._doubted if entry.call == call and entry.role == role]
        if not found:
            return []
        self._doubted = [entry for entry in self._doubted if entry not in found]
        remote = self._remote_media()
        verdicts = []
        for entry in found:
            failure = UpstreamStatusError(entry.server, entry.said[0], _detail(entry.answer), role=role)
            if remote:
                verdicts.append((entry.server, Verdict("media", failure)))
                continue
            # Not capped: the same items were served elsewhere, so the request was not at fault, and
            # every server that refused them failed on its own.
            self._failed.append(_Failed(role, entry.server, None, True))
            verdicts.append((entry.server, Verdict("unmasked", failure)))
        return verdicts

    def unmask(self, server: str, failure: UpstreamError) -> Verdict:
        """A "client fault" answer shown to be the server's own failure by its canary (which failed
        too): counted as ``unmasked`` (``capped`` where this request already cost a server a failure)."""
        verdict = self._count(server, failure, None)
        return verdict._replace(blame="unmasked") if verdict.blame == "server" else verdict

    def final(self, failure: UpstreamError, call: int = 0) -> UpstreamError:
        """The error ``call`` answers with when no server is left to try after ``failure``: a doubted
        answer no other server contradicted (the request's, as its server said); the request's own
        answer where it is a failed fetch of the request's media (no other server said otherwise);
        else ``failure`` itself."""
        for entry in self._doubted:
            if entry.call == call and entry.role == failure.role:
                return entry.answer
        if isinstance(failure, UpstreamStatusError) and self._fetch_failed(failure):
            return _rejected(failure, failure.detail, "the request's own media could not be fetched")
        return failure

    def _agreed(self, server: str, verdict: Verdict, call: int) -> Verdict:
        """``verdict`` on a client-fault answer: no longer doubtable where another server's doubted
        answer to the same call said the same (status and vLLM's message: the request's fault, by two
        servers), which vindicates that server. Two refusals of a client's key say nothing of either
        server's other answers: only an answer about the request vindicates the server that gave it."""
        answer = verdict.error
        said = _said(answer)
        for entry in self._doubted:
            if entry.call != call or entry.role != answer.role or entry.server == server:
                continue
            if verdict.blame == "credentials" and entry.said[0] == said[0]:
                return verdict._replace(doubtable=False)
            if verdict.blame == "request" and entry.said == said:
                return verdict._replace(doubtable=False, vindicate=entry.server)
        return verdict

    def _remote_media(self) -> bool:
        if self._hosts is None:
            self._hosts = _media_hosts(self._media)
        return bool(self._hosts)

    def settle(self, server: str, failure: UpstreamError, *, server_healthy: bool) -> Verdict:
        """The verdict on a ``suspect`` failure: the request's, where ``server`` is healthy on its own
        (the failure the earlier server was counted for is then taken back); else the server's."""
        signature = _signature(failure)
        if not server_healthy:
            return self._count(server, failure, signature)
        retract = None
        for index, earlier in enumerate(self._failed):
            if earlier.role == failure.role and earlier.signature == signature and earlier.counted:
                retract = earlier.server
                self._failed[index] = earlier._replace(counted=False)
        self._failed.append(_Failed(failure.role, server, signature, False))
        servers = len({entry.server for entry in self._failed if entry.signature == signature})
        return Verdict("request", _same_failure(failure, servers), retract)

    def _count(self, server: str, failure: UpstreamError, signature: tuple[object, ...] | None) -> Verdict:
        counted = not any(entry.counted for entry in self._failed)
        self._failed.append(_Failed(failure.role, server, signature, counted))
        return Verdict("server" if counted else "capped", failure)

    def _request_at_fault(self, failure: UpstreamError) -> Verdict | None:
        if not isinstance(failure, UpstreamStatusError):
            return None
        status, detail = failure.status_code, failure.detail
        if status in _CREDENTIAL_STATUSES and self.credentials_forwarded:
            said = detail or VllmError(_REFUSED_KEY.get(status, "the client's API key was refused"))
            answer = _rejected(failure, said, "the client's own key, forwarded")
            return Verdict("credentials", answer, doubtable=True)
        if status == _NOT_IMPLEMENTED:
            answer = _rejected(failure, detail, "vLLM's answer to what it cannot do")
            return Verdict("request", answer, doubtable=True)
        return None

    def _fetch_failed(self, failure: UpstreamError) -> bool:
        """Whether ``failure`` is a server error whose vLLM message names a host of the request's media:
        that server's fetch of it failed."""
        if not isinstance(failure, UpstreamStatusError) or failure.status_code < 500:
            return False
        detail = failure.detail
        return detail is not None and self._names_own_media(detail.message)

    def _names_own_media(self, message: str) -> bool:
        """Whether vLLM's error message names a host of this request's media (aiohttp's messages name
        the host or the URL it failed to fetch)."""
        if not self._remote_media():
            return False
        assert self._hosts is not None
        said = message.lower()
        return any(f"host {host}:" in said or f"://{host}" in said for host in self._hosts)


_REFUSED_KEY = {429: "the client's API key is over its quota"}


def _said_by_server(failure: UpstreamError) -> int | None:
    """The status of a rejection that is one server's own word about the request (its 4xx), else None
    (a verdict already reached on the evidence of several servers, or nothing the server said)."""
    if isinstance(failure, UpstreamRejected) and failure.evidence == _SERVERS_ANSWER:
        return failure.status_code
    return None


# What varies between two servers' otherwise equal messages: object addresses, ids, counts.
_VARYING = re.compile(r"0x[0-9a-fA-F]+|\d+")


def _said(answer: UpstreamError) -> tuple[int, str]:
    """A client-fault answer as two servers' are compared: its status and vLLM's message, with
    addresses and numbers made alike (PIL's messages name an object's address)."""
    status = answer.status_code if isinstance(answer, (UpstreamRejected, UpstreamStatusError)) else 0
    message = answer.message if isinstance(answer, UpstreamRejected) else ""
    return status, _VARYING.sub("#", message)


def _detail(answer: UpstreamError) -> VllmError | None:
    if isinstance(answer, UpstreamRejected):
        return VllmError(answer.message, answer.vllm_type, answer.param)
    return None


def _signature(failure: UpstreamError) -> tuple[object, ...] | None:
    if isinstance(failure, UpstreamStatusError):
        detail = failure.detail
        return ("status", failure.status_code, detail.message if detail is not None else None)
    if isinstance(failure, UpstreamTimeout):
        return ("timeout",)
    return None


def _rejected(failure: UpstreamStatusError, detail: VllmError | None, evidence: str) -> UpstreamRejected:
    return UpstreamRejected(failure.server, failure.status_code, detail, role=failure.role, evidence=evidence)


def _same_failure(failure: UpstreamError, servers: int) -> UpstreamError:
    evidence = f"the same failure on {servers} {failure.role}s"
    if isinstance(failure, UpstreamStatusError):
        return _rejected(failure, failure.detail, evidence)
    timed_out = RequestTimedOut(
        failure.server, f"{failure.reason}, on {servers} {failure.role}s for this request", role=failure.role
    )
    timed_out.message = (
        f"this request timed out on {servers} {failure.role}s ({failure.reason} on each): its media may "
        "not be readable in time; it is not tried on more"
    )
    return timed_out


def _media_hosts(media: Sequence[MediaPart]) -> frozenset[str]:
    """The hosts of the request's http(s) media URLs, lower-case."""
    hosts = set()
    for part in media:
        url = part.url
        if url is None:
            continue
        if isinstance(url, Raw):
            url = bytes(raw_text(url)[:_URL_HEAD]).decode("utf-8", "replace")
        head = url[:_URL_HEAD]
        if head[:4].lower() != "http":
            continue
        try:
            host = urlsplit(head).hostname
        except ValueError:
            continue
        if host:
            hosts.add(host.lower())
    return frozenset(hosts)
