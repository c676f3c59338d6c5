"""The lab's hold on vLLM's shared-memory busy-poll (epd_lab/busy_poll.py), and how a lab server's
processes get it: the lab's sitecustomize, on every server's PYTHONPATH, installs what the environment asks
for before vLLM is imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest

from epd_lab import busy_poll
from epd_lab import servers as lab


class StockSpinCondition:
    """vLLM 0.32's signature (shm_broadcast.py): busy_loop_s last, with a default of 1 s."""

    def __init__(self, is_reader: bool, context: Any, notify_address: str, busy_loop_s: float = 1) -> None:
        self.busy_loop_s = busy_loop_s


def shm_module(condition: type | None = StockSpinCondition) -> types.ModuleType:
    module = types.ModuleType(busy_poll.MODULE)
    module.SHM_READER_RECHECK_INTERVAL_MS = 5000  # vLLM 0.32's and 0.33's
    if condition is not None:
        module.SpinCondition = type("SpinCondition", (condition,), {})  # a copy per test
    return module


def test_a_spin_condition_that_names_no_spin_gets_the_labs() -> None:
    module = shm_module()
    busy_poll.hold_spin(module, 0.005)
    assert module.SpinCondition(True, None, "ipc://x").busy_loop_s == 0.005


def test_a_sleeping_reader_rechecks_often_enough_that_a_missed_wake_up_costs_little() -> None:
    """With the spin held, a reader sleeps many times a second, and a message that does not wake it was
    found only at vLLM's 5 s recheck (the lab's 5.2 s stalls)."""
    module = shm_module()
    busy_poll.hold_spin(module, 0.005)
    assert module.SHM_READER_RECHECK_INTERVAL_MS == busy_poll.RECHECK_MS == 20


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((True, None, "ipc://x", 2.0), {}), ((True, None, "ipc://x"), {"busy_loop_s": 2.0})],
)
def test_one_that_names_its_own_spin_keeps_it(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    module = shm_module()
    busy_poll.hold_spin(module, 0.005)
    assert module.SpinCondition(*args, **kwargs).busy_loop_s == 2.0


def test_a_vllm_without_the_spin_condition_or_its_parameter_is_left_as_it_is() -> None:
    class Other:
        def __init__(self, is_reader: bool) -> None:
            self.is_reader = is_reader

    busy_poll.hold_spin(shm_module(None), 0.005)  # no SpinCondition: nothing to patch, no error
    module = shm_module(Other)
    stock = module.SpinCondition.__init__
    busy_poll.hold_spin(module, 0.005)
    assert module.SpinCondition.__init__ is stock


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("0.005", 0.005), (" 0 ", 0.0), ("", None), ("-1", None), ("nan", None), ("inf", None), ("soon", None)],
)
def test_the_environment_names_the_spin_or_leaves_vllms(value: str, seconds: float | None) -> None:
    assert busy_poll.spin_seconds({busy_poll.SPIN_ENV: value}) == seconds
    assert busy_poll.spin_seconds({}) is None


def test_every_lab_server_runs_the_labs_site_with_the_hold(tmp_path: Path) -> None:
    assert lab.BASE_ENV[busy_poll.SPIN_ENV] == "0.005"
    started: dict[str, Any] = {}

    class Recorder:
        def __init__(self, command: list[str], **kwargs: Any) -> None:
            started.update(kwargs)

    server = lab.single_server(sys.executable, tmp_path, tmp_path)
    mooncake = lab.pd_server(sys.executable, tmp_path, tmp_path, tmp_path, [], connector="mooncake")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(subprocess, "Popen", Recorder)
        server.start()
        single_env = started["env"]
        mooncake.start()
        mooncake_env = started["env"]
    for env in (single_env, mooncake_env):
        path = env["PYTHONPATH"].split(os.pathsep)
        assert path[:2] == [str(lab.LAB_SITE), str(lab.ROOT)]
        assert env[busy_poll.SPIN_ENV] == "0.005"
    assert "EPD_LAB_V1_RUNNER_SHIM" not in single_env
    assert mooncake_env["EPD_LAB_V1_RUNNER_SHIM"] == "1"


SHM_STANDIN = """
SHM_READER_RECHECK_INTERVAL_MS = 5000


class SpinCondition:
    def __init__(self, is_reader, context, notify_address, busy_loop_s=1):
        self.busy_loop_s = busy_loop_s
"""


@pytest.mark.parametrize(("spin", "expected"), [("0.005", 0.005), ("", 1.0)])
def test_the_labs_site_patches_the_module_when_a_process_imports_it(
    tmp_path: Path, spin: str, expected: float
) -> None:
    """In a fresh interpreter, as a server's process starts: sitecustomize runs first, the module is
    imported later and comes out patched (or stock when the environment names no spin)."""
    package = tmp_path / "vllm" / "distributed" / "device_communicators"
    package.mkdir(parents=True)
    for folder in (tmp_path / "vllm", tmp_path / "vllm" / "distributed", package):
        (folder / "__init__.py").write_text("")
    (package / "shm_broadcast.py").write_text(SHM_STANDIN)
    probe = textwrap.dedent(
        """
        import sys
        assert "vllm" not in sys.modules
        from vllm.distributed.device_communicators import shm_broadcast
        print(shm_broadcast.SpinCondition(True, None, "ipc://x").busy_loop_s)
        print(shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS)
        """
    )
    env = {
        **os.environ,
        busy_poll.SPIN_ENV: spin,
        "PYTHONPATH": os.pathsep.join([str(lab.LAB_SITE), str(lab.ROOT), str(tmp_path)]),
    }
    env.pop("EPD_LAB_V1_RUNNER_SHIM", None)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    spin_seen, recheck_seen = out.stdout.split()
    assert float(spin_seen) == expected
    assert int(recheck_seen) == (20 if spin else 5000)
    # The line that shows it in the server's log (vLLM's logging is not set up yet at that import).
    assert ("busy-poll held to 0.005 s, a sleeping reader's recheck to 20 ms" in out.stderr) is bool(spin)
