"""``epd-middleware check`` cannot say ok for a fleet PD will refuse (issue 36, item 3).

Each of the three false oks an operator met fails before and passes now: two encoders serving one name
from two model paths (PD uses only those of its own), PD's own verdict on an encoder left unread, and a
lone encoder checked against nothing. ``--canary`` runs PD's equivalence probe once and exits non-zero
on a mismatch. Loopback servers in threads; the command in-process on both backends.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from epd_middleware.cli import main

from .fakes import models_answer


@contextmanager
def server(answers: dict[tuple[str, str], Any]) -> Iterator[tuple[str, list[str]]]:
    """A loopback server answering JSON per (method, path); what it was asked, in order."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            asked.append(f"{method} {self.path}")
            if method == "POST":
                self.rfile.read(int(self.headers.get("content-length") or 0))
            found = answers.get((method, self.path))
            status, body = (404, b"{}") if found is None else (200, json.dumps(found).encode())
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

        def log_message(self, format: str, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}", asked
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def encoder(name: str = "m", root: str = "/models/m") -> dict[tuple[str, str], Any]:
    return {("GET", "/health"): {}, ("GET", "/v1/models"): models_answer([name], root)}


def pd_page(encoders: dict[str, dict[str, Any]], **extra: Any) -> dict[tuple[str, str], Any]:
    page = {
        "model_runner": "v2",
        "known_problems": [],
        "model": {"names": ["m"], "root": "/models/m"},
        "encoders": encoders,
        **extra,
    }
    return {("GET", "/epd/status"): page}


HEALTHY = {"member": True, "healthy": True, "why_not": None}


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.startswith(("EPD_", "VLLM_"))]:
        monkeypatch.delenv(name)


