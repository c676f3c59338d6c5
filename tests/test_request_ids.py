"""One request id everywhere (issue 31, point 1): every log line about a request carries its id, the request
line names the encoders that answered, the middleware's own errors leave a line and carry X-Request-Id
where vLLM's --enable-request-id-headers would, and the lines can be JSON. Each case failed before."""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import pytest

from epd_middleware import Host
from epd_middleware._logs import logger

from .fakes import FakeEncoders, FakeEngine, build_app, chat_body, image
from .test_middleware import E0, E1, png, post

pytestmark = pytest.mark.anyio


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "epd_middleware"]


async def test_a_failover_its_lines_and_the_request_line_carry_the_id_and_name_who_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: the failure warning had no id, and the request line named the encoder planned (E1), not
    the one that answered (E0)."""
    caplog.set_level(logging.INFO, "epd_middleware")
    encoders, engine = FakeEncoders([E1, E0], mode={E1: "500"}), FakeEngine()
    app, _ = build_app(encoders, engine)
    response = await post(app, chat_body(image(png(1))), headers={"x-request-id": "client-req-0"})
    assert response.status_code == 200
    about = lines(caplog)
    assert any(line.startswith(f"request client-req-0: encoder {E1} failed: HTTP 500") for line in about)
    [summary] = [line for line in about if "media item(s)" in line]
    assert summary.startswith("request client-req-0: 1 media item(s), 1 encoder call(s) answered by ")
    assert E0 in summary
    assert E1 not in summary


async def test_an_ejection_a_request_caused_names_the_request(caplog: pytest.LogCaptureFixture) -> None:
    encoders, engine = FakeEncoders([E0, E1], mode={E1: "refuse"}), FakeEngine()
    app, _ = build_app(encoders, engine, eject_after=1)
    middleware = app.build_middleware_stack()
    for seed in range(2):
        await post(middleware, chat_body(image(png(seed))), headers={"x-request-id": f"r{seed}"})
    [ejected] = [line for line in lines(caplog) if "ejected for" in line]
    assert ejected.startswith(("request r0: ", "request r1: "))


@pytest.mark.parametrize(("mode", "status"), [("refuse", 502), ("hang", 504)])
async def test_the_middlewares_own_error_leaves_one_line_with_id_status_and_reason(
    mode: str, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: a 503 left no line at all, a 502 only id-less warnings."""
    encoders, engine = FakeEncoders([E0], mode={E0: mode}), FakeEngine()
    app, _ = build_app(encoders, engine, encoder_timeout=0.1, eject_after=1)
    middleware = app.build_middleware_stack()
    first = await post(middleware, chat_body(image(png(1))), headers={"x-request-id": "first"})
    second = await post(middleware, chat_body(image(png(2))), headers={"x-request-id": "second"})
    assert (first.status_code, second.status_code) == (status, 503)
    answered = [line for line in lines(caplog) if " answered " in line and "HTTP" not in line]
    assert answered[0].startswith(f"request first: answered {status} ")
    assert E0 in answered[0]  # the log names the server, the answer does not
    assert answered[1].startswith("request second: answered 503 ServiceUnavailableError: every encoder")


async def test_a_client_error_is_one_line_at_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "epd_middleware")
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, max_media_items=1)
    response = await post(app, chat_body(image(png(1)), image(png(2))), headers={"x-request-id": "two"})
    assert response.status_code == 400
    [line] = [record for record in caplog.records if "answered 400" in record.getMessage()]
    assert line.levelno == logging.INFO
    assert line.getMessage().startswith("request two: answered 400 BadRequestError: ")


@pytest.mark.parametrize("headers_on", [True, False])
async def test_own_error_answers_carry_x_request_id_where_vllm_would(headers_on: bool) -> None:
    """vLLM's XRequestIdMiddleware sits inside the middleware: it never sees the middleware's own
    answers. Before: none of them carried the id, whatever --enable-request-id-headers said."""
    encoders, engine = FakeEncoders([E0], mode={E0: "refuse"}), FakeEngine()
    host = Host(request_id_headers=headers_on)
    app, _ = build_app(encoders, engine, host=host)
    given = await post(app, chat_body(image(png(1))), headers={"x-request-id": "mine-1"})
    made = await post(app, chat_body(image(png(2))))
    assert given.status_code == made.status_code == 502
    assert given.headers.get("x-request-id") == ("mine-1" if headers_on else None)
    assert (made.headers.get("x-request-id") is not None) == headers_on


async def test_a_made_up_id_is_the_one_the_engine_and_the_log_see(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "epd_middleware")
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    assert (await post(app, chat_body(image(png(1))))).status_code == 200
    made = engine.received[0].headers["x-request-id"]
    assert any(line.startswith(f"request {made}: ") for line in lines(caplog))
    assert encoders.calls[0].headers["x-request-id"] == f"{made}-enc0"


async def test_a_hostile_id_never_breaks_a_line_or_forges_one(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "epd_middleware")
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine)
    hostile = "%s%d\x1b[31m" + "x" * 500
    response = await post(app, chat_body(image(png(1))), headers={"x-request-id": hostile})
    assert response.status_code == 200
    [summary] = [line for line in lines(caplog) if "media item(s)" in line]
    assert summary.startswith("request %s%d?[31mxxx")
    assert len(summary.split(":")[0]) <= len("request ") + 128


async def test_json_log_lines_are_one_object_each_with_the_request_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)  # where log_format=json writes
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    try:
        encoders, engine = FakeEncoders([E1, E0], mode={E1: "500"}), FakeEngine()
        app, _ = build_app(encoders, engine, log_format="json")
        await post(app, chat_body(image(png(1))), headers={"x-request-id": "json-1"})
    finally:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        for handler in handlers:
            logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
    records: list[dict[str, Any]] = [json.loads(line) for line in stream.getvalue().splitlines()]
    failed = [record for record in records if "failed: HTTP 500" in record["message"]]
    assert failed
    assert failed[0]["request_id"] == "json-1"
    assert failed[0]["message"].startswith(f"encoder {E1} failed")  # the id is a field, not a prefix
    assert {"time", "level", "logger"} <= set(failed[0])
