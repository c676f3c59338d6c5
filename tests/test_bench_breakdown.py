"""benchmarks.vllm_bench's breakdown (where a request's time went, from the servers' own /metrics) and its
fronts: the variants of the middleware's PD in the lab, and a fleet's servers named by URL."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from benchmarks import server_metrics, vllm_bench


def exposition(observations: dict[str, list[float]], stages: dict[str, list[float]] | None = None) -> str:
    """A server's /metrics as prometheus_client writes it: vLLM's histograms (two engines' series each,
    as vLLM labels them) and the middleware's stage histogram."""
    registry = CollectorRegistry()
    for name, values in observations.items():
        histogram = Histogram(name, "x", ["engine", "model_name"], registry=registry)
        for index, value in enumerate(values):
            histogram.labels(str(index % 2), "m").observe(value)
    if stages:
        stage = Histogram("epd_stage_duration_seconds", "x", ["stage"], registry=registry)
        for label, values in stages.items():
            for value in values:
                stage.labels(label).observe(value)
    return generate_latest(registry).decode()


class TestParse:
    def test_every_series_of_a_histogram_is_added_up(self) -> None:
        text = exposition({"vllm:e2e_request_latency_seconds": [0.1, 0.2, 0.3]})
        snapshot = server_metrics.parse(text)
        assert snapshot["e2e"].seconds == pytest.approx(0.6)
        assert snapshot["e2e"].observations == 3

    def test_a_stage_is_told_from_the_others_by_its_label(self) -> None:
        text = exposition({}, {"parse": [0.001], "encode": [0.03, 0.05], "rewrite": [0.0002]})
        snapshot = server_metrics.parse(text)
        assert snapshot["epd encode"].seconds == pytest.approx(0.08)
        assert snapshot["epd encode"].observations == 2
        assert snapshot["epd parse"].observations == 1
        assert "epd prefill" not in snapshot

    def test_what_a_server_does_not_export_is_absent_not_zero(self) -> None:
        # A plain vLLM has no epd_* series; a measure it lacks must not read as 0 ms.
        snapshot = server_metrics.parse(exposition({"vllm:time_to_first_token_seconds": [0.02]}))
        assert set(snapshot) == {"TTFT"}

    def test_the_engines_inter_token_latency_is_read_per_token(self) -> None:
        # benchmarks.pd_decode's engine-side ITL: vLLM observes one value per output token.
        snapshot = server_metrics.parse(exposition({"vllm:inter_token_latency_seconds": [0.002] * 15}))
        assert snapshot["ITL"].seconds == pytest.approx(0.03)
        assert snapshot["ITL"].observations == 15

    def test_other_metrics_are_ignored(self) -> None:
        text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 3.0\n"
        assert server_metrics.parse(text) == {}


class TestMeans:
    def test_the_mean_is_over_what_happened_between_the_snapshots(self) -> None:
        before = server_metrics.parse(exposition({"vllm:e2e_request_latency_seconds": [5.0]}))
        after = server_metrics.parse(exposition({"vllm:e2e_request_latency_seconds": [5.0, 0.1, 0.3]}))
        assert server_metrics.means_ms(before, after) == {"e2e": {"ms": 200.0, "count": 2}}

    def test_nothing_observed_gives_no_figure(self) -> None:
        same = server_metrics.parse(exposition({"vllm:e2e_request_latency_seconds": [0.1]}))
        assert server_metrics.means_ms(same, same) == {}

    def test_a_restarted_server_gives_no_figure_rather_than_a_wrong_one(self) -> None:
        before = server_metrics.parse(exposition({"vllm:e2e_request_latency_seconds": [9.0, 9.0, 9.0]}))
        after = server_metrics.parse(exposition({"vllm:e2e_request_latency_seconds": [0.1, 0.1, 0.1, 0.1]}))
        assert server_metrics.means_ms(before, after) == {}


