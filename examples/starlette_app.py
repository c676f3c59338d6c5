"""epd-middleware on a plain Starlette app (the same call works on FastAPI).

    EPD_DEMO_ENCODER=http://127.0.0.1:8001 uvicorn examples.starlette_app:app --port 8000

The stand-in engine echoes what reached it, so you can see the rewritten request: media parts replaced by
metadata-only references and the encoder's handles in ``ec_transfer_params``.
"""

from __future__ import annotations

import json
import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from epd_middleware import EPDMiddleware


async def chat_completions(request: Request) -> JSONResponse:
    body = json.loads(await request.body())
    return JSONResponse({"engine_received": body})


app = Starlette(routes=[Route("/v1/chat/completions", chat_completions, methods=["POST"])])
app.add_middleware(
    EPDMiddleware,
    encoders=[os.environ.get("EPD_DEMO_ENCODER", "http://127.0.0.1:8001")],
    encoder_timeout=30,
)
