"""OpenTelemetry spans of the middleware's work, in the trace vLLM itself exports.

vLLM traces where ``--otlp-traces-endpoint`` is set: its engine client installs the process's tracer
provider (``vllm/tracing/otel.py`` ``init_otel_tracer``), and each request that carries a ``traceparent``
gets an ``llm_request`` span of the engine, child of that context. The middleware, in the same API-server
process, uses the same provider: a span for the request (child of the client's ``traceparent``, or a new
root), one for the encode stage, one per encoder or prefill call, and the trace context is passed on to
every call and to the engine, so the encoders' own engine spans and PD's join one trace.

The stages call this module, never the OpenTelemetry API: where tracing is off (no endpoint, or the API not
installed: the ``tracing`` extra) each function is a constant context manager or a return, and the API is
never imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

from ._http import body_size
from .transport import Body

__all__ = ["available", "call_span", "inject", "request_span", "stage_span"]

_NOTHING: contextlib.nullcontext[Any] = contextlib.nullcontext()
_otel: Any = None  # the OpenTelemetry API, once imported
_TRACE_HEADERS = (b"traceparent", b"tracestate")


def available() -> bool:
    """Whether the OpenTelemetry API can be imported (the ``tracing`` extra; every vLLM that traces has
    it)."""
    global _otel
    if _otel is None:
        try:
            from opentelemetry import propagate, trace
        except ImportError:
            _otel = False
        else:
            _otel = (trace, propagate)
    return _otel is not False


def request_span(on: bool, headers: Sequence[tuple[bytes, bytes]]) -> contextlib.AbstractContextManager[Any]:
    """The span of one intercepted request, child of the client's trace context (its ``traceparent``
    header) or a new root."""
    if not on or not available():
        return _NOTHING
    return _request_span(headers)


@contextlib.contextmanager
def _request_span(headers: Sequence[tuple[bytes, bytes]]) -> Iterator[Any]:
    trace, propagate = _otel
    # The first of each, as vLLM reads them (Starlette's Headers give the first of a repeated header).
    carrier: dict[str, str] = {}
    for name, value in headers:
        if name in _TRACE_HEADERS:
            carrier.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    parent = propagate.extract(carrier) if carrier else None
    tracer = trace.get_tracer("epd_middleware")
    with tracer.start_as_current_span("epd.request", context=parent, kind=trace.SpanKind.SERVER) as span:
        yield span


def stage_span(on: bool, name: str, attributes: Mapping[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """A span of one stage of the request (``epd.encode``, ``epd.prefill``) under its request's."""
    if not on or not available():
        return _NOTHING
    tracer = _otel[0].get_tracer("epd_middleware")
    span: contextlib.AbstractContextManager[Any] = tracer.start_as_current_span(
        name, attributes=dict(attributes)
    )
    return span


def call_span(
    on: bool, role: str, server: str, attempt: int, body: Body
) -> contextlib.AbstractContextManager[Any]:
    """The span of one try (``attempt``, from 1) of a call to ``server`` (``epd.encoder_call``,
    ``epd.prefill_call``); its context goes with the call (:func:`inject`)."""
    if not on or not available():
        return _NOTHING
    trace = _otel[0]
    size = body_size(body)
    span: contextlib.AbstractContextManager[Any] = trace.get_tracer("epd_middleware").start_as_current_span(
        f"epd.{role}_call",
        kind=trace.SpanKind.CLIENT,
        attributes={"server.address": server, "epd.try": attempt, "epd.bytes": size},
    )
    return span


def inject(on: bool, headers: MutableMapping[str, str]) -> None:
    """The current span's context into ``headers`` (``traceparent``, ``tracestate``), so the server it
    goes to continues the trace."""
    if on and available():
        _otel[1].inject(headers)


def record(span: Any, **attributes: Any) -> None:
    """Attributes on ``span`` (the value a span context manager gave; None where tracing is off)."""
    if span is not None:
        for key, value in attributes.items():
            if value is not None:
                span.set_attribute(key, value)
