"""Prometheus metrics, request logs and the status endpoint, on asyncio and trio."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from epd_middleware import EPDConfig, Host
from epd_middleware import _metrics as metrics_module
from epd_middleware._metrics import Stats

from .fakes import FakeEncoders, FakeEngine, build_app, chat_body, image
from .test_middleware import png, post

pytestmark = pytest.mark.anyio

E0, E1 = "http://obs-0:8001", "http://obs-1:8001"


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_metrics_count_requests_calls_failovers_and_fallbacks() -> None:
    before = {
        "encoded": sample("epd_requests_total", outcome="encoded", code=""),
        "passed": sample("epd_requests_total", outcome="passed_through", code=""),
        "fallback": sample("epd_requests_total", outcome="fallback", code=""),
        "error": sample("epd_requests_total", outcome="error", code="502"),
        "ok_calls": sample("epd_encoder_call_duration_seconds_count", encoder=E0, outcome="ok"),
        "bad_calls": sample("epd_encoder_call_duration_seconds_count", encoder=E1, outcome="status"),
        "encoder_failovers": sample("epd_encoder_failovers_total", encoder=E1),
        "fallback_items": sample("epd_fallback_items_total"),
        "items": sample("epd_request_media_items_sum"),
        "encode_stage": sample("epd_stage_duration_seconds_count", stage="encode"),
    }
    encoders, engine = FakeEncoders([E0, E1], mode={E1: "500"}), FakeEngine()
    app, _ = build_app(encoders, engine, eject_after=100)
    middleware = app.build_middleware_stack()
    assert (await post(middleware, chat_body(image(png(1)), image(png(2))))).status_code == 200
    assert (await post(middleware, b'{"model": "m", "messages": []}')).status_code == 200

    local, _ = build_app(
        FakeEncoders([E1], mode={E1: "500"}), FakeEngine(), on_encoder_failure="local", max_attempts=1
    )
    assert (await post(local, chat_body(image(png(3))))).status_code == 200
    failing, _ = build_app(FakeEncoders([E1], mode={E1: "500"}), FakeEngine(), max_attempts=1)
    assert (await post(failing, chat_body(image(png(4))))).status_code == 502

    assert sample("epd_requests_total", outcome="encoded", code="") == before["encoded"] + 1
    assert sample("epd_requests_total", outcome="passed_through", code="") == before["passed"] + 1
    assert sample("epd_requests_total", outcome="fallback", code="") == before["fallback"] + 1
    assert sample("epd_requests_total", outcome="error", code="502") == before["error"] + 1
    assert (
        sample("epd_encoder_call_duration_seconds_count", encoder=E0, outcome="ok") == before["ok_calls"] + 2
    )
    assert (
        sample("epd_encoder_call_duration_seconds_count", encoder=E1, outcome="status")
        == before["bad_calls"] + 3
    )
    assert sample("epd_encoder_failovers_total", encoder=E1) == before["encoder_failovers"] + 1
    assert sample("epd_fallback_items_total") == before["fallback_items"] + 1
    assert sample("epd_request_media_items_sum") == before["items"] + 2
    assert sample("epd_stage_duration_seconds_count", stage="encode") >= before["encode_stage"] + 2
    assert sample("epd_encoder_in_flight", encoder=E0) == 0


async def test_health_gauge_follows_ejection() -> None:
    encoders, engine = FakeEncoders([E0, E1], mode={E1: "refuse"}), FakeEngine()
    app, _ = build_app(encoders, engine, eject_after=1, eject_cooldown=30)
    middleware = app.build_middleware_stack()
    assert (await post(middleware, chat_body(image(png(1)), image(png(2))))).status_code == 200
    assert sample("epd_encoder_healthy", encoder=E1) == 0
    assert sample("epd_encoder_healthy", encoder=E0) == 1


async def test_one_info_line_per_encoded_request_and_none_for_pass_through(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="epd_middleware")
    encoders, engine = FakeEncoders([E0, E1]), FakeEngine()
    app, _ = build_app(encoders, engine)
    await post(app, b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}')
    assert [r for r in caplog.records if r.levelno == logging.INFO] == []

    await post(app, chat_body(image(png(1)), image(png(2))), headers={"x-request-id": "req-77"})
    # Besides the once-per-process line that says which model this server learned it serves.
    [line] = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.INFO and "epd: this server serves" not in r.getMessage()
    ]
    assert line.startswith("request req-77: 2 media item(s), 2 encoder call(s) answered by ")
    assert E0 in line
    assert E1 in line
    assert "encode " in line
    assert " ms, rewrite " in line


async def test_encoder_failures_are_warnings_naming_the_encoder(caplog: pytest.LogCaptureFixture) -> None:
    encoders, engine = FakeEncoders([E0, E1], mode={E1: "garbage"}), FakeEngine()
    app, _ = build_app(encoders, engine)
    await post(app, chat_body(image(png(1)), image(png(2))))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        E1 in message and "not JSON" in message and f"retrying on {E0}" in message for message in warnings
    )


async def test_status_endpoint() -> None:
    encoders, engine = FakeEncoders([E0, E1], mode={E1: "500"}), FakeEngine()
    app, _ = build_app(
        encoders,
        engine,
        api_keys=["k"],
        encoder_api_key="secret-enc",
        canary_api_key="secret-canary",
        uuid_key="secret-fleet-uuid-key",
        eject_after=1,
    )
    middleware = app.build_middleware_stack()
    await post(middleware, chat_body(image(png(1)), image(png(2))), headers={"authorization": "Bearer k"})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=middleware)) as client:
        denied = await client.get("http://pd/epd/status")
        status = await client.get("http://pd/epd/status", headers={"authorization": "Bearer k"})
        wrong_method = await client.post("http://pd/epd/status", headers={"authorization": "Bearer k"})
    assert denied.status_code == 401
    assert wrong_method.status_code == 405
    assert status.status_code == 200
    body = status.json()
    assert body["encoders"][E0]["healthy"] is True
    assert body["encoders"][E1]["healthy"] is False
    assert body["encoders"][E1]["consecutive_failures"] == 1
    assert body["counters"]["encoded"] == 1
    assert body["counters"]["encoder_failovers"] == 1
    assert body["pending_requests"] == 0
    assert body["config"]["encoders"] == [E0, E1]
    assert "secret-enc" not in status.text
    assert "api_keys" not in body["config"]
    # Issue 35's secrets too (before: the canary key and the fleet's uuid key were on the page).
    assert "secret-canary" not in status.text
    assert "secret-fleet-uuid-key" not in status.text
    assert body["uuid_key"] == "configured"


async def test_status_endpoint_names_the_runner_and_the_known_problems() -> None:
    v1 = Host(ec_connector="ECMooncakeConnector", ec_consumer=True, model_runner="v1", push_wait_s=60)
    for host, runner, problems in ((v1, "v1", 1), (Host(), None, 0)):
        encoders, engine = FakeEncoders([E0]), FakeEngine()
        app, _ = build_app(encoders, engine, host=host)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            body = (await client.get("http://pd/epd/status")).json()
        assert body["model_runner"] == runner
        assert len(body["known_problems"]) == problems
        if problems:
            assert body["known_problems"][0].startswith("ECMooncakeConnector on the V1 model runner")


async def test_status_endpoint_path_and_off_switch() -> None:
    for path, expected in (("", 404), ("/ops/epd", 200)):
        encoders, engine = FakeEncoders([E0]), FakeEngine()
        app, _ = build_app(encoders, engine, status_path=path)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            assert (await client.get("http://pd/epd/status")).status_code == 404
            if path:
                assert (await client.get(f"http://pd{path}")).status_code == expected


def test_stats_without_prometheus_is_a_no_op() -> None:
    stats = Stats()
    stats._prom = None
    stats.request("encoded")
    stats.call("encoder", E0, "ok", 0.1)
    stats.in_flight("encoder", E0, 1)
    stats.health("encoder", E0, False)
    assert stats.counters == {"encoded": 1, "encoder_calls_ok": 1}


async def test_without_prometheus_client_start_up_warns_once_naming_the_metrics_extra(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: without ``prometheus_client`` (a plain Starlette app installed without the ``metrics``
    extra) the metrics were a silent no-op: no ``epd_*`` series in ``/metrics`` and no line saying why.
    Now the first middleware built in the process logs one WARNING naming the extra; later ones say
    nothing, and requests are served as before."""
    monkeypatch.setattr(metrics_module, "_loaded", False)
    monkeypatch.setattr(metrics_module, "_prometheus", None)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import prometheus_client fails
    caplog.set_level(logging.WARNING, logger="epd_middleware")
    for n in (1, 2):
        encoders, engine = FakeEncoders([E0]), FakeEngine()
        app, _ = build_app(encoders, engine)
        assert (await post(app, chat_body(image(png(n))))).status_code == 200
    [warning] = [r for r in caplog.records if "prometheus_client" in r.getMessage()]
    assert warning.levelno == logging.WARNING
    assert "epd-middleware[metrics]" in warning.getMessage()
    assert Stats()._prom is None


