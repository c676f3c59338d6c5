"""A vLLM encoder stand-in on a raw loopback socket whose HTTP framing is scripted byte by byte.

It answers an encoder request as vLLM 0.32 does (``id`` "chatcmpl-<x-request-id>", each part's uuid as
its hash, ``item_indices``, ``metadata``), then wraps that answer in the framing its ``mode`` names: the
odd framings real servers and proxies produce (1xx answers, bytes after the answer, bad chunks, two
lengths, truncation ...). Stray answers carry a handle no request asked for ("stray-N") and no id, so
only the client's framing rules can keep them away from the next request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

STRAY_GRID = [1, 2, 2]


def answer_json(body: dict[str, Any], request_id: str | None) -> bytes:
    entries = {
        part["uuid"]: {"item_indices": [index], "metadata": {"image_grid_thw": [1, 4, 4]}}
        for index, part in enumerate(body["messages"][0]["content"])
    }
    answer: dict[str, Any] = {"object": "chat.completion", "choices": [], "ec_transfer_params": entries}
    if request_id is not None:
        answer["id"] = f"chatcmpl-{request_id}"
    return json.dumps(answer).encode()


def stray_json(number: int) -> bytes:
    entries = {f"stray-{number}": {"item_indices": [0], "metadata": {"image_grid_thw": STRAY_GRID}}}
    return json.dumps({"object": "chat.completion", "ec_transfer_params": entries}).encode()


def framed(payload: bytes, *, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status,
        len(payload),
        extra,
        payload,
    )


def chunked(payload: bytes, *, after_chunk: bytes = b"\r\n", extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n%s\r\n"
        b"%x\r\n%s%s0\r\n\r\n" % (extra, len(payload), payload, after_chunk)
    )


# mode -> what the client must make of it: "ok" (every request answered with its own handles), "error"
# (every encoder call fails cleanly), "either" (depends on timing or on framing the client may accept).
MODES: dict[str, str] = {
    "ok": "ok",
    "100 continue first": "ok",
    "two 1xx first": "ok",
    "answer then stray answer": "ok",
    "answer then stray bytes": "ok",
    "stray answer while idle": "ok",
    "chunked": "ok",
    "chunk extensions and trailers": "ok",
    "close-delimited HTTP/1.0": "ok",
    "connection close": "ok",
    "answer before the body is read": "ok",
    "chunk without CRLF then stray answer": "error",
    "negative chunk size": "error",
    "bad chunk size": "error",
    "two content-lengths": "error",
    "content-length and chunked": "error",
    "transfer-encoding not chunked": "error",
    "status 600": "error",
    "status 099": "error",
    "101 switching protocols": "error",
    "header block over the limit": "error",
    "body over the limit": "error",
    "not HTTP": "error",
    "truncated in the status line": "error",
    "truncated in the headers": "error",
    "truncated in the body": "error",
    "truncated in a chunk": "error",
    "closed without an answer": "error",
    "no answer": "error",
    "another request's answer": "error",
}


@dataclass
class RawUpstream:
    """The server's script and what it saw."""

    mode: str = "ok"
    connections: int = 0
    requests: int = 0
    strays: int = 0
    url: str = ""
    request_ids: list[str] = field(default_factory=list)

    def _stray(self) -> bytes:
        self.strays += 1
        return framed(stray_json(self.strays))

    async def serve(self, stream: anyio.abc.SocketStream) -> None:
        self.connections += 1
        reader = BufferedByteReceiveStream(stream)
        async with stream:
            try:
                while await self._exchange(stream, reader):
                    pass
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError):
                return

    async def _exchange(self, stream: anyio.abc.SocketStream, reader: BufferedByteReceiveStream) -> bool:
        """One request; False when the connection is to be closed."""
        head = await reader.receive_until(b"\r\n\r\n", 65536)
        length, request_id = 0, None
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
            elif name.lower() == b"x-request-id":
                request_id = value.strip().decode()
        mode = self.mode
        if head.startswith(b"GET /v1/models"):
            cards = [{"id": name, "root": name} for name in ("tiny-qwen2-vl", "m")]
            await stream.send(framed(json.dumps({"data": cards}).encode()))
            return True
        if head.startswith(b"GET"):  # health probes: always fine
            await stream.send(framed(b""))
            return True
        self.requests += 1
        if request_id is not None:
            self.request_ids.append(request_id)
        if mode == "answer before the body is read":
            # Nothing of the body is needed for a refusal: answer first, read the body after.
            await stream.send(framed(b'{"error": {"message": "busy"}}', status=b"503 Service Unavailable"))
            await reader.receive_exactly(length)
            return True
        body = json.loads(await reader.receive_exactly(length))
        answer = answer_json(body, request_id)
        send = stream.send
        if mode == "ok":
            await send(framed(answer))
        elif mode == "100 continue first":
            await send(b"HTTP/1.1 100 Continue\r\n\r\n" + framed(answer))
        elif mode == "two 1xx first":
            await send(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n")
            await anyio.sleep(0.01)
            await send(framed(answer))
        elif mode == "answer then stray answer":
            await send(framed(answer) + self._stray())
        elif mode == "answer then stray bytes":
            await send(framed(answer))
            await anyio.sleep(0.01)
            await send(b"HTTP/1.1 2")
        elif mode == "stray answer while idle":
            await send(framed(answer))
            await anyio.sleep(0.05)  # the client has read its answer and pooled the connection
            await send(self._stray())
        elif mode == "chunked":
            await send(chunked(answer))
        elif mode == "chunk extensions and trailers":
            half = len(answer) // 2
            await send(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                b"%x;name=value\r\n%s\r\n%x\r\n%s\r\n0\r\nx-trailer: 1\r\n\r\n"
                % (half, answer[:half], len(answer) - half, answer[half:])
            )
        elif mode == "close-delimited HTTP/1.0":
            await send(b"HTTP/1.0 200 OK\r\ncontent-type: application/json\r\n\r\n" + answer)
            return False
        elif mode == "connection close":
            await send(framed(answer, extra=b"connection: close\r\n"))
            await anyio.sleep(0.05)  # a client that pools the connection anyway would reuse a dead one
            return False
        elif mode == "chunk without CRLF then stray answer":
            await send(chunked(answer, after_chunk=b"") + self._stray())
        elif mode == "negative chunk size":
            await send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n-5\r\nhello\r\n0\r\n\r\n")
        elif mode == "bad chunk size":
            await send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n")
        elif mode == "two content-lengths":
            await send(framed(answer, extra=b"content-length: %d\r\n" % (len(answer) + 40)) + self._stray())
        elif mode == "content-length and chunked":
            await send(chunked(answer, extra=b"content-length: %d\r\n" % len(answer)))
        elif mode == "transfer-encoding not chunked":
            await send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n" + answer)
            return False
        elif mode == "status 600":
            await send(framed(answer, status=b"600 Odd"))
        elif mode == "status 099":
            await send(framed(answer, status=b"099 Odd"))
        elif mode == "101 switching protocols":
            await send(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n")
            await send(framed(answer))
        elif mode == "header block over the limit":
            await send(framed(answer, extra=b"x-filler: " + b"a" * 70_000 + b"\r\n"))
        elif mode == "body over the limit":
            await send(framed(answer + b" " * 5000))  # the tests lower the client's limit
        elif mode == "not HTTP":
            await send(b"SSH-2.0-OpenSSH_9.6\r\n\r\n" + answer)
        elif mode == "truncated in the status line":
            await send(b"HTTP/1.1 20")
            return False
        elif mode == "truncated in the headers":
            await send(b"HTTP/1.1 200 OK\r\ncontent-type: appl")
            return False
        elif mode == "truncated in the body":
            await send(framed(answer)[:-10])
            return False
        elif mode == "truncated in a chunk":
            await send(chunked(answer)[:-20])
            return False
        elif mode == "closed without an answer":
            return False
        elif mode == "no answer":
            await anyio.sleep_forever()
        elif mode == "another request's answer":
            other = json.loads(stray_json(0))
            other["id"] = "chatcmpl-someone-else-enc0"
            await send(framed(json.dumps(other).encode()))
        else:
            raise AssertionError(f"unknown mode {mode!r}")
        return True


@asynccontextmanager
async def raw_upstream(mode: str = "ok", host: str = "127.0.0.1") -> AsyncIterator[RawUpstream]:
    upstream = RawUpstream(mode)
    listener = await anyio.create_tcp_listener(local_host=host)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    upstream.url = f"http://{host}:{port}"
    async with anyio.create_task_group() as group:
        group.start_soon(listener.serve, upstream.serve)
        try:
            yield upstream
        finally:
            group.cancel_scope.cancel()
