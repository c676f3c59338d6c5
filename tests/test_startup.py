"""``strict_startup`` under the ASGI servers people run: after ``lifespan.startup.failed`` the lifespan
ends with :class:`StartupFailed`, as a Starlette app's does, so that uvicorn, hypercorn and Starlette's
TestClient all stop instead of serving on (hypercorn answered 404 with nothing logged, and the TestClient
waited for ever)."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
from starlette.testclient import TestClient

from epd_middleware import EPDMiddleware, StartupFailed

from .fakes import MODEL, FakeEncoders, FakeEngine, upstream_client

pytestmark = pytest.mark.anyio

E0, E1 = "http://enc-0:8001", "http://enc-1:8001"


def mismatched_app(strict: bool = True) -> EPDMiddleware:
    """E1 serves another model: with strict_startup the start must fail."""
    encoders = FakeEncoders([E0, E1], served={E1: ["another-model"]})
    return EPDMiddleware(
        FakeEngine().app(),
        encoders=encoders.urls,
        http_client=upstream_client(encoders),
        health_check_interval=0,
        expected_model=MODEL,
        strict_startup=strict,
    )


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_uvicorn_stops_when_the_start_fails() -> None:
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(mismatched_app(), host="127.0.0.1", port=0, lifespan="on", log_level="critical")
    )
    with anyio.fail_after(10), pytest.raises(SystemExit) as exited:
        await server.serve()
    assert exited.value.code == 3  # uvicorn's STARTUP_FAILURE
    assert not server.started


async def test_hypercorn_stops_when_the_start_fails(anyio_backend: str) -> None:
    from hypercorn.config import Config
    from hypercorn.utils import LifespanFailureError

    config = Config()
    config.bind = ["127.0.0.1:0"]
    if anyio_backend == "trio":
        from hypercorn.trio import serve
    else:
        from hypercorn.asyncio import serve  # type: ignore[assignment]
    with anyio.fail_after(10):
        try:
            await serve(mismatched_app(), config)  # type: ignore[arg-type]
        except BaseException as exc:  # hypercorn on trio raises it from its nursery, in a group
            raised = exc
            while isinstance(getattr(raised, "exceptions", None), tuple):
                [raised] = raised.exceptions  # type: ignore[attr-defined]
        else:
            raise AssertionError("hypercorn went on serving after the failed start")
    assert isinstance(raised, LifespanFailureError)
    assert "another-model" in str(raised)


def test_starlettes_test_client_raises_when_the_start_fails() -> None:
    outcome: list[Any] = []

    def start() -> None:
        try:
            with TestClient(mismatched_app()):
                outcome.append("served")
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the test client waited on a lifespan that never ended"
    [raised] = outcome
    assert isinstance(raised, StartupFailed)
    assert "another-model" in str(raised)


def test_without_strict_startup_the_same_servers_start() -> None:
    with TestClient(mismatched_app(strict=False)) as client:
        assert client.get("/epd/status").status_code == 200
