"""Typed errors of the request path and the OpenAI-style JSON bodies clients see for them.

Messages name the encoder or prefill server (by its configured URL) and the reason, never a stack
trace, a request body, or an address the operator did not configure.
"""

from __future__ import annotations

from http import HTTPStatus

import msgspec

__all__ = [
    "BodyTooLarge",
    "EPDError",
    "ForbiddenTarget",
    "MediaBudgetExceeded",
    "MediaRefused",
    "NoHealthyUpstream",
    "Overloaded",
    "RefusedField",
    "RequestNotSendable",
    "TooManyMediaItems",
    "Unauthorized",
    "UnreadableRequest",
    "UnresolvableReference",
    "UnwritableRequest",
    "UpstreamBadReply",
    "UpstreamError",
    "UpstreamRejected",
    "UpstreamStatusError",
    "UpstreamTimeout",
    "UpstreamUnavailable",
]

_encode = msgspec.json.Encoder().encode

# Statuses that say something about the server, not about the request: another server may succeed.
RETRYABLE_STATUSES = frozenset({401, 403, 408, 429})


class EPDError(Exception):
    """An error answered to the client instead of calling the local engine."""

    status: int = 500

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

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
        return phrase.replace(" ", "").replace("-", "") + "Error"

    def body(self) -> bytes:
        return _encode(
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


class ForbiddenTarget(EPDError):
    """A request named a server (a scheduler header) that this server may not call."""

    status = 403


class _RetryLater(EPDError):
    status = 503

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(self.retry_after).encode())]


class Overloaded(_RetryLater):
    """Too many requests are waiting for encoders or prefill: refuse now rather than queue without bound."""


class NoHealthyUpstream(_RetryLater):
    """Every server of a pool (encoders, prefill servers) is ejected and the policy is 'error'."""


class UpstreamError(EPDError):
    """A call to an encoder or a prefill server that did not give a usable answer; names the server (by
    its configured URL), its role and the reason."""

    status = 502
    retryable = True  # another server of the pool may succeed where this one failed
    outcome = "failed"  # the outcome label of the call in metrics
    blames_server = True  # counts a failure of the server (towards its ejection)

    def __init__(self, server: str, reason: str, *, role: str = "encoder") -> None:
        super().__init__(f"{role} {server} failed: {reason}")
        self.server = server
        self.role = role
        self.reason = reason


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
    """The server answered 5xx or a status about itself (401, 403, 408, 429)."""

    outcome = "status"

    def __init__(self, server: str, status_code: int, detail: str = "", *, role: str = "encoder") -> None:
        super().__init__(
            server, f"HTTP {status_code}: {detail}" if detail else f"HTTP {status_code}", role=role
        )
        self.status_code = status_code


class UpstreamRejected(UpstreamError):
    """The server said the request itself is bad (400, 404, 413, 422 ...): no other server will differ,
    so the client gets the server's status and message."""

    retryable = False
    outcome = "rejected"

    def __init__(self, server: str, status_code: int, detail: str, *, role: str = "encoder") -> None:
        super().__init__(
            server, f"HTTP {status_code}: {detail}" if detail else f"HTTP {status_code}", role=role
        )
        self.status_code = status_code
        self.status = status_code


class UpstreamBadReply(UpstreamError):
    """The server answered 200 with a body the middleware cannot use, or an embedding that is missing."""

    outcome = "bad_reply"


class RequestNotSendable(UpstreamError):
    """The request could not be written to the server (a header it carries cannot go into HTTP/1.1):
    nothing was sent, the server is not blamed and no other server would fare better."""

    status = 400
    retryable = False
    outcome = "not_sent"

    def __init__(self, server: str, reason: str, *, role: str = "encoder") -> None:
        super().__init__(server, reason, role=role)
        self.message = f"the request cannot be sent to {role} {server}: {reason}"
        self.args = (self.message,)


class StartupFailed(RuntimeError):
    """``strict_startup``: an encoder or prefill server serves another model; the message says which. The
    lifespan ends with it after telling the server ``lifespan.startup.failed``, so every server stops."""
