"""``epd-middleware check``: in-process on asyncio and trio against loopback servers (one of another
model, one down, one found by DNS), and the installed command itself in a subprocess (table, --json,
exit codes)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
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
    [problem] = problems
    assert problem.startswith("encoder dns+http://missing.test:8001: DNS has no such name missing.test")


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


# --- Issue 31 (3): the command as an operator uses it -------------------------------------------------


def _down() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_text_mode_names_the_warnings_of_a_configuration_it_refuses() -> None:
    """A typo (``EPD_ENCODER=`` for ``EPD_ENCODERS``) leaves the encoders unset: the command exits 2, and
    the warning that says what was meant must be printed in text too. Before, only ``--json`` carried it:
    the text said "EPD_ENCODERS is not set" and nothing about the variable the operator did set."""
    result = run_check(env={"EPD_ENCODER": "http://enc-0:8001"})
    assert result.returncode == 2
    assert "EPD_ENCODERS is not set" in result.stderr
    assert "EPD_ENCODER is not an option of the middleware and is ignored; did you mean EPD_ENCODERS?" in (
        result.stderr
    )


def test_the_v1_strip_is_listed_in_text_and_json() -> None:
    """An encoder URL ending in /v1 is used without it, with a WARNING in the middleware's log; the docs
    say ``check`` lists it. Before, the command's own NullHandler swallowed that WARNING: neither the text
    nor the JSON said that the URL given is not the URL used."""
    down = _down()
    text = run_check("--encoders", f"{down}/v1")
    assert text.returncode == 1
    assert f"warning: encoder URL {down}/v1: the middleware adds /v1/... itself; using {down}" in text.stdout
    payload = json.loads(run_check("--encoders", f"{down}/v1", "--pd", f"{down}/v1/", "--json").stdout)
    assert payload["warnings"] == [
        f"encoder URL {down}/v1: the middleware adds /v1/... itself; using {down}",
        f"pd URL {down}/v1: the status page is not under /v1; using {down}",
    ]
    assert [server["url"] for server in payload["servers"]] == [down]
    assert f"pd {down}: status page: connection failed (ECONNREFUSED)" in payload["problems"]


@pytest.mark.parametrize(
    ("pd", "shown"),
    [
        ("pd:8000", "'pd:8000'"),  # no scheme: read as scheme "pd" before
        ("user:s3cret@pd:8000", "'...@pd:8000'"),  # no scheme, and a password
        ("ftp://pd:8000", "'ftp://pd:8000'"),
        ("http://pd:port", "'http://pd:port'"),
    ],
)
def test_a_pd_url_that_is_no_http_url_is_a_configuration_error(pd: str, shown: str) -> None:
    """``--pd pd:8000`` was asked as a URL (scheme "pd") and failed as a server that cannot be reached
    (exit 1, "connection failed"); now it is a configuration error (exit 2) naming --pd, in text and in
    JSON, and a password in it never appears. (An http URL with a password is asked, the password masked
    wherever the URL is shown: test_hostile_operations.py.)"""
    for args in ((), ("--json",)):
        result = run_check("--encoders", _down(), "--pd", pd, *args)
        assert result.returncode == 2, result.stdout
        assert f"--pd {shown}" in result.stderr
        assert "s3cret" not in result.stdout + result.stderr
    payload = json.loads(result.stdout)
    assert [problem for problem in payload["problems"] if problem.startswith("--pd")]


async def test_an_unresolvable_host_is_named_as_such() -> None:
    """A name that does not resolve was "connection failed (gaierror)", which reads like a server that
    is down. Now it is named: the host cannot be resolved, and the server is not asked."""
    config = EPDConfig(encoders=("http://no-such-encoder.invalid:8001",), health_check_timeout=2)
    client = HTTPClient(connect_timeout=1)
    reports, problems = await check_fleet(config, client, None)
    await client.aclose()
    [report] = reports
    assert problems == []  # a bad server is its report; the command counts it as a problem
    assert not report.reachable
    assert report.model is None
    assert report.verdict.startswith("not usable: host no-such-encoder.invalid cannot be resolved")


def test_an_unresolvable_pd_host_is_named_as_such() -> None:
    """The same for the PD's status page: "status page: connection failed (gaierror)" before."""
    result = run_check("--encoders", _down(), "--pd", "http://no-such-pd.invalid:8000", "--json")
    assert result.returncode == 1
    problems = json.loads(result.stdout)["problems"]
    assert any(
        problem.startswith("pd http://no-such-pd.invalid:8000: status page: host no-such-pd.invalid cannot")
        for problem in problems
    ), problems


