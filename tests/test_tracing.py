"""OpenTelemetry, as vLLM traces (issue 31, point 2): where the server traces (``Host.traces``, vLLM's
``--otlp-traces-endpoint``) the middleware's spans join the client's trace, every encoder and prefill call
passes the trace context on, and the engine gets the request span's; where it does not, nothing is
traced and no header is added. Spans read back from an in-memory exporter."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from epd_middleware import Host

from .fakes import FakeEncoders, FakeEngine, FakePrefill, build_app, chat_body, image
from .test_middleware import E0, E1, png, post

pytestmark = pytest.mark.anyio

EXPORTER = InMemorySpanExporter()
_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(EXPORTER))
# What vLLM's engine client does once per API-server process where it traces (init_otel_tracer).
trace.set_tracer_provider(_provider)

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"


@pytest.fixture(autouse=True)
def spans() -> Any:
    EXPORTER.clear()
    yield EXPORTER
    EXPORTER.clear()


def by_name(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def hex_id(value: int, width: int) -> str:
    return format(value, f"0{width}x")


async def test_a_traced_request_is_one_trace_from_the_client_through_every_call_to_the_engine() -> None:
    encoders, engine = FakeEncoders([E1, E0], mode={E1: "500"}), FakeEngine()  # E1 fails, E0 answers
    app, _ = build_app(encoders, engine, host=Host(traces=True))
    response = await post(app, chat_body(image(png(1))), headers={"traceparent": TRACEPARENT})
    assert response.status_code == 200
    spans = EXPORTER.get_finished_spans()
    [request] = by_name(spans, "epd.request")
    [stage] = by_name(spans, "epd.encode")
    calls = by_name(spans, "epd.encoder_call")
    # One trace, the client's: request <- client, encode <- request, calls <- encode.
    assert {hex_id(span.context.trace_id, 32) for span in spans} == {CLIENT_TRACE}
    assert request.parent is not None
    assert hex_id(request.parent.span_id, 16) == CLIENT_PARENT
    assert stage.parent is not None
    assert stage.parent.span_id == request.context.span_id
    assert [call.parent.span_id for call in calls if call.parent] == [stage.context.span_id] * 2
    assert [call.attributes["server.address"] for call in calls] == [E1, E0]
    assert [call.attributes["epd.outcome"] for call in calls] == ["status", "ok"]
    assert calls[0].attributes["http.response.status_code"] == 500
    assert calls[1].attributes["epd.try"] == 2
    assert stage.attributes["epd.items"] == 1
    # Each call carried its own span's context: the encoder's spans are children of the call's.
    sent = [record.headers["traceparent"] for record in encoders.calls]
    assert sent == [f"00-{CLIENT_TRACE}-{hex_id(call.context.span_id, 16)}-01" for call in calls]
    # The engine got the request span's context, not the client's: vLLM's engine span is its child.
    assert engine.received[0].headers["traceparent"] == (
        f"00-{CLIENT_TRACE}-{hex_id(request.context.span_id, 16)}-01"
    )


async def test_without_a_client_trace_the_middleware_starts_one() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, host=Host(traces=True))
    assert (await post(app, chat_body(image(png(1))))).status_code == 200
    [request] = by_name(EXPORTER.get_finished_spans(), "epd.request")
    assert request.parent is None
    assert engine.received[0].headers["traceparent"].split("-")[1] == hex_id(request.context.trace_id, 32)


async def test_prefill_calls_are_traced_and_pass_the_context_on() -> None:
    encoders, prefill, engine = FakeEncoders([E0]), FakePrefill(["http://prefill-0:8100"]), FakeEngine()
    app, _ = build_app(encoders, engine, prefill, host=Host(traces=True), health_check_interval=0)
    assert (
        await post(app, chat_body(image(png(1))), headers={"traceparent": TRACEPARENT})
    ).status_code == 200
    [call] = by_name(EXPORTER.get_finished_spans(), "epd.prefill_call")
    assert (
        prefill.calls[0].headers["traceparent"] == f"00-{CLIENT_TRACE}-{hex_id(call.context.span_id, 16)}-01"
    )


async def test_where_the_server_does_not_trace_nothing_is_traced_or_added() -> None:
    """The default: vLLM without --otlp-traces-endpoint. The client's traceparent goes to the engine as
    it came (vLLM's own behaviour), and no call gets one."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    response = await post(app, chat_body(image(png(1))), headers={"traceparent": TRACEPARENT})
    assert response.status_code == 200
    assert EXPORTER.get_finished_spans() == ()
    assert "traceparent" not in encoders.calls[0].headers
    assert engine.received[0].headers["traceparent"] == TRACEPARENT


def test_the_host_traces_where_vllm_exports_traces() -> None:
    from types import SimpleNamespace

    traced = SimpleNamespace(observability_config=SimpleNamespace(otlp_traces_endpoint="http://otel:4317"))
    assert Host.of_vllm(traced).traces is True
    assert (
        Host.of_vllm(SimpleNamespace(observability_config=SimpleNamespace(otlp_traces_endpoint=None))).traces
        is False
    )


async def test_with_two_traceparent_headers_the_request_joins_the_first_as_vllm_would() -> None:
    """vLLM reads a request's trace context with Starlette's Headers, which give the first of a repeated
    header; the middleware took the last, so its spans and vLLM's own joined two different traces."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, host=Host(traces=True))
    other = "00-11111111111111111111111111111111-2222222222222222-01"
    headers = [("content-type", "application/json"), ("traceparent", TRACEPARENT), ("traceparent", other)]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pd") as client:
        response = await client.post("/v1/chat/completions", json=chat_body(image(png(1))), headers=headers)
    assert response.status_code == 200
    [request] = by_name(EXPORTER.get_finished_spans(), "epd.request")
    assert hex_id(request.context.trace_id, 32) == CLIENT_TRACE
    assert request.parent is not None
    assert hex_id(request.parent.span_id, 16) == CLIENT_PARENT
