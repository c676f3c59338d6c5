"""The PD server of ``benchmarks.attack``: a verifying fake engine behind EPDMiddleware, served by hypercorn
on 127.0.0.1, in its own process.

    PYTHONPATH=CHECKOUT python benchmarks/attack_pd.py PORT CONFIG_JSON

Run by path, with the checkout whose middleware it serves first on ``PYTHONPATH`` (this one, or another
for ``--baseline``), so it imports nothing of this project but ``epd_middleware``. CONFIG_JSON:
``encoders`` (URLs), ``options`` (EPDMiddleware keywords), ``prefill_s`` per image and ``decode_s`` per
request, the fake engine's time. It prints ``ready`` and the middleware's file once it serves.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio
from hypercorn.asyncio import serve
from hypercorn.config import Config
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import epd_middleware
from epd_middleware import EPDMiddleware


def engine(prefill_s: float, decode_s: float) -> Starlette:
    """Answers after prefill and decode time, ``verified`` true when every image reached it as a
    reference whose handle sits in ec_transfer_params (as tests/load/harness.py's engine). Concurrent
    requests do not wait for each other: a decode batch of a few sequences costs about what one does."""

    async def chat(request: Request) -> Response:
        body = json.loads(await request.body())
        params = body.get("ec_transfer_params") or {}
        images, verified = 0, True
        for message in body["messages"]:
            if not isinstance(message["content"], list):
                continue
            for part in message["content"]:
                if part["type"] == "image_embeds":
                    images += 1
                    verified &= part["uuid"] in params
                elif part["type"] == "image_url":
                    verified = False  # no fallback to local encoding here: every image goes out
        await anyio.sleep(prefill_s * images + decode_s)
        return JSONResponse({"verified": verified and images > 0})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


async def main(port: int, config: dict[str, Any]) -> None:
    app = EPDMiddleware(
        engine(config["prefill_s"], config["decode_s"]), encoders=config["encoders"], **config["options"]
    )
    hypercorn = Config()
    hypercorn.bind = [f"127.0.0.1:{port}"]
    hypercorn.accesslog = None
    hypercorn.keep_alive_timeout = 60
    print("ready", epd_middleware.__file__, flush=True)
    await serve(app, hypercorn)  # type: ignore[arg-type]


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]), json.loads(sys.argv[2]))
