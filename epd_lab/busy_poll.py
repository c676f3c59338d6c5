"""Hold vLLM's shared-memory busy-poll to a few milliseconds in the lab's servers (never in the package).

vLLM's engine core and its worker pass each step through a shared-memory queue whose reader spins
(``sched_yield`` in a loop) for one second after every message before it sleeps on a socket
(vLLM 0.32 and 0.33 ``distributed/device_communicators/shm_broadcast.py``, ``SpinCondition``,
``busy_loop_s=1``; the writer wakes a sleeping reader on every message, ``notify``). On a GPU node each
server has cores of its own and the spin costs nothing. In the lab every server shares the machine's two
cores: an encoder that answered a request 0.9 s ago still spins a whole core, and at one request at a
time the lab's E + PD kept both cores busy: the figures are in docs/performance.md ("The lab's
busy-poll").

``EPD_LAB_VLLM_SPIN_S`` (the lab's BASE_ENV sets it): the spin in seconds after the last message. A
decode step comes every few milliseconds, so the spin still covers a running request's steps; it no
longer outlasts the request by a second. Unset or empty: vLLM's own.

With the spin held, a reader goes to sleep many times a second instead of after a second of quiet, and
now and then a message does not wake it: it finds the message only at its periodic recheck,
``SHM_READER_RECHECK_INTERVAL_MS`` (5,000 ms), and the request stalls for 5 s (seen in 6 of 24 c4 runs
of ``vllm bench serve``, 5.15-5.32 s each, under either front; never in 105 runs with vLLM's 1 s spin).
The hold therefore also makes a sleeping reader recheck every :data:`RECHECK_MS`: a missed wake-up
costs that much, and a reader that sleeps wakes 50 times a second for a check of a few microseconds.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from epd_lab.import_patch import patch_on_import

SPIN_ENV = "EPD_LAB_VLLM_SPIN_S"
MODULE = "vllm.distributed.device_communicators.shm_broadcast"
PARAMETER = "busy_loop_s"
RECHECK = "SHM_READER_RECHECK_INTERVAL_MS"
RECHECK_MS = 20


def _say(message: str, *args: object) -> None:
    """A line in the server's log. vLLM configures its logging after it imports this module, so a
    logger's line would be dropped here: straight to stderr, which the lab writes to the server's log."""
    print(message % args, file=sys.stderr, flush=True)


def spin_seconds(environ: Mapping[str, str] = os.environ) -> float | None:
    """The spin the environment asks for; None for vLLM's own (unset, empty, or not a finite number >= 0)."""
    text = environ.get(SPIN_ENV, "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def install() -> None:
    seconds = spin_seconds()
    if seconds is not None:
        patch_on_import({MODULE: functools.partial(hold_spin, seconds=seconds)})


def hold_spin(module: ModuleType, seconds: float) -> None:
    """Make ``seconds`` the spin of every ``SpinCondition`` that does not name its own."""
    condition = getattr(module, "SpinCondition", None)
    stock = getattr(condition, "__init__", None)
    if condition is None or stock is None:
        _say("epd-lab: %s has no SpinCondition; vLLM's busy-poll left as it is", MODULE)
        return
    signature = inspect.signature(stock)
    if PARAMETER not in signature.parameters:
        _say("epd-lab: SpinCondition takes no %s; vLLM's busy-poll left as it is", PARAMETER)
        return

    @functools.wraps(stock)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if PARAMETER not in signature.bind_partial(self, *args, **kwargs).arguments:
            kwargs[PARAMETER] = seconds
        stock(self, *args, **kwargs)

    condition.__init__ = __init__
    # Read by the reader's wait at each call (ReadTimeoutWithWarnings.timeout_ms), so setting the module's
    # value is enough.
    recheck = getattr(module, RECHECK, None)
    if isinstance(recheck, int) and recheck > RECHECK_MS:
        setattr(module, RECHECK, RECHECK_MS)
    else:
        _say("epd-lab: %s has no %s above %d ms; left as it is", MODULE, RECHECK, RECHECK_MS)
    _say(
        "epd-lab: vLLM's shared-memory busy-poll held to %g s, a sleeping reader's recheck to %s ms",
        seconds,
        getattr(module, RECHECK, None),
    )
