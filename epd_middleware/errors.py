"""Typed errors of the request path and the OpenAI-style JSON bodies clients see for them.

What a client reads (``message``) names the role that failed (encoder, prefill server) and the reason,
never a stack trace, a request body, or an address of the deployment: encoder URLs and pod addresses are
the operator's. The same error naming the server (``internal``) goes to the log and the status page, and
to clients only under ``expose_upstream_addresses`` (debugging).
"""

from __future__ import annotations

import json
from http import HTTPStatus

import msgspec

__all__ = [
    "BodyTooLarge",
    "EPDError",
    "ForbiddenTarget",
    "MediaBudgetExceeded",
    "MediaRefused",
    "MethodNotAllowed",
    "NoHealthyUpstream",
    "Overloaded",
    "RefusedField",
    "RequestNotSendable",
    "RequestTimedOut",
    "ShuttingDown",
    "TooManyMediaItems",
    "Unauthorized",
    "UnreadableRequest",
    "UnresolvableReference",
    "UnwritableRequest",
    "UpstreamBadReply",
    "UpstreamError",
    "UpstreamRejected",
    "UpstreamStatusError",
    "UpstreamStopping",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "VllmError",
    "error_json",
]

_encode = msgspec.json.Encoder().encode


def error_json(payload: object) -> bytes:
    """An error answer as JSON. Its message may quote the client's own text, which may hold a lone
    surrogate (a body read by Python's json takes ``"\\ud800"``) that UTF-8 cannot encode: then it is
    written as JSON's escape, which the client reads back as it sent it."""
    try:
        return _encode(payload)
    except UnicodeEncodeError:
        return json.dumps(payload, ensure_ascii=True, separators=(",", ":")).encode()


# Statuses that say something about the server, not about the request: another server may succeed.
RETRYABLE_STATUSES = frozenset({401, 403, 408, 429})


class EPDError(Exception):
    """An error answered to the client instead of calling the local engine."""

    status: int = 500
    # The request itself is at fault, whatever the status (a 501 vLLM gives to what it cannot do): the
    # log line of the answer is INFO, not a WARNING an operator has to act on.
    requests_fault: bool = False

    def __init__(self, message: str, *, param: str | None = None, internal: str | None = None) -> None:
        super().__init__(internal or message)
        self.message = message
        self.param = param
        # The message naming the deployment's own addresses, for the log; None where ``message`` names
        # none.
        self.internal = internal

    @property
    def logged(self) -> str:
        """What the log says of it: the message with the servers' addresses."""
        return self.internal or self.message

    def expose(self) -> None:
        """Answer the message naming the servers (``expose_upstream_addresses``)."""
        if self.internal is not None:
            self.message = self.internal

    @property
    def error_type(self) -> str:
        # vLLM names its error types after the status phrase ("BadRequestError"); follow it so clients
        # see one convention whether the error came from vLLM or from the middleware.
        # A status Python does not name (an encoder's 419 or 499, passed on as it came) is named by its
        # class, never by an exception here.
        try:
            phrase = HTTPStatus(self.status).phrase
        except ValueError:
            phrase = "Client" if 400 <= self.status < 500 else "Server"
        name = phrase.replace(" ", "").replace("-", "")
        # "Internal Server Error" is vLLM's InternalServerError, not ...ErrorError.
        return name if name.endswith("Error") else name + "Error"

    def body(self) -> bytes:
        return error_json(
            {
                "error": {
                    "message": self.message,
                    "type": self.error_type,
                    "param": self.param,
                    "code": self.status,
                }
            }
        )

    def headers(self) -> list[tuple[bytes, bytes]]:
        return []


class BodyTooLarge(EPDError):
    status = 413

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body is larger than the limit of {limit} bytes")
        self.limit = limit


class TooManyMediaItems(EPDError):
    status = 400

    def __init__(self, count: int, limit: int) -> None:
        super().__init__(
            f"the request has {count} media parts, more than the limit of {limit}", param="messages"
        )


class RefusedField(EPDError):
    """A request field the middleware does not pass on (it would reach the engine unchecked)."""

    status = 400


class MediaRefused(EPDError):
    """A media URL this server's media policy refuses (vLLM's ``--allowed-media-domains``,
    ``--allowed-local-media-path``), with vLLM's own message."""

    status = 400


