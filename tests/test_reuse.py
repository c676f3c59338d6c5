"""Media already encoded never crosses to an encoder again (handle reuse), and the same media lands on
the same encoder from every middleware (content affinity), on asyncio and trio with fakes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from epd_middleware import EPDMiddleware
from epd_middleware import _selection as selection
from epd_middleware._plan import MediaItem, plan_calls
from epd_middleware._reuse import request_key

from .fakes import (
    MODEL,
    TEST_UUID_KEY,
    FakeEncoders,
    FakeEngine,
    chat_body,
    derived_hash,
    image,
    upstream_client,
    uuid_of,
)
from .test_middleware import OPTIONS, png, post

pytestmark = pytest.mark.anyio

E = [f"http://127.0.0.{50 + n}:8001" for n in range(4)]


def app_with(
    encoders: FakeEncoders, engine: FakeEngine, storage: Path | None, **options: Any
) -> EPDMiddleware:
    if storage is not None:
        encoders.storage = storage
        options.setdefault("ec_storage_path", str(storage))
    options.setdefault("uuid_key", TEST_UUID_KEY)
    return EPDMiddleware(
        engine.app(),
        encoders=encoders.urls,
        http_client=upstream_client(encoders),
        health_check_interval=0,
        **options,
    )


def conversation(turns: int, **fields: Any) -> dict[str, Any]:
    """A chat after ``turns`` turns: every user turn carries its own new image, every turn is resent."""
    messages: list[dict[str, Any]] = []
    for turn in range(turns):
        messages.append(
            {"role": "user", "content": [{"type": "text", "text": f"turn {turn}"}, image(png(100 + turn))]}
        )
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {turn}"})
    return {"model": "tiny-qwen2-vl", "messages": messages, "max_tokens": 8, **fields}


def media_parts(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        part
        for message in body["messages"]
        if isinstance(message["content"], list)
        for part in message["content"]
        if part.get("type") != "text"
    ]


def without_positions(body: dict[str, Any]) -> dict[str, Any]:
    """The body with each handle's item_indices left out: they are positions in the encoder call that
    reported the handle, and differ with how items were batched whether reused or not."""
    params = {
        mm_hash: {key: value for key, value in entry.items() if key != "item_indices"}
        for mm_hash, entry in body["ec_transfer_params"].items()
    }
    return {**body, "ec_transfer_params": params}


def items_sent(encoders: FakeEncoders, since: int = 0) -> int:
    return sum(len(call.body["messages"][0]["content"]) for call in encoders.calls[since:])


# --- reuse -------------------------------------------------------------------------------------------


async def test_a_multi_turn_chat_sends_each_image_to_an_encoder_once(tmp_path: Path) -> None:
    encoders, engine = FakeEncoders(E[:2]), FakeEngine()
    app = app_with(encoders, engine, tmp_path)
    for turns in range(1, 6):
        before = items_sent(encoders)
        assert (await post(app, conversation(turns, **OPTIONS))).status_code == 200
        assert items_sent(encoders) - before == 1  # only this turn's new image
        body = engine.received[-1].json
        parts = media_parts(body)
        assert [part["type"] for part in parts] == ["image_embeds"] * turns
        assert len(body["ec_transfer_params"]) == turns
    assert app.pipeline.counters["reused_items"] == 0 + 1 + 2 + 3 + 4


async def test_reused_handles_build_the_same_engine_request_as_encoding_them_all(tmp_path: Path) -> None:
    fresh_encoders, fresh_engine = FakeEncoders(E[:2]), FakeEngine()
    fresh = app_with(fresh_encoders, fresh_engine, tmp_path / "a", reuse_handles=False)
    warm_encoders, warm_engine = FakeEncoders(E[:2]), FakeEngine()
    warm = app_with(warm_encoders, warm_engine, tmp_path / "b")
    for turns in (1, 2, 3):
        await post(warm, conversation(turns, **OPTIONS))
    assert (await post(fresh, conversation(3, **OPTIONS))).status_code == 200
    assert without_positions(warm_engine.received[-1].json) == without_positions(
        fresh_engine.received[-1].json
    )
    assert items_sent(fresh_encoders) == 3
    assert items_sent(warm_encoders) == 3  # one per turn


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (OPTIONS, {"mm_processor_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 100352}}}),
        ({}, OPTIONS),
        ({"cache_salt": "alice"}, {"cache_salt": "bob"}),
        ({"model": "a"}, {"model": "b"}),
    ],
    ids=["other options", "options added", "other salt", "other model"],
)
async def test_anything_that_changes_the_embedding_is_in_the_key(
    tmp_path: Path, first: dict[str, Any], second: dict[str, Any]
) -> None:
    encoders, engine = FakeEncoders(E[:1]), FakeEngine()
    app = app_with(encoders, engine, tmp_path)
    await post(app, chat_body(image(png(1)), **first))
    await post(app, chat_body(image(png(1)), **second))
    assert items_sent(encoders) == 2
    await post(app, chat_body(image(png(1)), **second))
    assert items_sent(encoders) == 2  # now that one is cached too


async def test_options_in_another_order_are_another_key(tmp_path: Path) -> None:
    """issue 29 item 10: vLLM's hasher sorts only its top-level keywords and serialises the options in
    the order they were written (``MultiModalHasher``), so reordered ``mm_processor_kwargs`` give the
    item another hash. The key sorted them: outside vLLM (where the identifier is not derived here) the
    second request was handed the first one's handle, under a hash the engine never derives."""
    encoders, engine = FakeEncoders(E[:1]), FakeEngine()
    app = app_with(encoders, engine, tmp_path)
    options = {"mm_processor_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 50176}}}
    reordered = {"mm_processor_kwargs": {"size": {"longest_edge": 50176, "shortest_edge": 3136}}}
    await post(app, chat_body(image(png(1)), **options))
    await post(app, chat_body(image(png(1)), **options))
    assert items_sent(encoders) == 1  # the same order: reused
    body = chat_body(image(png(1)), **reordered)
    await post(app, body)
    assert items_sent(encoders) == 2
    uuid = uuid_of("image", (body["messages"][0]["content"][1]["image_url"]["url"],))
    assert list(engine.received[-1].json["ec_transfer_params"]) == [derived_hash(MODEL, uuid, "image", body)]


async def test_the_key_holds_a_digest_of_the_request_not_its_fields() -> None:
    """issue 29 item 8: the options went into every key as JSON, so a client's large options were kept
    once per cached item (12 requests with 1 MiB salts held 18 MiB, and the cache holds up to 4096
    entries). The key now holds a fixed-size digest of them."""
    small = request_key({"model": "m"}, pins_uuids=True)
    large = request_key({"model": "m", "mm_processor_kwargs": {"x": "y" * (1 << 20)}}, pins_uuids=True)
    assert len(small) == len(large) == 32
    assert small != large
    assert request_key({"model": "m", "cache_salt": None}, pins_uuids=True) == small  # absent is null
    assert request_key({"model": "m"}, pins_uuids=False) != small


async def test_a_trusted_client_uuid_is_a_key_only_with_its_options(tmp_path: Path) -> None:
    encoders, engine = FakeEncoders(E[:1]), FakeEngine()
    app = app_with(encoders, engine, tmp_path, trust_client_uuid=True)
    await post(app, chat_body(image(png(1), uuid="client-id")))
    await post(app, chat_body(image(png(2), uuid="client-id")))  # the client says: the same media
    assert items_sent(encoders) == 1
    await post(app, chat_body(image(png(1), uuid="client-id"), **OPTIONS))
    assert items_sent(encoders) == 2


async def test_an_embedding_that_has_gone_is_encoded_again(tmp_path: Path) -> None:
    encoders, engine = FakeEncoders(E[:1]), FakeEngine()
    app = app_with(encoders, engine, tmp_path)
    await post(app, conversation(2))
    first_hash = next(iter(engine.received[-1].json["ec_transfer_params"]))
    shutil.rmtree(tmp_path / first_hash)  # evicted from the shared storage
    before = items_sent(encoders)
    assert (await post(app, conversation(3))).status_code == 200
    assert items_sent(encoders) - before == 2  # the evicted one and the new one
    assert app.pipeline.reuse.stale == 1
    assert (tmp_path / first_hash).exists()


async def test_reuse_off_by_configuration_and_where_nothing_can_be_checked(tmp_path: Path) -> None:
    for options, storage in (({"reuse_handles": False}, tmp_path), ({}, None)):
        encoders, engine = FakeEncoders(E[:1]), FakeEngine()
        app = app_with(encoders, engine, storage, **options)
        await post(app, chat_body(image(png(1))))
        await post(app, chat_body(image(png(1))))
        assert items_sent(encoders) == 2
    status = await status_of(app)
    assert status["handle_reuse"]["enabled"] is False
    assert "no embedding storage" in status["handle_reuse"]["why_not"]


async def test_reuse_is_off_with_mooncake_push(tmp_path: Path) -> None:
    encoders, engine = FakeEncoders(E[:1]), FakeEngine()
    app = app_with(encoders, engine, tmp_path, ec_consumer_zmq="tcp://127.0.0.1:5570")
    await post(app, chat_body(image(png(1))))
    await post(app, chat_body(image(png(1))))
    assert items_sent(encoders) == 2
    status = await status_of(app)
    assert "Mooncake" in status["handle_reuse"]["why_not"]


async def test_status_shows_the_cache(tmp_path: Path) -> None:
    encoders, engine = FakeEncoders(E[:1]), FakeEngine()
    app = app_with(encoders, engine, tmp_path)
    await post(app, conversation(3))
    await post(app, conversation(3))
    reuse = (await status_of(app))["handle_reuse"]
    assert reuse == {"enabled": True, "why_not": None, "entries": 3, "hits": 3, "stale_dropped": 0}


async def test_an_engine_retry_encodes_everything_again(tmp_path: Path) -> None:
    encoders, engine = FakeEncoders(E[:1]), FakeEngine()
    app = app_with(encoders, engine, tmp_path)
    await post(app, chat_body(image(png(1))))
    engine.fail_next = 1  # the engine could not load what it was given
    assert (await post(app, chat_body(image(png(1))))).status_code == 200
    assert items_sent(encoders) == 2  # the retry did not trust the cached handle


async def test_the_cache_is_bounded(tmp_path: Path) -> None:
    encoders, engine = FakeEncoders(E[:1]), FakeEngine()
    app = app_with(encoders, engine, tmp_path, reuse_cache_size=2)
    for seed in range(3):
        await post(app, chat_body(image(png(seed))))
    assert len(app.pipeline.reuse) == 2
    await post(app, chat_body(image(png(0))))  # the oldest was forgotten
    assert items_sent(encoders) == 4


async def status_of(app: EPDMiddleware) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        response = await client.get("http://pd/epd/status")
    result: dict[str, Any] = response.json()
    return result


# --- affinity ----------------------------------------------------------------------------------------


def item(seed: int, modality: str = "image") -> MediaItem:
    return MediaItem(uuid_of(modality, (f"data:image/png;base64,{png(seed)}",)), modality, {})


def first_choice(
    items: list[MediaItem], encoders: list[str], load: dict[str, int] | None = None
) -> list[str]:
    rankings = selection.affinity(items, encoders, load or {}, max_inflight=64, max_batch_size=8)
    return [ranking[0] for ranking in rankings]


def test_affinity_spreads_items_and_moves_only_a_removed_encoders_items() -> None:
    items = [item(seed) for seed in range(400)]
    chosen = first_choice(items, E)
    counts = {url: chosen.count(url) for url in E}
    assert all(60 <= count <= 140 for count in counts.values()), counts  # 100 each, give or take
    without = first_choice(items, [E[0], E[1], E[3]])
    for before, after in zip(chosen, without, strict=True):
        if before != E[2]:
            assert after == before  # only the removed encoder's items moved
    added = first_choice(items, [*E, "http://127.0.0.60:8001"])
    moved = sum(before != after for before, after in zip(chosen, added, strict=True))
    assert all(
        after == "http://127.0.0.60:8001"
        for before, after in zip(chosen, added, strict=True)
        if before != after
    )
    assert 40 <= moved <= 120  # about a fifth moved to the new encoder


def test_affinity_rankings_are_full_orders_used_for_failover() -> None:
    [ranking] = selection.affinity([item(1)], E, {}, max_inflight=64, max_batch_size=8)
    assert sorted(ranking) == sorted(E)
    [call] = plan_calls([item(1)], [ranking], 8)
    assert call.encoder == ranking[0]
    assert call.preferred == ranking[1:]


def test_affinity_load_bound() -> None:
    items = [item(seed) for seed in range(40)]
    chosen = first_choice(items, E)
    busy = chosen[0]
    under_load = first_choice(items, E, {busy: 10})  # mean 2.5: the bound is 1.5 * 2.5 + 2 = 5.75
    assert busy not in under_load
    light = first_choice(items, E, {busy: 3})  # under the bound: affinity kept
    assert light == chosen
    assert selection.load_bound(0, 64) == 2
    assert selection.load_bound(100, 64) == 63  # never past the in-flight bound


def test_one_requests_own_calls_count_toward_the_bound() -> None:
    # 30 audio items (one call each) that would all rank the same encoder first cannot all go there.
    items = [item(7, "audio")] * 30
    chosen = first_choice(items, E)
    assert max(chosen.count(url) for url in E) < 30


async def test_the_same_image_goes_to_the_same_encoder_from_two_middlewares() -> None:
    encoders = FakeEncoders(E)
    apps = [app_with(encoders, FakeEngine(), None) for _ in range(2)]
    for seed in range(20):
        for app in apps:
            assert (await post(app, chat_body(image(png(seed))))).status_code == 200
    by_image: dict[str, set[str]] = {}
    for call in encoders.calls:
        url = json.dumps(call.body["messages"][0]["content"][0]["image_url"])
        by_image.setdefault(url, set()).add(call.encoder)
    assert len(by_image) == 20
    assert all(len(used) == 1 for used in by_image.values())  # both middlewares, one encoder per image
    assert len({encoder for used in by_image.values() for encoder in used}) >= 3  # and they spread


async def test_affinity_batches_images_per_encoder_and_sends_audio_alone() -> None:
    encoders, engine = FakeEncoders(E[:2]), FakeEngine()
    app = app_with(encoders, engine, None, max_batch_size=3)
    parts = [image(png(seed)) for seed in range(10)]
    parts.append({"type": "input_audio", "input_audio": {"data": png(99), "format": "wav"}})
    assert (await post(app, chat_body(*parts))).status_code == 200
    sizes = [len(call.body["messages"][0]["content"]) for call in encoders.calls]
    assert sum(sizes) == 11
    assert max(sizes) <= 3
    assert len(encoders.calls) <= 6  # batched: ceil over two encoders, plus the audio call


# --- reuse across surfaces (issue 20, item 1) -------------------------------------------------------


def messages_body(data: str) -> dict[str, Any]:
    source = {"type": "base64", "media_type": "image/png", "data": data}
    return {
        "model": "tiny-qwen2-vl",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}],
    }


