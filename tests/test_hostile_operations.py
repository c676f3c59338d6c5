"""What an outside tester found in keys, configuration errors, metrics and ``check`` (issue 29, items 7,
12, 13, 14), on asyncio and trio with fakes. Each test names the hole it closes; each failed against the
code before the fix."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client import REGISTRY
from starlette.applications import Starlette

from epd_lab.servers import free_port
from epd_middleware import EPDConfig, EPDMiddleware, HttpxTransport
from epd_middleware._metrics import Stats
from epd_middleware.cli import main, pd_status
from epd_middleware.config import ConfigurationError
from epd_middleware.vllm_plugin import EPDPlugin

from .dns_server import dns_server
from .fakes import FakeEncoders, FakeEngine, chat_body, image, models_answer
from .load.harness import ROOT
from .test_cli import run_check
from .test_discovery import NAME, settle
from .test_discovery import middleware as dns_middleware
from .test_discovery import url as dns_url
from .test_middleware import E0, png

pytestmark = pytest.mark.anyio


async def post(app: Any, body: Any, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        return await client.post(
            "http://pd/v1/chat/completions",
            content=json.dumps(body).encode(),
            headers={"content-type": "application/json", **headers},
        )


async def get(app: Any, path: str, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        return await client.get(f"http://pd{path}", headers=headers)


# --- item 7: vLLM's own key is always enforced ------------------------------------------------------


def as_vllm_sets_it(app: Starlette, api_key: Any = None) -> None:
    """What vLLM puts on the app's state before it serves (its configuration and command line)."""
    consumer = SimpleNamespace(ec_connector="ECExampleConnector", ec_role="ec_consumer", is_ec_consumer=True)
    app.state.vllm_config = SimpleNamespace(ec_transfer_config=consumer)
    app.state.args = SimpleNamespace(api_key=api_key)


def key_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str | None]) -> None:
    monkeypatch.setenv("EPD_ENCODERS", E0)
    monkeypatch.setenv("EPD_HEALTH_CHECK_INTERVAL", "0")
    monkeypatch.setenv("EPD_CHECK_MODELS", "false")
    monkeypatch.setenv("EPD_CHECK_EMBEDDINGS", "false")
    for name in ("EPD_API_KEYS", "VLLM_API_KEY"):
        value = env.get(name)
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


# (environment, vLLM's --api-key, a key vLLM refuses, the key vLLM takes)
KEY_CASES = [
    pytest.param({"EPD_API_KEYS": "", "VLLM_API_KEY": "k"}, None, None, "k", id="empty-EPD_API_KEYS"),
    pytest.param({"EPD_API_KEYS": " , ,", "VLLM_API_KEY": "k"}, None, None, "k", id="only-empty-keys"),
    pytest.param({"EPD_API_KEYS": "extra", "VLLM_API_KEY": "k"}, None, None, "k", id="extra-and-env-key"),
    # vLLM's --api-key takes precedence over VLLM_API_KEY: the environment's key opens nothing there.
    pytest.param({"VLLM_API_KEY": "env"}, ["cli"], "env", "cli", id="cli-key-over-env-key"),
]


@pytest.mark.parametrize(("env", "cli_key", "refused_key", "vllm_key"), KEY_CASES)
async def test_with_middleware_vllm_s_own_key_guards_the_encoders(
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str | None],
    cli_key: Any,
    refused_key: str | None,
    vllm_key: str,
) -> None:
    """Before: EPD_API_KEYS set but empty (or only commas) was read as "these are all the keys", so
    VLLM_API_KEY was dropped: with ``--middleware`` (outside vLLM's key check) a request without any key
    drove the encoders. And with ``--api-key`` the environment's VLLM_API_KEY, which vLLM ignores then,
    still opened the encoder path."""
    key_env(monkeypatch, env)
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = engine.app()
    as_vllm_sets_it(app, cli_key)
    app.add_middleware(EPDMiddleware, http_client=encoders.client())  # configured from EPD_*, as vLLM does
    body = chat_body(image(png(1)))
    refused: list[dict[str, str]] = [{}, {"authorization": "Bearer "}]
    if refused_key is not None:
        refused.append({"authorization": f"Bearer {refused_key}"})
    for headers in refused:
        assert (await post(app, body, **headers)).status_code == 401, headers
    assert encoders.calls == []
    assert (await post(app, body, authorization=f"Bearer {vllm_key}")).status_code == 200
    if env.get("EPD_API_KEYS") == "extra":
        assert (await post(app, body, authorization="Bearer extra")).status_code == 200


