"""One PD process of the fleet test: the verifying engine behind EPDMiddleware, configured from the EPD_*
environment as vLLM's plugin is, served by hypercorn on asyncio or trio.

    python -m tests.fleet.pd_server PORT BACKEND
"""

from __future__ import annotations

import sys

import anyio
from hypercorn.config import Config

from epd_middleware import EPDConfig, EPDMiddleware
from tests.load.harness import verifying_engine


async def main(port: int, backend: str) -> None:
    app = EPDMiddleware(verifying_engine(), config=EPDConfig.from_env())
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.loglevel = "WARNING"
    config.accesslog = None
    config.keep_alive_timeout = 30
    if backend == "trio":
        from hypercorn.trio import serve
    else:
        from hypercorn.asyncio import serve  # type: ignore[assignment]
    await serve(app, config)  # type: ignore[arg-type]


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]), sys.argv[2], backend=sys.argv[2])
