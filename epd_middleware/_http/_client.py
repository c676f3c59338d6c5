"""The client: a LIFO keep-alive pool per origin, the request on the wire, and which connections may be
reused."""

from __future__ import annotations

import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import anyio

from ._errors import ConnectFailed, ConnectionLost
from ._framing import read_answer
from ._headers import header_lines
from ._socket import Connection, connect

__all__ = ["Body", "HTTPClient", "body_size"]

# A request body, whole or in pieces sent one after the other (large media strings are sent from where
# they arrived, not copied into one buffer).
Body = bytes | Sequence[bytes | memoryview]


def body_size(body: Body) -> int:
    """The bytes ``body`` sends, whole or in pieces."""
    return len(body) if isinstance(body, bytes) else sum(memoryview(piece).nbytes for piece in body)


_JOIN_LIMIT = 64 * 1024
# uvicorn closes idle keep-alive connections after 5 s; retire ours before that to avoid the race
# between its close and our next request.
_IDLE_SECONDS = 4.0


@dataclass
class _Origin:
    scheme: str
    host: str
    port: int
    idle: list[Connection] = field(default_factory=list)

    @property
    def host_header(self) -> bytes:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (host if self.port == default else f"{host}:{self.port}").encode()


class HTTPClient:
    """Keep-alive HTTP/1.1 client; one per middleware, used from one event loop."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
        max_body: int | None = None,
    ) -> None:
        """``max_body``: the largest answer body taken (default: the framing's 256 MiB)."""
        self._connect_timeout = connect_timeout
        self._max_body = max_body
        self._ssl_context = ssl_context
        self._origins: dict[str, _Origin] = {}
        self._closed = False
        self._swept = time.monotonic()

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def request(
        self, method: str, url: str, body: Body = b"", headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]:
        """Send one request and return (status, body) of its final answer. Raises :class:`HTTPError`
        subclasses, or :class:`UnsendableRequest` before anything is sent; the caller's cancel scope
        bounds the whole exchange."""
        if time.monotonic() - self._swept >= _IDLE_SECONDS:
            await self._sweep()
        parts = urlsplit(url)
        base = f"{parts.scheme}://{parts.netloc}"
        origin = self._origins.get(base)
        if origin is None:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            origin = self._origins[base] = _Origin(parts.scheme, parts.hostname or "", port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = [f"{method} {target} HTTP/1.1".encode(), b"host: " + origin.host_header]
        head.extend(b"%s: %s" % line for line in header_lines(headers or {}))
        pieces = (body,) if isinstance(body, bytes) else body
        length = sum(map(_size, pieces))
        if length or method == "POST":
            head.append(b"content-length: %d" % length)
        message = _message(b"\r\n".join(head) + b"\r\n\r\n", pieces)

        connection, reused = await self._idle(origin)
        if connection is None:
            connection = await self._open(origin)
        try:
            try:
                await connection.send(message)
                status, payload, keep = await read_answer(connection, self._max_body)
            except ConnectionLost as exc:
                if not reused or exc.answered:
                    raise
                # The server closed a pooled connection as we reused it, before any byte of an answer:
                # once more on a fresh connection (encoder and prefill calls are idempotent in effect).
                await connection.aclose()
                connection, reused = await self._open(origin), False
                await connection.send(message)
                status, payload, keep = await read_answer(connection, self._max_body)
        except BaseException:
            await connection.aclose()
            raise
        if keep and not self._closed:
            connection.idle_since = time.monotonic()
            # The sweep may have forgotten the origin while this call ran (it had no idle connection).
            self._origins.setdefault(base, origin).idle.append(connection)
        else:
            await connection.aclose()
        return status, payload

    async def drop_idle(self, url: str) -> None:
        """Close every idle connection to ``url``'s origin: after an answer that should not have come,
        none of them is trusted."""
        parts = urlsplit(url)
        origin = self._origins.get(f"{parts.scheme}://{parts.netloc}")
        if origin is not None:
            idle, origin.idle = origin.idle, []
            for connection in idle:
                await connection.aclose()

    async def _sweep(self) -> None:
        """Close every idle connection past its idle time and forget the origins left without one. Only
        a call to its origin takes a connection from the pool, so a server called no more (one DNS no
        longer names: a replaced pod's address) would otherwise keep its sockets open and its entry here
        for the client's life. Runs at most once an idle time, from a request."""
        now = self._swept = time.monotonic()
        stale: list[Connection] = []
        for base, origin in list(self._origins.items()):
            fresh: list[Connection] = []
            for connection in origin.idle:
                (fresh if now - connection.idle_since < _IDLE_SECONDS else stale).append(connection)
            origin.idle = fresh
            if not fresh:
                del self._origins[base]
        # Closed whatever happens to the request that swept: they are out of every pool already.
        with anyio.CancelScope(shield=True):
            for connection in stale:
                await connection.aclose()

    async def _idle(self, origin: _Origin) -> tuple[Connection | None, bool]:
        """The most recently used idle connection that is still fresh and on which the server said
        nothing since its last answer; the others are closed on the way."""
        now = time.monotonic()
        while origin.idle:
            connection = origin.idle.pop()
            if now - connection.idle_since < _IDLE_SECONDS and connection.quiet():
                return connection, True
            await connection.aclose()
        return None, False

    async def _open(self, origin: _Origin) -> Connection:
        tls = None
        if origin.scheme == "https":
            if self._ssl_context is None:
                self._ssl_context = ssl.create_default_context()  # loads the CA store: once
            tls = self._ssl_context
        try:
            with anyio.fail_after(self._connect_timeout):
                return await connect(
                    origin.host, origin.port, ssl_context=tls, server_hostname=origin.host if tls else None
                )
        except TimeoutError:
            raise ConnectFailed(f"no connection within {self._connect_timeout:g} s") from None

    async def aclose(self) -> None:
        self._closed = True
        origins, self._origins = self._origins, {}
        for origin in origins.values():
            for connection in origin.idle:
                await connection.aclose()


def _size(piece: bytes | memoryview) -> int:
    return len(piece) if isinstance(piece, bytes) else piece.nbytes


def _message(head: bytes, pieces: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """What to send: large pieces on their own, the head and small pieces joined between them. Joining
    a large piece would copy it (0.14 ms a MB, more on fresh pages); sending many small ones would cost
    a write each."""
    message: list[bytes | memoryview] = []
    pending: list[bytes | memoryview] = [head]
    for piece in pieces:
        if _size(piece) > _JOIN_LIMIT:
            message.append(b"".join(pending))
            message.append(piece)
            pending = []
        elif piece:
            pending.append(piece)
    if pending:
        message.append(b"".join(pending))
    return message