@pytest.mark.parametrize(("env", "cli_key", "refused_key", "vllm_key"), KEY_CASES)
async def test_with_the_plugin_vllm_s_own_key_guards_the_status_page(
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str | None],
    cli_key: Any,
    refused_key: str | None,
    vllm_key: str,
) -> None:
    """Before: with the plugin, EPD_API_KEYS set but empty and the key in VLLM_API_KEY left /epd/status
    open to anyone (vLLM's own check covers /v1/* only)."""
    key_env(monkeypatch, env)
    engine = FakeEngine()
    app = engine.app()
    as_vllm_sets_it(app, cli_key)
    EPDPlugin().attach_router(app)
    refused: list[dict[str, str]] = [{}, {"authorization": "Bearer "}]
    if refused_key is not None:
        refused.append({"authorization": f"Bearer {refused_key}"})
    for headers in refused:
        assert (await get(app, "/epd/status", **headers)).status_code == 401, headers
    assert (await get(app, "/epd/status", authorization=f"Bearer {vllm_key}")).status_code == 200


async def test_an_empty_string_is_never_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``api_keys=[""]`` made the empty string a key: "Authorization: Bearer " (nothing after the
    space) passed, and inside vLLM the key in VLLM_API_KEY was not required at all."""
    key_env(monkeypatch, {"VLLM_API_KEY": "k"})
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = engine.app()
    as_vllm_sets_it(app)
    app.add_middleware(
        EPDMiddleware,
        encoders=[E0],
        api_keys=["", ""],
        health_check_interval=0,
        check_models=False,
        check_embeddings=False,
        http_client=encoders.client(),
    )
    body = chat_body(image(png(1)))
    assert (await post(app, body, authorization="Bearer ")).status_code == 401
    assert (await post(app, body)).status_code == 401
    assert encoders.calls == []
    assert (await post(app, body, authorization="Bearer k")).status_code == 200


async def test_check_pd_sends_vllm_s_key_without_keys_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """``EPDConfig.api_keys`` no longer stands in for VLLM_API_KEY: ``check --pd`` still opens the status
    page with it."""
    monkeypatch.setenv("VLLM_API_KEY", "k")
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"model_runner": "v2", "known_problems": []})

    transport = HttpxTransport(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    assert (await pd_status(EPDConfig(encoders=[E0]), transport, "http://pd:8000"))[1] is None
    assert seen[0].headers["authorization"] == "Bearer k"
    await pd_status(EPDConfig(encoders=[E0], api_keys=["own"]), transport, "http://pd:8000")
    assert seen[1].headers["authorization"] == "Bearer own"


# --- item 12: no password of a URL in any message ---------------------------------------------------

SECRET = "s3cret"
# Server URLs carrying a password, each wrong in another way besides (or cut by the list's commas).
BAD_SERVER_URLS = [
    f"http://alice:{SECRET}@enc-0:8001 http://enc-1:8001",  # a space
    f"http://alice:{SECRET}@enc-0:8001;http://enc-1:8001",  # a ';'
    f"http:/alice:{SECRET}@enc-0:8001",  # no host
    f"alice:{SECRET}@enc-0:8001",  # no scheme
    f"ftp://alice:{SECRET}@enc-0:8001",
    f"http://alice:{SECRET}/x@enc-0:8001",  # a '/' in the password: urllib sees port {SECRET}
    f"http://alice:{SECRET}?x@enc-0:8001",
    f"http://alice:{SECRET}#x@enc-0:8001",
    f"dns+http://alice:{SECRET}@enc:8001",
    f"http://alice:ab,{SECRET}@enc-0:8001",  # cut by a comma: "http://alice:ab" and "{SECRET}@enc-0:8001"
    f"http://alice:{SECRET},x@enc-0:8001",
]


def assert_secret_free(text: str, user: bool = True) -> None:
    assert SECRET not in text, text
    if user:  # cut by a comma, "http://alice:ab" reads as host alice, port "ab" (not shown)
        assert "alice" not in text, text


@pytest.mark.parametrize("value", BAD_SERVER_URLS)
@pytest.mark.parametrize("field", ["encoders", "prefill"])
def test_a_bad_server_url_never_shows_its_password(field: str, value: str) -> None:
    """Before: the space, ';', no-host, scheme, query and port messages printed the URL as given,
    password included, through options and EPD_* alike."""
    with pytest.raises(ConfigurationError) as from_options:
        EPDConfig.of_options({field: value.split(",")})
    assert_secret_free(str(from_options.value), user="," not in value)
    with pytest.raises(ConfigurationError) as from_env:
        EPDConfig.from_env({f"EPD_{field.upper()}": value})
    assert_secret_free(str(from_env.value), user="," not in value)
    assert all(problem.startswith(f"EPD_{field.upper()}: ") for problem in from_env.value.problems)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("ec_consumer_zmq", f"tcp://alice:{SECRET}@pd-0:15000"),  # accepted before, and logged
        ("ec_consumer_zmq", f"tcp://alice:{SECRET}@pd-0"),
        ("ec_consumer_zmq", f"http://alice:{SECRET}@pd-0:15000"),
        ("scheduler_allow", f"alice:{SECRET}@10.0.0.1:8001"),
        ("scheduler_allow", f"http://alice:{SECRET}@10.0.0.0/8"),
        ("dns_nameservers", f"alice:{SECRET}@10.0.0.10:53"),
        ("paths", f"http://alice:{SECRET}@pd/v1/chat/completions"),
        ("status_path", f"http://alice:{SECRET}@pd/epd/status"),
    ],
)
def test_no_other_option_shows_a_password_either(field: str, value: str) -> None:
    """Before: ec_consumer_zmq took a URL with credentials (shown on the status page and in the
    start-up log), and every option naming an address printed it whole in its error."""
    given: Any = value if field in ("ec_consumer_zmq", "status_path") else [value]
    with pytest.raises(ConfigurationError) as from_options:
        EPDConfig.of_options({"encoders": [E0], field: given})
    assert_secret_free(str(from_options.value))
    with pytest.raises(ConfigurationError) as from_env:
        EPDConfig.from_env({"EPD_ENCODERS": E0, f"EPD_{field.upper()}": value})
    assert_secret_free(str(from_env.value))


def test_the_plugin_s_start_up_never_shows_a_password(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: vLLM stopped with the plugin's error, the password in it."""
    monkeypatch.setenv("EPD_ENCODERS", f"http://alice:{SECRET}@enc-0:8001 http://enc-1:8001")
    with caplog.at_level(logging.DEBUG), pytest.raises(ValueError, match="separate several URLs") as raised:
        EPDPlugin().attach_router(FakeEngine().app())
    assert "separate several URLs with commas" in str(raised.value)
    assert_secret_free(str(raised.value))
    assert_secret_free(caplog.text)


