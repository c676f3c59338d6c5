"""What a broken or hostile encoder can answer, and what the request gets (issue 20), on asyncio and trio:
statuses Python does not name, answers nested past any stack, hashes the engine will never look up,
and, in llm-d mode, how many metric series a stream of named targets can make. Each failed before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from prometheus_client import REGISTRY

from epd_middleware import EPDMiddleware
from epd_middleware._identifiers import hash_kwargs
from epd_middleware._pool import OTHER_SERVERS

from .fakes import FakeEncoders, FakeEngine, app_with_encoder_handler, chat_body, image, models_answer
from .test_hostile_clients import MODEL_PATH, inside_vllm, post, vllm_state
from .test_middleware import E0, E1, media_parts, png

pytestmark = pytest.mark.anyio

DEEP = b"[" * 100_000 + b"]" * 100_000


def first_uuid(request: httpx.Request) -> str:
    uuid: str = json.loads(request.content)["messages"][0]["content"][0]["uuid"]
    return uuid


def good(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"ec_transfer_params": {first_uuid(request): {"metadata": {"g": [1]}}}})


@pytest.mark.parametrize("status", [419, 420, 440, 460, 463, 499])
async def test_a_status_python_does_not_name_reaches_the_client_named_by_its_class(status: int) -> None:
    """Before: HTTPStatus(419) raised inside the error's own type: a 500 and a traceback."""
    app, engine = app_with_encoder_handler(
        lambda request: httpx.Response(status, json={"error": {"message": "odd"}}), encoders=[E0]
    )
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == status
    assert response.json()["error"]["type"] == "ClientError"
    assert engine.received == []


@pytest.mark.parametrize("status", [200, 500])
async def test_an_answer_nested_past_the_stack_is_a_failed_try_of_that_encoder(status: int) -> None:
    """Before: msgspec's RecursionError escaped the call: a 500, and no failover."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "enc-0":
            return httpx.Response(status, content=DEEP)
        return good(request)

    app, engine = app_with_encoder_handler(handler, encoders=[E0, E1], check_models=False)
    for seed in range(2):  # round-robin: one call starts on each encoder
        assert (await post(app, chat_body(image(png(seed))))).status_code == 200
    assert len(engine.received) == 2


async def test_deep_metadata_that_decodes_but_could_not_be_written_again_is_a_bad_reply() -> None:
    """Before: the engine body then could not be encoded, and the client's body went on unread."""
    deep: Any = []
    for _ in range(200):
        deep = [deep]

    def handler(request: httpx.Request) -> httpx.Response:
        entry = {"metadata": {"g": deep}} if request.url.host == "enc-0" else {"metadata": {"g": [1]}}
        return httpx.Response(200, json={"ec_transfer_params": {first_uuid(request): entry}})

    app, engine = app_with_encoder_handler(handler, encoders=[E0, E1], check_models=False)
    for seed in range(2):
        assert (await post(app, chat_body(image(png(seed))))).status_code == 200
    for record in engine.received:
        assert media_parts(record.json)[0]["image_embeds"] == {"g": [1]}


async def test_a_deep_model_list_neither_fails_a_call_nor_the_start_up() -> None:
    """Before: the same answer to GET /v1/models gave a 500, and at start-up failed the whole lifespan."""

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            if request.url.host == "enc-0":
                return httpx.Response(200, content=DEEP)
            return httpx.Response(200, json=models_answer(["tiny-qwen2-vl"]))
        return good(request)

    engine = FakeEngine()
    middleware = EPDMiddleware(
        engine.app(),
        encoders=[E0, E1],
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(handler)),
        expected_model="tiny-qwen2-vl",
        health_check_interval=0,
    )
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if not messages:
            await anyio.sleep_forever()
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with anyio.fail_after(10):
        await middleware({"type": "lifespan"}, receive, send)
    assert [message["type"] for message in sent] == [
        "lifespan.startup.complete",
        "lifespan.shutdown.complete",
    ]
    assert (await post(middleware, chat_body(image(png(1))))).status_code == 200


# --- hashes the engine will never look up ----------------------------------------------------------


