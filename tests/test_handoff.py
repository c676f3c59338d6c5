"""What the engine is handed (issue 29, items 2, 3 and 6), on asyncio and trio with fakes: never raw media
a Mooncake consumer would wait for, never a client reference that vanished while the request was
prepared, never a client's own transfer parameters. Each test failed on the code before.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from epd_middleware import EPDMiddleware, Host
from epd_middleware.host import MooncakeConsumers

from .fakes import FakeEncoders, FakeEngine, build_app, chat_body, image
from .test_hostile_clients import inside_vllm, post, reference, stored
from .test_middleware import E0, E1, png

pytestmark = pytest.mark.anyio

PUSH_TO = "tcp://127.0.0.1:15000"


def mooncake_consumer(*, policy: str = "local", wait: float = 10.0) -> Host:
    """A PD whose EC connector is ECMooncakeConnector as consumer: its engine encodes nothing itself."""
    return Host(
        inside_vllm=True,
        ec_connector="ECMooncakeConnector",
        ec_role="ec_consumer",
        ec_consumer=True,
        model_runner="v1",
        push_wait_s=wait,
        push=MooncakeConsumers({0: PUSH_TO}, pin=False),
        on_encoder_failure=policy,
    )


# --- item 2: media left raw on a Mooncake consumer ------------------------------------------------------


@pytest.mark.parametrize("mode", ["refuse", "500", "hang"])
async def test_on_a_mooncake_consumer_media_no_encoder_took_is_an_error_at_once(mode: str) -> None:
    """Before, under on_encoder_failure=local: the media went to the engine raw, which waited the whole
    push wait (60 s by default) for a push nobody asked for and answered a bare 500."""
    encoders, engine = FakeEncoders([E0, E1], mode={E0: mode, E1: mode}), FakeEngine()
    app, _ = build_app(
        encoders, engine, host=mooncake_consumer(), on_encoder_failure="local", encoder_timeout=0.2
    )
    with anyio.fail_after(5):
        response = await post(app, chat_body(image(png(1))))
    assert response.status_code in (502, 504)
    assert response.json()["error"]["message"].startswith("an encoder failed: ")
    assert engine.received == []


async def test_on_a_mooncake_consumer_with_every_encoder_ejected_the_client_gets_503_at_once() -> None:
    encoders, engine = FakeEncoders([E0], mode={E0: "refuse"}), FakeEngine()
    app, _ = build_app(encoders, engine, host=mooncake_consumer(), on_encoder_failure="local", eject_after=1)
    middleware = app.build_middleware_stack()
    assert (await post(middleware, chat_body(image(png(1))))).status_code == 502  # ejects it
    response = await post(middleware, chat_body(image(png(2))))
    assert response.status_code == 503
    assert "every encoder is failing" in response.json()["error"]["message"]
    assert engine.received == []


async def test_on_a_mooncake_consumer_media_with_no_encoder_named_is_a_503() -> None:
    """llm-d mode: a request the scheduler named no encoder for. Before: raw to the engine, 500 after
    the push wait."""
    engine = FakeEngine()
    app = engine.app()
    app.add_middleware(
        EPDMiddleware,
        scheduler="llm-d",
        scheduler_allow=["127.0.0.0/8"],
        host=mooncake_consumer(policy="error"),
        health_check_interval=0,
    )
    response = await post(app, chat_body(image(png(1))))
    assert response.status_code == 503
    message = response.json()["error"]["message"]
    assert "no encoder is configured or named for this request" in message
    assert "ECMooncakeConnector consumer" in message
    assert engine.received == []


async def test_a_server_that_can_encode_still_leaves_media_to_its_engine_under_the_local_policy() -> None:
    encoders, engine = FakeEncoders([E0], mode={E0: "refuse"}), FakeEngine()
    app, _ = build_app(encoders, engine, on_encoder_failure="local")
    assert (await post(app, chat_body(image(png(1))))).status_code == 200
    assert engine.received[0].json["messages"][0]["content"][1]["type"] == "image_url"


async def test_the_local_policy_on_a_mooncake_consumer_is_a_known_problem_said_at_start_and_on_status(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from types import SimpleNamespace

    from epd_middleware import EPDConfig

    ec = SimpleNamespace(
        ec_connector="ECMooncakeConnector",
        ec_role="ec_consumer",
        is_ec_consumer=True,
        ec_ip="127.0.0.1",
        ec_port=15000,
        ec_connector_extra_config={"push_wait_timeout_s": 10},
    )
    vllm_config = SimpleNamespace(ec_transfer_config=ec, use_v2_model_runner=True)
    config = EPDConfig(encoders=[E0], on_encoder_failure="local", health_check_interval=0)
    host = Host.of_vllm(vllm_config, None, config)
    [problem] = host.known_problems
    assert problem.startswith("on_encoder_failure=local cannot work here")
    assert "waits for a push of every image" in problem
    assert "on_encoder_failure=local cannot work here" in caplog.text  # logged once, at start
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, host=host, on_encoder_failure="local")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        page = (await client.get("http://pd/epd/status")).json()
    assert page["known_problems"] == [problem]
    error_policy = Host.of_vllm(vllm_config, None, EPDConfig(encoders=[E0], health_check_interval=0))
    assert error_policy.known_problems == []


@pytest.mark.parametrize("broken", [[E0], [E0, E1]])
async def test_on_a_mooncake_consumer_an_item_an_encoder_gave_no_handle_for_is_its_bad_answer(
    broken: list[str],
) -> None:
    """Elsewhere such an item stays raw for the engine; here the engine would wait for its push. Before:
    raw to the engine, 500 after the push wait."""
    encoders, engine = FakeEncoders([E0, E1], mode=dict.fromkeys(broken, "no_entries")), FakeEngine()
    app, _ = build_app(encoders, engine, host=mooncake_consumer(policy="local"))
    response = await post(app, chat_body(image(png(1))))
    if len(broken) == 2:
        assert response.status_code == 502
        assert "no handle" in response.json()["error"]["message"]
        assert engine.received == []
    else:
        assert response.status_code == 200
        [part] = [p for p in engine.received[0].json["messages"][0]["content"] if p["type"] != "text"]
        assert part["type"] == "image_embeds"


# --- item 3: a client reference checked again at hand-off ---------------------------------------------


async def test_a_client_reference_removed_while_a_sibling_call_runs_never_reaches_the_engine(
    tmp_path: Path,
) -> None:
    """Before: checked once, before the encoder calls; a cleanup during a slow call removed it, the
    engine got the reference and its core died."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, tmp_path)
    identifier = "a" * 64
    stored(tmp_path, identifier)
    encoders.pause = 0.3
    encoders.started = anyio.Event()
    body = chat_body(reference(identifier), image(png(1)))
    result: dict[str, httpx.Response] = {}

    async def send() -> None:
        result["response"] = await post(app, body)

    async with anyio.create_task_group() as group:
        group.start_soon(send)
        await encoders.started.wait()
        shutil.rmtree(tmp_path / identifier)  # a cleanup, while the image's encoder call runs
    response = result["response"]
    assert response.status_code == 400
    error = response.json()["error"]
    assert "no longer has" in error["message"]
    assert "messages[0].content[1]" in error["message"]
    assert engine.received == []


