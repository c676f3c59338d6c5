"""glibc's malloc told to keep the memory large request bodies pass through (``tune_malloc``).

A multimodal body is megabytes, and every request that carries one allocates and frees blocks of that
size: the ASGI server's pieces of it, the buffers the middleware reads it into and writes the encoder
request from. By default glibc serves a block over its mmap threshold (128 KiB at start, raised as it
sees larger blocks freed, up to 32 MiB) with a mapping of its own, and trims the top of the heap once
more than twice that threshold lies free there. So at a steady trickle of large bodies each request
frees its blocks, glibc hands them back, and the next request faults every 4 KiB page in again, zeroed:
2.4 us a page on the perf rig's machine, about 1 ms for an 8-image request in the engine process at
concurrency 1, more than the work the middleware does on it (docs/performance.md).

Told to serve blocks under 32 MiB from the heap and to keep up to 64 MiB free there, glibc reuses warm
pages: the state its own adaptive thresholds reach after one 32 MiB block is freed, set at start instead
of after the first such request. The price is resident memory: up to 64 MiB freed and kept. An operator
who tuned malloc already (``MALLOC_*_`` variables, ``GLIBC_TUNABLES``, as deploy/kubernetes does) is
left as they chose; another malloc (musl, or none of glibc's) is left alone.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

# glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# The largest mmap threshold glibc's dynamic rule reaches on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX), and
# the trim threshold it sets beside it (twice).
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD
# What tells glibc's malloc how to behave already: the operator's choice stands.
_OPERATOR_SETTINGS = (
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)


def keep_freed_memory(environ: Mapping[str, str] = os.environ, libc: Any = None) -> str:
    """Tell glibc's malloc to keep freed memory for the next large body, once per process (setting it
    again changes nothing). Says what was done: ``"set"``, ``"operator"`` (malloc tuned already),
    ``"not glibc"``."""
    if any(name in environ for name in _OPERATOR_SETTINGS) or "glibc.malloc." in environ.get(
        "GLIBC_TUNABLES", ""
    ):
        return "operator"
    if libc is None:
        if not sys.platform.startswith("linux"):
            return "not glibc"
        try:
            libc = ctypes.CDLL(None)
        except OSError:  # pragma: no cover - a process without a C library to open
            return "not glibc"
    try:
        libc.gnu_get_libc_version  # noqa: B018 - glibc's own symbol: musl's mallopt does nothing
        mallopt = libc.mallopt
    except AttributeError:
        return "not glibc"
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "not glibc"  # pragma: no cover - glibc refused values within its own limits
    return "set"
