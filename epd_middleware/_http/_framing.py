"""Reading one answer off a connection, framed by llhttp (``httptools``, the parser uvicorn uses, kept and
fuzzed by the Node.js project) and held to a strict reading of HTTP/1.1 (RFC 9112).

- Informational answers (1xx) are skipped: the final answer follows them (RFC 9110 allows any number).
  A 101 (a protocol switch, never asked for) is a violation.
- llhttp refuses repeated ``content-length`` headers, ``content-length`` beside ``transfer-encoding``,
  and bad chunk framing (sizes, the CRLF after each chunk). On top of it: a ``transfer-encoding`` that
  does not end in ``chunked``, a status outside 100-599, a head over 64 KiB and a body over 256 MiB are
  violations.
- An answer with neither length nor chunking ends when the server closes (RFC 9112 6.3); then, and after
  ``connection: close`` or an HTTP/1.0 answer without keep-alive, the connection is not reused.
- Anything after the end of the answer (a second answer nobody asked for, stray bytes) makes the
  connection unusable: the answer itself is still this request's, the next request must not see it.
"""

from __future__ import annotations

from typing import Protocol

import httptools

from ._errors import ConnectionLost, ProtocolViolation

__all__ = ["MAX_BODY", "MAX_HEAD", "read_answer"]

MAX_HEAD = 64 * 1024
MAX_BODY = 256 * 1024 * 1024
_NO_BODY = (204, 304)


class _Source(Protocol):
    async def receive(self) -> bytes: ...


class _Stop(Exception):
    """Raised inside a parser callback to stop parsing; the reason is on the reader."""


class _Answer:
    """llhttp's callbacks for one exchange: what the final answer holds, and what went wrong."""

    __slots__ = (
        "chunks",
        "done",
        "framed",
        "head_done",
        "head_size",
        "keep",
        "max_body",
        "parser",
        "problem",
        "size",
        "status",
        "stray",
        "transfer_encoding",
    )

    def __init__(self, max_body: int | None) -> None:
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.max_body = MAX_BODY if max_body is None else max_body
        self.status = 0
        self.head_done = False
        self.head_size = 0
        self.done = False
        self.keep = False
        self.stray = False
        self.framed = False
        self.transfer_encoding: bytes | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.problem: str | None = None

    def _refuse(self, problem: str) -> None:
        self.problem = problem
        raise _Stop

    def on_message_begin(self) -> None:
        if self.done:
            self.stray = True  # bytes after the final answer
            raise _Stop

    def on_header(self, name: bytes, value: bytes) -> None:
        # Every head of the exchange counts (1xx ones too): a server cannot make the client hold more.
        self.head_size += len(name) + len(value) + 4
        if self.head_size > MAX_HEAD:
            self._refuse("answer headers too large")
        name = name.lower()
        if name == b"content-length":
            self.framed = True
        elif name == b"transfer-encoding":
            seen = self.transfer_encoding
            self.transfer_encoding = value if seen is None else seen + b"," + value

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        status = self.parser.get_status_code()
        if not 100 <= status <= 599:
            self._refuse(f"status {status} is outside 100-599")
        coding = self.transfer_encoding
        if coding is not None:
            if not coding.rstrip(b" \t").lower().endswith(b"chunked"):
                self._refuse("transfer-encoding does not end in chunked")
            self.framed = True
        self.status = status
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.max_body:
            self._refuse("answer body too large")
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        if self.status < 200:
            # Informational: the final answer is still to come, under a head of its own.
            self.head_done = self.framed = False
            self.transfer_encoding = None
            return
        assert self.parser is not None
        self.done = True
        self.keep = self.parser.should_keep_alive()

    def answer(self, keep: bool) -> tuple[int, bytes, bool]:
        self.parser = None  # the parser holds this object: no cycle left for the collector
        chunks = self.chunks
        return self.status, chunks[0] if len(chunks) == 1 else b"".join(chunks), keep


async def read_answer(source: _Source, max_body: int | None = None) -> tuple[int, bytes, bool]:
    """The final answer on ``source``: (status, body, whether the connection may be reused); a body over
    ``max_body`` bytes (default :data:`MAX_BODY`) is a violation.

    Raises :class:`ProtocolViolation` for a malformed answer and :class:`ConnectionLost` when the server
    closes before the answer is complete (``answered`` once any byte of it arrived).
    """
    answer = _Answer(max_body)
    assert answer.parser is not None
    feed = answer.parser.feed_data
    head_bytes = 0
    while True:
        data = await source.receive()
        if not data:
            if answer.head_done and not answer.framed and answer.status not in _NO_BODY:
                return answer.answer(False)  # delimited by the close
            answer.parser = None
            if head_bytes:
                raise ConnectionLost("connection closed before a complete answer", answered=True)
            raise ConnectionLost("connection closed before an answer")
        if not answer.head_done:
            head_bytes += len(data)
        try:
            feed(data)
        except httptools.HttpParserUpgrade:
            answer.parser = None
            raise ProtocolViolation("the server switched protocols (101)") from None
        except httptools.HttpParserError as exc:
            if not answer.stray:
                answer.parser = None
                raise ProtocolViolation(answer.problem or f"malformed answer: {exc}") from None
        if answer.done:
            return answer.answer(answer.keep and not answer.stray)
        if not answer.head_done and head_bytes > MAX_HEAD:
            answer.parser = None
            raise ProtocolViolation("answer headers too large")
