"""Start and stop real vLLM OpenAI servers (CPU build) as subprocesses: single instance, encoder, PD.

Only the standard library and httpx, so it runs in the project's environment or in the vLLM one.
Flags and environment: docs/vllm-cpu.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx

SERVED_MODEL = "tiny-qwen2-vl"
ROOT = Path(__file__).resolve().parent.parent

BASE_ENV = {
    "HF_HUB_OFFLINE": "1",
    # The lab's servers share the machine's cores, so vLLM must not pin threads to them (nobind). But
    # nobind also skips vLLM's own choice of thread count, and the CPU worker then keeps torch's default,
    # one OpenMP thread per core: its idle threads spin after every parallel region and stall the decode
    # (TPOT 2-3x, gaps of ~100 ms on 2 cores; vLLM 0.32 v1/worker/cpu_worker.py:139-145 turns vLLM's own
    # reduction to 1 thread into a no-op). One thread is what vLLM itself chooses for serving
    # (utils/torch_utils.py set_torch_threads_for_runtime). Figures: benchmarks/pd_decode.py.
    "OMP_NUM_THREADS": "1",
    # vLLM's engine and worker spin on their shared-memory queue for 1 s after each message: on cores
    # shared by every server of the lab that is a core per idle server. Held to 5 ms, which still covers
    # the steps of a running request (epd_lab/busy_poll.py; figures in docs/performance.md).
    "EPD_LAB_VLLM_SPIN_S": "0.005",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


# Every port free_port has handed out in this process.
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback port that is free now and that this process has not handed out before.

    The port is bound later by whoever gets it (a vLLM server seconds later, after its imports), and
    until then the kernel may offer it again: the e2e suite once gave its OTLP receiver and a PD the same
    port, and the PD failed to start with "Address already in use" (the receiver bound it first), which
    took the whole suite's deployment down."""
    with _HANDED_OUT_LOCK:
        for _ in range(1000):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
    raise RuntimeError("no loopback port left that this process has not handed out already")


def find_vllm_python() -> str | None:
    """EPD_VLLM_PYTHON, else this interpreter when it can import vLLM, else None."""
    given = os.environ.get("EPD_VLLM_PYTHON")
    if given:
        return given
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm"], capture_output=True, timeout=120, check=False
    )
    return sys.executable if probe.returncode == 0 else None


def ensure_tiny_model(python: str, cache_dir: Path, builder: str = "tiny_model") -> Path:
    """A tiny model (``tiny_model``: Qwen2-VL; ``tiny_audio_model``: Qwen2-Audio), built once per
    content of its builder and cached under ``cache_dir``."""
    import hashlib

    source = (ROOT / "epd_lab" / f"{builder}.py").read_bytes() + (
        ROOT / "epd_lab" / "tiny_model.py"
    ).read_bytes()
    digest = hashlib.sha256(source).hexdigest()[:12]
    name = "tiny-qwen2-vl" if builder == "tiny_model" else "tiny-qwen2-audio"
    out = cache_dir / f"{name}-{digest}"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    tmp = cache_dir / f".building-{digest}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run(
        [python, "-m", f"epd_lab.{builder}", str(tmp)],
        check=True,
        cwd=ROOT,
        env={**os.environ, **BASE_ENV},
        capture_output=True,
        timeout=600,
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def prepared(builder: str = "tiny_model") -> tuple[str, Path]:
    """The python of a vLLM install (this project installed into it) and a tiny model built for it, for
    the benchmarks and the demo; SystemExit when no vLLM is found."""
    python = find_vllm_python()
    if python is None:
        raise SystemExit("set EPD_VLLM_PYTHON to the python of a vLLM install (scripts/setup-vllm-cpu.sh)")
    install_project(python)
    return python, ensure_tiny_model(python, cache_dir(), builder)


def cache_dir() -> Path:
    """Where built models and media are kept between runs (``EPD_CACHE_DIR``), made if missing."""
    cache = Path(os.environ.get("EPD_CACHE_DIR", Path.home() / ".cache" / "epd-middleware"))
    cache.mkdir(parents=True, exist_ok=True)
    return cache