async def test_a_client_reference_still_there_at_hand_off_goes_to_the_engine(tmp_path: Path) -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, tmp_path)
    identifier = "b" * 64
    stored(tmp_path, identifier)
    assert (await post(app, chat_body(reference(identifier), image(png(1))))).status_code == 200
    assert len(engine.received) == 1


# --- item 6: nothing of the client's transfer parameters steers a transfer ----------------------------


async def test_a_clients_push_address_never_reaches_a_mooncake_engine() -> None:
    """Before: the handles replaced only ``ec_items``; the client's ``consumer_zmq`` reached the engine,
    and an ec_both PD pushes embeddings to the address its request names."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app, _ = build_app(encoders, engine, host=mooncake_consumer(policy="error"))
    forged = {"consumer_zmq": "tcp://203.0.113.9:5555", "ec_items": [{"transfer_id": "x"}], "h": {"m": 1}}
    assert (await post(app, chat_body(image(png(1)), ec_transfer_params=forged))).status_code == 200
    params = engine.received[0].json["ec_transfer_params"]
    assert "consumer_zmq" not in params
    assert "h" not in params
    sent = encoders.calls[0].body["ec_transfer_params"]
    assert sent["consumer_zmq"] == PUSH_TO  # the encoder pushes here, to this server's own address
    assert [item["transfer_id"] for item in params["ec_items"]] == [
        item["transfer_id"] for item in sent["ec_items"]
    ]


async def test_a_clients_transfer_parameters_are_dropped_where_nothing_is_encoded(tmp_path: Path) -> None:
    """A request of references only: the engine gets no ec_transfer_params of the client's either."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, tmp_path)
    identifier = "c" * 64
    stored(tmp_path, identifier)
    body = chat_body(reference(identifier), ec_transfer_params={"consumer_zmq": "tcp://203.0.113.9:1"})
    assert (await post(app, body)).status_code == 200
    assert "ec_transfer_params" not in engine.received[0].json


# --- item 2, every other path: media on routes the middleware does not intercept -----------------------