class MetricsServer:
    """A loopback server whose /metrics answers what the test last set (404 where it says None)."""

    def __init__(self) -> None:
        self.text: str | None = ""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path != "/metrics" or outer.text is None:
                    self.send_error(404)
                    return
                body = outer.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers() -> Iterator[list[MetricsServer]]:
    made = [MetricsServer() for _ in range(3)]
    yield made
    for server in made:
        server.close()


class TestBreakdown:
    def test_each_servers_means_over_the_run_and_encoders_added_up(
        self, servers: list[MetricsServer]
    ) -> None:
        pd, encoder_a, encoder_b = servers
        pd.text = exposition({"vllm:time_to_first_token_seconds": [1.0]}, {"encode": [1.0]})
        encoder_a.text = exposition({"vllm:e2e_request_latency_seconds": [1.0]})
        encoder_b.text = exposition({"vllm:e2e_request_latency_seconds": []})
        breakdown = vllm_bench.Breakdown({"PD": [pd.url], "encoder": [encoder_a.url, encoder_b.url]})
        # The run: two requests, each encoded on one of the two encoders.
        pd.text = exposition(
            {"vllm:time_to_first_token_seconds": [1.0, 0.02, 0.04]}, {"encode": [1.0, 0.03, 0.05]}
        )
        encoder_a.text = exposition({"vllm:e2e_request_latency_seconds": [1.0, 0.03]})
        encoder_b.text = exposition({"vllm:e2e_request_latency_seconds": [0.05]})
        out = breakdown.finish()
        assert out["breakdown_ms"] == {
            "PD": {"TTFT": pytest.approx(30.0), "epd encode": pytest.approx(40.0)},
            "encoder": {"e2e": pytest.approx(40.0)},
        }
        assert out["breakdown_counts"]["encoder"] == {"e2e": 2}
        assert "breakdown_errors" not in out

    def test_a_server_without_metrics_is_named_and_the_others_still_count(
        self, servers: list[MetricsServer]
    ) -> None:
        proxy, encoder, _ = servers
        proxy.text = None
        encoder.text = exposition({"vllm:e2e_request_latency_seconds": []})
        breakdown = vllm_bench.Breakdown({"proxy": [proxy.url], "encoder": [encoder.url]})
        encoder.text = exposition({"vllm:e2e_request_latency_seconds": [0.01]})
        out = breakdown.finish()
        assert out["breakdown_ms"] == {"encoder": {"e2e": pytest.approx(10.0)}}
        assert len(out["breakdown_errors"]) == 1
        assert out["breakdown_errors"][0].startswith("proxy: ")

    def test_a_server_gone_by_the_end_gives_no_figure(self, servers: list[MetricsServer]) -> None:
        pd = servers[0]
        pd.text = exposition({"vllm:e2e_request_latency_seconds": []})
        breakdown = vllm_bench.Breakdown({"PD": [pd.url]})
        pd.text = None
        out = breakdown.finish()
        assert out["breakdown_ms"] == {}
        assert out["breakdown_errors"][0].startswith("PD: ")