async def test_an_image_seen_on_messages_is_encoded_again_for_chat_and_the_other_way(tmp_path: Path) -> None:
    """Messages lets the engine hash the image itself, chat pins the content uuid: the same image has
    two identifiers. Before: one reuse key for both, so chat after Messages got a reference to an
    embedding stored under the other identifier (missing: the engine would have died), and Messages
    after chat silently lost disaggregation."""
    from .test_hostile_clients import post as post_to

    for first, second in (("messages", "chat"), ("chat", "messages")):
        encoders, engine = FakeEncoders(E[:1]), FakeEngine()
        app = app_with(encoders, engine, tmp_path / first)
        data = png(7)
        bodies = {"messages": messages_body(data), "chat": chat_body(image(data))}
        paths = {"messages": "/v1/messages", "chat": "/v1/chat/completions"}
        for surface in (first, second):
            assert (await post_to(app, bodies[surface], paths[surface])).status_code == 200
        assert items_sent(encoders) == 2, first  # encoded for each surface
        chat = engine.received[0 if first == "chat" else 1].json
        [part] = media_parts(chat)
        assert part["type"] == "image_embeds"
        assert (tmp_path / first / part["uuid"] / "encoder_cache.safetensors").exists()
        assert list(chat["ec_transfer_params"]) == [part["uuid"]]
        # ... and each surface reuses its own from then on.
        for surface in (first, second):
            assert (await post_to(app, bodies[surface], paths[surface])).status_code == 200
        assert items_sent(encoders) == 2


def test_a_cached_handle_under_another_identifier_than_the_engines_is_dropped(tmp_path: Path) -> None:
    from epd_middleware._handles import Handle
    from epd_middleware._reuse import HandleCache

    cache = HandleCache(8)
    for name in ("u", "other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "encoder_cache.safetensors").write_bytes(b"x")
    key = ("image", "u", b"k")
    cache.put({("image", "u"): key}, {("image", "u"): Handle("other", {})})
    assert cache.take({("image", "u"): key}, str(tmp_path), {("image", "u"): "u"}) == {}
    assert len(cache) == 0
    cache.put({("image", "u"): key}, {("image", "u"): Handle("u", {})})
    assert cache.take({("image", "u"): key}, str(tmp_path), {("image", "u"): "u"}) != {}