def ensure_media(python: str, cache_dir: Path) -> tuple[Path, Path]:
    """The test clip (mp4, made with the vLLM environment's OpenCV) and tone (wav), made once."""
    video, audio = cache_dir / "clip-16f-4fps.mp4", cache_dir / "tone-2s.wav"
    for kind, path, args in (("video", video, ["16", "4"]), ("audio", audio, ["2.0"])):
        if not path.exists():
            tmp = path.with_suffix(f".tmp{os.getpid()}{path.suffix}")
            subprocess.run(
                [python, "-m", "epd_lab.media", kind, str(tmp), *args],
                check=True,
                cwd=ROOT,
                capture_output=True,
                timeout=300,
            )
            tmp.rename(path)
    return video, audio


def install_project(python: str) -> None:
    """Make the middleware (and its endpoint-plugin entry point) importable by the vLLM python."""
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "-e", str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )


CONNECTORS = ("example", "mooncake")
# On every lab server's PYTHONPATH: installs what the lab's environment asks for in each of its processes
# (epd_lab/lab_site/sitecustomize.py): the busy-poll hold, a Mooncake PD's V1-runner shim.
LAB_SITE = ROOT / "epd_lab" / "lab_site"
# What Mooncake needs here (docs/vllm-cpu.md): its hostname is vLLM's get_ip(), which is not loopback.
MOONCAKE_ENV = {"VLLM_HOST_IP": "127.0.0.1"}
# The lab fleet's secret for content uuids (EPD_UUID_KEY): every PD of the lab shares it, as a fleet's PD
# replicas share one from a Secret, so the tests can name the uuid the middleware gives an image.
LAB_UUID_KEY = "epd-lab-fleet-secret-not-for-production"


def ec_config(
    role: str,
    storage: Path,
    connector: str = "example",
    *,
    port: int | None = None,
    push_wait: float | None = None,
) -> str:
    """``--ec-transfer-config``: ECExampleConnector on shared files, or ECMooncakeConnector over TCP with
    CPU buffers on loopback (``port``: the server's own control port; the default collides between
    servers on one machine; ``push_wait``: the consumer's ``push_wait_timeout_s``)."""
    if connector == "example":
        return json.dumps(
            {
                "ec_connector": "ECExampleConnector",
                "ec_role": role,
                "ec_connector_extra_config": {"shared_storage_path": str(storage)},
            }
        )
    if connector != "mooncake":
        raise ValueError(f"unknown EC connector {connector!r}: one of {', '.join(CONNECTORS)}")
    extra: dict[str, object] = {"mooncake_protocol": "tcp"}
    if push_wait is not None:
        extra["push_wait_timeout_s"] = push_wait
    return json.dumps(
        {
            "ec_connector": "ECMooncakeConnector",
            "ec_role": role,
            "ec_ip": "127.0.0.1",
            "ec_port": port if port is not None else free_port(),
            "ec_buffer_device": "cpu",
            # 64 MiB of registered buffer (the default is 1e9 bytes, allocated at start-up).
            "ec_buffer_size": 64 * 1024 * 1024,
            "ec_connector_extra_config": extra,
        }
    )


def kv_config(role: str, storage: Path) -> str:
    """vLLM's KV ExampleConnector (shared files): the KV connector that runs on CPU, for P/D."""
    return json.dumps(
        {
            "kv_connector": "ExampleConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        }
    )


# vLLM logs what its example connectors load at DEBUG only; this config (VLLM_LOGGING_CONFIG_PATH) keeps
# vLLM at INFO and lets those lines through, so a test can see that a server loaded an embedding.
CONNECTOR_DEBUG_LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(levelname)s %(asctime)s [%(name)s] %(message)s"}},
    "handlers": {
        "vllm": {
            "class": "logging.StreamHandler",
            "formatter": "plain",
            "level": "DEBUG",
            "stream": "ext://sys.stdout",
        }
    },
    "loggers": {
        "vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
        "vllm.distributed.ec_transfer.ec_connector.example_connector": {"level": "DEBUG"},
    },
}