class TestFronts:
    def test_a_variant_is_a_name_and_epd_options(self) -> None:
        variant = vllm_bench.Variant.parse("b1:EPD_MAX_BATCH_SIZE=1,EPD_REUSE_HANDLES=false")
        assert variant.front == "epd-b1"
        assert variant.env == {"EPD_MAX_BATCH_SIZE": "1", "EPD_REUSE_HANDLES": "false"}
        assert variant.label == "E + PD (epd, EPD_MAX_BATCH_SIZE=1, EPD_REUSE_HANDLES=false)"
        assert vllm_bench.Variant.parse(variant.text) == variant

    @pytest.mark.parametrize(
        "text", ["b1", "b1:", "B1:EPD_X=1", ":EPD_X=1", "b1:PATH=/tmp", "b1:VLLM_PLUGINS="]
    )
    def test_a_variant_sets_only_epd_options(self, text: str) -> None:
        with pytest.raises(argparse.ArgumentTypeError):
            vllm_bench.Variant.parse(text)

    def test_two_variants_need_two_names(self) -> None:
        with pytest.raises(SystemExit):
            vllm_bench.parse_args(["--epd-variant", "a:EPD_X=1", "--epd-variant", "a:EPD_X=2"])

    def test_variants_start_lab_servers_not_a_fleets(self) -> None:
        fleet = ["--single", "http://s", "--epd", "http://e", "--model", "m"]
        with pytest.raises(SystemExit):
            vllm_bench.parse_args([*fleet, "--epd-variant", "b1:EPD_MAX_BATCH_SIZE=1"])
        with pytest.raises(SystemExit):
            vllm_bench.parse_args(["--encoder-url", "http://e1"])

    def test_a_fleets_encoders_stand_behind_both_e_pd_fronts(self) -> None:
        args = vllm_bench.parse_args(
            [
                "--single", "http://single:8000/", "--epd", "http://epd:8000", "--model", "m",
                "--proxy-url", "http://proxy:8000", "--plain-pd-url", "http://plain-0:8000,http://plain-1:8000",
                "--encoder-url", "http://e1:8000,http://e2:8000", "--encoder-url", "http://e3:8000/",
            ]
        )  # fmt: skip
        fronts = {front.name: front for front in vllm_bench.fleet_fronts(args)}
        encoders = ["http://e1:8000", "http://e2:8000", "http://e3:8000"]
        assert fronts["single"].metrics == {"single": ["http://single:8000"]}
        assert fronts["epd"].metrics == {"PD": ["http://epd:8000"], "encoder": encoders}
        assert fronts["proxy"].metrics == {
            "plain PD": ["http://plain-0:8000", "http://plain-1:8000"],
            "encoder": encoders,
        }
        assert fronts["proxy"].label == "E + PD (reference proxy)"

    def test_the_pd_pods_are_named_one_by_one_where_the_front_is_a_service(self) -> None:
        args = vllm_bench.parse_args(
            [
                "--single",
                "http://s",
                "--epd",
                "http://epd-svc",
                "--model",
                "m",
                "--pd-url",
                "http://pd-0,http://pd-1",
            ]
        )
        epd = vllm_bench.fleet_fronts(args)[1]
        assert epd.url == "http://epd-svc"
        assert epd.metrics == {"PD": ["http://pd-0", "http://pd-1"]}

    def test_fronts_picks_which_run(self) -> None:
        fleet = ["--single", "http://s", "--epd", "http://e", "--model", "m", "--proxy-url", "http://p"]
        args = vllm_bench.parse_args([*fleet, "--fronts", "epd,proxy"])
        assert [front.name for front in vllm_bench.fleet_fronts(args)] == ["epd", "proxy"]
        with pytest.raises(SystemExit):
            vllm_bench.fleet_fronts(vllm_bench.parse_args([*fleet, "--fronts", "epd,nonesuch"]))


def run(
    front: str, tag: str, req_s: float, ttft: float, breakdown: dict[str, dict[str, float]]
) -> dict[str, object]:
    figures = {key: 1.0 for key, _ in vllm_bench.METRICS}
    figures.update(request_throughput=req_s, median_ttft_ms=ttft)
    return {
        "front": front, "point": "c1:4x224", "tag": tag, "failed": 0, "completed": 40,
        **figures, "breakdown_ms": breakdown,
    }  # fmt: skip


