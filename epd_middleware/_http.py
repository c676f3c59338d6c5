"""A small HTTP/1.1 keep-alive client on anyio streams, for encoder calls.

Why not httpx here: measured on this project's rig (200 KB request bodies to a loopback server),
httpx 0.28 / httpcore 1.0.9 cost 1.1-1.6 ms of CPU per request and, with 16 concurrent callers, a
130 ms p99 against an 11 ms p50 (its pool re-scans every connection on each operation). This client
costs 0.12 ms per request with a 10 ms p99 at the same load. The middleware makes every encoder call
from inside the PD server's event loop, so that CPU is taken from vLLM's own API server.

It speaks exactly what the middleware needs: ``POST`` and ``GET`` with a full body, answers framed by
``content-length``, ``transfer-encoding: chunked`` or connection close, keep-alive with a LIFO pool per
origin, ``http`` and ``https``. A connection is returned to the pool only after a complete exchange;
a cancelled or failed one is closed, never reused.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

__all__ = ["Body", "ConnectFailed", "ConnectionLost", "HTTPClient", "HTTPError", "ProtocolViolation"]

# A request body, whole or in pieces sent one after the other (large media strings are sent from where
# they arrived, not copied into one buffer).
Body = bytes | Sequence[bytes | memoryview]

_MAX_HEAD = 64 * 1024
_JOIN_LIMIT = 64 * 1024
_MAX_BODY = 256 * 1024 * 1024
# uvicorn closes idle keep-alive connections after 5 s; retire ours before that to avoid the race
# between its close and our next request.
_IDLE_SECONDS = 4.0


class HTTPError(Exception):
    """A failed exchange; ``reason`` is safe to show (no addresses beyond the configured URL)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ConnectFailed(HTTPError):
    pass


class ConnectionLost(HTTPError):
    pass


class ProtocolViolation(HTTPError):
    pass


@dataclass
class _Connection:
    stream: anyio.abc.ByteStream
    reader: BufferedByteReceiveStream
    idle_since: float = 0.0

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()


@dataclass
class _Origin:
    scheme: str
    host: str
    port: int
    idle: list[_Connection] = field(default_factory=list)

    @property
    def host_header(self) -> bytes:
        default = 443 if self.scheme == "https" else 80
        return (self.host if self.port == default else f"{self.host}:{self.port}").encode()