class UnresolvableReference(EPDError):
    """A metadata-only part of the client's own whose embedding this server does not have or cannot
    confirm: the engine would have nothing to take it from."""

    status = 400


class UnreadableRequest(EPDError):
    """A body whose shape the middleware cannot read where it must look, holding what it must handle
    (media, an embedding reference): passing it on unread would let the engine act on what the
    middleware never checked."""

    status = 400

    def __init__(self, found: str) -> None:
        super().__init__(
            f"the request holds {found} in a shape this server does not read; media and embedding "
            "references are taken only in the shapes vLLM documents"
        )


class UnwritableRequest(EPDError):
    """A body the middleware read but cannot write again for the engine (nested too deeply)."""

    status = 400

    def __init__(self) -> None:
        super().__init__("the request is nested too deeply to be passed on")


class Unauthorized(EPDError):
    status = 401

    def __init__(self) -> None:
        super().__init__("missing or invalid API key")

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"www-authenticate", b"Bearer")]


class MediaBudgetExceeded(EPDError):
    """A request whose media vLLM would refuse to decode as a whole (its per-request budget), though
    each encoder's share would pass."""

    status = 400


class MethodNotAllowed(EPDError):
    status = 405


class ForbiddenTarget(EPDError):
    """A request named a server (a scheduler header) that this server may not call."""

    status = 403


class _RetryLater(EPDError):
    status = 503

    def __init__(self, message: str, retry_after: int, *, internal: str | None = None) -> None:
        super().__init__(message, internal=internal)
        self.retry_after = retry_after

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(self.retry_after).encode())]


class Overloaded(_RetryLater):
    """Too many requests are waiting for encoders or prefill: refuse now rather than queue without bound."""


class NoHealthyUpstream(_RetryLater):
    """Every server of a pool (encoders, prefill servers) is ejected and the policy is 'error'."""


class ShuttingDown(_RetryLater):
    """This server is shutting down (SIGTERM): its engine takes no more requests, so one not yet handed
    to it is answered, not aborted; another server can run it."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(
            "this server is shutting down and did not run the request: retry it on another server",
            retry_after,
        )


class UpstreamError(EPDError):
    """A call to an encoder or a prefill server that did not give a usable answer. The client reads the
    role and the reason; ``server`` (its configured URL, or the address DNS gave) is for the log."""

    status = 502
    retryable = True  # another server of the pool may succeed where this one failed
    outcome = "failed"  # the outcome label of the call in metrics
    blames_server = True  # may count a failure of the server (towards its ejection): _blame.py decides

    def __init__(self, server: str, reason: str, *, role: str = "encoder") -> None:
        super().__init__(f"{_a(role)} failed: {reason}", internal=f"{role} {server} failed: {reason}")
        self.server = server
        self.role = role
        self.reason = reason

    def tried(self, reasons: list[tuple[str, str]]) -> None:
        """Say every server the call tried, each with its reason (the last one alone would hide the
        others); the client reads the reasons, the log the servers too."""
        role = self.role
        self.message = (
            f"{self.message} (tried {len(reasons)} {role}s: {'; '.join(why for _, why in reasons)})"
        )
        self.internal = (
            f"{self.logged} (tried {len(reasons)} {role}s: "
            + "; ".join(f"{server}: {why}" for server, why in reasons)
            + ")"
        )
        self.args = (self.internal,)


def _a(role: str) -> str:
    """The role as the client reads it: "an encoder", "a prefill server"."""
    return "an encoder" if role == "encoder" else f"a {role} server"


class UpstreamUnavailable(UpstreamError):
    """The server could not be reached (connection refused, reset, DNS)."""

    outcome = "unavailable"


class UpstreamTimeout(UpstreamError):
    status = 504
    outcome = "timeout"


class UpstreamBusy(UpstreamError):
    """Every slot this process may use on the server stayed taken by its own other calls for the call's
    whole timeout: the server is not blamed (nothing was sent), another may be free."""

    status = 503
    outcome = "busy"
    blames_server = False


class UpstreamStatusError(UpstreamError):
    """The server answered 5xx or a status about itself (401, 403, 408, 429). ``detail``: vLLM's own
    error (message, type, param), kept for judging who is at fault; a 5xx's message is not shown to the
    client (server errors may carry internals) unless the request is found at fault."""

    outcome = "status"

    def __init__(
        self, server: str, status_code: int, detail: VllmError | None = None, *, role: str = "encoder"
    ) -> None:
        shown = detail.message if detail is not None and status_code < 500 else ""
        super().__init__(
            server, f"HTTP {status_code}: {shown}" if shown else f"HTTP {status_code}", role=role
        )
        self.status_code = status_code
        self.detail = detail
        if detail is not None and not shown and detail.message:
            # Server errors may carry internals: the log reads them, the client only where the request
            # is found at fault (then vLLM alone would have answered the same).
            self.internal = f"{self.internal} ({detail.message})"
            self.args = (self.internal,)


class VllmError:
    """vLLM's error answer (``{"error": {"message", "type", "param"}}``), as a server gave it."""

    __slots__ = ("message", "param", "type")

    def __init__(self, message: str, type: str | None = None, param: str | None = None) -> None:
        self.message = message
        self.type = type
        self.param = param