def test_check_never_shows_a_password_in_its_text_or_json() -> None:
    """Before: ``epd-middleware check`` printed the configuration error with the password, on stderr and
    in ``--json``'s configuration_errors; and ``--pd URL`` with credentials was repeated whole in its
    problem and its JSON."""
    bad = f"http://alice:{SECRET}@enc-0:8001;http://enc-1:8001"
    for args in ((), ("--json",)):
        result = run_check(*args, env={"EPD_ENCODERS": bad})
        assert result.returncode == 2
        assert "separate several URLs with commas" in result.stderr
        assert_secret_free(result.stdout + result.stderr)
    closed = free_port()
    pd = f"http://alice:{SECRET}@127.0.0.1:{closed}"
    encoder = f"http://127.0.0.1:{free_port()}"
    for args in (("--pd", pd), ("--pd", pd, "--json")):
        result = run_check("--encoders", encoder, *args)
        assert result.returncode == 1
        assert f"pd http://...@127.0.0.1:{closed}: status page: " in result.stdout
        assert_secret_free(result.stdout + result.stderr)


# --- item 13: a server that left takes its metric series along -------------------------------------

LEAVER, STAYER = "127.0.0.41", "127.0.0.42"


def series_of(server: str) -> dict[str, float]:
    """Every sample in the default registry labelled with ``server`` (as encoder or prefill)."""
    return {
        f"{sample.name}{sorted(sample.labels.items())}": sample.value
        for metric in REGISTRY.collect()
        for sample in metric.samples
        if server in (sample.labels.get("encoder"), sample.labels.get("prefill"))
    }


