"""Issue 37 on real vLLM: a rollout loses no request. Under a steady load of four concurrent clients, an
encoder sent SIGTERM (its own ``--shutdown-timeout``) costs no request, and a PD sent SIGTERM answers
every request it holds: the engine's with the single instance's answer, the rest 503 with Retry-After,
none with vLLM's silent abort (200, ``finish_reason: "abort"``, no output) or a 500.

A deployment of its own (a single instance, two encoders, one PD), started before the main one and
stopped after it, since its PD and an encoder are sent SIGTERM.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from epd_lab import servers as lab
from epd_lab.seed import seed_image, seed_request

from .conftest import _start, _vllm_python

pytestmark = pytest.mark.e2e

MODEL = lab.SERVED_MODEL
SHUTDOWN_TIMEOUT = 30
CLIENTS = 4
# Distinct images, each with its own reference answer from the single instance; the load cycles them.
IMAGES = [seed_image(shift=11 * i) for i in range(8)]


@dataclass
class DrainDeployment:
    single: lab.VLLMServer
    leaving: lab.VLLMServer  # the encoder sent SIGTERM
    staying: lab.VLLMServer
    pd: lab.VLLMServer  # sent SIGTERM last
    # The single instance's answer per (image, long): what every 200 must equal.
    references: dict[tuple[int, bool], dict[str, Any]] = field(default_factory=dict)

    @property
    def all(self) -> list[lab.VLLMServer]:
        return [self.single, self.leaving, self.staying, self.pd]


@pytest.fixture(scope="module")
def drain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DrainDeployment]:
    python, _, model = _vllm_python()
    root = tmp_path_factory.mktemp("drain")
    storage, logs = root / "ec-cache", root / "logs"
    storage.mkdir()
    timeout = ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT)]
    leaving, staying = (
        lab.encoder_server(python, model, logs, storage, name=f"drain-encoder-{i}") for i in range(2)
    )
    leaving.args += timeout
    staying.args += timeout
    pd = lab.pd_server(
        python,
        model,
        logs,
        storage,
        [leaving.url, staying.url],
        name="drain-pd",
        # An encoder that left is seen gone within a second; no reuse, so that every request calls one.
        extra_env={"EPD_HEALTH_CHECK_INTERVAL": "1", "EPD_REUSE_HANDLES": "false"},
    )
    pd.args += timeout
    deployment = DrainDeployment(
        lab.single_server(python, model, logs, name="drain-single"), leaving, staying, pd
    )
    _start(deployment.all)
    try:
        for image, url in enumerate(IMAGES):
            for long in (False, True):
                reply = httpx.post(
                    f"{deployment.single.url}/v1/chat/completions", json=body(url, long), timeout=300
                )
                assert reply.status_code == 200, reply.text
                deployment.references[image, long] = reply.json()
        yield deployment
    finally:
        lab.stop_all(deployment.all)


def body(url: str, long: bool = False) -> dict[str, Any]:
    """The seed request for one image; ``long``: 96 tokens, every one generated (``ignore_eos``), so that
    a request spends most of its time in the engine rather than in its encoder call."""
    return seed_request(MODEL, images=[url], **({"max_tokens": 96, "ignore_eos": True} if long else {}))


@dataclass
class Outcome:
    image: int
    long: bool
    sent: float
    answered: float
    status: int | None  # None: no answer (the connection failed)
    answer: dict[str, Any] | None
    headers: dict[str, str]
    error: str = ""


class Load:
    """``CLIENTS`` clients, each sending the next request as soon as its last one is answered."""

    def __init__(self, server: lab.VLLMServer, *, long: bool = False) -> None:
        self.server = server
        self.long = long
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(CLIENTS)
        ]

    def _client(self, index: int) -> None:
        n = index
        with httpx.Client(timeout=300) as client:
            while not self._stop.is_set():
                image = n % len(IMAGES)
                n += CLIENTS
                sent = time.monotonic()
                try:
                    reply = client.post(
                        f"{self.server.url}/v1/chat/completions", json=body(IMAGES[image], self.long)
                    )
                    decoded = (
                        reply.json()
                        if reply.headers.get("content-type", "").startswith("application/json")
                        else None
                    )
                    outcome = Outcome(
                        image,
                        self.long,
                        sent,
                        time.monotonic(),
                        reply.status_code,
                        decoded,
                        dict(reply.headers),
                    )
                except httpx.HTTPError as exc:
                    outcome = Outcome(image, self.long, sent, time.monotonic(), None, None, {}, repr(exc))
                with self._lock:
                    self.outcomes.append(outcome)
                if outcome.status is None:
                    time.sleep(0.2)  # the server is gone: do not spin

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)

    def answered(self, at_least: int) -> None:
        deadline = time.monotonic() + 300
        while len(self.outcomes) < at_least:
            assert time.monotonic() < deadline, "the load got no answers"
            time.sleep(0.1)


def equal_to_single(outcome: Outcome, drain: DrainDeployment) -> bool:
    reference = drain.references[outcome.image, outcome.long]
    answer = outcome.answer or {}
    return bool(
        answer.get("choices")
        and answer["choices"][0]["message"] == reference["choices"][0]["message"]
        and answer["usage"] == reference["usage"]
    )


def running(server: lab.VLLMServer) -> float:
    """The requests the server's engine runs now (vLLM's gauge)."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    )