async def test_an_encoder_hash_other_than_the_engines_identifier_is_refused_even_if_stored(
    tmp_path: Path,
) -> None:
    """Before: a hash that existed in storage passed, whatever the engine would derive: a reference to
    an embedding the engine then looked for under another name (and died on)."""
    lying, honest = E0, E1
    options = {"mm_processor_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 50176}}}

    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(str(request.url.host))
        uuid = first_uuid(request)
        # The liar reports the plain uuid (as an encoder run without the options would); it is stored.
        name = (
            uuid
            if request.url.host == "enc-0"
            else hash_kwargs("blake3", model_id=MODEL_PATH, image=uuid, **options)
        )
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "encoder_cache.safetensors").write_bytes(b"x")
        return httpx.Response(200, json={"ec_transfer_params": {name: {"metadata": {"g": [1]}}}})

    app, engine = app_with_encoder_handler(
        handler, encoders=[lying, honest], eject_after=100, check_models=False, health_check_interval=0
    )
    for name, value in vars(vllm_state(tmp_path)).items():
        setattr(app.state, name, value)
    statuses = [(await post(app, chat_body(image(png(seed)), **options))).status_code for seed in range(2)]
    assert statuses == [200, 200]
    assert asked.count("enc-0") >= 1  # the liar was asked, and its answer refused (failed over)
    for record in engine.received:
        [part] = media_parts(record.json)
        identifier = hash_kwargs("blake3", model_id=MODEL_PATH, image=part["uuid"], **options)
        assert list(record.json["ec_transfer_params"]) == [identifier]


async def test_an_item_whose_identifier_cannot_be_derived_inside_vllm_stays_raw(tmp_path: Path) -> None:
    """A request naming a video decoder backend: vLLM may edit it before hashing, so the middleware
    cannot name the identifier and sends the video as it came, with its handle (the engine loads the
    embedding when it finds it under its own identifier, and encodes the video otherwise)."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, tmp_path)
    video = {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}
    options = {"media_io_kwargs": {"video": {"backend": "opencv"}}}
    assert (await post(app, chat_body(video, image(png(1)), **options))).status_code == 200
    parts = media_parts(engine.received[0].json)
    assert [part["type"] for part in parts] == ["video_url", "image_embeds"]


# --- metric series of servers outside the pool (item 8) --------------------------------------------


def series(name: str, label: str) -> set[str]:
    return {
        sample.labels[label]
        for metric in REGISTRY.collect()
        for sample in metric.samples
        if sample.name.startswith(name) and label in sample.labels
    }


async def test_targets_a_client_names_share_one_metric_label() -> None:
    """Before: every distinct target a header named kept its own series for ever (1,088 targets, ~5.5 KB
    each), while the pool's table of strangers stayed bounded."""
    engine = FakeEngine()
    app = engine.app()
    app.add_middleware(
        EPDMiddleware,
        scheduler="llm-d",
        scheduler_allow=["127.0.0.0/8:8000"],
        http_client=httpx.AsyncClient(transport=httpx.MockTransport(good)),
        health_check_interval=0,
        check_models=False,
    )
    before = series("epd_encoder_call_duration_seconds", "encoder")
    for index in range(60):
        target = f"127.1.{index // 200}.{index % 200 + 1}:8000"
        response = await post(app, chat_body(image(png(index))), **{"x-encoder-hosts-ports": target})
        assert response.status_code == 200
    added = series("epd_encoder_call_duration_seconds", "encoder") - before
    assert added <= {OTHER_SERVERS}
    assert not any(label.startswith("http://127.1.") for label in series("epd_encoder_in_flight", "encoder"))
    stack = app.middleware_stack
    while not isinstance(stack, EPDMiddleware):
        stack = stack.app  # type: ignore[union-attr]
    assert len(stack.pipeline.stats._children) < 10


async def test_tower_adapters_keep_every_item_raw(tmp_path: Path) -> None:
    """With LoRA on the vision tower vLLM identifies an adapter's items as "<adapter>:<hash>": which
    adapter a request runs under is the engine's to say, so nothing is made a reference."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(
        encoders, engine, tmp_path, lora=type("Lora", (), {"enable_tower_connector_lora": True})()
    )
    assert (await post(app, chat_body(image(png(1))))).status_code == 200
    [part] = media_parts(engine.received[0].json)
    assert part["type"] == "image_url"


async def test_a_huge_hash_from_an_encoder_is_cut_short_in_the_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"ec_transfer_params": {"x" * 5_000_000: {"item_indices": [7]}}})

    app, _ = app_with_encoder_handler(handler, encoders=[E0], check_models=False)
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == 502
    assert len(response.content) < 2_000
