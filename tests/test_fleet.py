"""The fleet test: three PD processes with the middleware in llm-d scheduler mode, encoders found by DNS on
their own loopback addresses, and a front playing the gateway and the endpoint picker, on asyncio and
trio. During the load an encoder is added, one removed, one killed, and DNS goes down for a while: no
request fails or gets a wrong answer, nothing ever connects to a forged target, every forged prefill
target is refused, and the encoders share the load."""

from __future__ import annotations

import json

import pytest

from .fleet.harness import ADDED, FIRST, fleet, pool_figures, run_load, summary

pytestmark = pytest.mark.anyio

REQUESTS = 1200


async def test_a_changing_fleet_loses_no_request_and_calls_no_forged_target(anyio_backend: str) -> None:
    async with fleet(anyio_backend) as made:
        outcomes, wall = await run_load(made, REQUESTS, concurrency=16, rate=100)
        statuses = await made.statuses()
        served = await made.served()
        canary = made.canary_connections
    figures = {**summary(outcomes, wall), "pools": pool_figures(statuses), "served": served}
    print(json.dumps({**figures, "events": made.events}, indent=1))
    assert len(made.events) == 5, made.events  # every change happened during the load
    for outcome in outcomes:
        if outcome.kind == "forged prefill":
            assert outcome.status == 403, outcome
        else:
            assert outcome.status == 200, outcome
            assert outcome.verified, outcome
    assert canary == 0
    forged = sum(outcome.kind == "forged encoder" for outcome in outcomes)
    assert figures["pools"]["forged_encoder_targets"] == forged
    assert figures["pools"]["forged_prefill_targets"] == REQUESTS // 20
    # Load spread: the encoders that lived through the run, and the one added during it, all encoded.
    survivors = [FIRST[2], ADDED]
    assert set(served) == {*FIRST, ADDED}
    assert all(count > 0 for count in served.values()), served
    # Every PD process kept looking DNS up, and the outage was seen and survived.
    for status in statuses:
        [name] = status["dns"]["encoder"].values()
        assert sorted(name["addresses"]) == sorted(survivors)
    assert figures["pools"]["encoder_dns_lookups_failed"] > 0
