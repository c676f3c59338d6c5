"""The built-in HTTP/1.1 client against scripted servers on real loopback sockets, on asyncio and trio."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

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
