"""Placement (issue 30): where each modality of a request is encoded, here or on an encoder, by the
``placement`` option and, under ``adaptive``, by the request's size, PD's own load and the encoders'.
Below the ASGI layer against a pool and a Host, then through the middleware with fake encoders."""

from __future__ import annotations

import base64
import json
import struct
import zlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from epd_middleware import EPDMiddleware, Host
from epd_middleware._placement import Placement, PlacementPolicy, item_tokens, vision_tokens
from epd_middleware._plan import MediaItem
from epd_middleware._pool import PoolPolicy, ServerPool
from epd_middleware._probes import probe
from epd_middleware.host import MooncakeConsumers
from epd_middleware.transport import HttpxTransport

from .fakes import FakeEncoders, FakeEngine, audio, chat_body
from .test_middleware import E0, E1, media_parts, png, post

pytestmark = pytest.mark.anyio


def png_of(width: int, height: int) -> str:
    """A data URL of a PNG whose header says ``width`` x ``height`` (its pixels are never read here)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    head = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    data = b"\x89PNG\r\n\x1a\n" + head + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(data).decode()


def picture(width: int, height: int) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": png_of(width, height)}}


# --- the size of a request --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("width", "height", "tokens"),
    # placement-costs.md's Qwen2.5-VL figures (HF smart_resize, factor 28).
    [(448, 448, 256), (1280, 720, 1196), (1024, 1024, 1369), (1920, 1080, 2691), (10, 10, 4)],
)
def test_vision_tokens_follow_qwen2_vls_resize(width: int, height: int, tokens: int) -> None:
    assert vision_tokens(width, height, 28, 56 * 56, 28 * 28 * 16384) == tokens


def test_a_requests_pixel_bounds_change_its_tokens() -> None:
    class Part:
        modality = "image"
        url = png_of(1920, 1080)

    fields = {"mm_processor_kwargs": {"max_pixels": 256 * 28 * 28}}
    assert item_tokens([Part()], ["u"], fields, Host()) == {("image", "u"): 252}  # type: ignore[list-item]
    assert item_tokens([Part()], ["u"], {}, Host()) == {("image", "u"): 2691}  # type: ignore[list-item]
    # The server's own processor bounds (the lab's tiny model: max_pixels 200704): the seed image's 234.
    tiny = Host(image_pixel_bounds=(3136, 200704))
    Part.url = png_of(800, 600)
    assert item_tokens([Part()], ["u"], {}, tiny) == {("image", "u"): 234}  # type: ignore[list-item]


def test_the_host_reads_the_models_patch_grid_and_pixel_bounds(tmp_path: Path) -> None:
    from types import SimpleNamespace

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 200704}))
    vision = SimpleNamespace(patch_size=16, spatial_merge_size=2)
    model_config = SimpleNamespace(model=str(tmp_path), hf_config=SimpleNamespace(vision_config=vision))
    host = Host.of_vllm(SimpleNamespace(model_config=model_config))
    assert (host.vision_token_side, host.image_pixel_bounds) == (32, (3136, 200704))
    assert Host.of_vllm(SimpleNamespace()).image_pixel_bounds == (3136, 28 * 28 * 16384)


# --- the decision, below the ASGI layer ----------------------------------------------------------------


def placement(mode: str, **thresholds: Any) -> tuple[Placement, ServerPool]:
    pool = ServerPool("encoder", PoolPolicy(5.0))
    pool.set_members([E0, E1])
    thresholds.setdefault("small_tokens", 300)
    thresholds.setdefault("pd_idle_load", 0)  # the other rules, below; idleness has its own test
    return Placement(PlacementPolicy(mode=mode, **thresholds), pool, pool.stats), pool


IMAGE, AUDIO = MediaItem("i", "image", {}), MediaItem("a", "audio", {})


def idle_host(load: int = 0) -> Host:
    return Host(engine_load=lambda: load)


def test_the_host_reads_the_engines_load_backlog_and_step_from_vllms_state() -> None:
    """vLLM's engine client (``AsyncLLM.get_num_unfinished_requests``, ``get_num_queued_tokens``) and
    ``scheduler_config.max_num_batched_tokens``; a count the client cannot give is not known."""
    from types import SimpleNamespace

    client = SimpleNamespace(get_num_unfinished_requests=lambda: 3, get_num_queued_tokens=lambda: 5000)
    state = SimpleNamespace(
        vllm_config=SimpleNamespace(scheduler_config=SimpleNamespace(max_num_batched_tokens=8192)),
        engine_client=client,
    )
    host = Host.from_state(state)
    assert host is not None
    assert (host.unfinished_requests(), host.queued_tokens(), host.step_tokens) == (3, 5000, 8192)

    def broken() -> int:
        raise RuntimeError("engine dead")

    older = SimpleNamespace(vllm_config=SimpleNamespace(), engine_client=SimpleNamespace())
    host = Host.from_state(older)
    assert host is not None
    assert (host.unfinished_requests(), host.queued_tokens(), host.step_tokens) == (None, None, None)
    assert Host(engine_queued_tokens=broken).queued_tokens() is None


def test_remote_and_local_are_fixed_whatever_the_signals() -> None:
    remote, _ = placement("remote")
    assert remote.decide([IMAGE], {("image", "i"): 4}, idle_host(), [E0]).local == frozenset()
    local, _ = placement("local")
    decision = local.decide([IMAGE, AUDIO], {}, idle_host(99), [E0])
    assert decision.local == {"image", "audio"}
    assert decision.why == {"image": ("local", "policy"), "audio": ("local", "policy")}


@pytest.mark.parametrize("mode", ["local", "adaptive"])
def test_a_mooncake_consumer_never_encodes_locally(mode: str) -> None:
    """Its engine waits for a push of every item (mooncake/scheduler.py ensure_cache_available)."""
    decide, _ = placement(mode)
    host = Host(
        ec_connector="ECMooncakeConnector",
        ec_consumer=True,
        push=MooncakeConsumers({0: "tcp://127.0.0.1:1"}, pin=False),
        engine_load=lambda: 0,
    )
    decision = decide.decide([IMAGE], {("image", "i"): 4}, host, [E0])
    assert decision.local == frozenset()
    assert decision.why["image"] == ("remote", "pd_cannot_encode")


def test_adaptive_keeps_small_items_here_while_pd_has_headroom() -> None:
    decide, _ = placement("adaptive", small_tokens=300, pd_max_load=4)
    small, large = {("image", "i"): 256}, {("image", "i"): 1369}
    assert decide.decide([IMAGE], small, idle_host(3), [E0]).why["image"] == ("local", "small")
    assert decide.decide([IMAGE], large, idle_host(0), [E0]).why["image"] == ("remote", "large")
    assert decide.decide([IMAGE], small, idle_host(4), [E0]).why["image"] == ("remote", "pd_busy")
    assert decide.decide([IMAGE], {("image", "i"): None}, idle_host(), [E0]).why["image"] == (
        "remote",
        "size_unknown",
    )
    assert decide.decide([IMAGE], small, Host(), [E0]).why["image"] == ("remote", "pd_load_unknown")
    # Items of a modality add up: four small images are not small.
    four = [MediaItem(str(n), "image", {}) for n in range(4)]
    sizes = {("image", str(n)): 256 for n in range(4)}
    assert decide.decide(four, sizes, idle_host(), [E0]).why["image"] == ("remote", "large")


@pytest.mark.parametrize("signal", ["latency", "in_flight", "server_load"])
def test_adaptive_encodes_here_when_every_encoder_it_would_use_is_saturated(signal: str) -> None:
    decide, pool = placement("adaptive", small_tokens=0, encoder_slowdown=3.0, encoder_busy_calls=2)
    for url in (E0, E1):
        pool.record_latency(url, 0.010, 256)
    big = {("image", "i"): 5000}
    assert decide.decide([IMAGE], big, idle_host(), [E0, E1]).why["image"] == ("remote", "large")

    def saturate(url: str) -> None:
        health = pool.record(url)
        if signal == "latency":
            for _ in range(20):
                pool.record_latency(url, 0.100, 256)
        elif signal == "in_flight":
            health.capacity.in_flight = 2  # two calls from this process under way
        else:
            health.server_load = 5

    saturate(E0)  # one saturated, the other free: remote
    assert decide.decide([IMAGE], big, idle_host(), [E0, E1]).local == frozenset()
    saturate(E1)
    assert decide.decide([IMAGE], big, idle_host(), [E0, E1]).why["image"] == ("local", "encoders_saturated")
    # ... unless PD itself is busy.
    assert decide.decide([IMAGE], big, idle_host(9), [E0, E1]).why["image"] == ("remote", "pd_busy")


def test_an_idle_pd_encodes_everything_here_whatever_its_size() -> None:
    """No request is decoding for a local encode to hold up; the request saves the remote path's fixed
    cost (the encoder's round trip, the step that loads its embedding)."""
    decide, pool = placement("adaptive", pd_idle_load=1, small_tokens=0)
    sizes = {("image", "i"): 5000, ("audio", "a"): None}
    decision = decide.decide([IMAGE, AUDIO], sizes, idle_host(0), [E0])
    assert decision.why == {"image": ("local", "pd_idle"), "audio": ("local", "pd_idle")}
    assert decide.decide([IMAGE], sizes, idle_host(1), [E0]).why["image"] == ("remote", "large")
    assert decide.decide([IMAGE], sizes, Host(), [E0]).why["image"] == ("remote", "pd_load_unknown")
    never, _ = placement("adaptive", pd_idle_load=0, small_tokens=0)
    assert never.decide([IMAGE], sizes, idle_host(0), [E0]).why["image"] == ("remote", "large")
    assert pool.stats.counters["placement_local_pd_idle"] == 2


def test_a_large_call_is_never_taken_for_a_slow_small_one() -> None:
    """Latency compares within a size class (the vision tokens by powers of two): an idle encoder serving
    small and large images in turn is not saturated, one whose calls of each size take 4x their fastest
    is."""
    decide, pool = placement("adaptive", small_tokens=0, encoder_slowdown=3.0)
    big = {("image", "i"): 5000}
    for size, seconds in ((256, 0.040), (4 * 1296, 0.142)):  # a 448x448 image, then four larger ones:
        for _ in range(20):  # 3.5x the small call, and as fast as ever
            pool.record_latency(E0, seconds, size)
    assert not decide.saturated([E0])
    assert decide.decide([IMAGE], big, idle_host(1), [E0]).why["image"] == ("remote", "large")
    for _ in range(20):
        pool.record_latency(E0, 0.160, 256)
        pool.record_latency(E0, 0.570, 4 * 1296)
    assert decide.saturated([E0])
    assert decide.decide([IMAGE], big, idle_host(1), [E0]).why["image"] == ("local", "encoders_saturated")


def test_a_pd_with_more_prompt_to_prefill_than_one_step_has_no_headroom() -> None:
    """Work placed here would wait behind the prompts PD has yet to prefill, and its encode would hold
    them all up: with more than one engine step of them queued, even saturated encoders are the better
    wait. Where vLLM does not tell the backlog, the request count decides alone."""
    decide, pool = placement("adaptive", small_tokens=300, encoder_busy_calls=1)
    small = {("image", "i"): 256}

    def pd(queued: int | None) -> Host:
        return Host(
            engine_load=lambda: 2,
            engine_queued_tokens=None if queued is None else (lambda: queued),
            step_tokens=8192,
        )

    assert decide.decide([IMAGE], small, pd(6858), [E0]).why["image"] == ("local", "small")
    assert decide.decide([IMAGE], small, pd(10287), [E0]).why["image"] == ("remote", "pd_prefilling")
    assert decide.decide([IMAGE], small, pd(None), [E0]).why["image"] == ("local", "small")
    pool.record(E0).capacity.in_flight = 1
    big = {("image", "i"): 5000}
    assert decide.decide([IMAGE], big, pd(6858), [E0]).why["image"] == ("local", "encoders_saturated")
    assert decide.decide([IMAGE], big, pd(10287), [E0]).why["image"] == ("remote", "pd_prefilling")


def test_adaptive_decides_per_modality() -> None:
    decide, _ = placement("adaptive", small_tokens=300)
    decision = decide.decide([IMAGE, AUDIO], {("image", "i"): 256, ("audio", "a"): None}, idle_host(), [E0])
    assert decision.local == {"image"}
    assert decision.why["audio"] == ("remote", "size_unknown")


# --- through the middleware -----------------------------------------------------------------------------


def app_with(encoders: FakeEncoders, engine: FakeEngine, load: int = 1, **options: Any) -> Any:
    """The middleware over ``engine``, whose engine has ``load`` unfinished requests (1: not idle)."""
    app = engine.app()
    app.add_middleware(
        EPDMiddleware,
        encoders=encoders.urls,
        http_client=encoders.client(),
        host=Host(engine_load=lambda: load),
        health_check_interval=0,
        **options,
    )
    return app


async def test_placement_local_calls_no_encoder_and_leaves_the_media_raw() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = app_with(encoders, engine, placement="local")
    response = await post(app, chat_body(picture(448, 448), audio(png(2))))
    assert response.status_code == 200
    assert encoders.calls == []
    parts = media_parts(engine.received[0].json)
    assert [part["type"] for part in parts] == ["image_url", "input_audio"]
    assert all(part["uuid"] for part in parts)  # pinned: the engine hashes the uuid, as on encoders
    assert "ec_transfer_params" not in engine.received[0].json


async def test_adaptive_through_the_middleware_counts_logs_and_shows_its_decisions(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    prometheus_client = pytest.importorskip("prometheus_client")
    caplog.set_level(logging.INFO, "epd_middleware")
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = app_with(encoders, engine, placement="adaptive", placement_small_tokens=300)
    middleware = app.build_middleware_stack()
    assert (await post(middleware, chat_body(picture(448, 448)))).status_code == 200  # small: here
    assert (await post(middleware, chat_body(picture(1024, 1024)))).status_code == 200  # large: remote
    small, large = (media_parts(record.json)[0]["type"] for record in engine.received)
    assert (small, large) == ("image_url", "image_embeds")
    assert len(encoders.calls) == 1
    assert "image placed local (small)" in caplog.text
    assert "image placed remote (large)" in caplog.text
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=middleware)) as client:
        page = (await client.get("http://pd/epd/status")).json()["placement"]
    assert page["mode"] == "adaptive"
    assert page["pd_load"] == 1
    assert page["decisions"] == {"local_small": 1, "remote_large": 1}
    assert page["thresholds"]["small_tokens"] == 300
    assert prometheus_client.REGISTRY.get_sample_value(
        "epd_placement_total", {"where": "local", "why": "small"}
    )


