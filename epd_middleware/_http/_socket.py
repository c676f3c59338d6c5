"""One connection: an anyio TCP stream, TLS in memory when asked, and whether the server said anything
since the last answer.

Every byte the server sent that the client has not read is in one of three places: the kernel's socket
buffer (a poll of the socket sees it), the TLS buffers (kept here, in memory, so they can be looked at),
or, on asyncio, the queue of anyio's stream protocol, which the event loop fills whenever it saw the
socket readable while a read was pending. :meth:`Connection.quiet` looks at all three before a reuse.

Why not read the socket directly: waiting for readability on a bare socket costs ~28 us on uvloop
(``add_reader`` makes and drops a libuv handle each time), while anyio's stream reads through uvloop's
C transport. Writes are the other way round: a request goes into the socket with one ``writev`` of the
head and every piece of the body while the kernel takes it all (the common case), which spares a send
through the stream per piece, each with its trip round the event loop; only what the kernel does not
take goes through the stream (:meth:`Connection._send_plain`).
"""

from __future__ import annotations

import errno
import os
import select
import ssl
from collections.abc import Callable, Sequence

import anyio
import anyio.abc
from anyio.abc import SocketAttribute

from ._errors import ConnectFailed, ConnectionLost

__all__ = ["Connection", "connect"]

_RECEIVE_SIZE = 256 * 1024
_IOV_MAX = 1024
_STREAM_FAILURES = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


class _TLS:
    """TLS over memory buffers: the socket I/O stays in :class:`Connection`."""

    __slots__ = ("incoming", "obj", "outgoing")

    def __init__(self, context: ssl.SSLContext, server_hostname: str | None) -> None:
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.obj = context.wrap_bio(self.incoming, self.outgoing, server_hostname=server_hostname)


class Connection:
    """A connected stream; ``idle_since`` is set by the pool."""

    __slots__ = ("_direct", "_fd", "_poll", "_queued", "_stream", "_tls", "idle_since")

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self._stream = stream
        self._tls: _TLS | None = None
        # Looked up once: anyio builds its table of extra attributes on every ``extra`` call.
        self._fd = stream.extra(SocketAttribute.raw_socket).fileno()
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)
        self._queued = _queue_probe(stream)
        self._direct = True  # writes may go straight to the socket (nothing waits in the stream's buffer)
        self.idle_since = 0.0

    async def send(self, pieces: Sequence[bytes | memoryview]) -> None:
        try:
            tls = self._tls
            if tls is None:
                await self._send_plain(pieces)
                return
            for piece in pieces:
                tls.obj.write(piece)
                await self._flush()
        except (*_STREAM_FAILURES, ssl.SSLError):
            raise ConnectionLost("connection closed while sending the request") from None

    async def receive(self) -> bytes:
        """The next bytes of the answer; ``b""`` once the server closed (or reset) the connection."""
        tls = self._tls
        if tls is None:
            return await self._receive_raw()
        while True:
            try:
                return tls.obj.read(_RECEIVE_SIZE)
            except ssl.SSLWantReadError:
                await self._flush()  # what TLS itself wants sent first (a key update's answer, say)
                data = await self._receive_raw()
                if data:
                    tls.incoming.write(data)
                else:
                    tls.incoming.write_eof()
            except ssl.SSLZeroReturnError:
                return b""
            except ssl.SSLError:
                # Includes a close without TLS's close_notify: the answer may be cut short, so it is not
                # taken as the end of a close-delimited body.
                raise ConnectionLost("TLS connection broken", answered=True) from None

    async def _send_plain(self, pieces: Sequence[bytes | memoryview]) -> None:
        """Straight into the socket, every piece in one ``writev``, while the kernel takes them all: no copy
        into the transport's buffer and no event-loop round trip per piece (anyio's ``send`` makes one
        each). What the kernel does not take goes through the stream, which waits for the socket (a
        bare wait for writability is refused on a descriptor an asyncio transport owns); from then on
        this connection writes only through the stream, whose buffer a direct write could overtake."""
        if self._direct:
            fd = self._fd
            views = [memoryview(piece).cast("B") for piece in pieces if len(piece)]
            while views:
                batch = views[:_IOV_MAX]
                try:
                    written = os.writev(fd, batch)
                except BlockingIOError:
                    written = 0
                sent = written
                while sent:
                    size = views[0].nbytes
                    if sent < size:
                        views[0] = views[0][sent:]
                        break
                    sent -= size
                    views.pop(0)
                if written < sum(view.nbytes for view in batch):
                    break  # the socket is full
            if not views:
                return
            self._direct = False
            pieces = views
        for piece in pieces:
            # Every byte stream takes a bytes-like object (the transports write it as a buffer).
            await self._stream.send(piece)  # type: ignore[arg-type]

    def quiet(self) -> bool:
        """True when the server sent nothing and did not close since the last answer was read: only then
        may the connection carry another request (anything it sent would be taken as the next answer)."""
        tls = self._tls
        if tls is not None and (tls.obj.pending() or tls.incoming.pending):
            return False
        return not self._queued() and not self._poll.poll(0)

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self._stream.aclose()

    async def _receive_raw(self) -> bytes:
        try:
            return await self._stream.receive(_RECEIVE_SIZE)
        except anyio.EndOfStream:
            return b""
        except _STREAM_FAILURES:
            return b""  # reset: for the reader, the same as a close before the answer ended

    async def _flush(self) -> None:
        assert self._tls is not None
        data = self._tls.outgoing.read()
        if data:
            await self._stream.send(data)

    async def _handshake(self, context: ssl.SSLContext, server_hostname: str | None) -> None:
        self._tls = tls = _TLS(context, server_hostname)
        while True:
            try:
                tls.obj.do_handshake()
            except ssl.SSLWantReadError:
                await self._flush()
                data = await self._receive_raw()
                if not data:
                    raise ConnectFailed("connection closed during the TLS handshake") from None
                tls.incoming.write(data)
                continue
            await self._flush()
            return


