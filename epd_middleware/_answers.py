"""The middleware's own answers to a request (an error instead of the engine's answer), complete wherever
they are given: one line in the log, the request id where vLLM's ``--enable-request-id-headers`` puts it
on its answers, and ``Retry-After`` on every 503 (a client told "unavailable" is told when to come back).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.types import Send

from ._asgi import send_error
from ._logs import logger
from ._protocol import REQUEST_ID_HEADER
from .errors import EPDError

__all__ = ["answer"]

_RETRY_AFTER = b"retry-after"


async def answer(
    send: Send,
    error: EPDError,
    *,
    request_id: str,
    id_header: bool,
    expose: bool,
    retry_after: int,
    body_of: Callable[[EPDError], bytes] | None = None,
) -> None:
    """Answer ``error`` (``body_of``: its body in another surface's language than OpenAI's), and say
    so in one line (a client's mistake at INFO, whatever its status; the rest at WARNING). ``expose``:
    the message names the servers (``expose_upstream_addresses``)."""
    logger.log(
        logging.WARNING if error.status >= 500 and not error.requests_fault else logging.INFO,
        "answered %d %s: %s",
        error.status,
        error.error_type,
        error.logged,
    )
    if expose:
        error.expose()
    extra = [(REQUEST_ID_HEADER, request_id.encode("latin-1"))] if id_header else []
    if error.status == 503 and not any(name == _RETRY_AFTER for name, _ in error.headers()):
        extra.append((_RETRY_AFTER, str(retry_after).encode()))
    await send_error(send, error, body_of(error) if body_of is not None else None, extra)