async def test_a_server_that_left_the_pool_takes_every_series_along() -> None:
    """Before: only ``_healthy`` and ``_model_ok`` of a server DNS no longer named were removed; its call
    latencies, failovers and in-flight gauge stayed for ever, and a call still in flight when it left
    brought its series back when it ended."""
    leaver, stayer = dns_url(LEAVER), dns_url(STAYER)
    async with dns_server({NAME: [LEAVER, STAYER]}) as dns:
        fakes = FakeEncoders([leaver, stayer])
        app = dns_middleware(dns.address, fakes, encoder_timeout=1, max_attempts=2, eject_after=100)
        await settle(app, LEAVER, STAYER)
        fakes.mode[leaver] = "500"
        for seed in range(1, 3):  # round robin: one of them fails on the leaver and fails over
            assert (await post(app, chat_body(image(png(seed))))).status_code == 200
        fakes.mode[leaver] = "hang"
        ended: list[int] = []

        async def one(seed: int) -> None:
            ended.append((await post(app, chat_body(image(png(seed))))).status_code)

        async with anyio.create_task_group() as group:
            for seed in range(3, 5):  # one of them hangs on the leaver until encoder_timeout
                group.start_soon(one, seed)
            with anyio.fail_after(5):
                while fakes.in_flight.get(leaver) != 1:  # noqa: ASYNC110 (the fake counts its calls)
                    await anyio.sleep(0.01)
            names = set(series_of(leaver))
            for kind in ("call_duration_seconds_count", "failovers_total", "healthy", "in_flight"):
                assert any(f"epd_encoder_{kind}" in name for name in names), kind
            dns.records[NAME] = [STAYER]
            await settle(app, STAYER)
            assert series_of(leaver) == {}
        assert len(ended) == 2
        # The call in flight ended after the server left (timeout, then the failover to the stayer):
        # its series did not come back.
        assert series_of(leaver) == {}

        fakes.mode[leaver] = "ok"
        dns.records[NAME] = [LEAVER, STAYER]
        await settle(app, LEAVER, STAYER)
        back = series_of(leaver)
    assert back[f"epd_encoder_healthy{[('encoder', leaver)]}"] == 1
    assert back.get(f"epd_encoder_in_flight{[('encoder', leaver)]}", 0) == 0


def test_a_call_in_flight_across_a_leave_and_a_return_is_counted_once() -> None:
    """The in-flight gauge of a server that left while a call was in flight, and came back before the
    call ended, says the truth: 1 while that call runs, 0 after (not -1 for ever); a late outcome of a
    server still gone is not exported, and every labelled series goes, model_ok and foreign answers
    included."""
    stats, server = Stats(), "http://metrics-leave:8001"
    stats.health("encoder", server, True)
    stats.model_check("encoder", server, True)
    stats.in_flight("encoder", server, 1)
    stats.foreign_answer("encoder", server)
    stats.call("encoder", server, "bad_reply", 0.01)
    stats.failover("encoder", server)
    assert len(series_of(server)) > 6
    stats.forget("encoder", server)
    assert series_of(server) == {}
    stats.call("encoder", server, "ok", 0.01)  # another call, still in flight when it left, ends
    stats.failover("encoder", server)
    stats.foreign_answer("encoder", server)
    assert series_of(server) == {}
    stats.health("encoder", server, True)  # the pool exports a member's health first when it joins
    assert series_of(server)[f"epd_encoder_in_flight{[('encoder', server)]}"] == 1
    stats.in_flight("encoder", server, -1)  # the call from before the leave ends
    assert series_of(server)[f"epd_encoder_in_flight{[('encoder', server)]}"] == 0
    assert stats.counters["encoder_calls_ok"] == 1  # the status page's counters count every call