async def test_a_mixed_request_encodes_one_modality_here_and_another_remotely() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = app_with(encoders, engine, placement="adaptive", placement_small_tokens=300)
    assert (await post(app, chat_body(picture(448, 448), audio(png(3))))).status_code == 200
    image_part, audio_part = media_parts(engine.received[0].json)
    assert image_part["type"] == "image_url"
    assert audio_part["type"] == "audio_embeds"
    assert [len(call.body["messages"][0]["content"]) for call in encoders.calls] == [1]


async def test_by_default_an_idle_pd_encodes_here_and_a_busy_one_on_the_encoders() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    idle = app_with(encoders, engine, load=0, placement="adaptive")
    assert (await post(idle, chat_body(picture(1024, 1024)))).status_code == 200
    assert encoders.calls == []
    busy = app_with(encoders, engine, load=1, placement="adaptive")
    assert (await post(busy, chat_body(picture(1024, 1024)))).status_code == 200
    assert len(encoders.calls) == 1
    here, there = (media_parts(record.json)[0]["type"] for record in engine.received)
    assert (here, there) == ("image_url", "image_embeds")


async def test_with_no_encoder_free_but_a_busy_pd_adaptive_stays_remote() -> None:
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = app_with(encoders, engine, load=50, placement="adaptive", placement_small_tokens=10_000)
    assert (await post(app, chat_body(picture(448, 448)))).status_code == 200
    assert media_parts(engine.received[0].json)[0]["type"] == "image_embeds"


