"""A server shutting down (SIGTERM, vLLM's --shutdown-timeout drain): every request the middleware holds
gets an answer, never vLLM's silent abort of a request added while the engine stops."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from epd_middleware import EPDMiddleware
from epd_middleware._draining import AbortWatch
from epd_middleware._surfaces import anthropic_messages, choices_aborted, openai_responses
from epd_middleware.host import Host, _engine_client_stopping

from .fakes import TEST_UUID_KEY, FakeEncoders, chat_body, image

pytestmark = pytest.mark.anyio

E0, E1 = "http://enc-0:8001", "http://enc-1:8001"
PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="

# vLLM 0.32's answers to a request added while its engine shuts down (the engine core aborts it at once).
CHAT_ABORT = {
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": ""}, "finish_reason": "abort"}],
}
MESSAGES_ABORT = {"type": "message", "role": "assistant", "content": [], "stop_reason": None}
RESPONSES_ABORT = {"object": "response", "status": "incomplete", "output": []}
CHAT_DONE = {
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "a cat"}, "finish_reason": "stop"}],
}


class Engine:
    """A vLLM stand-in whose engine can be told to stop: from then on it answers what vLLM answers a
    request added during its drain (``stop_on_arrival``: it stops as the request arrives, after the
    middleware looked)."""

    def __init__(self) -> None:
        self.stopping = False
        self.stop_on_arrival = False
        self.received: list[dict[str, Any]] = []
        self.answer_while_stopping: dict[str, Any] = CHAT_ABORT

    def app(self) -> Starlette:
        async def chat(request: Request) -> Response:
            body = json.loads(await request.body())
            self.received.append(body)
            if self.stop_on_arrival:
                self.stopping = True
            if body.get("stream"):

                async def events() -> Any:
                    yield 'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
                    yield 'data: {"choices":[{"index":0,"delta":{},"finish_reason":"abort"}]}\n\n'
                    yield "data: [DONE]\n\n"

                return StreamingResponse(events(), media_type="text/event-stream")
            return JSONResponse(self.answer_while_stopping if self.stopping else CHAT_DONE)

        async def messages(request: Request) -> Response:
            self.received.append(json.loads(await request.body()))
            self.stopping = self.stopping or self.stop_on_arrival
            return JSONResponse(MESSAGES_ABORT)

        async def responses(request: Request) -> Response:
            self.received.append(json.loads(await request.body()))
            self.stopping = self.stopping or self.stop_on_arrival
            return JSONResponse(RESPONSES_ABORT)

        return Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/messages", messages, methods=["POST"]),
                Route("/v1/responses", responses, methods=["POST"]),
            ]
        )


def serving(engine: Engine, encoders: FakeEncoders, **options: Any) -> Starlette:
    app = engine.app()
    app.add_middleware(
        EPDMiddleware,
        encoders=encoders.urls,
        http_client=encoders.client(),
        host=Host(engine_stopping=lambda: engine.stopping),
        uuid_key=TEST_UUID_KEY,
        encoder_selection="round_robin",
        **options,
    )
    return app


async def post(app: Starlette, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pd") as client:
        return await client.post(path, json=body)


async def test_a_request_arriving_at_a_server_shutting_down_is_answered_503_without_a_call() -> None:
    engine, encoders = Engine(), FakeEncoders([E0])
    engine.stopping = True
    response = await post(serving(engine, encoders, retry_after=7), chat_body(image(PNG)))
    assert response.status_code == 503
    assert response.headers["retry-after"] == "7"
    error = response.json()["error"]
    assert "shutting down" in error["message"]
    assert "another server" in error["message"]
    assert encoders.calls == []
    assert engine.received == []


async def test_a_request_whose_server_began_stopping_during_its_encoder_calls_never_reaches_the_engine() -> (
    None
):
    engine, encoders = Engine(), FakeEncoders([E0])
    encoders.started, encoders.pause = anyio.Event(), 0.05
    app = serving(engine, encoders)

    async def sigterm() -> None:
        assert encoders.started is not None
        await encoders.started.wait()
        engine.stopping = True

    async with anyio.create_task_group() as group:
        group.start_soon(sigterm)
        response = await post(app, chat_body(image(PNG)))
    assert len(encoders.calls) == 1  # it ran: the encoder calls in flight finish
    assert engine.received == []  # but the engine would have aborted it
    assert response.status_code == 503
    assert "retry-after" in response.headers


async def test_an_abort_the_engine_answers_because_it_stopped_after_the_middleware_looked_becomes_a_503() -> (
    None
):
    engine, encoders = Engine(), FakeEncoders([E0])
    engine.stop_on_arrival = True
    response = await post(serving(engine, encoders), chat_body(image(PNG)))
    assert len(engine.received) == 1
    assert response.status_code == 503
    assert "shutting down" in response.json()["error"]["message"]


async def test_an_abort_on_messages_becomes_a_503_in_anthropics_shape() -> None:
    engine, encoders = Engine(), FakeEncoders([E0])
    engine.stop_on_arrival = True
    body = {
        "model": "m",
        "max_tokens": 8,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
                ],
            }
        ],
    }
    response = await post(serving(engine, encoders), body, "/v1/messages")
    assert response.status_code == 503
    assert response.json()["type"] == "error"
    assert "shutting down" in response.json()["error"]["message"]


async def test_an_abort_on_responses_becomes_a_503() -> None:
    engine, encoders = Engine(), FakeEncoders([E0])
    engine.stop_on_arrival = True
    body = {
        "model": "m",
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}],
            }
        ],
    }
    response = await post(serving(engine, encoders), body, "/v1/responses")
    assert len(engine.received) == 1
    assert response.status_code == 503


async def test_an_answer_the_engine_drained_to_its_end_passes_as_it_came() -> None:
    """A request the engine holds at SIGTERM runs to its end (the drain): its answer is the model's."""
    engine, encoders = Engine(), FakeEncoders([E0])
    engine.stop_on_arrival = True
    engine.answer_while_stopping = CHAT_DONE
    response = await post(serving(engine, encoders), chat_body(image(PNG)))
    assert response.status_code == 200
    assert response.json() == CHAT_DONE


