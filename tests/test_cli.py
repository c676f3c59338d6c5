"""``epd-middleware check``: in-process on asyncio and trio against loopback servers (one of another
model, one down, one found by DNS), and the installed command itself in a subprocess (table, --json,
exit codes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from epd_lab.servers import free_port
from epd_middleware import EPDConfig, HttpxTransport
from epd_middleware._http import HTTPClient
from epd_middleware.cli import check_fleet, pd_status

from .dns_server import dns_server
from .load.harness import ROOT
from .raw_upstream import raw_upstream

pytestmark = pytest.mark.anyio


async def test_check_reports_every_server_and_its_verdict() -> None:
    down = f"http://127.0.0.1:{free_port()}"
    async with raw_upstream() as good, raw_upstream() as other, dns_server() as dns:
        other_port = other.url.rsplit(":", 1)[1]
        dns.records["enc.test"] = ["127.0.0.1"]
        config = EPDConfig(
            encoders=(good.url, down, f"dns+http://enc.test:{other_port}"),
            dns_nameservers=(dns.address,),
            health_check_timeout=1,
        )
        client = HTTPClient(connect_timeout=1)
        reports, problems = await check_fleet(config, client, "m")
        await client.aclose()
        assert problems == []
        by_url = {report.url: report for report in reports}
        assert by_url[good.url].ok
        assert by_url[good.url].verdict == "ok"
        assert by_url[good.url].health_ms is not None
        assert "tiny-qwen2-vl" in by_url[good.url].model
        assert not by_url[down].ok
        assert not by_url[down].reachable
        assert by_url[down].verdict.startswith("not usable: connection failed")
        assert by_url[other.url].ok  # the DNS name's address, asked like the others

        client = HTTPClient(connect_timeout=1)
        reports, _ = await check_fleet(config, client, "a-model-nobody-serves")
        await client.aclose()
        assert {report.verdict for report in reports if report.reachable} == {
            "serves another model (expected a-model-nobody-serves)"
        }


async def test_check_reports_dns_problems() -> None:
    async with dns_server() as dns:
        config = EPDConfig(encoders=("dns+http://missing.test:8001",), dns_nameservers=(dns.address,))
        client = HTTPClient(connect_timeout=1)
        reports, problems = await check_fleet(config, client, None)
        await client.aclose()
    assert reports == []
    assert problems == ["encoder dns+http://missing.test:8001: DNS answered no address"]


def run_check(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    command = Path(sys.executable).parent / "epd-middleware"
    environment = {key: value for key, value in os.environ.items() if not key.startswith("EPD_")}
    # The installed command imports the package where it was installed from; the tree under test
    # comes first (a worktree's own code, not the checkout the environment was built from).
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
    return subprocess.run(
        [str(command), "check", *args],
        capture_output=True,
        text=True,
        env={**environment, **(env or {})},
        cwd=ROOT,
        timeout=60,
    )


def test_the_command_prints_a_table_and_exits_by_the_verdicts() -> None:
    good_port, other_port = free_port(), free_port()
    servers = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.load.fake_encoder_server", str(port), *extra],
            cwd=ROOT,
            stdout=subprocess.PIPE,
        )
        for port, extra in ((good_port, ()), (other_port, ("--model", "another-model")))
    ]
    try:
        for server in servers:
            assert server.stdout is not None
            assert server.stdout.readline().strip() == b"ready"
        good, other = f"http://127.0.0.1:{good_port}", f"http://127.0.0.1:{other_port}"
        passing = run_check("--expected-model", "m", env={"EPD_ENCODERS": good})
        assert passing.returncode == 0, passing.stderr
        assert "all servers ok" in passing.stdout
        assert good in passing.stdout

        failing = run_check("--encoders", f"{good},{other}", "--expected-model", "m", "--json")
        assert failing.returncode == 1
        payload = json.loads(failing.stdout)
        assert payload["ok"] is False
        verdicts = {server["url"]: server["verdict"] for server in payload["servers"]}
        assert verdicts == {good: "ok", other: "serves another model (expected m)"}

        # Without an expected model the servers must agree with each other.
        disagreeing = run_check("--encoders", f"{good},{other}", "--backend", "trio")
        assert disagreeing.returncode == 1
        assert "serves a model the other servers do not" in disagreeing.stdout

        module = subprocess.run(
            [sys.executable, "-m", "epd_middleware", "check", "--encoders", good, "--json"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert module.returncode == 0
        assert json.loads(module.stdout)["ok"] is True
    finally:
        for server in servers:
            server.kill()
            server.wait()


def test_a_bad_configuration_exits_2_naming_the_variable() -> None:
    result = run_check(env={"EPD_ENCODERS": "ftp://nope"})
    assert result.returncode == 2
    assert "EPD_ENCODERS" in result.stderr


def _status_transport(reply: httpx.Response | Exception, seen: list[httpx.Request]) -> HttpxTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if isinstance(reply, Exception):
            raise reply
        return reply

    return HttpxTransport(httpx.AsyncClient(transport=httpx.MockTransport(handler)))


async def test_pd_status_reads_what_the_middleware_inside_vllm_knows() -> None:
    page = {"model_runner": "v1", "known_problems": ["ECMooncakeConnector on the V1 model runner: ..."]}
    seen: list[httpx.Request] = []
    config = EPDConfig(encoders=("http://e:1",), api_keys=("k1", "k2"))
    found, error = await pd_status(
        config, _status_transport(httpx.Response(200, json=page), seen), "http://pd:8000/"
    )
    assert (found, error) == (page, None)
    assert str(seen[0].url) == "http://pd:8000/epd/status"
    assert seen[0].headers["authorization"] == "Bearer k1"


async def test_pd_status_says_why_it_could_not_be_read() -> None:
    config = EPDConfig(encoders=("http://e:1",))
    cases = [
        (httpx.Response(401, json={"error": "no"}), "HTTP 401"),
        (httpx.Response(200, content=b"<html>"), "not the middleware's status page"),
        (httpx.Response(200, json=["a list"]), "not the middleware's status page"),
        (httpx.ConnectError("refused"), "connection failed"),
    ]
    for reply, reason in cases:
        seen: list[httpx.Request] = []
        found, error = await pd_status(config, _status_transport(reply, seen), "http://pd:8000")
        assert found is None
        assert error is not None
        assert reason in error
        assert "authorization" not in seen[0].headers  # no keys configured: none sent


def test_check_with_a_pd_whose_status_page_cannot_be_read_reports_a_problem() -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.load.fake_encoder_server", str(port)], cwd=ROOT, stdout=subprocess.PIPE
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == b"ready"
        url = f"http://127.0.0.1:{port}"
        result = run_check("--encoders", url, "--pd", url, "--json")
        assert result.returncode == 1
        payload = json.loads(result.stdout)
        assert payload["pd"] is None
        [problem] = payload["problems"]
        assert problem.startswith(f"pd {url}: status page: ")  # the fake encoder has no such page
    finally:
        server.kill()
        server.wait()
