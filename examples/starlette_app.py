"""epd-middleware on a plain Starlette app (the same call works on FastAPI).

    pip install 'epd-middleware[metrics] @ git+https://github.com/epd-middleware/epd-middleware' uvicorn
    EPD_DEMO_ENCODER=http://127.0.0.1:8001 uvicorn examples.starlette_app:app --port 8000

The stand-in engine echoes what reached it, so you can see the rewritten request: media parts replaced by
metadata-only references and the encoder's handles in ``ec_transfer_params``.

Outside vLLM two things are the application's (docs/observability.md, "Outside vLLM"): serving
``/metrics`` (vLLM serves it; here prometheus_client's ASGI app, when the ``metrics`` extra is installed)
and configuring logging (uvicorn configures only its own loggers, so the middleware's INFO lines would be
lost; ``EPD_LOG_FORMAT=json`` is the other way).
"""

from __future__ import annotations

import json
import logging
import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from epd_middleware import EPDMiddleware

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


async def chat_completions(request: Request) -> JSONResponse:
    body = json.loads(await request.body())
    return JSONResponse({"engine_received": body})


routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"])]
try:
    import prometheus_client
except ImportError:  # the middleware logs a WARNING naming the extra
    pass
else:

    async def metrics(request: Request) -> Response:
        return Response(prometheus_client.generate_latest(), media_type=prometheus_client.CONTENT_TYPE_LATEST)

    routes.append(Route("/metrics", metrics))

app = Starlette(routes=routes)
app.add_middleware(
    EPDMiddleware,
    encoders=[os.environ.get("EPD_DEMO_ENCODER", "http://127.0.0.1:8001")],
    encoder_timeout=30,
)