def sigterm(server: lab.VLLMServer) -> float:
    """SIGTERM to the server's main process alone, as the kubelet sends it to a container's."""
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGTERM)
    return time.monotonic()


def test_an_encoder_sent_sigterm_under_load_costs_no_request(drain: DrainDeployment) -> None:
    with Load(drain.pd) as load:
        load.answered(2 * CLIENTS)
        sent_at = sigterm(drain.leaving)
        assert drain.leaving.process is not None
        drain.leaving.process.wait(timeout=SHUTDOWN_TIMEOUT + 30)
        left_after = time.monotonic() - sent_at
        count = len(load.outcomes)
        load.answered(count + 3 * CLIENTS)  # and as many again with the encoder gone
    wrong = [o for o in load.outcomes if o.status != 200 or not equal_to_single(o, drain)]
    assert not wrong, [(o.status, o.answer, o.error) for o in wrong[:5]]
    print(
        f"encoder SIGTERM: {len(load.outcomes)} requests, all 200 and equal; it left after {left_after:.1f} s"
    )
    status = httpx.get(f"{drain.pd.url}/epd/status", timeout=30).json()
    assert status["encoders"][drain.staying.url]["healthy"] is True


def test_a_pd_sent_sigterm_under_load_answers_every_request_it_holds(drain: DrainDeployment) -> None:
    with Load(drain.pd, long=True) as load:
        load.answered(2 * CLIENTS)
        deadline = time.monotonic() + 120
        while running(drain.pd) < 2:  # SIGTERM while the engine holds requests, as at any rollout
            assert time.monotonic() < deadline, "the engine never held two requests"
            time.sleep(0.05)
        sent_at = sigterm(drain.pd)
        assert drain.pd.process is not None
        drain.pd.process.wait(timeout=SHUTDOWN_TIMEOUT + 60)
        exited_after = time.monotonic() - sent_at
    held = [o for o in load.outcomes if o.sent < sent_at < o.answered]
    later = [o for o in load.outcomes if o.sent >= sent_at]
    assert len(held) == CLIENTS  # four requests in flight at SIGTERM
    for outcome in held + later:
        if outcome.status == 200:
            assert equal_to_single(outcome, drain), outcome.answer  # never vLLM's empty abort
        elif outcome.status == 503:
            assert "retry-after" in outcome.headers
            assert outcome.answer is not None
            assert "shutting down" in outcome.answer["error"]["message"]
        else:
            # Once the engine has stopped, the HTTP server closes its idle connections and its socket:
            # a request sent after SIGTERM may then find its keep-alive connection reset, or be
            # refused. Never half-answered: uvicorn closes no connection with a request in progress.
            assert outcome.status is None, (outcome.status, outcome.answer)
            assert outcome in later
            assert outcome.error.startswith(("ConnectError", "ReadError", "RemoteProtocolError")), (
                outcome.error
            )
    served = [o for o in held if o.status == 200]
    assert served, [(o.status, o.answer) for o in held]  # the drain ran what the engine held
    assert exited_after < SHUTDOWN_TIMEOUT + 10
    print(  # the figures of the closing note (pytest -s)
        f"PD SIGTERM: held {[o.status for o in held]}, sent later {[o.status for o in later]}, "
        f"exited after {exited_after:.1f} s"
    )
