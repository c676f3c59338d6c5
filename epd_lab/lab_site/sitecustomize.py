"""On every lab server's PYTHONPATH (epd_lab.servers.VLLMServer.start): each Python process of the server
(API server, engine core, workers) installs, at start-up and before vLLM is imported, what the lab's
environment asks for:

- ``EPD_LAB_VLLM_SPIN_S``: vLLM's shared-memory busy-poll held to that many seconds (epd_lab/busy_poll.py);
- ``EPD_LAB_V1_RUNNER_SHIM=1``: the V1-runner shim of a Mooncake PD (epd_lab/v1_runner_shim.py).
"""

import os

from epd_lab import busy_poll

busy_poll.install()

if os.environ.get("EPD_LAB_V1_RUNNER_SHIM") == "1":
    from epd_lab.v1_runner_shim import install

    install()