def test_an_error_outcome_carries_its_status_in_a_code_label() -> None:
    """Prometheus gets outcome="error" and the status in code (so a query can sum the errors or pick the
    5xx); the counters the status page shows keep "error_503"."""
    outcomes = {
        "error_503": ("error", "503"),
        "error_400": ("error", "400"),
        "fallback": ("fallback", ""),
        "prefill_fallback": ("prefill_fallback", ""),
    }
    before = {
        key: sample("epd_requests_total", outcome=outcome, code=code)
        for key, (outcome, code) in outcomes.items()
    }
    stats = Stats()
    for outcome in ("error_503", "error_503", "error_400", "prefill_fallback"):
        stats.request(outcome)
    stats.fallback(2)
    counts = {"error_503": 2, "error_400": 1, "fallback": 1, "prefill_fallback": 1}
    assert stats.counters == {**counts, "fallback_items": 2}
    for key, (outcome, code) in outcomes.items():
        assert sample("epd_requests_total", outcome=outcome, code=code) == before[key] + counts[key], key
    [family] = [family for family in REGISTRY.collect() if family.name == "epd_requests"]
    assert {frozenset(s.labels) for s in family.samples} == {frozenset({"outcome", "code"})}
    assert not [s for s in family.samples if s.labels["outcome"].startswith("error_")]


