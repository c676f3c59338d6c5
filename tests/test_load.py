"""Fault injection under load, over real loopback sockets, on asyncio and trio (issue: keep serving).

2,000 multimodal requests at concurrency 64 over 3 encoders, one of which fails in every way in turn
(refuses connections, answers 500, hangs past the timeout, answers garbage, drops the connection
mid-response): every request must be answered correctly. Then every encoder down, under both fallback
policies. Figures are printed (run with -s, or see benchmarks/fault_injection.py); no timing is asserted
except that nothing waits past its deadline.
"""

from __future__ import annotations

import json

import pytest

from epd_lab.servers import free_port

from .load.harness import encoder_processes, run_scenario

pytestmark = pytest.mark.anyio

FAST_RECOVERY = {
    "encoder_timeout": 1.0,
    "eject_cooldown": 0.1,
    "max_eject_cooldown": 0.3,
    "health_check_interval": 0.5,
    "health_check_timeout": 0.3,
}


async def test_one_encoder_failing_every_way_loses_no_request(anyio_backend: str) -> None:
    with encoder_processes(faulty=1, healthy=3) as urls:
        faulty, healthy = urls[0], urls[1:]
        clean = await run_scenario(anyio_backend, healthy, requests=2000, concurrency=64, **FAST_RECOVERY)
        faults = await run_scenario(
            anyio_backend, [faulty, *healthy[:2]], requests=2000, concurrency=64, rounds=2, **FAST_RECOVERY
        )
    print(json.dumps({"no_faults": clean, "one_encoder_faulty": faults}, indent=1))
    for scenario in (clean, faults):
        for round_ in scenario["rounds"]:
            assert round_["answered_correctly"] == round_["sent"] == 2000, round_
            assert round_["errors_by_status"] == {}
        leaks = scenario["leaks"]
        assert leaks["tasks_left_after_load"] == 0
        assert leaks["tasks_left_after_shutdown"] <= 0
        assert leaks["sockets_left_after_shutdown"] <= 0
    assert faults["counters"].get("fallback", 0) == 0
    # The faulty encoder was really in the rotation, and really failing.
    assert (
        faults["encoder_health"][faulty]["consecutive_failures"] > 0
        or not faults["encoder_health"][faulty]["healthy"]
    )
    # Memory is bounded: a second round of 2,000 requests does not grow the process noticeably.
    assert faults["leaks"]["rss_growth_mb_after_first_round"] < 40


@pytest.mark.parametrize("policy", ["local", "error"])
async def test_every_encoder_down(anyio_backend: str, policy: str) -> None:
    down = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    result = await run_scenario(
        anyio_backend,
        down,
        requests=300,
        concurrency=32,
        on_encoder_failure=policy,
        encode_deadline=2.0,
        **FAST_RECOVERY,
    )
    print(json.dumps(result, indent=1))
    [round_] = result["rounds"]
    if policy == "local":
        assert round_["answered_correctly"] == round_["fallback"] == 300
    else:
        assert round_["answered_correctly"] == 0
        assert set(round_["errors_by_status"]) <= {502, 503}
        assert sum(round_["errors_by_status"].values()) == 300
        assert round_["errors_without_clear_json"] == 0
    assert round_["max_ms"] < 10_000, "a request waited far past the encode deadline"
    assert result["leaks"]["tasks_left_after_load"] == 0