def test_timeout_bounds_every_question() -> None:
    """--timeout SECONDS: how long each server has to answer. Before there was no such flag (argparse
    refused it, exit 2), and a silent server held the command for EPD_HEALTH_CHECK_TIMEOUT."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections, never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        result = run_check(
            "--encoders",
            url,
            "--pd",
            url,
            "--timeout",
            "0.5",
            "--json",
            env={"EPD_HEALTH_CHECK_TIMEOUT": "30"},
        )
        assert time.monotonic() - started < 20
    assert result.returncode == 1, result.stderr
    payload = json.loads(result.stdout)
    [server] = payload["servers"]
    assert "within 0.5 s" in server["verdict"]
    assert f"pd {url}: status page: no answer within 0.5 s" in payload["problems"]


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_timeout_that_is_no_positive_number_is_a_configuration_error(value: str) -> None:
    result = run_check("--encoders", _down(), "--timeout", value, "--json")
    assert result.returncode == 2
    assert "--timeout" in result.stderr
    assert json.loads(result.stdout)["problems"] == [
        result.stderr.strip().removeprefix("epd-middleware check: ")
    ]


def test_json_has_one_shape_for_every_exit_and_problems_match_the_text() -> None:
    """Exit 2's JSON had no ``problems`` and no ``pd``; exit 1's ``problems`` left out the bad servers
    that the text counted ("1 problem(s)" beside ``"problems": []``); an unreachable server's model was
    the table's ``"-"``. Now every exit gives the same keys, ``problems`` holds each problem the text
    names (one ``problem:`` line each, counted in the last line), and a model nobody told is null."""
    down = _down()
    bad_config = run_check("--json", env={"EPD_ENCODERS": "ftp://nope"})
    bad_server = run_check("--encoders", down, "--json")
    assert (bad_config.returncode, bad_server.returncode) == (2, 1)
    two, one = json.loads(bad_config.stdout), json.loads(bad_server.stdout)
    assert (
        two.keys()
        == one.keys()
        == {
            "ok",
            "verified",
            "configuration_errors",
            "warnings",
            "servers",
            "problems",
            "pd",
        }
    )
    assert two["ok"] is one["ok"] is False
    assert two["problems"] == two["configuration_errors"]
    assert two["problems"] == [
        line.removeprefix("epd-middleware check: ")
        for line in run_check(env={"EPD_ENCODERS": "ftp://nope"}).stderr.splitlines()
    ]
    assert (two["servers"], two["pd"]) == ([], None)
    [server] = one["servers"]
    assert server["model"] is None
    assert one["problems"] == [f"encoder {down}: {server['verdict']}"]
    text = run_check("--encoders", down).stdout.splitlines()
    assert [line.removeprefix("problem: ") for line in text if line.startswith("problem: ")] == one[
        "problems"
    ]
    assert text[-1] == "1 problem(s)"
    [row] = [line for line in text if line.startswith("encoder")]
    assert row.split()[3] == "-"  # the table still shows a dash


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize(
    "args", [("--encoders", "{down}"), ("--encoders", "{down}", "--json"), ("--help",)], ids=str
)
def test_the_command_ends_quietly_when_its_reader_goes(args: tuple[str, ...], buffered: bool) -> None:
    """``epd-middleware check | head -1``: the reader goes before the command writes. Before, Python's
    BrokenPipeError traceback came out on stderr ("Exception ignored ... BrokenPipeError" and exit 120
    where stdout is buffered, a traceback and exit 1 where it is not; --help exited 0 or 120). Now
    nothing is written to stderr and the command exits 141 (128 + SIGPIPE), what a shell reports for a
    command a closed pipe ends: distinct from the verdicts 0, 1 and 2, since a reader that left has seen
    no verdict."""
    process = _into_a_closed_pipe(
        [*(arg.format(down=_down()) for arg in args)], {} if buffered else {"PYTHONUNBUFFERED": "1"}
    )
    assert process.stderr == ""
    assert process.returncode == 141


def test_the_command_ends_quietly_when_stderr_goes_too() -> None:
    """``check 2>&1 | head -1`` with a configuration error: the errors go to stderr, which is the
    closed pipe as well."""
    process = _into_a_closed_pipe([], {"EPD_ENCODERS": "ftp://nope"}, stderr_too=True)
    assert process.returncode == 141


def _into_a_closed_pipe(
    args: list[str], env: dict[str, str], *, stderr_too: bool = False
) -> subprocess.CompletedProcess[str]:
    command = Path(sys.executable).parent / "epd-middleware"
    environment = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("EPD_") and key != "PYTHONUNBUFFERED"
    }
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
    read, write = os.pipe()
    os.close(read)  # the reader has gone before the command writes a byte
    try:
        return subprocess.run(
            [str(command), "check", *args],
            stdout=write,
            stderr=write if stderr_too else subprocess.PIPE,
            text=True,
            env={**environment, **env},
            cwd=ROOT,
            timeout=60,
        )
    finally:
        os.close(write)


def test_help_is_plain_text() -> None:
    """``check --help`` printed the module's docstring with its reStructuredText (````EPD_*````,
    ``:data:`MAX_ANSWER```): markup an operator reads as noise."""
    result = subprocess.run(
        [sys.executable, "-m", "epd_middleware", "check", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert result.returncode == 0
    assert "--timeout" in result.stdout
    assert "``" not in result.stdout
    assert not re.search(r":\w+:`", result.stdout), result.stdout