class UpstreamRejected(UpstreamError):
    """The request itself is at fault, by the server's answer or by the evidence of several (_blame.py):
    no other server would differ, so the client gets what vLLM answers (its status, message, type and
    param) and no server is blamed."""

    retryable = False
    outcome = "rejected"
    blames_server = False
    requests_fault = True

    def __init__(
        self,
        server: str,
        status_code: int,
        detail: VllmError | str | None = None,
        *,
        role: str = "encoder",
        evidence: str = "the server's answer",
    ) -> None:
        if isinstance(detail, str):
            detail = VllmError(detail)
        said = detail.message if detail is not None else ""
        super().__init__(server, f"HTTP {status_code}: {said}" if said else f"HTTP {status_code}", role=role)
        # vLLM's own words where it gave some: what a single instance would answer.
        self.message = said or f"{_a(role)} answered HTTP {status_code} to this request"
        self.internal = f"{role} {server} answered HTTP {status_code} ({evidence}): {said}"
        self.args = (self.internal,)
        self.status_code = status_code
        self.status = status_code
        self.evidence = evidence
        self.vllm_type = detail.type if detail is not None else None
        if detail is not None and detail.param is not None:
            self.param = detail.param

    @property
    def error_type(self) -> str:
        # vLLM's own type where it named one ("NotImplementedError", "UnprocessableEntityError").
        if self.vllm_type and self.vllm_type.isidentifier() and len(self.vllm_type) <= 64:
            return self.vllm_type
        return super().error_type


class RequestTimedOut(UpstreamError):
    """The same request timed out on more than one server: its own media (a host that never answers the
    encoder's fetch) is the likely cause, so it is not tried on more and no server is blamed."""

    status = 504
    retryable = False
    outcome = "timeout"
    blames_server = False
    requests_fault = True


class UpstreamBadReply(UpstreamError):
    """The server answered 200 with a body the middleware cannot use, or an embedding that is missing."""

    outcome = "bad_reply"


class UpstreamStopping(UpstreamError):
    """The server answered its engine's abort of the call, having run nothing: it is shutting down
    (vLLM aborts every request added while it drains). Another server takes the call; this one counts
    a failure, as it leaves."""

    status = 503
    outcome = "stopping"

    def __init__(self, server: str, *, role: str = "encoder") -> None:
        super().__init__(server, "it is shutting down (its engine aborted the call unrun)", role=role)


class RequestNotSendable(UpstreamError):
    """The request could not be written to the server (a header it carries cannot go into HTTP/1.1):
    nothing was sent, the server is not blamed and no other server would fare better."""

    status = 400
    retryable = False
    outcome = "not_sent"
    blames_server = False

    def __init__(self, server: str, reason: str, *, role: str = "encoder") -> None:
        super().__init__(server, reason, role=role)
        self.message = f"the request cannot be sent to {_a(role)}: {reason}"
        self.internal = f"the request cannot be sent to {role} {server}: {reason}"
        self.args = (self.internal,)


class StartupFailed(RuntimeError):
    """``strict_startup``: an encoder or prefill server serves another model; the message says which. The
    lifespan ends with it after telling the server ``lifespan.startup.failed``, so every server stops."""