async def test_the_probes_ask_vllms_load_only_where_it_is_tracked() -> None:
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/load":
            asked.append(str(request.url.host))
            if request.url.host == "enc-0":
                return httpx.Response(200, json={"server_load": 7})
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(200)

    pool = ServerPool("encoder", PoolPolicy(5.0))
    pool.set_members([E0, E1])
    transport = HttpxTransport(httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    for _ in range(2):
        await probe(pool, transport, {}, ask_load=True)
    assert pool.record(E0).server_load == 7
    assert pool.record(E1).server_load is None
    assert sorted(asked) == ["enc-0", "enc-0", "enc-1"]  # a server without tracking is asked once
    await probe(pool, transport, {})
    assert len(asked) == 3


def test_the_placement_option_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from epd_middleware import EPDConfig

    monkeypatch.setenv("EPD_ENCODERS", E0)
    monkeypatch.setenv("EPD_PLACEMENT", "adaptive")
    monkeypatch.setenv("EPD_PLACEMENT_SMALL_TOKENS", "512")
    config = EPDConfig.from_env()
    assert (config.placement, config.placement_small_tokens) == ("adaptive", 512)


# --- placement that cannot be gamed (issue 35, item 4) ----------------------------------------------------


async def test_an_encoders_calls_are_classed_by_their_vision_work_not_their_bytes() -> None:
    """Flat 1000 x 1000 PNGs are a few kilobytes, as small photos are. Before, a call's size class was
    its body's bytes, so their encodes counted as a slowdown of the small photos' class: 12 of them passed
    3, and every later request went local as ``encoders_saturated``. The class is the vision tokens now."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = app_with(encoders, engine, load=1, placement="adaptive", max_batch_size=1)
    assert len(png_of(56, 56)) == len(png_of(1000, 1000))  # the same bytes
    for width in (56, 1000):
        assert (await post(app, chat_body(picture(width, width)))).status_code == 200
    tokens = [vision_tokens(side, side, 28, 56 * 56, 28 * 28 * 16384) for side in (56, 1000)]
    assert tokens == [4, 1296]
    classes = sorted(_pool_of(app).record(E0).fastest)
    assert [work for work, _ in classes] == [(4).bit_length(), (1296).bit_length()]
    assert len({size for _, size in classes}) == 1  # the same bytes: before, one class for both


def _pool_of(app: Any) -> ServerPool:
    layer = app.middleware_stack
    while not isinstance(layer, EPDMiddleware):
        layer = layer.app
    return layer.pipeline.encoders


def test_a_saturation_no_call_renews_goes_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before, once every encoder read as saturated, every request went local, no encoder got a call, and
    the verdict never changed. A slowdown holds a health-check interval: then the next request goes to
    the encoders and measures again."""
    import time as time_module

    decide, pool = placement("adaptive", small_tokens=0, encoder_slowdown=3.0)
    big = {("image", "i"): 5000}
    for url in (E0, E1):
        pool.record_latency(url, 0.010, 256)
        for _ in range(20):
            pool.record_latency(url, 0.100, 256)
    assert decide.decide([IMAGE], big, idle_host(1), [E0, E1]).why["image"] == ("local", "encoders_saturated")
    now = time_module.monotonic()
    monkeypatch.setattr(time_module, "monotonic", lambda: now + pool.policy.health_check_interval + 0.1)
    assert decide.decide([IMAGE], big, idle_host(1), [E0, E1]).why["image"] == ("remote", "large")


async def test_a_burst_at_an_idle_pd_places_one_request_here_not_all() -> None:
    """Eight requests arriving together at an idle PD all saw it idle (the engine counts a request only
    once it has it) and all went local. Requests this process placed and has not seen finish count."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    engine.delay = 0.05  # the engine takes a while: the burst overlaps
    app = app_with(encoders, engine, load=0, placement="adaptive")
    middleware = app.build_middleware_stack()
    import anyio

    async with anyio.create_task_group() as group:
        for seed in range(8):
            group.start_soon(post, middleware, chat_body(picture(1024 + seed, 1024)))
    kinds = [media_parts(record.json)[0]["type"] for record in engine.received]
    assert kinds.count("image_url") == 1  # the first: PD was idle
    assert kinds.count("image_embeds") == 7
    assert len(encoders.calls) == 7


def test_small_tokens_zero_places_nothing_here_for_its_size() -> None:
    """0 means never: a header that says 0 x 100 (no image Pillow decodes) counted 0 tokens, and 0 <= 0
    placed it here as small."""
    decide, _ = placement("adaptive", small_tokens=0)
    zero = {("image", "i"): 0}
    assert decide.decide([IMAGE], zero, idle_host(1), [E0]).why["image"] == ("remote", "large")

    class Part:
        modality = "image"
        url = png_of(0, 100)

    assert item_tokens([Part()], ["i"], {}, Host()) == {("image", "i"): None}  # type: ignore[list-item]


# --- no 500 for a client's input (issue 35, item 5) -------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"min_pixels": 10**400},
        {"max_pixels": 10**400, "min_pixels": 10**399},
        {"size": {"shortest_edge": 10**400}},
    ],
)
async def test_pixel_bounds_no_float_holds_are_left_to_vllm_not_a_500(options: dict[str, Any]) -> None:
    """``min_pixels`` 10**400 raised OverflowError in the token estimate: the client got a 500. Its size is
    not known here now, and the encoder (vLLM) answers for the options."""
    encoders, engine = FakeEncoders([E0]), FakeEngine()
    app = app_with(encoders, engine, load=1, placement="adaptive")
    body = json.dumps(chat_body(picture(448, 448), mm_processor_kwargs=options))
    response = await post(app, json.loads(body))
    assert response.status_code == 200, response.text
    assert len(encoders.calls) == 1
