"""The shipped alert rules, run by Prometheus's own rule engine (``promtool test rules``) on series shaped
as the middleware exports them: an alert fires on what it is for and stays quiet on what it is not.
``.ci/run`` installs promtool (Debian's prometheus package) where it is missing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

RULES = Path(__file__).parent.parent / "deploy" / "kubernetes" / "monitoring" / "prometheusrule.yaml"
PROMTOOL = shutil.which("promtool")

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (.ci/run installs it)")


def run_rule_tests(tmp_path: Path, tests: list[dict[str, Any]]) -> subprocess.CompletedProcess[str]:
    """``promtool test rules`` of the PrometheusRule's groups (the custom resource's spec is a rule file)
    against ``tests``."""
    spec = yaml.safe_load(RULES.read_text())["spec"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "tests.yaml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests})
    )
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True, text=True, check=False
    )


SERIES = 'epd_encoder_failures_total{namespace="epd", pod="pd-0", encoder="http://10.0.0.7:8000", blame="%s"}'


def test_an_encoder_unmasked_behind_the_clients_fault_raises_its_alert(tmp_path: Path) -> None:
    """Issue 35: an encoder answering 501 or 404 to everything failed every request routed to it with an
    INFO line and no alert (the "rejected" outcome is outside the error-ratio alert on purpose). Its
    unmasked failures now raise EPDEncoderHidesItsFailures; clients' bad requests (blame "request") do
    not."""
    alert = "EPDEncoderHidesItsFailures"
    labels = {"namespace": "epd", "encoder": "http://10.0.0.7:8000"}
    tests = [
        {
            "interval": "1m",
            "input_series": [
                {"series": SERIES % "unmasked", "values": "0 0 0 0 0 1 2 3"},
                {"series": SERIES % "request", "values": "0 100 200 300 400 500 600 700"},
            ],
            "alert_rule_test": [
                {"eval_time": "3m", "alertname": alert, "exp_alerts": []},
                {
                    "eval_time": "7m",
                    "alertname": alert,
                    "exp_alerts": [
                        {
                            "exp_labels": {**labels, "severity": "warning"},
                            "exp_annotations": _annotations(alert, labels),
                        }
                    ],
                },
            ],
        },
        {
            "interval": "1m",
            "input_series": [{"series": SERIES % "request", "values": "0 100 200 300 400 500"}],
            "alert_rule_test": [{"eval_time": "5m", "alertname": alert, "exp_alerts": []}],
        },
    ]
    result = run_rule_tests(tmp_path, tests)
    assert result.returncode == 0, result.stdout + result.stderr


def _annotations(alert: str, labels: dict[str, str]) -> dict[str, str]:
    """The alert's annotations as Prometheus renders them for ``labels`` (its templates name the encoder
    only)."""
    rule = next(
        rule
        for group in yaml.safe_load(RULES.read_text())["spec"]["groups"]
        for rule in group["rules"]
        if rule.get("alert") == alert
    )
    return {
        name: text.replace("{{ $labels.encoder }}", labels["encoder"])
        for name, text in rule["annotations"].items()
    }


EQUIVALENCE = 'epd_equivalence_mismatched{namespace="epd", pod="pd-0", encoder="http://10.0.0.7:8000"}'
CHECKS = (
    'epd_equivalence_checks_total{namespace="epd", pod="pd-0", encoder="http://10.0.0.7:8000", result="%s"}'
)


def test_an_encoder_whose_answers_differ_raises_its_alert_at_once(tmp_path: Path) -> None:
    """Issue 36: an encoder whose embeddings change PD's answers fails no request; only the equivalence
    probe sees it, and its mismatch must reach someone. A later match clears it."""
    alert = "EPDEncoderNotEquivalent"
    labels = {"namespace": "epd", "encoder": "http://10.0.0.7:8000"}
    tests = [
        {
            "interval": "1m",
            "input_series": [{"series": EQUIVALENCE, "values": "0 0 1 1 0"}],
            "alert_rule_test": [
                {"eval_time": "1m", "alertname": alert, "exp_alerts": []},
                {
                    "eval_time": "2m",
                    "alertname": alert,
                    "exp_alerts": [
                        {
                            "exp_labels": {**labels, "severity": "critical"},
                            "exp_annotations": _annotations(alert, labels),
                        }
                    ],
                },
                {"eval_time": "4m", "alertname": alert, "exp_alerts": []},
            ],
        }
    ]
    result = run_rule_tests(tmp_path, tests)
    assert result.returncode == 0, result.stdout + result.stderr


def test_probes_that_prove_nothing_for_30_minutes_raise_a_warning(tmp_path: Path) -> None:
    alert = "EPDEquivalenceProbeFailing"
    labels = {"namespace": "epd", "encoder": "http://10.0.0.7:8000"}
    failing = {
        "interval": "5m",
        "input_series": [
            {"series": CHECKS % "error", "values": "0 1 2 3 4 5 6 7"},
            {"series": CHECKS % "match", "values": "0 0 0 0 0 0 0 0"},
        ],
        "alert_rule_test": [
            {
                "eval_time": "35m",
                "alertname": alert,
                "exp_alerts": [
                    {
                        "exp_labels": {**labels, "severity": "warning"},
                        "exp_annotations": _annotations(alert, labels),
                    }
                ],
            }
        ],
    }
    # Errors beside a match in the same 30 minutes (an engine restart): the encoder was proven.
    recovering = {
        "interval": "5m",
        "input_series": [
            {"series": CHECKS % "error", "values": "0 1 2 3 4 5 6 7"},
            {"series": CHECKS % "match", "values": "0 0 0 0 0 0 0 1"},
        ],
        "alert_rule_test": [{"eval_time": "35m", "alertname": alert, "exp_alerts": []}],
    }
    result = run_rule_tests(tmp_path, [failing, recovering])
    assert result.returncode == 0, result.stdout + result.stderr


VLLM_RUNNING = (
    'vllm:num_requests_running{namespace="epd", pod="%s", job="epd-pd", model_name="m", engine="0"}'
)
LOADED = 'epd_middleware_info{namespace="epd", pod="%s", job="epd-pd", version="0.1.0"}'


def test_a_pd_serving_without_the_middleware_raises_its_alert(tmp_path: Path) -> None:
    """Issue 37: vLLM logs and skips a plugin that fails to import; every other alert needs epd_*
    series, so such a PD served every image itself with no alarm. Its vLLM series without the
    middleware's raise EPDMiddlewareNotLoaded; a PD with both stays quiet."""
    alert = "EPDMiddlewareNotLoaded"
    tests = [
        {
            "interval": "1m",
            "input_series": [
                {"series": VLLM_RUNNING % "pd-0", "values": "0x10"},
                {"series": LOADED % "pd-0", "values": "1x10"},
                {"series": VLLM_RUNNING % "pd-1", "values": "2x10"},
            ],
            "alert_rule_test": [
                {"eval_time": "3m", "alertname": alert, "exp_alerts": []},  # pending for 5 min first
                {
                    "eval_time": "6m",
                    "alertname": alert,
                    "exp_alerts": [
                        {
                            "exp_labels": {"namespace": "epd", "pod": "pd-1", "severity": "critical"},
                            "exp_annotations": {
                                name: text.replace("{{ $labels.namespace }}", "epd").replace(
                                    "{{ $labels.pod }}", "pd-1"
                                )
                                for name, text in _rule(alert)["annotations"].items()
                            },
                        }
                    ],
                },
            ],
        }
    ]
    result = run_rule_tests(tmp_path, tests)
    assert result.returncode == 0, result.stdout + result.stderr


def _rule(alert: str) -> dict[str, Any]:
    found: dict[str, Any] = next(
        rule
        for group in yaml.safe_load(RULES.read_text())["spec"]["groups"]
        for rule in group["rules"]
        if rule.get("alert") == alert
    )
    return found


def test_prometheus_loads_every_rule(tmp_path: Path) -> None:
    """``promtool check rules``: every expression parses and every annotation is a template Prometheus
    can render, the runbook links among them."""
    spec = yaml.safe_load(RULES.read_text())["spec"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {sum(len(group['rules']) for group in spec['groups'])} rules found" in result.stdout
