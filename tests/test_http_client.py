"""The built-in HTTP/1.1 client against scripted servers on real loopback sockets, on asyncio and trio."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import pytest
import trustme
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.tls import TLSListener

from epd_middleware._http import ConnectFailed, ConnectionLost, HTTPClient, ProtocolViolation

pytestmark = pytest.mark.anyio

Reply = Callable[[int, bytes], bytes | None]  # (request number, request head) -> raw answer, None = close


@asynccontextmanager
async def scripted_server(
    reply: Reply, bodies: list[bytes] | None = None
) -> AsyncIterator[tuple[str, list[bytes], list[int]]]:
    """A loopback server answering each request with ``reply``; yields (base URL, request heads, connection
    numbers of each request). Request bodies go into ``bodies`` when given."""
    heads: list[bytes] = []
    connections: list[int] = []
    opened = 0
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def serve(stream: anyio.abc.SocketStream) -> None:
        nonlocal opened
        opened += 1
        number = opened
        reader = BufferedByteReceiveStream(stream)
        async with stream:
            while True:
                try:
                    head = await reader.receive_until(b"\r\n\r\n", 65536)
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                    return
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.receive_exactly(length) if length else b""
                if bodies is not None:
                    bodies.append(body)
                heads.append(head)
                connections.append(number)
                answer = reply(len(heads), head)
                if answer is None:
                    return
                await stream.send(answer)

    async with anyio.create_task_group() as group:
        group.start_soon(listener.serve, serve)
        try:
            yield f"http://127.0.0.1:{port}", heads, connections
        finally:
            group.cancel_scope.cancel()


def ok(body: bytes = b'{"ok": true}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def test_keep_alive_reuses_one_connection() -> None:
    async with scripted_server(lambda n, head: ok(b"%d" % n)) as (url, heads, connections):
        client = HTTPClient(connect_timeout=1)
        for n in range(1, 4):
            assert await client.request("POST", f"{url}/v1/chat/completions", b"{}", {"x-a": "1"}) == (
                200,
                b"%d" % n,
            )
        await client.aclose()
    assert connections == [1, 1, 1]
    assert heads[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"content-length: 2" in heads[0]
    assert b"x-a: 1" in heads[0]
    assert b"host: 127.0.0.1:" in heads[0]


@pytest.mark.parametrize("sizes", [(10, 200_000, 7, 300_000, 3), (70_000,), (5, 6), ()])
async def test_a_body_in_pieces_arrives_whole(sizes: tuple[int, ...]) -> None:
    pieces: list[bytes | memoryview] = [
        memoryview(bytes([65 + n]) * size) if n % 2 else bytes([65 + n]) * size
        for n, size in enumerate(sizes)
    ]
    bodies: list[bytes] = []
    async with scripted_server(lambda n, head: ok(), bodies) as (url, heads, _):
        client = HTTPClient(connect_timeout=1)
        for _ in range(2):  # and again on the kept-alive connection
            assert (await client.request("POST", f"{url}/x", pieces))[0] == 200
        await client.aclose()
    whole = b"".join(pieces)
    assert bodies == [whole, whole]
    assert b"content-length: %d" % len(whole) in heads[0].split(b"\r\n")


@pytest.mark.parametrize(
    "sizes",
    [
        (8 << 20, 8 << 20, 8 << 20),  # more than the kernel takes at once: the rest through the stream
        tuple(100 + n % 7 for n in range(2500)),  # more pieces than one writev takes
    ],
    ids=["larger-than-the-socket-buffer", "more-pieces-than-iov-max"],
)
async def test_a_body_the_socket_cannot_take_at_once_arrives_whole_and_in_order(
    sizes: tuple[int, ...],
) -> None:
    """Pieces go straight into the socket while it takes them; once it does not, the rest goes through the
    stream and so does everything after it on that connection: no byte overtakes another, then or on the
    next requests of the kept-alive connection."""
    pieces: list[bytes | memoryview] = [
        memoryview(bytes([65 + n % 26]) * size) if n % 2 else bytes([65 + n % 26]) * size
        for n, size in enumerate(sizes)
    ]
    small = [b"x" * 10, memoryview(b"y" * 20)]
    bodies: list[bytes] = []
    async with scripted_server(lambda n, head: ok(), bodies) as (url, _, connections):
        client = HTTPClient(connect_timeout=1)
        for body in (pieces, small, pieces, small):
            assert (await client.request("POST", f"{url}/x", body))[0] == 200
        await client.aclose()
    whole, little = b"".join(pieces), b"".join(small)
    assert [len(body) for body in bodies] == [len(whole), len(little), len(whole), len(little)]
    assert bodies == [whole, little, whole, little]
    assert connections == [1, 1, 1, 1]


async def test_chunked_and_close_delimited_answers() -> None:
    answers = {
        1: b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        b"4\r\nabcd\r\n3;ext=1\r\nefg\r\n0\r\nx-trailer: 1\r\n\r\n",
        2: b"HTTP/1.1 500 Internal Server Error\r\nconnection: close\r\ncontent-length: 2\r\n\r\nno",
    }

    def reply(n: int, head: bytes) -> bytes:
        return answers[n]

    async with scripted_server(reply) as (url, _, connections):
        client = HTTPClient(connect_timeout=1)
        assert await client.request("POST", url + "/a", b"x") == (200, b"abcdefg")
        assert await client.request("POST", url + "/a", b"x") == (500, b"no")  # connection: close
        assert client._origins[url].idle == []
        await client.aclose()
    assert connections == [1, 1]


async def test_answer_delimited_by_close() -> None:
    async def serve(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            reader = BufferedByteReceiveStream(stream)
            await reader.receive_until(b"\r\n\r\n", 65536)
            await stream.send(b"HTTP/1.0 200 OK\r\n\r\nuntil close")

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as group:
        group.start_soon(listener.serve, serve)
        client = HTTPClient(connect_timeout=1)
        assert await client.request("GET", f"http://127.0.0.1:{port}/health") == (200, b"until close")
        group.cancel_scope.cancel()


async def test_a_pooled_connection_dropped_without_an_answer_is_retried_on_a_new_one() -> None:
    # The server reads request 2 on the pooled connection and closes it without answering. Encoder
    # requests are idempotent in effect (same uuid, same embedding), so it is sent once more, on a new
    # connection; a fresh connection that fails the same way is not retried.
    async with scripted_server(lambda n, head: None if n in (2, 4, 5) else ok()) as (
        url,
        _heads,
        connections,
    ):
        client = HTTPClient(connect_timeout=1)
        assert (await client.request("POST", url + "/a", b"{}"))[0] == 200
        assert (await client.request("POST", url + "/a", b"{}"))[0] == 200
        assert connections == [1, 1, 2]
        # Request 4 on the pooled connection 2 is dropped, its retry (5) on a new connection too: fails.
        with pytest.raises(ConnectionLost):
            await client.request("POST", url + "/a", b"{}")
        await client.aclose()
    assert connections == [1, 1, 2, 2, 3]


async def test_stale_pooled_connection_is_retried_once() -> None:
    closes: list[anyio.abc.SocketStream] = []

    async def serve(stream: anyio.abc.SocketStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        await reader.receive_until(b"\r\n\r\n", 65536)
        await reader.receive_exactly(2)
        await stream.send(ok())
        closes.append(stream)
        await stream.aclose()  # closes right after answering, while the client pools the connection

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as group:
        group.start_soon(listener.serve, serve)
        client = HTTPClient(connect_timeout=1)
        for _ in range(3):
            assert (await client.request("POST", f"http://127.0.0.1:{port}/a", b"{}"))[0] == 200
            await anyio.sleep(0.05)
        await client.aclose()
        group.cancel_scope.cancel()
    assert len(closes) == 3


async def test_connection_refused_and_garbage() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    client = HTTPClient(connect_timeout=1)
    with pytest.raises(ConnectFailed):
        await client.request("GET", f"http://127.0.0.1:{port}/health")

    async with scripted_server(lambda n, head: b"SSH-2.0-OpenSSH\r\n\r\n") as (url, _, _c):
        with pytest.raises(ProtocolViolation):
            await client.request("GET", url + "/health")
    async with scripted_server(lambda n, head: b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc") as (
        url,
        _,
        _c,
    ):
        with anyio.fail_after(5):
            with pytest.raises(TimeoutError):
                with anyio.fail_after(0.3):
                    await client.request("GET", url + "/health")


async def test_a_cancelled_request_never_returns_its_connection_to_the_pool() -> None:
    async with scripted_server(lambda n, head: b"" if n == 1 else ok()) as (url, _, connections):
        client = HTTPClient(connect_timeout=1)
        with anyio.move_on_after(0.2):
            await client.request("POST", url + "/a", b"{}")  # no answer: cancelled mid-exchange
        assert (await client.request("POST", url + "/a", b"{}"))[0] == 200
        await client.aclose()
    assert connections == [1, 2]


@asynccontextmanager
async def tls_server(reply: Reply, ca: trustme.CA) -> AsyncIterator[tuple[str, list[int]]]:
    """A TLS loopback server answering each request with ``reply``; yields (base URL, connection numbers
    of each request)."""
    connections: list[int] = []
    opened = 0
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    listener = TLSListener(await anyio.create_tcp_listener(local_host="127.0.0.1"), context)
    port = listener.listener.extra(anyio.abc.SocketAttribute.local_port)

    async def serve(stream: anyio.abc.ByteStream) -> None:
        nonlocal opened
        opened += 1
        number = opened
        reader = BufferedByteReceiveStream(stream)
        try:
            while True:
                try:
                    head = await reader.receive_until(b"\r\n\r\n", 65536)
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    if length:
                        await reader.receive_exactly(length)
                    connections.append(number)
                    answer = reply(len(connections), head)
                    if answer is None:
                        return
                    await stream.send(answer)
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, ssl.SSLError):
                    return
        finally:
            # The client drops connections without TLS's goodbye; the server's own goodbye may then fail.
            with contextlib.suppress(ssl.SSLError, anyio.BrokenResourceError, OSError):
                await stream.aclose()

    async with anyio.create_task_group() as group:
        group.start_soon(listener.serve, serve)
        try:
            yield f"https://127.0.0.1:{port}", connections
        finally:
            group.cancel_scope.cancel()


async def test_https_with_keep_alive() -> None:
    ca = trustme.CA()
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    big = b"x" * 300_000
    async with tls_server(lambda n, head: ok(b"%d" % n), ca) as (url, connections):
        client = HTTPClient(connect_timeout=2, ssl_context=client_context)
        for n in range(1, 4):
            assert await client.request("POST", f"{url}/v1/chat/completions", [b"{", big, b"}"]) == (
                200,
                b"%d" % n,
            )
        await client.aclose()
    assert connections == [1, 1, 1]


async def test_https_refuses_a_certificate_it_does_not_trust() -> None:
    async with tls_server(lambda n, head: ok(), trustme.CA()) as (url, _):
        client = HTTPClient(connect_timeout=2)  # the system's trust store: the test CA is not in it
        with pytest.raises(ConnectFailed, match="TLS handshake failed"):
            await client.request("GET", f"{url}/health")


async def test_https_stray_answer_while_idle_is_never_taken_as_the_next_answer() -> None:
    ca = trustme.CA()
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    answers = {1: ok(b"first") + ok(b"stray"), 2: ok(b"second")}
    async with tls_server(lambda n, head: answers[n], ca) as (url, connections):
        client = HTTPClient(connect_timeout=2, ssl_context=client_context)
        assert await client.request("GET", f"{url}/a") == (200, b"first")
        assert await client.request("GET", f"{url}/a") == (200, b"second")
        await client.aclose()
    assert connections == [1, 2]


async def test_a_pooled_connection_the_server_wrote_to_while_idle_is_closed() -> None:
    async def serve(stream: anyio.abc.SocketStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        async with stream:
            while True:
                try:
                    await reader.receive_until(b"\r\n\r\n", 65536)
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                    return
                await stream.send(ok(b"mine"))
                await anyio.sleep(0.05)
                await stream.send(ok(b"stray"))  # after the client read its answer and pooled us

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as group:
        group.start_soon(listener.serve, serve)
        client = HTTPClient(connect_timeout=1)
        for _ in range(3):
            assert await client.request("GET", f"http://127.0.0.1:{port}/a") == (200, b"mine")
            await anyio.sleep(0.1)
        await client.aclose()
        group.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nabc", ProtocolViolation),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n-1\r\nx\r\n0\r\n\r\n", ProtocolViolation),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nabXX0\r\n\r\n", ProtocolViolation),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nabc", ProtocolViolation),
        (b"HTTP/1.1 700 Odd\r\ncontent-length: 0\r\n\r\n", ProtocolViolation),
        (b"HTTP/1.1 101 Switching\r\nupgrade: x\r\nconnection: upgrade\r\n\r\n", ProtocolViolation),
        (b"HTTP/1.1 200 OK\r\nx: " + b"a" * 70_000 + b"\r\n\r\n", ProtocolViolation),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nab", ConnectionLost),
        (b"HTTP/1.1 200 OK\r\ncontent-len", ConnectionLost),
        (b"", ConnectionLost),
    ],
)
async def test_framing_violations_raise_the_documented_errors(answer: bytes, error: type[Exception]) -> None:
    async def serve(stream: anyio.abc.SocketStream) -> None:
        async with stream:  # answers, then closes: a truncated answer stays truncated
            await BufferedByteReceiveStream(stream).receive_until(b"\r\n\r\n", 65536)
            await stream.send(answer)

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with anyio.create_task_group() as group:
        group.start_soon(listener.serve, serve)
        client = HTTPClient(connect_timeout=1)
        with anyio.fail_after(5), pytest.raises(error):
            await client.request("GET", f"http://127.0.0.1:{port}/a")
        await client.aclose()
        group.cancel_scope.cancel()


async def test_informational_answers_are_skipped() -> None:
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n" + ok(b"final")
    async with scripted_server(lambda n, head: answer if n == 1 else ok(b"next")) as (url, _, connections):
        client = HTTPClient(connect_timeout=1)
        assert await client.request("GET", url + "/a") == (200, b"final")
        assert await client.request("GET", url + "/a") == (200, b"next")
        await client.aclose()
    assert connections == [1, 1]


async def test_ipv6_literal_origin() -> None:
    try:
        listener = await anyio.create_tcp_listener(local_host="::1")
    except OSError:
        pytest.skip("no IPv6 loopback here")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    heads: list[bytes] = []

    async def serve(stream: anyio.abc.SocketStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        async with stream:
            heads.append(await reader.receive_until(b"\r\n\r\n", 65536))
            await stream.send(ok(b"v6"))

    async with anyio.create_task_group() as group:
        group.start_soon(listener.serve, serve)
        client = HTTPClient(connect_timeout=1)
        assert await client.request("GET", f"http://[::1]:{port}/health") == (200, b"v6")
        await client.aclose()
        group.cancel_scope.cancel()
    assert b"host: [::1]:%d" % port in heads[0]
