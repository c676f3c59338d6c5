"""Encoders found by DNS (``dns+http://NAME:PORT``), against a DNS server on loopback whose records change
while the middleware runs, on asyncio and trio: new addresses take traffic, vanished ones get no new
calls, survivors keep their health, a failed lookup keeps the last answer, an empty one means no
encoders."""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import pytest

from epd_middleware import EPDMiddleware
from epd_middleware.config import EPDConfig

from .dns_server import dns_server
from .fakes import FakeEncoders, FakeEngine, chat_body, image, scripted_receive
from .test_middleware import http_scope
from .test_topologies import png, post

pytestmark = pytest.mark.anyio

A, B, C = "127.0.0.31", "127.0.0.32", "127.0.0.33"
NAME = "encoders.epd.svc.cluster.local"


def url(address: str) -> str:
    return f"http://{address}:8001"


def middleware(dns: str, fakes: FakeEncoders, **options: Any) -> EPDMiddleware:
    options.setdefault("encoder_selection", "round_robin")
    return EPDMiddleware(
        FakeEngine().app(),
        encoders=[f"dns+http://{NAME}:8001"],
        dns_nameservers=[dns],
        dns_refresh_interval=0.05,
        dns_timeout=0.5,
        health_check_interval=0,
        http_client=fakes.client(),
        **options,
    )


async def settle(app: EPDMiddleware, *members: str) -> None:
    """Requests trigger refreshes (no lifespan here): send a few until the pool has ``members``."""
    with anyio.fail_after(5):
        while set(app.pipeline.encoders.members) != {url(m) for m in members}:
            await anyio.sleep(0.06)
            await post(app, chat_body(image(png(0))))


def test_dns_urls_and_nameservers_are_checked() -> None:
    assert EPDConfig(encoders=("dns+http://enc.ns.svc:8001",)).encoders == ("dns+http://enc.ns.svc:8001",)
    for bad in ("dns+http://enc.ns.svc", "dns+http://enc:8001/v1", "dns+ftp://enc:8001"):
        with pytest.raises(ValueError, match="URL"):
            EPDConfig(encoders=(bad,))
    with pytest.raises(ValueError, match="DNS server"):
        EPDConfig(encoders=("http://a:1",), dns_nameservers=("dns.example:53",))


async def test_the_first_request_waits_for_the_first_answer_and_uses_every_address() -> None:
    async with dns_server({NAME: [A, B, "::1"]}) as dns:
        fakes = FakeEncoders([url(A), url(B), "http://[::1]:8001"])
        app = middleware(dns.address, fakes)
        for seed in range(6):
            assert (await post(app, chat_body(image(png(seed))))).status_code == 200
    assert {call.encoder for call in fakes.calls} == {url(A), url(B), "http://[::1]:8001"}
    status = app.pipeline.discoveries[0].snapshot()[f"dns+http://{NAME}:8001"]
    assert status["addresses"] == [A, B, "::1"]
    assert status["last_error"] is None


async def test_added_and_removed_addresses_and_survivors_keep_their_health() -> None:
    async with dns_server({NAME: [A, B]}) as dns:
        fakes = FakeEncoders([url(A), url(B), url(C)])
        app = middleware(dns.address, fakes, eject_after=1, eject_cooldown=60, max_eject_cooldown=60)
        fakes.mode[url(B)] = "500"
        await settle(app, A, B)
        for seed in range(1, 3):  # round-robin: one of these goes to B first, which fails over to A
            assert (await post(app, chat_body(image(png(seed))))).status_code == 200
        assert not app.pipeline.encoders.snapshot(anyio.current_time())[url(B)]["healthy"]
        dns.records[NAME] = [B, C]  # A goes, C comes, B stays (ejected)
        await settle(app, B, C)
        before = len(fakes.calls)
        for seed in range(10, 16):
            assert (await post(app, chat_body(image(png(seed))))).status_code == 200
        later = {call.encoder for call in fakes.calls[before:]}
    assert later == {url(C)}  # A is gone, B is still ejected: its health survived the change
    snapshot = app.pipeline.encoders.snapshot(anyio.current_time())
    assert url(A) not in snapshot
    assert snapshot[url(B)]["healthy"] is False


async def test_a_failed_lookup_keeps_the_last_answer_and_is_shown() -> None:
    async with dns_server({NAME: [A]}) as dns:
        fakes = FakeEncoders([url(A)])
        app = middleware(dns.address, fakes)
        await settle(app, A)
        dns.mode = "servfail"
        failed_before = app.pipeline.counters["encoder_dns_lookups_failed"]
        with anyio.fail_after(5):
            while app.pipeline.counters["encoder_dns_lookups_failed"] == failed_before:
                await anyio.sleep(0.06)
                assert (await post(app, chat_body(image(png(1))))).status_code == 200
        assert app.pipeline.encoders.members == (url(A),)
        status = app.pipeline.discoveries[0].snapshot()[f"dns+http://{NAME}:8001"]
        assert status["addresses"] == [A]
        assert status["failed_lookups"] >= 1
        assert "SERVFAIL" in status["last_error"] or "NoNameservers" in status["last_error"]


async def test_an_empty_answer_means_no_encoders() -> None:
    async with dns_server({}) as dns:  # NXDOMAIN: the headless Service has no ready pod
        fakes = FakeEncoders([url(A)])
        app = middleware(dns.address, fakes)
        response = await post(app, chat_body(image(png(1))))
        assert response.status_code == 503
        assert "every encoder" in response.json()["error"]["message"]
        local = middleware(dns.address, fakes, on_encoder_failure="local")
        assert (await post(local, chat_body(image(png(1))))).status_code == 200
    assert fakes.calls == []


async def test_a_dead_dns_server_never_delays_a_response() -> None:
    async with dns_server({NAME: [A]}) as dns:
        fakes = FakeEncoders([url(A)])
        app = middleware(dns.address, fakes)
        await settle(app, A)
        dns.mode = "drop"  # every later lookup takes dns_timeout (0.5 s) and fails
        await anyio.sleep(0.1)  # the answer is now older than the refresh interval
        body = json.dumps(chat_body(image(png(2)))).encode()
        answered: list[float] = []

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                answered.append(time.monotonic())

        started = time.monotonic()
        with anyio.fail_after(5):
            await app(http_scope(body), scripted_receive(body), send)
        assert answered
        assert answered[0] - started < 0.3
        assert app.pipeline.encoders.members == (url(A),)


async def test_the_lifespan_refreshes_in_the_background() -> None:
    async with dns_server({NAME: [A]}) as dns:
        fakes = FakeEncoders([url(A), url(B)])
        app = middleware(dns.address, fakes)
        messages = [{"type": "lifespan.startup"}]
        shutdown = anyio.Event()
        sent: list[str] = []

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await shutdown.wait()
            return {"type": "lifespan.shutdown"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message["type"])

        async with anyio.create_task_group() as group:
            group.start_soon(app, {"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send)
            with anyio.fail_after(5):
                # Polled: nothing sends a request, the lifespan's own task looks names up.
                while app.pipeline.encoders.members != (url(A),):  # noqa: ASYNC110
                    await anyio.sleep(0.02)
                dns.records[NAME] = [A, B]
                while set(app.pipeline.encoders.members) != {url(A), url(B)}:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            shutdown.set()
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
