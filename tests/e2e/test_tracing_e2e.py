"""Issue 31, point 2 on real vLLM: PD (with the middleware) and the encoders export OpenTelemetry spans
(``--otlp-traces-endpoint``) to a receiver of the test's own; one request with the client's traceparent
gives one trace holding the middleware's spans, PD's engine span (child of the middleware's request span)
and the encoder's engine span (child of the middleware's call span)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from epd_lab.seed import seed_image, seed_request

from .conftest import Deployment
from .test_vllm_e2e import AUTH, MODEL, assert_same, chat, record

pytestmark = pytest.mark.e2e

TRACE = "5bd92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"


def spans_of(deployment: Deployment, trace_id: str) -> list[dict[str, Any]]:
    if not deployment.spans.exists():
        return []
    lines = deployment.spans.read_text().splitlines()
    return [span for span in map(json.loads, lines) if span["trace_id"] == trace_id]


def test_one_trace_holds_the_middlewares_spans_pds_engine_span_and_the_encoders(
    deployment: Deployment,
) -> None:
    body = seed_request(MODEL, images=[seed_image(shift=257)])
    baseline = chat(deployment.single, body)
    response = chat(deployment.pd, body, {**AUTH, "traceparent": TRACEPARENT})
    record("traced request (client traceparent)", response, baseline)
    assert_same(response, baseline)
    wanted = {"epd.request", "epd.encode", "epd.encoder_call", "llm_request"}
    deadline = time.monotonic() + 30
    while True:
        spans = spans_of(deployment, TRACE)
        names = {span["name"] for span in spans}
        engines = [span for span in spans if span["name"] == "llm_request"]
        if (wanted <= names and len(engines) >= 2) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert wanted <= names, spans
    by_id = {span["span_id"]: span for span in spans}
    [request] = [span for span in spans if span["name"] == "epd.request"]
    [call] = [span for span in spans if span["name"] == "epd.encoder_call"]
    assert request["parent_span_id"] == TRACEPARENT.split("-")[2]  # the client's
    assert request["service"] == "pd"
    pd_engine = [span for span in engines if span["service"] == "pd"]
    encoder_engine = [span for span in engines if span["service"].startswith("encoder-")]
    assert [span["parent_span_id"] for span in pd_engine] == [request["span_id"]]
    assert [span["parent_span_id"] for span in encoder_engine] == [call["span_id"]]
    assert by_id[call["parent_span_id"]]["name"] == "epd.encode"


FAILED_TRACE = "0af7651916cd43dd8448eb211c80319c"
FAILED_TRACEPARENT = f"00-{FAILED_TRACE}-b7ad6b7169203331-01"
NOT_BASE64 = "data:image/png,not-base64-at-all"


def test_a_failed_request_is_followed_from_its_answer_to_its_log_lines_and_spans(
    deployment: Deployment,
) -> None:
    """A request vLLM refuses on the encoder (a data URL that is not base64: its 501) gets vLLM's own
    answer, and its id (the client's X-Request-Id) and trace (its traceparent) lead to the PD log's line
    about it and to its spans: the request, the encode stage and the failed call, with the server's
    status."""
    body = seed_request(MODEL, images=[NOT_BASE64])
    baseline = chat(deployment.single, body)
    headers = {**AUTH, "traceparent": FAILED_TRACEPARENT, "x-request-id": "followed-501"}
    response = chat(deployment.pd, body, headers)
    record("failed request followed by id and trace", response, baseline)
    assert (response.status_code, baseline.status_code) == (501, 501)
    assert response.json() == baseline.json()
    deadline = time.monotonic() + 30
    while True:
        spans = spans_of(deployment, FAILED_TRACE)
        names = {span["name"] for span in spans}
        lines = [
            line
            for line in deployment.pd.log_path.read_text(errors="replace").splitlines()
            if "request followed-501:" in line
        ]
        if ({"epd.request", "epd.encoder_call"} <= names and lines) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert any("answered 501" in line for line in lines), lines
    [request] = [span for span in spans if span["name"] == "epd.request"]
    assert request["parent_span_id"] == FAILED_TRACEPARENT.split("-")[2]
    assert request["attributes"]["epd.request_id"] == "followed-501"
    [call] = [span for span in spans if span["name"] == "epd.encoder_call"]
    assert call["error"]
    assert call["attributes"]["http.response.status_code"] == 501
    assert call["attributes"]["epd.outcome"] in {"status", "rejected"}  # as the call saw it, before judging
    assert call["attributes"]["server.address"].rstrip("/") in {e.url for e in deployment.encoders}
    assert {span["service"] for span in spans if span["name"].startswith("epd.")} == {"pd"}