def connector_debug_logging(directory: Path) -> dict[str, str]:
    """The environment that turns on :data:`CONNECTOR_DEBUG_LOGGING` for a server."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "connector-debug-logging.json"
    path.write_text(json.dumps(CONNECTOR_DEBUG_LOGGING))
    return {"VLLM_LOGGING_CONFIG_PATH": str(path)}


@dataclass
class VLLMServer:
    """One ``vllm serve`` subprocess with its log file."""

    name: str
    python: str
    model: Path
    log_dir: Path
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    served_name: str = SERVED_MODEL
    limits: str = '{"image":4,"video":0}'

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def command(self) -> list[str]:
        return [
            self.python,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--served-model-name",
            self.served_name,
            "--dtype",
            "float32",
            "--max-model-len",
            "2048",
            "--enforce-eager",
            # The tiny model needs 2 KB of KV cache a token: 128 MiB holds 64k tokens. The CPU backend's
            # usual 1 GiB (VLLM_CPU_KVCACHE_SPACE=1) is touched at start-up, 0.9 GB more per server.
            "--kv-cache-memory-bytes",
            str(128 * 1024 * 1024),
            "--limit-mm-per-prompt",
            self.limits,
            "--trust-request-mm-kwargs",
            *self.args,
        ]

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        env = {**os.environ, **BASE_ENV, **self.env}
        path = [str(LAB_SITE), str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
        env["PYTHONPATH"] = os.pathsep.join(path)
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        log.close()

    def wait_ready(self, deadline: float) -> None:
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} did not become healthy in time:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, no goodbye to its peers."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)

    def ec_port(self) -> int | None:
        """The control port of this server's ECMooncakeConnector, if it has one."""
        if "--ec-transfer-config" not in self.args:
            return None
        config = json.loads(self.args[self.args.index("--ec-transfer-config") + 1])
        port = config.get("ec_port")
        return int(port) if port is not None else None

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def start_all(servers: Iterable[VLLMServer], timeout: float = 300) -> None:
    """Start every server at once and wait for all of them; stop them all if one fails."""
    servers = list(servers)
    for server in servers:
        server.start()
    deadline = time.monotonic() + timeout
    try:
        for server in servers:
            server.wait_ready(deadline)
    except BaseException:
        stop_all(servers)
        raise


def stop_all(servers: Iterable[VLLMServer]) -> None:
    for server in servers:
        server.stop()


def encoder_server(
    python: str,
    model: Path,
    log_dir: Path,
    storage: Path,
    name: str = "encoder",
    *,
    connector: str = "example",
) -> VLLMServer:
    return VLLMServer(
        name,
        python,
        model,
        log_dir,
        args=[
            "--no-enable-prefix-caching",
            "--ec-transfer-config",
            ec_config("ec_producer", storage, connector),
        ],
        env=dict(MOONCAKE_ENV) if connector == "mooncake" else {},
    )


def pd_server(
    python: str,
    model: Path,
    log_dir: Path,
    storage: Path,
    encoders: list[str],
    *,
    via: str = "plugin",
    name: str = "pd",
    extra_env: Mapping[str, str] | None = None,
    kv: tuple[str, Path] | None = None,
    connector: str = "example",
    shim: bool = True,
    push_wait: float | None = None,
) -> VLLMServer:
    """A PD (ec_consumer) with the middleware loaded through the endpoint plugin or ``--middleware``.

    ``kv=(role, storage)`` adds a KV ExampleConnector: ``kv_producer`` for a prefill server,
    ``kv_consumer`` for a decoder whose middleware sends prefills to it (``EPD_PREFILL``).
    With ``connector="mooncake"`` the PD's processes load the V1-runner shim unless ``shim=False``
    (epd_lab/v1_runner_shim.py: without it an idle PD never loads a pushed embedding).
    """
    args = ["--ec-transfer-config", ec_config("ec_consumer", storage, connector, push_wait=push_wait)]
    if kv is not None:
        args += ["--kv-transfer-config", kv_config(*kv)]
    env = {"EPD_ENCODERS": ",".join(encoders), "EPD_ENCODER_TIMEOUT": "120", "EPD_UUID_KEY": LAB_UUID_KEY}
    if connector == "mooncake":
        env.update(MOONCAKE_ENV)
        if shim:
            env["EPD_LAB_V1_RUNNER_SHIM"] = "1"
    env.update(extra_env or {})
    if via == "plugin":
        env["VLLM_PLUGINS"] = "epd"
    elif via == "middleware":
        args += ["--middleware", "epd_middleware.EPDMiddleware"]
    elif via != "none":
        raise ValueError(f"unknown way to load the middleware: {via!r}")
    return VLLMServer(name, python, model, log_dir, args=args, env=env)


def single_server(python: str, model: Path, log_dir: Path, name: str = "single") -> VLLMServer:
    return VLLMServer(name, python, model, log_dir)


def lab_uuid(modality: str, content: Iterable[str], salt: str | None = None) -> str:
    """The content uuid a lab PD gives this media (under :data:`LAB_UUID_KEY`)."""
    from epd_middleware._plan import UuidKey, content_uuid

    return content_uuid(modality, tuple(content), salt, UuidKey(LAB_UUID_KEY))