@pytest.fixture(params=["asyncio", "trio"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def check(backend: str, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["check", *args, "--json", "--backend", backend])
    return code, json.loads(capsys.readouterr().out)


def test_two_encoders_of_one_name_from_two_model_paths_are_not_ok(
    backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: rc 0, both "ok" (the name alone was compared), and PD refused the second."""
    with server(encoder(root="/models/m")) as (first, _), server(encoder(root="/models/m-v2")) as (second, _):
        code, payload = check(backend, capsys, "--encoders", f"{first},{second}", "--expected-model", "m")
        assert code == 1
        verdicts = {report["url"]: report["verdict"] for report in payload["servers"]}
        assert verdicts[first].startswith("serves m from /models/m, other servers from /models/m-v2")
        assert verdicts[second].startswith("serves m from /models/m-v2, other servers from /models/m")
        # Told which path is right, the command names the one PD refuses.
        code, payload = check(
            backend,
            capsys,
            "--encoders",
            f"{first},{second}",
            "--expected-model",
            "m",
            "--expected-root",
            "/models/m",
        )
        assert code == 1
        verdicts = {report["url"]: report["verdict"] for report in payload["servers"]}
        assert verdicts == {first: "ok", second: "serves another model (expected m (/models/m))"}


def test_pd_s_own_model_is_the_expectation(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    with (
        server(encoder(root="/models/m")) as (good, _),
        server(encoder(root="/models/other")) as (bad, _),
    ):
        page = pd_page({good: HEALTHY, bad: HEALTHY})
        with server(page) as (pd, _):
            code, payload = check(backend, capsys, "--encoders", f"{good},{bad}", "--pd", pd)
    assert code == 1
    verdicts = {report["url"]: report["verdict"] for report in payload["servers"]}
    assert verdicts == {good: "ok", bad: "serves another model (expected m (/models/m))"}
    assert payload["pd"]["model"] == {"names": ["m"], "root": "/models/m"}


def test_pd_s_own_verdict_on_an_encoder_counts(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: rc 0, "all servers ok", though PD itself did not use the encoder (its model check said
    mismatch, or it was ejected, or out of the pool for answers that differ)."""
    with server(encoder()) as (first, _), server(encoder()) as (second, _):
        why = "serves another model: m (/models/m-old)"
        page = pd_page(
            {first: HEALTHY, second: {"member": True, "healthy": False, "why_not": why}},
            equivalence={
                "encoders": {first: {"result": "mismatch", "detail": "default: token 0: 'a' vs 'b'"}}
            },
        )
        with server(page) as (pd, _):
            code, payload = check(backend, capsys, "--encoders", f"{first},{second}", "--pd", pd)
    assert code == 1
    assert f"pd {pd}: encoder {second}: {why}" in payload["problems"]
    assert (
        f"pd {pd}: encoder {first}: its answers differ from PD's own: default: token 0: 'a' vs 'b'"
        in payload["problems"]
    )
    assert [report["verdict"] for report in payload["servers"]] == ["ok", "ok"]  # its own questions passed


def test_an_expected_model_pd_does_not_serve_is_a_problem(
    backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with server(encoder()) as (url, _), server(pd_page({})) as (pd, _):
        code, payload = check(backend, capsys, "--encoders", url, "--expected-model", "other", "--pd", pd)
    assert code == 1
    assert f"pd {pd} serves m (/models/m), not the expected model other" in payload["problems"]


def test_a_lone_encoder_without_an_expectation_is_a_warning_not_ok(
    backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: "all servers ok" for one encoder compared with nothing."""
    with server(encoder()) as (url, _):
        code, payload = check(backend, capsys, "--encoders", url)
        assert code == 0  # nothing is known to be wrong
        assert payload["verified"] is False
        assert any("nothing to compare what it serves with" in warning for warning in payload["warnings"])
        assert main(["check", "--encoders", url, "--backend", backend]) == 0
        text = capsys.readouterr().out
        assert text.rstrip().endswith("no problem found, but the model is not verified")
        assert "all servers ok" not in text
        code, payload = check(backend, capsys, "--encoders", url, "--expected-model", "m")
        assert (code, payload["verified"]) == (0, True)


def canary_pd(encoders: list[str], report: dict[str, Any]) -> dict[tuple[str, str], Any]:
    return {
        **pd_page(dict.fromkeys(encoders, HEALTHY)),
        ("POST", "/epd/status/equivalence"): report,
    }


def test_canary_exits_0_for_an_equal_fleet_and_1_for_a_mismatch(
    backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with server(encoder()) as (first, _), server(encoder()) as (second, _):
        both = f"{first},{second}"
        match = {"result": "match", "detail": "4 token(s) agree; largest logprob difference 0"}
        equal = {"ok": True, "mode": "pd_alone", "encoders": {first: match, second: match}}
        with server(canary_pd([first, second], equal)) as (pd, asked):
            code, payload = check(backend, capsys, "--encoders", both, "--pd", pd, "--canary")
            assert (code, payload["problems"]) == (0, [])
            assert "POST /epd/status/equivalence" in asked
            assert payload["pd"]["canary"]["ok"] is True
        mismatch = {"result": "mismatch", "detail": "default: token 0: 't3' where the reference has 't9'"}
        differ = {"ok": False, "mode": "pd_alone", "encoders": {first: match, second: mismatch}}
        with server(canary_pd([first, second], differ)) as (pd, _):
            code, payload = check(backend, capsys, "--encoders", both, "--pd", pd, "--canary")
        assert code == 1
        assert payload["problems"] == [f"pd {pd}: canary: encoder {second}: mismatch: {mismatch['detail']}"]
        skipped: dict[str, Any] = {
            "ok": None,
            "skipped": "the engine has 9 unfinished requests",
            "encoders": {},
        }
        with server(canary_pd([first, second], skipped)) as (pd, _):
            code, payload = check(backend, capsys, "--encoders", both, "--pd", pd, "--canary")
        assert code == 1
        assert payload["problems"] == [f"pd {pd}: canary not run: the engine has 9 unfinished requests"]


def test_canary_on_a_mooncake_consumer_says_the_proof_is_weaker(
    backend: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with server(encoder()) as (url, _):
        lone = {"result": "unproven", "detail": "no other encoder answered to compare with"}
        report = {"ok": True, "mode": "encoders_compared", "encoders": {url: lone}}
        with server(canary_pd([url], report)) as (pd, _):
            code, payload = check(backend, capsys, "--encoders", url, "--pd", pd, "--canary")
    assert code == 0
    assert any("a weaker proof" in warning for warning in payload["warnings"])
    assert any("unproven" in warning for warning in payload["warnings"])


def test_canary_needs_pd(backend: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--encoders", "http://127.0.0.1:9", "--canary", "--backend", backend])
    assert code == 2
    assert (
        "--canary runs PD's equivalence probe: give the PD server's URL with --pd" in capsys.readouterr().err
    )
