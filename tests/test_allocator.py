"""glibc's malloc keeps the memory large bodies pass through (``tune_malloc``, _allocator.py): set once
where nobody tuned it, never over an operator's choice or on another malloc, and with the effect it is
for: a request's large blocks reuse warm pages instead of faulting fresh ones in."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest

from epd_middleware import EPDMiddleware, _middleware
from epd_middleware._allocator import MMAP_THRESHOLD, TRIM_THRESHOLD, keep_freed_memory

from .fakes import FakeEngine


class FakeGlibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def gnu_get_libc_version(self) -> bytes:
        return b"2.36"

    def mallopt(self, parameter: int, value: int) -> int:
        self.calls.append((parameter, value))
        return 1


class FakeMusl:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, parameter: int, value: int) -> int:  # musl's does nothing
        self.calls.append((parameter, value))
        return 0


def test_where_nobody_tuned_glibc_it_keeps_blocks_under_32_mib_and_64_mib_free() -> None:
    libc = FakeGlibc()
    assert keep_freed_memory({}, libc) == "set"
    assert libc.calls == [(-3, MMAP_THRESHOLD), (-1, TRIM_THRESHOLD)]
    assert (MMAP_THRESHOLD, TRIM_THRESHOLD) == (32 << 20, 64 << 20)


@pytest.mark.parametrize(
    "environ",
    [
        {"MALLOC_TRIM_THRESHOLD_": "268435456"},
        {"MALLOC_MMAP_THRESHOLD_": "268435456"},
        {"MALLOC_TOP_PAD_": "0"},
        {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
    ],
)
def test_an_operators_malloc_settings_stand(environ: dict[str, str]) -> None:
    libc = FakeGlibc()
    assert keep_freed_memory(environ, libc) == "operator"
    assert libc.calls == []


def test_another_malloc_is_left_alone() -> None:
    libc = FakeMusl()
    assert keep_freed_memory({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}, libc) == "not glibc"
    assert libc.calls == []


@pytest.mark.parametrize(("tune", "expected"), [(True, 1), (False, 0)])
def test_the_middleware_tunes_malloc_unless_told_not_to(
    monkeypatch: pytest.MonkeyPatch, tune: bool, expected: int
) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(_middleware, "keep_freed_memory", lambda: calls.append(1) or "set")
    EPDMiddleware(FakeEngine().app(), encoders=["http://enc:8001"], tune_malloc=tune)
    assert len(calls) == expected


_REQUESTS = textwrap.dedent(
    """
    import resource, sys
    from epd_middleware._allocator import keep_freed_memory
    if sys.argv[1] == "tuned":
        assert keep_freed_memory({}) == "set"

    def one_request():
        # An 8-image body's life: the server's 256 KiB pieces, joined, and a buffer as large written.
        pieces = [bytearray(256 * 1024) for _ in range(7)]
        body = b"".join(pieces)
        del pieces
        written = bytearray(len(body))
        del body, written

    for _ in range(5):
        one_request()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        one_request()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc, on Linux")
def test_tuned_a_requests_large_blocks_reuse_warm_pages() -> None:
    def faults(mode: str) -> float:
        env = {"PATH": "/usr/bin:/bin"}  # no MALLOC_* variable of the runner's
        out = subprocess.run(
            [sys.executable, "-c", _REQUESTS, mode], capture_output=True, text=True, check=True, env=env
        )
        return float(out.stdout)

    # glibc's defaults hand the freed top of the heap back after every such request: each of its
    # ~850 pages (3.5 MB) faults in again. Tuned, the pages stay.
    assert faults("default") > 400
    assert faults("tuned") < 20
