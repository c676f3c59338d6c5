"""A request's priority and session id as vLLM reads them, for every encoder and prefill call it makes.

vLLM takes both from headers as well as from the body (:mod:`epd_middleware._protocol`,
``PRIORITY_HEADER``), so forwarding the body fields alone would send a client's header-given priority
and session to the encoders at the default priority and without the session. The calls carry:

- ``X-Vllm-Priority`` as the client sent it (its first value), on surfaces where vLLM reads it: the
  server called then resolves header against body (forwarded with the options) exactly as this server;
- the effective session id (body ``session_id``, else ``X-Session-ID``, else ``vllm_xargs.session_id``,
  each only when a non-empty string), as ``X-Session-ID`` where it came from a header or can be written as
  one unchanged; a session id from ``vllm_xargs`` that cannot (characters beyond Latin-1, controls, or
  spaces a parser would strip) goes into the encoder's body as ``session_id`` instead. A body's own
  ``session_id`` already travels in the encoder's body and in the prefill request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple, TypeGuard

from ._asgi import first_header
from ._protocol import PRIORITY_HEADER, SESSION_ID, SESSION_ID_HEADER, VLLM_XARGS
from ._rawjson import text_of
from ._surfaces import Surface

__all__ = ["NO_SCHEDULING", "Scheduling", "scheduling_of"]

_PRIORITY = PRIORITY_HEADER.decode()
_SESSION = SESSION_ID_HEADER.decode()


class Scheduling(NamedTuple):
    """What every call of one request carries so that it is scheduled as the request is."""

    # Header name and value pairs for each encoder and prefill call.
    headers: tuple[tuple[str, str], ...] = ()
    # Fields over the encoder's body (a session id no header can carry unchanged).
    encoder_fields: Mapping[str, Any] = MappingProxyType({})


NO_SCHEDULING = Scheduling()


def scheduling_of(
    surface: Surface, fields: Mapping[str, Any], headers: Sequence[tuple[bytes, bytes]]
) -> Scheduling:
    """The request's scheduling hints, read in vLLM's order."""
    calls: list[tuple[str, str]] = []
    if surface.reads_priority_header:
        priority = first_header(headers, PRIORITY_HEADER)
        if priority is not None:
            calls.append((_PRIORITY, priority.decode("latin-1")))
    as_header, in_body = _session(surface, fields, headers)
    if as_header is not None:
        calls.append((_SESSION, as_header))
    if in_body is not None:
        return Scheduling(tuple(calls), MappingProxyType({SESSION_ID: in_body}))
    return Scheduling(tuple(calls)) if calls else NO_SCHEDULING


def _session(
    surface: Surface, fields: Mapping[str, Any], headers: Sequence[tuple[bytes, bytes]]
) -> tuple[str | None, str | None]:
    """The effective session id as the calls carry it: (as a header, in the encoder's body); neither
    where there is none, or where the body's own ``session_id`` already travels."""
    reads_body = surface.reads_scheduling_fields
    if reads_body and _given(text_of(fields.get(SESSION_ID))):
        return None, None
    header = first_header(headers, SESSION_ID_HEADER)
    if header:
        return header.decode("latin-1"), None
    xargs = fields.get(VLLM_XARGS) if reads_body else None
    session = text_of(xargs.get(SESSION_ID)) if isinstance(xargs, dict) else None
    if not _given(session):
        return None, None
    return (session, None) if _header_safe(session) else (None, session)


def _given(value: object) -> TypeGuard[str]:
    """A session id vLLM takes: a non-empty string (``if request.session_id:``); a long one arrives as
    the raw JSON the parser kept (:func:`~epd_middleware._rawjson.text_of` made it text)."""
    return isinstance(value, str) and bool(value)


def _header_safe(value: str) -> bool:
    """Whether a header carries ``value`` unchanged: Latin-1 without controls, and no leading or trailing
    space or tab (HTTP parsers strip them)."""
    if value != value.strip(" \t"):
        return False
    return all(char == "\t" or (" " <= char <= "\xff" and char != "\x7f") for char in value)
