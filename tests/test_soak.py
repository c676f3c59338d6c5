"""The soak (benchmarks/soak.py, issue 38 item 4) at a small scale, and what it found.

``test_short_soak``: the full soak's processes and faults, cycled within seconds (an encoder restarted
every 6 s, the faulty one through slow and every failure every 7.7 s, a DNS member joining and one leaving
every 3 s, clients cutting streams and encode stages, bad media), a few thousand requests or more in
about 30 s of load per backend. It asserts what the full run asserts (benchmarks.soak.verdict): no
request lost, none answered wrongly, and every sampled quantity of the PD process flat after the
warm-up within its bound. Nothing about time is asserted.

The other tests: what the soak found growing. Every address a DNS name ever gave kept an entry in the
built-in client's table of origins, and the idle connections to it stayed open for ever (a departed encoder
is never called again, so nothing took them from its pool): a descriptor or more for every pod a rollout
replaced. And a member that left its pool while calls to it ran kept its health record (a stranger's,
listed on the status page) until 1,024 strangers had gathered: one more for every pod a rollout replaced
under load.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from benchmarks import soak
from epd_middleware._http import HTTPClient
from epd_middleware._http import _client as client_module
from epd_middleware._metrics import Stats
from epd_middleware._pool import PoolPolicy, ServerPool

OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


@asynccontextmanager
async def server(hold: anyio.Event | None = None) -> AsyncIterator[tuple[str, anyio.Event]]:
    """A loopback keep-alive server answering every request 200; yields its URL and an event set once
    the client closed a connection. With ``hold``, answers wait until it is set."""
    closed = anyio.Event()
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)

    async def serve(stream: anyio.abc.SocketStream) -> None:
        reader = BufferedByteReceiveStream(stream)
        async with stream:
            while True:
                try:
                    head = await reader.receive_until(b"\r\n\r\n", 65536)
                except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError):
                    closed.set()
                    return
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                if length:
                    await reader.receive_exactly(length)
                if hold is not None:
                    await hold.wait()
                await stream.send(OK)

    async with anyio.create_task_group() as group:
        group.start_soon(listener.serve, serve)
        try:
            yield f"http://127.0.0.1:{port}", closed
        finally:
            group.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_server_no_longer_called_keeps_neither_connections_nor_an_entry(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "_IDLE_SECONDS", 0.05)
    client = HTTPClient(connect_timeout=1)
    try:
        async with server() as (gone, gone_closed), server() as (kept, _):
            assert await client.request("POST", gone + "/v1/chat/completions", b"{}") == (200, b"ok")
            assert await client.request("POST", kept + "/v1/chat/completions", b"{}") == (200, b"ok")
            assert len(client._origins) == 2
            await anyio.sleep(0.1)  # past the idle time: nothing will take the connection to `gone` again
            assert await client.request("POST", kept + "/v1/chat/completions", b"{}") == (200, b"ok")
            assert list(client._origins) == [kept]
            with anyio.fail_after(5):
                await gone_closed.wait()
    finally:
        await client.aclose()


@pytest.mark.anyio
async def test_a_connection_whose_origin_was_forgotten_during_its_call_goes_back_to_the_pool(
    anyio_backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_module, "_IDLE_SECONDS", 0.05)
    client = HTTPClient(connect_timeout=1)
    hold = anyio.Event()
    try:
        async with server(hold) as (slow, _), server() as (other, _):
            async with anyio.create_task_group() as group:
                group.start_soon(client.request, "POST", slow + "/v1/chat/completions", b"{}")
                await anyio.sleep(0.1)
                # The sweep runs while the call to `slow` holds its only connection: no idle one left
                assert await client.request("POST", other + "/v1/chat/completions", b"{}") == (200, b"ok")
                hold.set()
            # The connection came back to a pool the client still knows, not to a forgotten one
            assert len(client._origins[slow].idle) == 1
    finally:
        await client.aclose()


@pytest.mark.anyio
async def test_a_member_that_left_while_busy_is_forgotten_once_idle(anyio_backend: str) -> None:
    pool = ServerPool("encoder", PoolPolicy(5.0), Stats())
    a, b = "http://127.0.0.1:8001", "http://127.0.0.2:8001"
    pool.set_members([a, b])
    capacity = pool.record(b).capacity
    assert capacity.take_now()  # a call to b in flight
    pool.set_members([a])  # b leaves the DNS answer meanwhile
    assert pool.known(b) is not None  # its call still runs: its record stays
    capacity.release()
    pool.record_latency(b, 0.01)  # the call's end, recorded as a successful call's is
    pool.set_members([a])  # the next lookup, the same answer
    assert pool.known(b) is None
    assert set(pool.snapshot(0.0)) == {a}
    # A server a scheduler names, never a member, keeps its record (its health between requests).
    stranger = "http://127.0.0.3:8001"
    pool.record_success(stranger)
    pool.set_members([a])
    assert pool.known(stranger) is not None
    # A departed member that comes back is a member like any other.
    pool.set_members([a, b])
    assert pool.known(b) is not None
    assert pool.is_member(b)


def test_short_soak(anyio_backend: str) -> None:
    results = soak.run(soak.short_config(anyio_backend))
    print(soak.report(results))
    checks = results["verdict"]["checks"]
    print(json.dumps(results["faults"]))
    faults = results["faults"]
    # Every fault kind happened.
    assert faults["encoder_restarts"] >= 2
    assert all(
        faults["faulty_phases"].get(mode, 0) >= 1 for mode, _ in soak.short_config("asyncio").faulty_schedule
    )
    assert faults["dns_joins"] >= 4
    assert faults["dns_leaves"] >= 4
    assert faults["client_cuts_mid_stream"] > 0
    assert faults["client_cuts_in_encode"] > 0
    assert all(count > 0 for count in faults["bad_media_requests"].values())
    assert results["summary"]["finished"] >= 3000
    failed = {name: check for name, check in checks.items() if not check["ok"]}
    assert not failed, failed