async def test_a_stream_passes_as_it_comes_even_while_the_server_shuts_down() -> None:
    engine, encoders = Engine(), FakeEncoders([E0])
    engine.stop_on_arrival = True
    response = await post(serving(engine, encoders), chat_body(image(PNG), stream=True))
    assert response.status_code == 200
    assert '"finish_reason":"abort"' in response.text


async def test_text_only_requests_keep_vllms_own_answer() -> None:
    engine, encoders = Engine(), FakeEncoders([E0])
    engine.stopping = True
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    response = await post(serving(engine, encoders), body)
    assert response.status_code == 200
    assert response.json() == CHAT_ABORT


async def test_a_server_that_does_not_shut_down_answers_as_before() -> None:
    engine, encoders = Engine(), FakeEncoders([E0, E1])
    for _ in range(3):
        response = await post(serving(engine, encoders), chat_body(image(PNG)))
        assert response.status_code == 200
        assert response.json() == CHAT_DONE


# What the middleware reads of vLLM's engine client ------------------------------------------------------


def state_with(core: object = None, errored: object = False) -> SimpleNamespace:
    client = SimpleNamespace(engine_core=core, errored=errored)
    return SimpleNamespace(engine_client=client)


def stopping_of(state: object) -> bool:
    return Host(engine_stopping=_engine_client_stopping(state)).shutting_down()


def test_the_engine_is_read_as_stopping_once_its_shutdown_detached_the_core_clients_finalizer() -> None:
    alive = SimpleNamespace(_finalizer=SimpleNamespace(alive=True))
    detached = SimpleNamespace(_finalizer=SimpleNamespace(alive=False))
    assert stopping_of(state_with(alive)) is False
    assert stopping_of(state_with(detached)) is True


def test_an_engine_gone_or_an_engine_client_without_a_finalizer_is_read_by_errored() -> None:
    assert stopping_of(state_with(SimpleNamespace(), errored=True)) is True
    assert stopping_of(state_with(SimpleNamespace(), errored=False)) is False
    assert stopping_of(state_with(None, errored="yes")) is False  # only a real True counts


def test_no_engine_client_or_one_that_raises_is_never_read_as_stopping() -> None:
    assert stopping_of(SimpleNamespace()) is False

    class Broken:
        @property
        def errored(self) -> bool:
            raise RuntimeError("engine client torn down")

    assert stopping_of(SimpleNamespace(engine_client=Broken())) is False