def _queue_probe(stream: anyio.abc.SocketStream) -> Callable[[], bool]:
    """Whether the stream holds bytes (or an end) that the client has not read yet.

    On asyncio, anyio's stream protocol queues what the transport read and sets ``read_event`` while its
    queue is not empty or the connection ended (anyio 4: ``_backends/_asyncio.py`` ``StreamProtocol``);
    on trio, anyio reads the socket directly and queues nothing. A stream of any other shape is never
    called quiet: its connections are not reused rather than trusted blindly.
    """
    module = type(stream).__module__
    if module == "anyio._backends._trio":
        return _nothing_queued
    protocol = getattr(stream, "_protocol", None)
    event = getattr(protocol, "read_event", None)
    if module == "anyio._backends._asyncio" and callable(getattr(event, "is_set", None)):
        return lambda: bool(protocol.read_event.is_set())  # type: ignore[union-attr]
    return _unknown_queue


def _why(exc: BaseException) -> str:
    """The errno's name where there is one (ECONNREFUSED ...), else the exception's type."""
    for error in (exc, exc.__cause__, *getattr(exc, "exceptions", ())):
        code = getattr(error, "errno", None)
        if isinstance(code, int) and code in errno.errorcode:
            return errno.errorcode[code]
    return type(exc).__name__


def _nothing_queued() -> bool:
    return False


def _unknown_queue() -> bool:
    return True


async def connect(
    host: str, port: int, *, ssl_context: ssl.SSLContext | None, server_hostname: str | None
) -> Connection:
    """A connection to ``host``:``port`` (TLS when ``ssl_context`` is given). Bounded by the caller's
    timeout."""
    try:
        stream = await anyio.connect_tcp(host, port)
    except (OSError, anyio.BrokenResourceError) as exc:
        raise ConnectFailed(f"connection failed ({_why(exc)})") from None
    connection = Connection(stream)
    if ssl_context is None:
        return connection
    try:
        await connection._handshake(ssl_context, server_hostname)
    except BaseException as exc:
        await connection.aclose()
        if isinstance(exc, (ssl.SSLError, *_STREAM_FAILURES)):
            raise ConnectFailed(f"TLS handshake failed ({type(exc).__name__})") from None
        raise
    return connection
