"""llm-d's scheduler protocol over ASGI with fakes, on asyncio and trio: the encoders and prefill server
the endpoint picker named in the request's headers, the allowlist that guards them (members, CIDR,
exact entries, ports), forged targets, and the headers never reaching anyone else."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from epd_middleware import EPDMiddleware
from epd_middleware._addresses import parse_allowlist, split_host_port
from epd_middleware._llmd import header_values

from .fakes import FakeEncoders, FakeEngine, FakePrefill, chat_body, image, upstream_client
from .test_topologies import png, post

pytestmark = pytest.mark.anyio

# Loopback addresses only: the fakes answer in-process, but the names stay ones no test could reach
# elsewhere.
POOL = "http://127.0.0.10:8001"
E1, E2, E3 = "http://127.0.0.11:8001", "http://127.0.0.12:8001", "http://127.0.0.13:8001"
P0, P1 = "http://127.0.0.20:8100", "http://127.0.0.21:8100"
ENC = "x-encoder-hosts-ports"
PRE = "x-prefiller-host-port"


def host(url: str) -> str:
    return url.removeprefix("http://")


def fleet(
    *, encoders: list[str] | None = None, prefill: list[str] | None = None, **options: Any
) -> tuple[Any, FakeEncoders, FakePrefill, FakeEngine]:
    """A PD app in llm-d mode; the fakes answer for every address, configured or not."""
    fakes = FakeEncoders([POOL, E1, E2, E3])
    prefills = FakePrefill([P0, P1])
    engine = FakeEngine()
    app = engine.app()
    options.setdefault("encoder_selection", "round_robin")
    app.add_middleware(
        EPDMiddleware,
        encoders=encoders if encoders is not None else [],
        prefill=prefill or [],
        scheduler="llm-d",
        http_client=upstream_client(fakes, prefills),
        health_check_interval=0,
        **options,
    )
    return app, fakes, prefills, engine


def headers_seen(record: Any) -> dict[str, str]:
    return {name.lower(): value for name, value in record.headers.items()}


# --- parsing ---------------------------------------------------------------------------------------


def test_header_entries_and_host_ports() -> None:
    headers = [
        (b"x-encoder-hosts-ports", b"10.0.0.1:8001, [fd00::1]:8001,,"),
        (b"x-encoder-hosts-ports", b"a:1"),
    ]
    assert header_values(headers, b"x-encoder-hosts-ports") == ["10.0.0.1:8001", "[fd00::1]:8001", "a:1"]
    assert split_host_port("[FD00::0001]:8001") == ("fd00::1", 8001)
    for bad in ("10.0.0.1", "fd00::1:8001", "[10.0.0.1]:80", "h/x:80", "h:0", "h:65536", "h@x:80", ":80"):
        assert split_host_port(bad) is None, bad


def test_allowlist_networks_ports_and_exact_entries() -> None:
    allow = parse_allowlist(
        ["10.1.0.0/16", "10.2.0.0/16:8001", "[fd00::/8]:9000", "enc.pool:8001", "10.3.0.7:80"]
    )
    assert allow.admits("10.1.2.3", 1)
    assert allow.admits("10.2.2.3", 8001)
    assert not allow.admits("10.2.2.3", 8002)
    assert allow.admits("fd00::5", 9000)
    assert not allow.admits("fd00::5", 9001)
    assert allow.admits("enc.pool", 8001)
    assert not allow.admits("enc.pool", 8002)
    assert allow.admits("10.3.0.7", 80)
    assert not allow.admits("10.3.0.7", 81)
    assert not allow.admits("10.4.0.1", 8001)
    assert not allow.admits("evil.example", 8001)  # a network admits addresses, never names
    for bad in ["10.0.0.0/33", "10.0.0.0/8:0", "nonsense", "10.0.0.1"]:
        with pytest.raises(ValueError, match="scheduler_allow"):
            parse_allowlist([bad])


def test_invalid_allowlist_fails_the_configuration() -> None:
    with pytest.raises(ValueError, match="scheduler_allow"):
        EPDMiddleware(FakeEngine().app(), scheduler="llm-d", scheduler_allow=["10.0.0.0/99"])


# --- routing -----------------------------------------------------------------------------------------


async def test_media_goes_to_the_encoders_the_header_names_item_i_on_the_ith() -> None:
    app, fakes, _, engine = fleet(encoders=[POOL], scheduler_allow=["127.0.0.0/24:8001"])
    body = chat_body(*(image(png(seed)) for seed in range(4)))
    response = await post(app, body, headers={ENC: f"{host(E1)},{host(E2)}"})
    assert response.status_code == 200
    assert sorted((call.encoder, len(call.body["messages"][0]["content"])) for call in fakes.calls) == [
        (E1, 2),
        (E2, 2),
    ]
    assert fakes.calls_to(POOL) == []
    assert len(engine.received) == 1


async def test_a_failing_named_encoder_fails_over_to_the_other_named_then_the_pool() -> None:
    app, fakes, _, _ = fleet(encoders=[POOL], scheduler_allow=["127.0.0.0/24"], max_attempts=3)
    fakes.mode[E1] = "500"
    response = await post(app, chat_body(image(png(1))), headers={ENC: f"{host(E1)},{host(E2)}"})
    assert response.status_code == 200
    assert [call.encoder for call in fakes.calls] == [E1, E2]
    fakes.mode[E2] = "500"
    response = await post(app, chat_body(image(png(2))), headers={ENC: f"{host(E1)},{host(E2)}"})
    assert response.status_code == 200
    assert [call.encoder for call in fakes.calls][2:] == [E1, E2, POOL]


async def test_without_headers_the_pool_serves_as_before() -> None:
    app, fakes, _, _ = fleet(encoders=[POOL])
    assert (await post(app, chat_body(image(png(1))))).status_code == 200
    assert [call.encoder for call in fakes.calls] == [POOL]


async def test_without_headers_or_pool_the_engine_encodes_itself() -> None:
    # An allowlist that admits none of these targets: llm-d mode with neither pool nor allowlist is refused
    # at configuration time (it could never follow a header).
    app, fakes, _, engine = fleet(scheduler_allow=["192.0.2.0/24"])
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == 200
    assert fakes.calls == []
    assert engine.received[0].json["messages"][0]["content"][1]["type"] == "image_url"


async def test_a_pool_member_is_allowed_without_an_allowlist_but_not_on_another_port(
    caplog: pytest.LogCaptureFixture,
) -> None:
    app, fakes, _, _ = fleet(encoders=[POOL, E1])
    with caplog.at_level(logging.WARNING, logger="epd_middleware"):
        response = await post(app, chat_body(image(png(1))), headers={ENC: "127.0.0.11:9999"})
    assert response.status_code == 200
    # The header's one entry was forged (a member's host on another port): served by the pool instead.
    assert next(call.encoder for call in fakes.calls) in (POOL, E1)
    assert "127.0.0.11:9999" not in {call.encoder for call in fakes.calls}
    assert "dropped encoder '127.0.0.11:9999'" in caplog.text
    response = await post(app, chat_body(image(png(2))), headers={ENC: host(E1)})
    assert [call.encoder for call in fakes.calls][-1] == E1


async def test_forged_encoder_entries_are_dropped_and_counted() -> None:
    app, fakes, _, _ = fleet(encoders=[POOL], scheduler_allow=["127.0.0.11:8001"])
    stack = app.build_middleware_stack()
    response = await post(
        stack,
        chat_body(image(png(1)), image(png(2))),
        headers={ENC: f"{host(E2)},{host(E1)},169.254.169.254:80,[::1]:22"},
    )
    assert response.status_code == 200
    assert {call.encoder for call in fakes.calls} == {E1}  # only the allowed entry
    assert _middleware(stack).pipeline.counters["forged_encoder_targets"] == 3


async def test_every_encoder_entry_forged_leaves_the_request_to_the_local_engine() -> None:
    app, fakes, _, engine = fleet(scheduler_allow=["192.0.2.0/24"])
    response = await post(app, chat_body(image(png(1))), headers={ENC: "127.0.0.99:8001"})
    assert response.status_code == 200
    assert fakes.calls == []
    assert engine.received[0].json["messages"][0]["content"][1]["type"] == "image_url"


async def test_a_forged_prefill_target_is_refused_with_403_and_nothing_is_called() -> None:
    app, fakes, prefills, engine = fleet(encoders=[POOL], prefill=[P0])
    response = await post(app, chat_body(image(png(1))), headers={PRE: "127.0.0.20:9999", ENC: host(POOL)})
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["type"] == "ForbiddenError"
    assert error["param"] == PRE
    assert "127.0.0.20:9999" in error["message"]
    assert fakes.calls == []
    assert prefills.calls == []
    assert engine.received == []


async def test_the_named_prefill_server_prefills_even_without_a_prefill_pool() -> None:
    app, fakes, prefills, engine = fleet(encoders=[POOL], scheduler_allow=["127.0.0.20:8100"])
    response = await post(app, chat_body(image(png(1))), headers={PRE: host(P0)})
    assert response.status_code == 200
    assert [call.server for call in prefills.calls] == [P0]
    assert prefills.calls[0].body["kv_transfer_params"]["do_remote_decode"] is True
    assert engine.received[0].json["kv_transfer_params"] == FakePrefill.params(
        P0, prefills.calls[0].headers["x-request-id"]
    )
    assert len(fakes.calls) == 1  # E -> P -> D


async def test_text_with_a_prefill_header_goes_p_to_d() -> None:
    app, fakes, prefills, engine = fleet(prefill=[P1])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    response = await post(app, body, headers={PRE: f"{host(P0)},{host(P1)}"})  # the first entry counts
    assert response.status_code == 403  # P0 is not a member here, P1 is
    response = await post(app, body, headers={PRE: host(P1)})
    assert response.status_code == 200
    assert [call.server for call in prefills.calls] == [P1]
    assert fakes.calls == []
    assert "kv_transfer_params" in engine.received[0].json


async def test_a_failing_named_prefill_server_fails_over_to_the_pool() -> None:
    app, _, prefills, _ = fleet(prefill=[P1], scheduler_allow=["127.0.0.20:8100"])
    prefills.mode[P0] = "500"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    response = await post(app, body, headers={PRE: host(P0)})
    assert response.status_code == 200
    assert [call.server for call in prefills.calls] == [P0, P1]


@pytest.mark.parametrize("scheduler", ["none", "llm-d"])
async def test_scheduler_headers_never_reach_the_engine_encoders_or_prefill(scheduler: str) -> None:
    fakes, prefills, engine = FakeEncoders([POOL, E1]), FakePrefill([P0]), FakeEngine()
    app = engine.app()
    app.add_middleware(
        EPDMiddleware,
        encoders=[POOL],
        prefill=[P0],
        scheduler=scheduler,
        scheduler_allow=["127.0.0.0/24"],
        http_client=upstream_client(fakes, prefills),
    )
    forged = {ENC: host(E1), PRE: host(P0), "x-kv-cache-source-host-port": "127.0.0.5:1"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        for path, body in (
            ("/v1/chat/completions", chat_body(image(png(1)))),
            ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/completions", {"model": "m", "prompt": "hi"}),
        ):
            response = await client.post(f"http://pd{path}", json=body, headers=forged)
            assert response.status_code == 200
    seen = [headers_seen(record) for record in engine.received]
    seen += [call.headers for call in fakes.calls] + [call.headers for call in prefills.calls]
    assert len(engine.received) == 3
    assert seen
    for headers in seen:
        assert not {ENC, PRE, "x-kv-cache-source-host-port"} & set(headers), headers


def _middleware(stack: Any) -> EPDMiddleware:
    while not isinstance(stack, EPDMiddleware):
        stack = stack.app
    return stack
