"""Issue 36 on real vLLM: the equivalence probe proves E + PD answers what PD alone would, per encoder.

Two extra PDs (the plugin, ECExampleConnector, the deployment's storage) and two extra encoders:

- ``equal``: the deployment's two encoders, a probe every few seconds: several runs, every one a match,
  with and without the non-default options; each probe request really computed (the encoders were
  called, PD's prefix cache gave no hit), and ``check --canary`` exits 0.
- ``mixed``: the deployment's encoder-0 beside an encoder of the same name and model path whose weights
  are others (vLLM's ``--load-format dummy``: random weights of the same architecture) and one whose
  processor defaults differ (``--mm-processor-kwargs``), ``equivalence_eject`` on. The first run (at
  start-up) names both: WARNING lines, the metric, the status page, both out of the pool, requests
  served by encoder-0 equal to the single instance; ``check --canary`` exits 1.

On the Mooncake consumer (tests/e2e/test_mooncake_e2e.py, its last test) the encoders are compared with
each other instead.
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

from .conftest import Deployment
from .test_vllm_e2e import MODEL, _sample, assert_same, chat, chat_calls

pytestmark = pytest.mark.e2e

INTERVAL_S = 4.0
# The probe image is 112 x 112 pixels (16 vision tokens); this caps the processor at 56 x 56 (4).
SMALLER = {"size": {"shortest_edge": 3136, "longest_edge": 3136}}
SETTLE_S = 180.0


@dataclass
class Fleet:
    equal: lab.VLLMServer
    mixed: lab.VLLMServer
    other_weights: lab.VLLMServer
    other_processor: lab.VLLMServer
    good: lab.VLLMServer  # the deployment's encoder-0, in both


def status(server: lab.VLLMServer) -> dict[str, Any]:
    page: dict[str, Any] = httpx.get(f"{server.url}/epd/status", timeout=30).json()
    return page


def metrics(server: lab.VLLMServer) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=30).text


@pytest.fixture(scope="module")
def fleet(deployment: Deployment) -> Iterator[Fleet]:
    python, model, logs, storage = (
        deployment.python,
        deployment.model,
        deployment.single.log_dir,
        deployment.storage,
    )
    other_weights = lab.encoder_server(python, model, logs, storage, name="encoder-other-weights")
    other_weights.args += ["--load-format", "dummy"]
    other_processor = lab.encoder_server(python, model, logs, storage, name="encoder-other-processor")
    other_processor.args += ["--mm-processor-kwargs", json.dumps(SMALLER)]
    good = deployment.encoders[0]
    equal = lab.pd_server(
        python,
        model,
        logs,
        storage,
        [server.url for server in deployment.encoders],
        via="plugin",
        name="pd-equivalence-equal",
        extra_env={"EPD_EQUIVALENCE_INTERVAL": str(INTERVAL_S)},
    )
    mixed = lab.pd_server(
        python,
        model,
        logs,
        storage,
        [good.url, other_weights.url, other_processor.url],
        via="plugin",
        name="pd-equivalence-mixed",
        extra_env={"EPD_EQUIVALENCE_INTERVAL": "600", "EPD_EQUIVALENCE_EJECT": "true"},
    )
    servers = [other_weights, other_processor, equal, mixed]
    try:
        lab.start_all(servers, timeout=900)
        yield Fleet(equal, mixed, other_weights, other_processor, good)
    finally:
        lab.stop_all(servers)


def wait_for(what: str, done: Any, limit: float = SETTLE_S) -> Any:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        found = done()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"not within {limit:g} s: {what}")


def test_an_equal_fleet_matches_run_after_run_with_and_without_options(
    fleet: Fleet, deployment: Deployment
) -> None:
    def runs() -> dict[str, Any] | None:
        page = status(fleet.equal)["equivalence"]
        return page if page["cost"]["runs"] >= 3 else None

    page = wait_for("three equivalence runs", runs)
    assert page["mode"] == "pd_alone"
    assert page["dtype"] == "float32"
    assert page["tolerance"] == 0.02
    for url, verdict in page["encoders"].items():
        assert verdict["result"] == "match", (url, verdict)
        assert set(verdict["variants"]) == {"default", "options"}
    counters = status(fleet.equal)["counters"]
    assert counters.get("equivalence_mismatch", 0) == 0
    assert counters["equivalence_match"] >= 3 * 2
    text = metrics(fleet.equal)
    for server in deployment.encoders:
        assert _sample(text, "epd_equivalence_checks_total", encoder=server.url, result="match") >= 3
        assert _sample(text, "epd_equivalence_mismatched", encoder=server.url) == 0


def test_every_probe_request_was_computed_not_read_from_a_cache(fleet: Fleet, deployment: Deployment) -> None:
    """One run by hand: each encoder answered a call for each E + PD path, and PD's prefix cache (whose
    queries grew) gave no hit; the control, the same probe body sent twice, does hit it."""
    before_calls = [chat_calls(server) for server in deployment.encoders]
    before = metrics(fleet.equal)
    time.sleep(11)  # past the last run's 10 s in which a request is answered with that run's report
    report = httpx.post(f"{fleet.equal.url}/epd/status/equivalence", timeout=300).json()
    assert report["ok"] is True, report
    after = metrics(fleet.equal)
    after_calls = [chat_calls(server) for server in deployment.encoders]
    # The schedule may have run once more meanwhile: at least the two variants' calls on each.
    assert all(later - earlier >= 2 for earlier, later in zip(before_calls, after_calls, strict=True))
    hits = _sample(after, "vllm:prefix_cache_hits_total") - _sample(before, "vllm:prefix_cache_hits_total")
    queries = _sample(after, "vllm:prefix_cache_queries_total") - _sample(
        before, "vllm:prefix_cache_queries_total"
    )
    assert queries > 0
    assert hits == 0, (hits, queries)
    # The control: a probe body of one salt, twice, is served from the prefix cache the second time.
    body = probe_fields(MODEL, {}, 2, "epd-e2e-control-salt", "epd-e2e-control-uuid")
    assert httpx.post(f"{fleet.equal.url}/v1/chat/completions", json=body, timeout=120).status_code == 200
    middle = metrics(fleet.equal)
    assert httpx.post(f"{fleet.equal.url}/v1/chat/completions", json=body, timeout=120).status_code == 200
    assert _sample(metrics(fleet.equal), "vllm:prefix_cache_hits_total") > _sample(
        middle, "vllm:prefix_cache_hits_total"
    )


def test_other_weights_and_other_processor_defaults_are_found_in_the_first_run(fleet: Fleet) -> None:
    def judged() -> dict[str, Any] | None:
        page = status(fleet.mixed)["equivalence"]
        return page if len(page["encoders"]) == 3 else None

    page = wait_for("the start-up run", judged)
    assert page["cost"]["runs"] == 1  # the first run found them (the next is 600 s away)
    verdicts = page["encoders"]
    assert verdicts[fleet.good.url]["result"] == "match", verdicts
    weights = verdicts[fleet.other_weights.url]
    assert weights["result"] == "mismatch", weights
    processor = verdicts[fleet.other_processor.url]
    assert processor["result"] == "mismatch", processor
    assert "prompt of" in processor["detail"], processor  # a smaller image: fewer vision tokens
    log = fleet.mixed.log_path.read_text(errors="replace")
    for server in (fleet.other_weights, fleet.other_processor):
        assert f"epd: encoder {server.url} does not answer what PD alone answers" in log
        state = status(fleet.mixed)["encoders"][server.url]
        assert state["healthy"] is False
        assert state["why_not"].startswith("out of the pool: its answers differ from PD's own")
    text = metrics(fleet.mixed)
    assert _sample(text, "epd_equivalence_mismatched", encoder=fleet.other_weights.url) == 1
    assert _sample(text, "epd_equivalence_mismatched", encoder=fleet.good.url) == 0
    assert (
        _sample(text, "epd_equivalence_checks_total", encoder=fleet.other_processor.url, result="mismatch")
        == 1
    )


def test_clients_of_the_mixed_fleet_get_the_single_instance_s_answer(
    fleet: Fleet, deployment: Deployment
) -> None:
    wait_for("the start-up run", lambda: len(status(fleet.mixed)["equivalence"]["encoders"]) == 3)
    served = [chat_calls(server) for server in (fleet.other_weights, fleet.other_processor)]
    for shift in (611, 612, 613):
        body = seed_request(MODEL, images=[seed_image(shift=shift)])
        baseline = chat(deployment.single, body)
        assert_same(chat(fleet.mixed, body), baseline)
    assert [chat_calls(server) for server in (fleet.other_weights, fleet.other_processor)] == served


def test_check_canary_exits_0_for_the_equal_fleet_and_1_for_the_mixed_one(
    fleet: Fleet, deployment: Deployment, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [name for name in os.environ if name.startswith(("EPD_", "VLLM_"))]:
        monkeypatch.delenv(name)
    equal = ",".join(server.url for server in deployment.encoders)
    assert main(["check", "--encoders", equal, "--pd", fleet.equal.url, "--canary", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["pd"]["canary"]["ok"] is True
    mixed = ",".join(server.url for server in (fleet.good, fleet.other_weights, fleet.other_processor))
    assert main(["check", "--encoders", mixed, "--pd", fleet.mixed.url, "--canary", "--json"]) == 1
    payload = json.loads(capsys.readouterr().out)
    problems = "\n".join(payload["problems"])
    assert f"canary: encoder {fleet.other_weights.url}: mismatch" in problems
    assert f"canary: encoder {fleet.other_processor.url}: mismatch" in problems
    # PD's own verdict (out of the pool) is a problem too, beside the command's own questions.
    assert f"pd {fleet.mixed.url}: encoder {fleet.other_weights.url}: out of the pool" in problems