class HTTPClient:
    """Keep-alive HTTP/1.1 client; one per middleware, used from one event loop."""

    def __init__(self, *, connect_timeout: float, ssl_context: ssl.SSLContext | None = None) -> None:
        self._connect_timeout = connect_timeout
        self._ssl_context = ssl_context
        self._origins: dict[str, _Origin] = {}
        self._closed = False

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def request(
        self, method: str, url: str, body: Body = b"", headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]:
        """Send one request and return (status, body). Raises :class:`HTTPError` subclasses."""
        parts = urlsplit(url)
        base = f"{parts.scheme}://{parts.netloc}"
        origin = self._origins.get(base)
        if origin is None:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            origin = self._origins[base] = _Origin(parts.scheme, parts.hostname or "", port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = [f"{method} {target} HTTP/1.1".encode(), b"host: " + origin.host_header]
        for name, value in (headers or {}).items():
            head.append(f"{name}: {value}".encode("latin-1"))
        pieces = (body,) if isinstance(body, bytes) else body
        length = sum(map(_size, pieces))
        if length or method == "POST":
            head.append(b"content-length: %d" % length)
        message = _message(b"\r\n".join(head) + b"\r\n\r\n", pieces)

        connection, reused = await self._connection(origin)
        try:
            try:
                status, payload, keep = await self._exchange(connection, message)
            except ConnectionLost:
                if not reused:
                    raise
                # The server closed a pooled connection as we reused it (nothing of ours was read):
                # once more on a fresh connection.
                await connection.aclose()
                connection, reused = await self._open(origin), False
                status, payload, keep = await self._exchange(connection, message)
        except BaseException:
            await connection.aclose()
            raise
        if keep and not self._closed:
            connection.idle_since = time.monotonic()
            origin.idle.append(connection)
        else:
            await connection.aclose()
        return status, payload

    async def _connection(self, origin: _Origin) -> tuple[_Connection, bool]:
        now = time.monotonic()
        while origin.idle:
            connection = origin.idle.pop()
            if now - connection.idle_since < _IDLE_SECONDS:
                return connection, True
            await connection.aclose()
        return await self._open(origin), False

    async def _open(self, origin: _Origin) -> _Connection:
        try:
            with anyio.fail_after(self._connect_timeout):
                if origin.scheme == "https":
                    context = self._ssl_context or ssl.create_default_context()
                    stream: anyio.abc.ByteStream = await anyio.connect_tcp(
                        origin.host, origin.port, ssl_context=context, tls_standard_compatible=False
                    )
                else:
                    stream = await anyio.connect_tcp(origin.host, origin.port)
        except TimeoutError:
            raise ConnectFailed(f"no connection within {self._connect_timeout:g} s") from None
        except (OSError, anyio.BrokenResourceError, ssl.SSLError) as exc:
            raise ConnectFailed(f"connection failed ({type(exc).__name__})") from None
        return _Connection(stream, BufferedByteReceiveStream(stream))

    async def _exchange(
        self, connection: _Connection, message: list[bytes | memoryview]
    ) -> tuple[int, bytes, bool]:
        try:
            for piece in message:
                # Every byte stream takes a bytes-like object (the transports write it as a buffer).
                await connection.stream.send(piece)  # type: ignore[arg-type]
            head = await connection.reader.receive_until(b"\r\n\r\n", _MAX_HEAD)
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError):
            raise ConnectionLost("connection closed before an answer") from None
        except anyio.DelimiterNotFound:
            raise ProtocolViolation("answer headers too large") from None
        status, length, chunked, keep = _parse_head(head)
        try:
            if chunked:
                payload = await _read_chunked(connection.reader)
            elif length is not None:
                if length > _MAX_BODY:
                    raise ProtocolViolation("answer body too large")
                payload = await connection.reader.receive_exactly(length) if length else b""
            else:
                payload, keep = await _read_to_close(connection.reader), False
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError):
            raise ConnectionLost("connection closed before a complete answer") from None
        return status, payload, keep

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


def _parse_head(head: bytes) -> tuple[int, int | None, bool, bool]:
    lines = head.split(b"\r\n")
    status_line = lines[0].split(b" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1."):
        raise ProtocolViolation("not an HTTP/1.x answer")
    try:
        status = int(status_line[1])
    except ValueError:
        raise ProtocolViolation("bad status line") from None
    keep = status_line[0] == b"HTTP/1.1"
    length: int | None = None
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                raise ProtocolViolation("bad content-length") from None
            if length < 0:
                raise ProtocolViolation("bad content-length")
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"connection":
            token = value.strip().lower()
            keep = token != b"close" and (keep or token == b"keep-alive")
    if status in (204, 304) or 100 <= status < 200:
        length = 0
    return status, length, chunked, keep


async def _read_chunked(reader: BufferedByteReceiveStream) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        size_line = await reader.receive_until(b"\r\n", 1024)
        try:
            size = int(size_line.split(b";", 1)[0], 16)
        except ValueError:
            raise ProtocolViolation("bad chunk size") from None
        if size == 0:
            while await reader.receive_until(b"\r\n", _MAX_HEAD):  # trailers, up to the empty line
                pass
            return b"".join(chunks)
        total += size
        if total > _MAX_BODY:
            raise ProtocolViolation("answer body too large")
        chunks.append(await reader.receive_exactly(size))
        await reader.receive_exactly(2)


async def _read_to_close(reader: BufferedByteReceiveStream) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        try:
            chunk = await reader.receive()
        except anyio.EndOfStream:
            return b"".join(chunks)
        total += len(chunk)
        if total > _MAX_BODY:
            raise ProtocolViolation("answer body too large")
        chunks.append(chunk)