def test_latency_buckets_reach_the_longest_timeout() -> None:
    """Every call and stage duration up to the longest default timeout (prefill_timeout) lands in a finite
    bucket, not only in +Inf; the fine buckets at the low end stay."""
    longest = max(
        EPDConfig.model_fields[name].default
        for name in ("prefill_timeout", "encode_deadline", "encoder_timeout")
    )
    server = "http://buckets-0:8000"
    stats = Stats()
    for role in ("encoder", "prefill"):
        stats.call(role, server, "ok", longest)
    stats.stage("prefill", longest)
    histograms = {
        "epd_encoder_call_duration_seconds": {"encoder": server, "outcome": "ok"},
        "epd_prefill_call_duration_seconds": {"prefill": server, "outcome": "ok"},
        "epd_stage_duration_seconds": {"stage": "prefill"},
    }
    edges_of = {
        family.name: sorted(
            float(s.labels["le"])
            for s in family.samples
            if s.name.endswith("_bucket") and s.labels.items() >= histograms[family.name].items()
        )
        for family in REGISTRY.collect()
        if family.name in histograms
    }
    assert edges_of.keys() == histograms.keys()
    for name, edges in edges_of.items():
        assert edges == edges_of["epd_stage_duration_seconds"], name  # one set of latency buckets
        *finite, infinite = edges
        assert infinite == float("inf")
        assert finite[0] <= 0.001, name  # sub-millisecond stages (parse, rewrite) keep their resolution
        assert finite[-1] >= longest, name
        # Every duration observed, the longest timeout's included, is in the last finite bucket already.
        top = REGISTRY.get_sample_value(f"{name}_bucket", {**histograms[name], "le": str(finite[-1])})
        assert top == REGISTRY.get_sample_value(f"{name}_count", histograms[name]), name


def test_metrics_aggregate_across_api_server_processes(tmp_path: Path) -> None:
    """vLLM sets PROMETHEUS_MULTIPROC_DIR with --api-server-count > 1: each process writes its values,
    /metrics sums them (counters, in-flight) or takes the minimum (health)."""
    script = textwrap.dedent(
        f"""
        from epd_middleware._metrics import Stats
        stats = Stats()
        stats.request("encoded")
        stats.health("encoder", "{E0}", {{healthy}})
        stats.in_flight("encoder", "{E0}", 2)
        import time; time.sleep(0.1)
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    procs = [
        subprocess.Popen([sys.executable, "-c", script.format(healthy=healthy)], env=env)
        for healthy in ("True", "False")
    ]
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    reader = textwrap.dedent(
        f"""
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        print(registry.get_sample_value("epd_requests_total", {{"outcome": "encoded", "code": ""}}))
        print(registry.get_sample_value("epd_encoder_healthy", {{"encoder": "{E0}"}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", reader], env=env, capture_output=True, text=True, check=True)
    encoded, healthy = out.stdout.split()
    assert float(encoded) == 2.0
    # One process has the encoder ejected: the minimum over processes says unhealthy.
    assert healthy == "0.0"
