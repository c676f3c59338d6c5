"""The errors of the HTTP client: every failed exchange raises one of these (or TimeoutError)."""

from __future__ import annotations

__all__ = ["ConnectFailed", "ConnectionLost", "HTTPError", "ProtocolViolation", "UnsendableRequest"]


class HTTPError(Exception):
    """A failed exchange; ``reason`` is safe to show (no addresses beyond the configured URL)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ConnectFailed(HTTPError):
    """No connection could be opened."""


class ConnectionLost(HTTPError):
    """The connection broke or was closed before the answer was complete. ``answered``: some of the answer
    had arrived (so the request was surely read by the server)."""

    def __init__(self, reason: str, *, answered: bool = False) -> None:
        super().__init__(reason)
        self.answered = answered


class ProtocolViolation(HTTPError):
    """The answer broke HTTP/1.1's framing rules or this client's limits; the connection is closed."""


class UnsendableRequest(Exception):
    """The request cannot be written as HTTP/1.1 (a header value with a line break, or a character outside
    Latin-1): nothing was sent, and the server is not to blame. Not an :class:`HTTPError` on purpose."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