# Which answers are aborts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("answer", "aborted"),
    [
        (CHAT_ABORT, True),
        (CHAT_DONE, False),
        ({"choices": [{"finish_reason": "abort", "message": {"content": "half a sent"}}]}, False),
        ({"choices": [{"finish_reason": "abort", "text": ""}]}, True),  # /v1/completions' shape
        ({"choices": []}, False),
        ({"choices": [CHAT_ABORT["choices"][0], CHAT_DONE["choices"][0]]}, False),
        ({"error": {"message": "x"}}, False),
        ({"choices": "abort"}, False),
    ],
)
def test_a_chat_answer_is_an_abort_only_when_every_choice_was_aborted_with_nothing_said(
    answer: dict[str, Any], aborted: bool
) -> None:
    assert choices_aborted(answer) is aborted


def test_messages_and_responses_aborts_are_told_from_answers() -> None:
    assert anthropic_messages.aborted(MESSAGES_ABORT)
    assert not anthropic_messages.aborted({**MESSAGES_ABORT, "stop_reason": "end_turn"})
    assert not anthropic_messages.aborted({**MESSAGES_ABORT, "content": [{"type": "text", "text": "a"}]})
    assert openai_responses.aborted(RESPONSES_ABORT)
    assert openai_responses.aborted({"object": "response", "status": "cancelled", "output": [{"x": 1}]})
    assert not openai_responses.aborted({"object": "response", "status": "incomplete", "output": [{"x": 1}]})
    assert not openai_responses.aborted({"object": "response", "status": "completed", "output": []})


async def test_the_watch_holds_only_json_answers_begun_while_stopping_and_passes_the_rest_whole() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    stopping = [False]
    host = Host(engine_stopping=lambda: stopping[0])
    start = {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"application/json")],
    }
    body = json.dumps(CHAT_ABORT).encode()

    watch = AbortWatch(send, host, choices_aborted)
    await watch.send(start)
    await watch.send({"type": "http.response.body", "body": body})
    assert not watch.aborted
    assert len(sent) == 2

    stopping[0] = True
    sent.clear()
    watch = AbortWatch(send, host, choices_aborted)
    await watch.send(start)
    await watch.send({"type": "http.response.body", "body": body[:10], "more_body": True})
    assert sent == []
    await watch.send({"type": "http.response.body", "body": body[10:]})
    assert watch.aborted
    assert sent == []

    done = json.dumps(CHAT_DONE).encode()
    watch = AbortWatch(send, host, choices_aborted)
    await watch.send(start)
    await watch.send({"type": "http.response.body", "body": done})
    assert not watch.aborted
    assert [m.get("body") for m in sent] == [None, done]

    sent.clear()
    watch = AbortWatch(send, host, choices_aborted)
    await watch.send({**start, "status": 400})
    await watch.send({"type": "http.response.body", "body": body})
    assert not watch.aborted
    assert len(sent) == 2


# An encoder shutting down ------------------------------------------------------------------------------


async def test_an_encoder_shutting_down_costs_no_request_its_abort_is_run_on_another_encoder() -> None:
    """A draining encoder's engine aborts what reaches it: the call goes to another encoder, and the item
    reaches the engine encoded, not raw (where a Mooncake consumer could not encode it)."""
    engine, encoders = Engine(), FakeEncoders([E0, E1], mode={E0: "abort"})
    app = serving(engine, encoders)
    stack = app.build_middleware_stack()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=stack), base_url="http://pd") as client:
        response = await client.post("/v1/chat/completions", json=chat_body(image(PNG)))
    assert response.status_code == 200
    assert response.json() == CHAT_DONE
    assert [call.encoder for call in encoders.calls] == [E0, E1]
    [sent] = engine.received
    assert sent["ec_transfer_params"]
    assert "image_url" not in json.dumps(sent["messages"])
    layer: Any = stack
    while not isinstance(layer, EPDMiddleware):
        layer = layer.app
    assert layer.pipeline.counters["encoder_calls_stopping"] == 1


async def test_every_encoder_shutting_down_is_a_503_with_retry_after() -> None:
    engine, encoders = Engine(), FakeEncoders([E0, E1], mode={E0: "abort", E1: "abort"})
    response = await post(serving(engine, encoders), chat_body(image(PNG)))
    assert response.status_code == 503
    assert "retry-after" in response.headers
    assert "shutting down" in response.json()["error"]["message"]
    assert engine.received == []
