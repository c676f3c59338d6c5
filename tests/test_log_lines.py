"""No forged log line (issue 35, item 2): every line the middleware writes for a request is one line,
starting with its own ``request <id>:``, with control characters escaped, in text mode as in JSON. A
refused URL's text is the client's, and so is vLLM's echo of it in an encoder's answer: before, a newline
in it wrote a second physical line, ``request victim-7: answered 200``, through the media policy's
refusal, the answer's line and the failover lines. And a lone surrogate in it lost the line and made
the error body raise (item 5)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from epd_middleware import EPDMiddleware, Host
from epd_middleware._logs import log_as_json, logger
from epd_middleware._media_policy import MediaPolicy

from .fakes import TEST_UUID_KEY, FakeEngine, chat_body, encoder_reply, models_answer, reported_entries
from .test_middleware import E0, E1, post

pytestmark = pytest.mark.anyio

FORGED = "x.png\nrequest victim-7: answered 200\r\x1b[2Kok\u2028done"


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    """What the middleware's logger writes, as a text handler with vLLM's kind of format writes it."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def physical_lines(stream: io.StringIO) -> list[str]:
    text = stream.getvalue()
    assert text.endswith("\n")
    return text[:-1].split("\n")


def assert_one_line_each(stream: io.StringIO, request_id: str) -> list[str]:
    found = physical_lines(stream)
    assert found
    for line in found:
        assert line.split(" ", 2)[2].startswith(f"request {request_id}: "), line
        assert "\r" not in line
        assert "\x1b" not in line
        assert "\u2028" not in line
    return found


def app_of(handler: Any, **options: Any) -> Any:
    # Without the start-up's own lines (the uuid key's, the allocator's): these tests read request lines.
    options.setdefault("uuid_key", TEST_UUID_KEY)
    options.setdefault("tune_malloc", False)
    return EPDMiddleware(
        FakeEngine().app(),
        encoders=[E0, E1],
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
        encoder_selection="round_robin",
        **options,
    )


def vllm_encoder(chat: Any) -> Any:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models_answer(["tiny-qwen2-vl"]))
        return chat(json.loads(request.content), request)  # type: ignore[no-any-return]

    return handler


def url_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


POLICY = MediaPolicy(allowed_domains=("images.example",), local_root=Path("/srv/media"))


@pytest.mark.parametrize("url", [f"file:///etc/{FORGED}", f"http://evil.example:{FORGED}/a.png"])
async def test_a_refused_url_writes_one_line(lines: io.StringIO, url: str) -> None:
    """The media policy quotes vLLM's refusal, which quotes the client's text: the file path, or the URL
    urllib3 cannot parse. Here it holds a line break and a forged line."""
    app = app_of(vllm_encoder(lambda body, request: httpx.Response(500)), host=Host(media_policy=POLICY))
    response = await post(app, chat_body(url_part(url)), headers={"x-request-id": "attacker-1"})
    assert response.status_code == 400
    assert "request victim-7" in response.json()["error"]["message"]  # vLLM's words, as a client reads them
    found = assert_one_line_each(lines, "attacker-1")
    assert any("\\nrequest victim-7" in line for line in found)


async def test_an_encoders_echo_of_the_clients_text_writes_one_line(lines: io.StringIO) -> None:
    """vLLM's 400 quotes the URL it could not take; the failover lines and the answer's line quote vLLM."""

    def chat(body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        url = body["messages"][0]["content"][0]["image_url"]["url"]
        return httpx.Response(400, json={"error": {"message": f"Invalid image URL: {url}", "code": 400}})

    app = app_of(vllm_encoder(chat))
    url = f"https://images.example/{FORGED}"
    response = await post(app, chat_body(url_part(url)), headers={"x-request-id": "attacker-2"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"Invalid image URL: {url}"  # the client's own text
    found = assert_one_line_each(lines, "attacker-2")
    assert any("x.png\\nrequest victim-7: answered 200\\r\\x1b[2Kok\\u2028done" in line for line in found)


async def test_a_servers_error_text_in_a_failover_line_is_escaped(lines: io.StringIO) -> None:
    said = iter(range(100))

    def chat(body: dict[str, Any], request: httpx.Request) -> httpx.Response:
        if "media.example" in json.dumps(body):
            message = f"boom {next(said)}\nrequest victim-7: answered 200"
            return httpx.Response(500, json={"error": {"message": message, "code": 500}})
        return httpx.Response(200, json=encoder_reply(body, reported_entries(body)))

    app = app_of(vllm_encoder(chat))
    response = await post(
        app, chat_body(url_part("https://media.example/a.png")), headers={"x-request-id": "attacker-3"}
    )
    assert response.status_code == 502
    found = assert_one_line_each(lines, "attacker-3")
    assert any("retrying on" in line for line in found)


async def test_json_lines_are_one_object_each_with_the_text_escaped() -> None:
    stream = io.StringIO()
    handlers, level = list(logger.handlers), logger.level
    log_as_json(stream)
    try:
        app = app_of(vllm_encoder(lambda body, request: httpx.Response(500)), host=Host(media_policy=POLICY))
        response = await post(
            app, chat_body(url_part(f"file:///etc/{FORGED}")), headers={"x-request-id": "attacker-4"}
        )
        assert response.status_code == 400
    finally:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        for handler in handlers:
            logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = True
    records = [json.loads(line) for line in physical_lines(stream)]
    assert records
    assert {record["request_id"] for record in records} == {"attacker-4"}
    assert all("\n" not in record["message"] and "\x1b" not in record["message"] for record in records)


async def test_a_lone_surrogate_in_a_url_is_answered_and_logged(lines: io.StringIO) -> None:
    """``http://\\ud800.example/x.png``: a body read by Python's json holds a lone surrogate, which UTF-8
    cannot encode. Before, the error body raised UnicodeEncodeError (a 500 from the server) and the
    log line was lost ("--- Logging error ---")."""
    host = Host(media_policy=MediaPolicy(allowed_domains=("images.example",)))
    app = app_of(vllm_encoder(lambda body, request: httpx.Response(500)), host=host)
    body = json.dumps(chat_body(url_part("http://\ud800.example/x.png")), ensure_ascii=True)
    response = await post(app, json.loads(body), headers={"x-request-id": "attacker-5"})
    assert response.status_code == 400
    assert "\ud800" in response.json()["error"]["message"]  # JSON's escape, read back as sent
    found = assert_one_line_each(lines, "attacker-5")
    assert any("\\ud800" in line for line in found)


async def test_a_lone_surrogate_in_an_anthropic_error_is_answered_in_anthropics_shape() -> None:
    host = Host(media_policy=MediaPolicy(allowed_domains=("images.example",)))
    app = app_of(vllm_encoder(lambda body, request: httpx.Response(500)), host=host)
    image = {"type": "image", "source": {"type": "url", "url": "http://\ud800.example/x.png"}}
    body = {"model": "tiny-qwen2-vl", "max_tokens": 4, "messages": [{"role": "user", "content": [image]}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pd") as client:
        response = await client.post(
            "/v1/messages",
            content=json.dumps(body, ensure_ascii=True),
            headers={"content-type": "application/json"},
        )
    assert response.status_code == 400
    assert response.json()["type"] == "error"
    assert "\ud800" in response.json()["error"]["message"]