class TestReport:
    def test_a_variant_is_compared_with_the_middleware_and_the_proxy_round_by_round(self) -> None:
        runs = [
            run("epd", "r1", 10.0, 50.0, {"PD": {"TTFT": 16.0}, "encoder": {"e2e": 33.0}}),
            run("epd-b1", "r1", 9.0, 55.0, {"PD": {"TTFT": 17.0}, "encoder": {"e2e": 30.0}}),
            run("proxy", "r1", 9.5, 52.0, {"plain PD": {"TTFT": 16.5}}),
            run(
                "epd", "r2", 10.0, 51.0, {"PD": {"TTFT": 18.0, "epd encode": 36.0}, "encoder": {"e2e": 35.0}}
            ),
            run("epd-b1", "r2", 11.0, 49.0, {"PD": {"TTFT": 15.0}, "encoder": {"e2e": 29.0}}),
            run("proxy", "r2", 9.0, 53.0, {"plain PD": {"TTFT": 17.5}}),
        ]
        summary = vllm_bench.summarise(runs, ["epd", "epd-b1", "proxy"], ["c1:4x224"])
        row = summary["c1:4x224"]
        assert row["epd-b1_vs_epd"]["rounds"] == 2
        assert row["epd-b1_vs_epd"]["throughput_ahead"] == 1
        assert row["epd-b1_vs_epd"]["ttft_p50_ahead"] == 1
        assert row["epd-b1_vs_proxy"]["throughput_ahead"] == 1
        assert row["epd-b1_vs_proxy"]["ttft_p50_ahead"] == 1
        # 5 ms slower in the first round, 2 ms faster in the second: the median of the two.
        assert row["epd-b1_vs_epd"]["ttft_p50_difference_ms"]["median"] == pytest.approx(1.5)
        # Medians per server and measure, over the runs that have the measure.
        assert row["epd"]["breakdown_ms"] == {
            "PD": {"TTFT": 17.0, "epd encode": 36.0},
            "encoder": {"e2e": 34.0},
        }
        labels = {"epd-b1": "E + PD (epd, EPD_MAX_BATCH_SIZE=1)"}
        table = vllm_bench.markdown(summary, ["epd", "epd-b1", "proxy"], {}, labels)
        assert "| c1:4x224 | E + PD (epd, EPD_MAX_BATCH_SIZE=1) | encoder | 29.5 |" in table
        assert "| c1:4x224 | E + PD (epd) | PD |  | 17.0 | 36.0 |" in table
        assert "epd-b1 ahead of epd in throughput in 1 of 2 rounds" in table


class TestPaired:
    def test_the_interval_is_between_order_statistics_of_the_rounds(self) -> None:
        # n = 30: the 95% interval of a median runs from the 10th to the 21st smallest (binomial tables).
        figure = vllm_bench.paired([float(value) for value in range(1, 31)], 0.0)
        assert figure["median"] == 15.5
        assert figure["ci95"] == [10.0, 21.0]
        # n = 10: from the 2nd to the 9th.
        assert vllm_bench.paired([float(value) for value in range(10)], 100.0)["ci95"] == [1.0, 8.0]

    def test_too_few_rounds_for_an_interval_say_so(self) -> None:
        assert vllm_bench.paired([1.0, 2.0, 3.0, 4.0, 5.0], 0.0)["ci95"] is None
        assert vllm_bench.paired([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 0.0)["ci95"] == [1.0, 6.0]

    def test_the_sign_test_counts_rounds_ahead_and_leaves_ties_out(self) -> None:
        # 9 of 10 decided rounds one way: p = 2 * 11/1024; two ties do not count.
        figure = vllm_bench.paired([-1.0] * 9 + [1.0] + [0.0, 0.0], 0.0)
        assert figure["sign_test_p"] == pytest.approx(2 * 11 / 1024, abs=1e-4)
        # Evenly split: nothing to tell.
        assert vllm_bench.paired([-1.0, 1.0] * 5, 0.0)["sign_test_p"] == 1.0

    def test_a_ratio_is_tested_against_one(self) -> None:
        figure = vllm_bench.paired([1.05, 1.02, 0.99, 1.04, 1.03, 1.06, 1.01, 1.02], 1.0)
        assert figure["median"] == pytest.approx(1.025)
        assert figure["sign_test_p"] == pytest.approx(2 * 9 / 256, abs=1e-4)