def test_with_several_processes_a_departed_server_s_gauges_are_neutral(tmp_path: Path) -> None:
    """prometheus_client cannot remove a series from the per-process files of PROMETHEUS_MULTIPROC_DIR
    (``remove`` only warns): a departed server's gauges are set to values that change no aggregate and
    fire no alert (in flight 0, healthy 0: it takes no traffic, model_ok 1: min's neutral), and late
    updates stay out. Its counters and histograms keep their totals until the directory is cleared."""
    script = textwrap.dedent(
        f"""
        from epd_middleware._metrics import Stats
        stats = Stats()
        stats.health("encoder", "{E0}", True)
        stats.model_check("encoder", "{E0}", False)
        stats.in_flight("encoder", "{E0}", 2)
        stats.call("encoder", "{E0}", "ok", 0.5)
        stats.forget("encoder", "{E0}")
        stats.in_flight("encoder", "{E0}", -1)
        stats.call("encoder", "{E0}", "ok", 0.5)
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", script], env=env, check=True, cwd=ROOT)
    reader = textwrap.dedent(
        f"""
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector
        registry = CollectorRegistry()
        MultiProcessCollector(registry)
        for name in ("in_flight", "healthy", "model_ok", "call_duration_seconds_count"):
            labels = {{"encoder": "{E0}"}}
            if name.startswith("call"):
                labels["outcome"] = "ok"
            print(registry.get_sample_value("epd_encoder_" + name, labels))
        """
    )
    out = subprocess.run([sys.executable, "-c", reader], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0.0", "0.0", "1.0", "1.0"]


# --- item 14: check --pd reads any answer without a traceback ---------------------------------------


@contextmanager
def pd_server(page: bytes) -> Iterator[str]:
    """A loopback server that is an encoder of model ``m`` and a PD whose status page is ``page``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/epd/status":
                body = page
            elif self.path == "/v1/models":
                body = json.dumps(models_answer(["m"])).encode()
            else:
                body = b""
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


MIB = 1024 * 1024
BAD_PAGES = [
    pytest.param(deep(100_000).encode(), "not JSON", id="nested-100k-deep"),
    pytest.param(
        f'{{"model_runner": {deep(900)}, "known_problems": []}}'.encode(), "model_runner", id="deep-runner"
    ),
    pytest.param(f'{{"known_problems": [{deep(900)}]}}'.encode(), "known_problems", id="deep-problem"),
    pytest.param(b'{"known_problems": [{"a": 1}]}', "known_problems", id="problem-not-a-string"),
    pytest.param(b'{"known_problems": "V1 runner"}', "known_problems", id="problems-not-a-list"),
    pytest.param(b'{"model_runner": 2, "known_problems": []}', "model_runner", id="runner-not-a-string"),
    pytest.param(b"\xff\xfe{", "not JSON", id="not-utf8"),
    pytest.param(b"1" * 5000, "not JSON", id="a-number-too-long-for-python"),
    pytest.param(b'{"known_problems": ["' + b"x" * (9 * MIB) + b'"]}', "too large", id="9-MiB"),
]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize(("page", "words"), BAD_PAGES)
def test_check_pd_names_any_bad_status_page_as_a_problem(
    page: bytes, words: str, backend: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a status page nested 100,000 deep crashed ``check --pd`` with a RecursionError traceback
    (exit 1 by accident); one nested 900 deep crashed ``--json``'s output; a page of the wrong shape was
    printed as warnings ("{'a': 1}"); and the answer was read up to the client's 256 MiB."""
    for name in [name for name in os.environ if name.startswith(("EPD_", "VLLM_"))]:
        monkeypatch.delenv(name)
    with pd_server(page) as url:
        for output in ((), ("--json",)):
            args = ["check", "--encoders", url, "--expected-model", "m", "--pd", url, *output]
            assert main([*args, "--backend", backend]) == 1
            out = capsys.readouterr().out
            if output:
                payload = json.loads(out)
                assert payload["pd"] is None
                [problem] = payload["problems"]
            else:
                [problem] = [
                    line.removeprefix("problem: ") for line in out.splitlines() if "problem: " in line
                ]
            assert problem.startswith(f"pd {url}: status page: "), problem
            assert words in problem, problem
            assert len(out) < 10_000


def test_check_pd_with_a_good_status_page_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    page = {"model_runner": "v1", "known_problems": ["ECMooncakeConnector on the V1 model runner"]}
    with pd_server(json.dumps(page).encode()) as url:
        assert main(["check", "--encoders", url, "--expected-model", "m", "--pd", url]) == 0
    assert f"warning: pd {url}: ECMooncakeConnector on the V1 model runner" in capsys.readouterr().out
