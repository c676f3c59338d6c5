"""The package's logger, its place in vLLM's logging when the middleware runs inside vLLM, and the request
id every line about a request carries.

The id is set once per request (:func:`request_scope`, in the exchange) in a context variable, which every
task the request starts inherits (encoder and prefill calls, their failovers, an ejection one of them
causes); a filter on the logger puts it in front of each line written meanwhile, and on the record
(``request_id``) for the JSON lines.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import secrets
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import msgspec

from ._protocol import REQUEST_ID_HEADER

__all__ = ["adopt_vllm_logging", "log_as_json", "logger", "new_request_id", "request_id_of", "request_scope"]

logger = logging.getLogger("epd_middleware")

_request_id: ContextVar[str | None] = ContextVar("epd_request_id", default=None)
# A client may send any id: what reaches a log line is printable ASCII, and not a screenful.
_MAX_ID = 128
_encode = msgspec.json.Encoder().encode


class _RequestIdFilter(logging.Filter):
    """Puts the current request's id in front of each line (and on the record as ``request_id``), and
    makes the line one line: a line quotes what clients wrote (a refused URL, vLLM's echo of it in an
    encoder's answer), and a line break or another control character in it would write a second,
    forged line (``request victim-7: answered 200``) or a terminal's escape. They are escaped as Python
    writes them (``\\n``, ``\\x1b``, ``\\u2028``), and lone surrogates too, which no stream encodes."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = _request_id.get()
        record.request_id = request_id
        if getattr(record, "epd_prefixed", False):
            return True
        try:
            message = record.getMessage()
        except Exception:  # a format that does not fit its arguments: logging's own handler reports it
            return True
        if _CONTROL.search(message) is not None:
            message = _CONTROL.sub(_escape, message)
        # The message is final: no argument is formatted into it again (a '%' in it stays a '%').
        record.msg = f"request {request_id}: {message}" if request_id is not None else message
        record.args = None
        record.epd_prefixed = True
        return True


# C0 and C1 controls, DEL, the Unicode line and paragraph separators, and lone surrogates.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    return match.group().encode("unicode_escape", "backslashreplace").decode("ascii")


logger.addFilter(_RequestIdFilter())


@contextmanager
def request_scope(request_id: str) -> Iterator[str]:
    """Every line logged inside (by this task and those it starts) is about request ``request_id``;
    yields the id as the log shows it."""
    # Printable ASCII but the space and the colon, which would let an id end early: "victim-7: answered
    # 200" would write a line read as another request's.
    shown = "".join(char if "!" <= char <= "~" and char != ":" else "?" for char in request_id[:_MAX_ID])
    token = _request_id.set(shown)
    try:
        yield shown
    finally:
        _request_id.reset(token)


def adopt_vllm_logging() -> None:
    """Inside a vLLM server, write through vLLM's own handlers and level.

    vLLM configures its ``vllm`` logger with its handlers and no propagation, so records of other
    libraries' loggers never reach its output; without this the middleware's INFO and WARNING lines would
    be lost. Does nothing outside vLLM or where the application configured this logger itself.
    """
    if "vllm" not in sys.modules or logger.handlers:
        return
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        return
    for handler in vllm_logger.handlers:
        logger.addHandler(handler)
    logger.setLevel(vllm_logger.level or logging.INFO)
    logger.propagate = False


class _JsonLines(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, request_id (null outside a request),
    message, and the traceback where there is one."""

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", None)
        message = record.getMessage()
        if request_id is not None:
            message = message.removeprefix(f"request {request_id}: ")
        line = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "request_id": request_id,
            "message": message,
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return _encode(line).decode()


def log_as_json(stream: object = None) -> None:
    """Write the middleware's lines as JSON (``log_format="json"``), to ``stream`` (stderr), instead of
    through the handlers it had (vLLM's, or the application's)."""
    handler = logging.StreamHandler(stream or sys.stderr)  # type: ignore[arg-type]
    handler.setFormatter(_JsonLines())
    for old in list(logger.handlers):
        logger.removeHandler(old)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False


class _RequestIds:
    """Unique request ids without a random draw each: a random prefix per process and a counter.

    ``uuid4`` reads the kernel's random source on every call (about 8 us a request on the perf rig). The
    prefix is drawn again in a forked child, so processes never share one.
    """

    def __init__(self) -> None:
        self._pid = -1
        self._prefix = ""
        self._counter = itertools.count()

    def __call__(self) -> str:
        if self._pid != os.getpid():
            self._pid, self._prefix = os.getpid(), secrets.token_hex(8)
        return f"{self._prefix}{next(self._counter):08x}"


new_request_id = _RequestIds()


def request_id_of(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The request's id: the client's X-Request-Id where it sent one (the first; vLLM takes it too),
    else a new one."""
    for name, value in headers:
        if name == REQUEST_ID_HEADER:
            return value.decode("latin-1")
    return new_request_id()