def guarded_app(engine: FakeEngine, **options: Any) -> Any:
    from .test_hostile_clients import recording_route

    app = engine.app()
    for path in ("/v1/embeddings", "/v1/audio/transcriptions", "/v2/embed", "/pooling"):
        app.router.routes.append(recording_route(engine, path))
    app.add_middleware(
        EPDMiddleware, encoders=[E0], host=mooncake_consumer(), health_check_interval=0, **options
    )
    return app


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/embeddings", {"model": "m", "messages": [{"role": "user", "content": [image(png(1))]}]}),
        ("/v2/embed", {"model": "m", "images": ["data:image/png;base64,AAAA"], "input_type": "image"}),
        (
            "/pooling",
            {
                "model": "m",
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
                        ],
                    }
                ],
            },
        ),
        # Escaped, and the scheme in another case: vLLM reads both.
        ("/v1/embeddings", b'{"model": "m", "input": [{"\\u0069mage_url": {"url": "x"}}]}'),
        ("/pooling", {"model": "m", "x": [{"y": "DaTa:image/png;base64,AAAA"}]}),
    ],
)
async def test_on_a_mooncake_consumer_media_on_a_route_not_intercepted_is_refused_at_once(
    path: str, body: Any
) -> None:
    """Before: passed to the engine, which waited the whole push wait for a push nobody asked for."""
    engine = FakeEngine()
    response = await post(guarded_app(engine), body, path)
    assert response.status_code == 501
    assert "cannot take media on this server" in response.json()["error"]["message"]
    assert engine.received == []


async def test_on_a_mooncake_consumer_an_audio_upload_for_transcription_is_refused() -> None:
    engine = FakeEngine()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded_app(engine))) as client:
        response = await client.post(
            "http://pd/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF....", "audio/wav")}
        )
    assert response.status_code == 501
    assert engine.received == []


async def test_text_on_those_routes_and_media_elsewhere_pass_untouched() -> None:
    engine = FakeEngine()
    app = guarded_app(engine)
    text = b'{"model": "m", "input": ["a sentence about data: and images"]}'
    assert (await post(app, text, "/v1/embeddings")).status_code == 200
    assert engine.received[-1].body == text
    # A server that can encode (ECExampleConnector) takes media there as vLLM does.
    plain = FakeEngine()
    other = plain.app()
    from .test_hostile_clients import recording_route

    other.router.routes.append(recording_route(plain, "/v1/embeddings"))
    other.add_middleware(EPDMiddleware, encoders=[E0], health_check_interval=0)
    media = {"model": "m", "messages": [{"role": "user", "content": [image(png(1))]}]}
    assert (await post(other, media, "/v1/embeddings")).status_code == 200


async def test_a_client_vllm_would_refuse_is_not_read_here() -> None:
    """vLLM's key check answers first: the body of an unauthorised client is not read by the guard."""
    engine = FakeEngine()
    host_with_key = dataclasses.replace(mooncake_consumer(), api_keys=("k",))
    from .test_hostile_clients import recording_route

    app = engine.app()
    app.router.routes.append(recording_route(engine, "/v1/embeddings"))
    app.add_middleware(EPDMiddleware, encoders=[E0], host=host_with_key, health_check_interval=0)
    media = {"model": "m", "messages": [{"role": "user", "content": [image(png(1))]}]}
    assert (await post(app, media, "/v1/embeddings")).status_code == 200  # the app's to refuse
    refused = await post(app, media, "/v1/embeddings", authorization="Bearer k")
    assert refused.status_code == 501


async def test_an_embedding_handed_to_the_engine_counts_as_used_now(tmp_path: Path) -> None:
    """The cleanup CronJob deletes embeddings by age: the age of one the engine is about to load, reused
    or referenced, starts again at the last check before the engine, or an image in constant use would be
    deleted under a queued request every EC_MAX_AGE_MINUTES (issue 31, point 4)."""
    import os

    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = inside_vllm(encoders, engine, tmp_path)
    body = chat_body(image(png(1)))
    assert (await post(app, body)).status_code == 200
    uuid = encoders.calls[0].body["messages"][0]["content"][0]["uuid"]  # the hash: no options
    stored_file = tmp_path / uuid / "encoder_cache.safetensors"
    os.utime(stored_file, (1_000_000, 1_000_000))  # written long ago
    assert (await post(app, body)).status_code == 200  # reused: no new encoder call
    assert len(encoders.calls) == 1
    assert stored_file.stat().st_mtime > 1_000_000

    identifier = "d" * 64
    stored(tmp_path, identifier)
    referenced = tmp_path / identifier / "encoder_cache.safetensors"
    os.utime(referenced, (1_000_000, 1_000_000))
    assert (await post(app, chat_body(reference(identifier)))).status_code == 200
    assert referenced.stat().st_mtime > 1_000_000
