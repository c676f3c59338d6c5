"""Issue 36 on real vLLM: the equivalence probe proves E + PD answers what PD alone would, per encoder.

- The deployment's own PD and its two equal encoders: runs after runs, every one a match, with and
  without the non-default options; each probe request really computed (the encoders were called for
  every E + PD path, and PD's prefix cache, which a control request shows hitting, gave the probe no
  hit); ``check --canary`` exits 0.
- One extra PD (the plugin, ``equivalence_eject``, its schedule's first run at start-up) over the
  deployment's encoder-0 and one more encoder of the same name and model path. That encoder runs first
  with other weights (vLLM's ``--load-format dummy``: random weights of the same architecture): the
  start-up run names it (WARNING line, metric, status page), it leaves the pool, clients are served by
  encoder-0 as the single instance serves them, and ``check --canary`` exits 1. It is then restarted on
  the same address with other processor defaults (``--mm-processor-kwargs``, which vLLM leaves out of
  the media hash: nothing else notices) and the next run names it too.

The extra servers come one at a time beside the deployment's (a 24 GiB machine holds about 16).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from epd_lab import servers as lab
from epd_lab.seed import seed_image, seed_request
from epd_middleware._equivalence import probe_fields
from epd_middleware.cli import main

from .conftest import API_KEY, Deployment
from .test_vllm_e2e import AUTH, MODEL, _sample, assert_same, chat, chat_calls

pytestmark = pytest.mark.e2e

# The probe image is 112 x 112 pixels (16 vision tokens); this caps the processor at 56 x 56 (4).
SMALLER = {"size": {"shortest_edge": 3136, "longest_edge": 3136}}
SETTLE_S = 180.0
# A run asked for within 10 s of the last is answered with the last one's report.
FRESH_S = 11.0


@dataclass
class Mixed:
    pd: lab.VLLMServer
    other: lab.VLLMServer  # the odd encoder: other weights first, then other processor defaults
    good: lab.VLLMServer  # the deployment's encoder-0


def status(server: lab.VLLMServer, headers: dict[str, str] | None = None) -> dict[str, Any]:
    page: dict[str, Any] = httpx.get(f"{server.url}/epd/status", headers=headers, timeout=30).json()
    return page


def metrics(server: lab.VLLMServer) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=30).text


def run_probe(server: lab.VLLMServer, headers: dict[str, str] | None = None) -> dict[str, Any]:
    time.sleep(FRESH_S)
    report: dict[str, Any] = httpx.post(
        f"{server.url}/epd/status/equivalence", headers=headers, timeout=300
    ).json()
    return report


@pytest.fixture(scope="module")
def mixed(deployment: Deployment) -> Iterator[Mixed]:
    python, model, logs, storage = (
        deployment.python,
        deployment.model,
        deployment.single.log_dir,
        deployment.storage,
    )
    other = lab.encoder_server(python, model, logs, storage, name="encoder-other-weights")
    other.args += ["--load-format", "dummy"]
    good = deployment.encoders[0]
    pd = lab.pd_server(
        python,
        model,
        logs,
        storage,
        [good.url, other.url],
        via="plugin",
        name="pd-equivalence",
        extra_env={"EPD_EQUIVALENCE_INTERVAL": "600", "EPD_EQUIVALENCE_EJECT": "true"},
    )
    state = Mixed(pd, other, good)
    try:
        lab.start_all([other], timeout=900)
        lab.start_all([pd], timeout=900)  # its start-up run finds the odd encoder up
        # That run starts once the server is up and takes seconds: its verdicts, both, before any test.
        deadline = time.monotonic() + SETTLE_S
        while len(status(pd)["equivalence"]["encoders"]) < 2:
            assert time.monotonic() < deadline, status(pd)["equivalence"]
            time.sleep(0.5)
        yield state
    finally:
        lab.stop_all([state.pd, state.other])


def test_an_equal_fleet_matches_run_after_run_with_and_without_options(deployment: Deployment) -> None:
    for _ in range(3):
        report = run_probe(deployment.pd, AUTH)
        assert report["ok"] is True, report
        assert report["mode"] == "pd_alone"
        assert report["tolerance"] == 0.02  # float32
        for server in deployment.encoders:
            verdict = report["encoders"][server.url]
            assert verdict["result"] == "match", verdict
            assert set(verdict["variants"]) == {"default", "options"}
    page = status(deployment.pd, AUTH)
    assert page["equivalence"]["dtype"] == "float32"
    assert page["counters"].get("equivalence_mismatch", 0) == 0
    text = metrics(deployment.pd)
    for server in deployment.encoders:
        assert _sample(text, "epd_equivalence_checks_total", encoder=server.url, result="match") >= 3
        assert _sample(text, "epd_equivalence_mismatched", encoder=server.url) == 0


def test_every_probe_request_was_computed_not_read_from_a_cache(deployment: Deployment) -> None:
    """Each encoder answered a call for each of its E + PD paths, and PD's prefix cache, queried by every
    probe request, gave none a hit: each path ran under its own salt. The control, one probe body sent
    twice under one salt, does hit it (the probe's prompt fills whole 128-token CPU blocks)."""
    before_calls = [chat_calls(server) for server in deployment.encoders]
    before = metrics(deployment.pd)
    report = run_probe(deployment.pd, AUTH)
    assert report["ok"] is True, report
    after = metrics(deployment.pd)
    after_calls = [chat_calls(server) for server in deployment.encoders]
    assert [later - earlier for earlier, later in zip(before_calls, after_calls, strict=True)] == [2, 2]
    hits = _sample(after, "vllm:prefix_cache_hits_total") - _sample(before, "vllm:prefix_cache_hits_total")
    queries = _sample(after, "vllm:prefix_cache_queries_total") - _sample(
        before, "vllm:prefix_cache_queries_total"
    )
    assert queries > 0
    assert hits == 0, (hits, queries)
    body = probe_fields(MODEL, {}, 2, "epd-e2e-control-salt", "epd-e2e-control-uuid")
    for _ in range(2):
        answer = httpx.post(f"{deployment.pd.url}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
        assert answer.status_code == 200, answer.text
    control = _sample(metrics(deployment.pd), "vllm:prefix_cache_hits_total") - _sample(
        after, "vllm:prefix_cache_hits_total"
    )
    assert control > 0


def test_other_weights_under_the_same_name_and_path_are_found_in_the_first_run(mixed: Mixed) -> None:
    page = status(mixed.pd)["equivalence"]
    assert page["cost"]["runs"] == 1  # the start-up run (the next is 600 s away)
    verdicts = page["encoders"]
    assert verdicts[mixed.good.url]["result"] == "match", verdicts
    other = verdicts[mixed.other.url]
    assert other["result"] == "mismatch", other
    log = mixed.pd.log_path.read_text(errors="replace")
    assert f"epd: encoder {mixed.other.url} does not answer what PD alone answers" in log
    state = status(mixed.pd)["encoders"][mixed.other.url]
    assert state["model"]["state"] == "ok"  # the same name and path: the model check passes it
    assert state["healthy"] is False
    assert state["why_not"].startswith("out of the pool: its answers differ from PD's own")
    text = metrics(mixed.pd)
    assert _sample(text, "epd_equivalence_mismatched", encoder=mixed.other.url) == 1
    assert _sample(text, "epd_equivalence_mismatched", encoder=mixed.good.url) == 0
    assert _sample(text, "epd_middleware_info") == 1  # what EPDMiddlewareNotLoaded looks for (issue 37)


def test_clients_of_the_mixed_fleet_get_the_single_instance_s_answer(
    mixed: Mixed, deployment: Deployment
) -> None:
    served = chat_calls(mixed.other)
    for shift in (611, 612, 613):
        body = seed_request(MODEL, images=[seed_image(shift=shift)])
        assert_same(chat(mixed.pd, body), chat(deployment.single, body))
    assert chat_calls(mixed.other) == served  # out of the pool: no client's call


def check_canary(
    pd: lab.VLLMServer, encoders: list[lab.VLLMServer], capsys: pytest.CaptureFixture[str]
) -> tuple[int, dict[str, Any]]:
    code = main(
        [
            "check",
            "--encoders",
            ",".join(server.url for server in encoders),
            "--pd",
            pd.url,
            "--canary",
            "--json",
        ]
    )
    payload: dict[str, Any] = json.loads(capsys.readouterr().out)
    return code, payload


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith(("EPD_", "VLLM_"))]:
        monkeypatch.delenv(name)


@pytest.mark.usefixtures("clean_environment")
def test_check_canary_exits_0_for_the_equal_fleet_and_1_for_the_mixed_one(
    mixed: Mixed, deployment: Deployment, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    time.sleep(FRESH_S)
    monkeypatch.setenv("VLLM_API_KEY", API_KEY)  # the deployment's PD is behind vLLM's key
    code, payload = check_canary(deployment.pd, deployment.encoders, capsys)
    assert code == 0, payload["problems"]
    assert payload["pd"]["canary"]["ok"] is True
    monkeypatch.delenv("VLLM_API_KEY")
    code, payload = check_canary(mixed.pd, [mixed.good, mixed.other], capsys)
    assert code == 1
    problems = "\n".join(payload["problems"])
    assert f"canary: encoder {mixed.other.url}: mismatch" in problems
    # PD's own verdict (out of the pool) is a problem too, beside the command's own questions.
    assert f"pd {mixed.pd.url}: encoder {mixed.other.url}: out of the pool" in problems


def test_other_processor_defaults_are_found_too(mixed: Mixed, deployment: Deployment) -> None:
    """The same address, restarted with --mm-processor-kwargs capping images at 56 x 56: vLLM leaves
    server-side processor options out of the media hash, so the handle checks pass it; only the
    answers differ (fewer vision tokens)."""
    before = _sample(
        metrics(mixed.pd), "epd_equivalence_checks_total", encoder=mixed.other.url, result="mismatch"
    )
    mixed.other.stop()
    replacement = lab.encoder_server(
        deployment.python,
        deployment.model,
        deployment.single.log_dir,
        deployment.storage,
        name="encoder-other-processor",
    )
    replacement.port = mixed.other.port
    replacement.args += ["--mm-processor-kwargs", json.dumps(SMALLER)]
    mixed.other = replacement
    lab.start_all([replacement], timeout=900)
    # Down while it restarted, it was ejected: a passing health probe brings it back for the probe.
    deadline = time.monotonic() + SETTLE_S
    while status(mixed.pd)["encoders"][replacement.url]["ejected_for_s"] > 0:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    report = run_probe(mixed.pd)
    verdict = report["encoders"][replacement.url]
    assert verdict["result"] == "mismatch", verdict
    assert "prompt of" in verdict["detail"], verdict  # a smaller image: fewer vision tokens
    assert report["encoders"][mixed.good.url]["result"] == "match"
    lines = [
        line
        for line in mixed.pd.log_path.read_text(errors="replace").splitlines()
        if f"epd: encoder {replacement.url} does not answer what PD alone answers" in line
    ]
    assert "prompt of" in lines[-1], lines  # this run's: fewer vision tokens
    assert all("prompt of" not in line for line in lines[:-1]), lines  # the weights' runs said otherwise
    after = _sample(
        metrics(mixed.pd), "epd_equivalence_checks_total", encoder=replacement.url, result="mismatch"
    )
    assert after == before + 1
