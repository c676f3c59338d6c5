"""A loopback gateway in front of real vLLM encoders, as an operator's API gateway would stand: one
listening port per encoder, everything relayed as it came, except where a test switches it:

- a throttled client key: chat completions carrying it get ``429`` (the gateway's quota, checked before
  the encoder is reached), whichever port;
- a broken port: every other chat completion to it gets ``501`` (what vLLM answers only for a
  ``NotImplementedError``: an encoder that says "the client's fault" of everything).

Every call is recorded (port, path, key, whether it is the middleware's canary, the status answered),
so a test can count what each encoder was asked and with which key.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from epd_middleware._canary import CANARY_UUID

CHAT = "/v1/chat/completions"
THROTTLED_MESSAGE = "key over its quota: 3 requests per hour (test gateway)"
BROKEN_MESSAGE = "this encoder is broken: it cannot do anything (test gateway)"
# Hop-by-hop headers and those the relay sets itself.
_NOT_RELAYED = frozenset({"host", "connection", "keep-alive", "content-length", "transfer-encoding"})


@dataclass(frozen=True)
class Call:
    port: int  # index of the upstream encoder
    method: str
    path: str
    authorization: str | None
    canary: bool
    status: int


class Gateway:
    """One ThreadingHTTPServer per upstream, on 127.0.0.1, in this process."""

    def __init__(self, upstreams: Iterable[str], throttled_key: str) -> None:
        self.upstreams = list(upstreams)
        self.throttled = f"Bearer {throttled_key}"
        self.broken: set[int] = set()
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self._client = httpx.Client(timeout=300, limits=httpx.Limits(max_connections=64))
        self._servers = [self._serve(index) for index in range(len(self.upstreams))]

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{server.server_port}" for server in self._servers]

    def chat_calls(
        self, port: int | None = None, *, canary: bool | None = None, since: int = 0
    ) -> list[Call]:
        """Chat completions recorded from the ``since``-th call on, to ``port`` (None: any), canaries
        only or none (None: both)."""
        with self._lock:
            calls = self.calls[since:]
        return [
            call
            for call in calls
            if call.path == CHAT
            and (port is None or call.port == port)
            and (canary is None or call.canary == canary)
        ]

    def mark(self) -> int:
        with self._lock:
            return len(self.calls)

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._client.close()

    def _record(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)

    def _answer(self, index: int, method: str, path: str, headers: dict[str, str], body: bytes) -> Any:
        """The status, content type and body to answer with: the gateway's own, or the encoder's."""
        if method == "POST" and path.split("?", 1)[0] == CHAT:
            # The gateway's own quota first, then the encoder behind it (broken: 501 to everything).
            if headers.get("authorization") == self.throttled:
                return 429, "application/json", _error(THROTTLED_MESSAGE, "RateLimitError", 429)
            if index in self.broken:
                return 501, "application/json", _error(BROKEN_MESSAGE, "NotImplementedError", 501)
        try:
            reply = self._client.request(method, self.upstreams[index] + path, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return 502, "application/json", _error(f"gateway: {exc!r}", "BadGateway", 502)
        return reply.status_code, reply.headers.get("content-type", "application/json"), reply.content

    def _serve(self, index: int) -> ThreadingHTTPServer:
        gateway = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {
                    name.lower(): value
                    for name, value in self.headers.items()
                    if name.lower() not in _NOT_RELAYED
                }
                status, content_type, content = gateway._answer(index, self.command, self.path, headers, body)
                gateway._record(
                    Call(
                        index,
                        self.command,
                        self.path.split("?", 1)[0],
                        headers.get("authorization"),
                        CANARY_UUID.encode() in body,
                        status,
                    )
                )
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PUT = do_DELETE = _relay

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True, name=f"gateway-{index}").start()
        return server


def _error(message: str, kind: str, code: int) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
