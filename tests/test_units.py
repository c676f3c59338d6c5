"""Pure functions of the request path: config, surface parsing, planning, reply matching."""

from __future__ import annotations

import json
from typing import Any

import pytest

from epd_middleware import EPDConfig, EPDMiddleware, UpstreamBadReply
from epd_middleware import _selection as selection
from epd_middleware._handles import Handle, match_reply, part_metadata, transfer_params
from epd_middleware._plan import EncoderCall, MediaItem, content_uuid, plan_calls
from epd_middleware._surfaces import ParsedRequest, encode_fields, forwarded_options
from epd_middleware._surfaces import openai_chat as chat

E0, E1, E2 = "http://enc-0:8001", "http://enc-1:8001", "http://enc-2:8001"


# --- config -----------------------------------------------------------------------------------------


def test_from_env_reads_every_option() -> None:
    config = EPDConfig.from_env(
        {
            "EPD_ENCODERS": " http://a:1/ , https://b:2 ",
            "EPD_ENCODER_TIMEOUT": "2.5",
            "EPD_PATHS": "/v1/chat/completions,/x",
            "EPD_MAX_BODY_BYTES": "1000",
            "EPD_MAX_BATCH_SIZE": "3",
            "EPD_REWRITE": "false",
            "EPD_TRUST_CLIENT_UUID": "1",
        }
    )
    assert config == EPDConfig(
        encoders=("http://a:1", "https://b:2"),
        encoder_timeout=2.5,
        paths=("/v1/chat/completions", "/x"),
        max_body_bytes=1000,
        max_batch_size=3,
        rewrite=False,
        trust_client_uuid=True,
    )


def test_every_field_has_an_env_var_and_a_middleware_keyword() -> None:
    import inspect

    from epd_middleware.config import EPDOptions

    assert set(EPDOptions.__annotations__) == set(EPDConfig.model_fields)
    assert {"config", "http_client", "options"} <= set(inspect.signature(EPDMiddleware.__init__).parameters)
    for name in EPDConfig.model_fields:
        assert EPDConfig.env_var(name) == "EPD_" + name.upper()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"encoders": []}, "at least one encoder"),
        ({"encoders": ["enc-0:8001"]}, "not an http"),
        ({"encoders": ["ftp://enc-0"]}, "not an http"),
        ({"encoders": [E0, E0 + "/"]}, "repeated"),
        ({"encoders": [E0], "encoder_timeout": -1}, "greater than 0"),
        ({"encoders": [E0], "max_batch_size": 0}, "greater than or equal to 1"),
        ({"encoders": [E0], "paths": ["v1/chat"]}, "must start with '/'"),
    ],
)
def test_invalid_configuration_fails_at_construction(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="configuration") as info:
        EPDMiddleware(_noop_app, **options)
    assert message in str(info.value)


def test_no_options_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_ENCODERS", E0)
    monkeypatch.setenv("EPD_MAX_BATCH_SIZE", "2")
    middleware = EPDMiddleware(_noop_app)
    assert middleware.config.encoders == (E0,)
    assert middleware.config.max_batch_size == 2


def test_empty_environment_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EPD_ENCODERS", raising=False)
    with pytest.raises(ValueError, match="EPD_ENCODERS"):
        EPDMiddleware(_noop_app)


def test_env_errors_name_the_variable() -> None:
    with pytest.raises(ValueError, match="EPD_MAX_BATCH_SIZE: Input should be a valid integer"):
        EPDConfig.from_env({"EPD_ENCODERS": E0, "EPD_MAX_BATCH_SIZE": "many"})
    with pytest.raises(ValueError, match="EPD_ENCODERS: encoder URL 'enc:1'"):
        EPDConfig.from_env({"EPD_ENCODERS": "enc:1"})


def test_unknown_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="Extra inputs"):
        EPDConfig(encoders=(E0,), no_such_option=1)  # type: ignore[call-arg]


def test_config_and_keywords_together_is_an_error() -> None:
    with pytest.raises(TypeError, match="not both"):
        EPDMiddleware(_noop_app, encoders=[E0], config=EPDConfig(encoders=(E0,)))


async def _noop_app(scope: Any, receive: Any, send: Any) -> None:
    pass


# --- surface ----------------------------------------------------------------------------------------


def parse(body: Any) -> ParsedRequest | None:
    return chat.parse(json.dumps(body).encode())


def test_quick_check_skips_bodies_without_media_markers() -> None:
    assert not chat.may_hold_media(b'{"messages": [{"role": "user", "content": "a long text"}]}')
    assert chat.may_hold_media(b'{"type": "image_url"}')
    assert chat.may_hold_media(b'{"type": "input_audio"}')
    assert chat.may_hold_media(b"_" * 100 + b'{"type": "video_url"}')  # past the underscore budget
    assert not chat.may_hold_media(b'{"max_tokens": 1, "top_p": 1, "x": "a_b"}')


def test_parse_finds_every_media_part_kind_vllm_accepts() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "text only"},
            {
                "role": "user",
                "content": [
                    "plain string part",
                    {"type": "text", "text": "image_url in text is not media"},
                    {"type": "image_url", "image_url": {"url": "data:a"}},
                    {"image_url": {"url": "data:no-type"}},
                    {"type": "image_url", "image_url": "data:bare-string", "uuid": "u1"},
                    {"type": "audio_url", "audio_url": {"url": "http://x/a.wav"}},
                    {"type": "input_audio", "input_audio": {"data": "QUJD", "format": "mp3"}},
                    {"type": "video_url", "video_url": {"url": "http://x/v.mp4"}},
                    {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}},
                    {"type": "image_url", "image_url": {"url": None}, "uuid": "ref"},
                ],
            },
        ]
    }
    request = parse(body)
    assert request is not None
    found = [(*m.location, m.modality, m.content, m.client_uuid) for m in request.media]
    assert found == [
        (1, 2, "image", ("data:a",), None),
        (1, 3, "image", ("data:no-type",), None),
        (1, 4, "image", ("data:bare-string",), "u1"),
        (1, 5, "audio", ("http://x/a.wav",), None),
        (1, 6, "audio", ("QUJD", "mp3"), None),
        (1, 7, "video", ("http://x/v.mp4",), None),
    ]
    assert request.referenced_modalities == frozenset({"image"})


def test_a_part_with_uuid_is_typed_by_its_keys_like_vllm_does() -> None:
    # With a uuid vLLM ignores "type" and looks at the keys: image_embeds comes before audio_url.
    body = {
        "messages": [{"content": [{"type": "audio_url", "image_embeds": {}, "audio_url": "x", "uuid": "u"}]}]
    }
    request = parse(body)
    assert request is not None
    assert request.media == ()


def test_forwarded_options_are_taken_verbatim() -> None:
    request = parse(
        {
            "messages": [],
            "mm_processor_kwargs": {"a": 1},
            "media_io_kwargs": {"image": {"b": 2}},
            "priority": 0,
            "session_id": "s",
            "cache_salt": "salt",
            "temperature": 0,
        }
    )
    assert request is not None
    assert forwarded_options(request) == {
        "mm_processor_kwargs": {"a": 1},
        "media_io_kwargs": {"image": {"b": 2}},
        "priority": 0,
        "session_id": "s",
    }
    assert request.cache_salt == "salt"


def test_rewritten_body_keeps_unrelated_fields_and_messages() -> None:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "sys"},
            {
                "role": "user",
                "name": "bob",
                "content": [{"type": "image_url", "image_url": {"url": "data:a"}}],
            },
        ],
        "extra_body_field": {"nested": [1, 2.5, None, True]},
        "ec_transfer_params": {"client": {"x": 1}},
    }
    request = parse(body)
    assert request is not None
    out = json.loads(
        encode_fields(chat.engine_fields(request, ["u"], [{"g": [1]}], {"h": {"metadata": {"g": [1]}}}))
    )
    assert out["messages"][0] == body["messages"][0]
    assert out["messages"][1]["name"] == "bob"
    assert out["messages"][1]["content"] == [
        {"type": "image_embeds", "image_embeds": {"g": [1]}, "uuid": "u"}
    ]
    assert out["extra_body_field"] == body["extra_body_field"]
    # The middleware's handles alone: nothing of the client's (issue 29, item 6).
    assert out["ec_transfer_params"] == {"h": {"metadata": {"g": [1]}}}
    # The parsed request is not mutated: a second rewrite starts from the original.
    assert request.fields["messages"][1]["content"][0]["type"] == "image_url"


# --- plan -------------------------------------------------------------------------------------------


def test_content_uuid_is_hex_stable_and_separates_modality_salt_and_content() -> None:
    base = content_uuid("image", ("data:a",))
    assert base == content_uuid("image", ("data:a",))
    assert len(base) == 32
    assert all(c in "0123456789abcdef" for c in base)
    others = {
        content_uuid("audio", ("data:a",)),
        content_uuid("image", ("data:b",)),
        content_uuid("image", ("data:a",), salt="s"),
        content_uuid("image", ("data:a",), salt=""),
        content_uuid("image", ("data:a", "")),
        content_uuid("audio", ("QUJD", "wav")),
        content_uuid("audio", ("QUJD", "mp3")),
    }
    assert base not in others
    assert len(others) == 7


def items(*modalities: str) -> list[MediaItem]:
    return [MediaItem(f"u{i}", modality, {}) for i, modality in enumerate(modalities)]


def shape(calls: tuple[EncoderCall, ...]) -> list[tuple[str, list[str]]]:
    return [(call.encoder, [item.uuid for item in call.items]) for call in calls]


def rr(modalities: list[MediaItem], encoders: list[str], start: int, size: int) -> tuple[EncoderCall, ...]:
    return plan_calls(modalities, selection.round_robin(encoders, start, len(modalities)), size)


def test_plan_round_robin_from_the_cursor_with_batches() -> None:
    calls = rr(items(*["image"] * 7), [E0, E1, E2], start=1, size=2)
    assert shape(calls) == [
        (E1, ["u0", "u3"]),
        (E2, ["u1", "u4"]),
        (E0, ["u2", "u5"]),
        (E1, ["u6"]),
    ]


def test_plan_sends_audio_and_video_alone() -> None:
    calls = rr(items("image", "audio", "image", "video", "image"), [E0, E1], start=0, size=8)
    assert shape(calls) == [(E1, ["u1"]), (E1, ["u3"]), (E0, ["u0", "u2", "u4"])]


def test_pool_cursor_spreads_single_item_requests_evenly() -> None:
    from epd_middleware._pool import PoolPolicy, ServerPool

    config = EPDConfig(encoders=(E0, E1, E2))
    pool = ServerPool("encoder", PoolPolicy(config.encoder_timeout))
    pool.set_members(config.encoders)
    counts = {E0: 0, E1: 0, E2: 0}
    for _ in range(30):
        [call] = rr(items("image"), list(pool.members), pool.reserve(1, 3), 8)
        counts[call.encoder] += 1
    assert counts == {E0: 10, E1: 10, E2: 10}


# --- handles ----------------------------------------------------------------------------------------


def call(n: int, encoder: str = E0) -> tuple[str, list[MediaItem]]:
    return encoder, items(*["image"] * n)


def test_match_by_item_indices_then_uuid_then_lone_entry() -> None:
    by_index = match_reply(
        *call(2), {"h1": {"item_indices": [1], "metadata": {"a": 1}}, "h0": {"item_indices": [0]}}
    )
    assert {key[1]: handle.mm_hash for key, handle in by_index.items()} == {"u0": "h0", "u1": "h1"}
    by_uuid = match_reply(*call(2), {"u1": {"metadata": {"a": 1}}})
    assert {key[1]: handle.mm_hash for key, handle in by_uuid.items()} == {"u1": "u1"}
    lone = match_reply(*call(1), {"derived": {"metadata": {"a": 1}, "peer_host": "h", "size_bytes": 9}})
    assert lone[("image", "u0")].entry["peer_host"] == "h"


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        ([1], "not an object"),
        ({"h": 3}, "not an object"),
        ({"h": {"item_indices": [2]}}, "out of range"),
        ({"h": {"item_indices": [-1]}}, "out of range"),
        ({"h": {"item_indices": ["0"]}}, "non-integer"),
        ({"h": {"item_indices": [True]}}, "non-integer"),
        ({"h": {"item_indices": [0, 0]}}, "repeats"),
        ({"h": {"item_indices": []}}, "non-empty list"),
        ({"h": {"item_indices": 0}}, "non-empty list"),
        ({"a": {"item_indices": [0]}, "b": {"item_indices": [0]}}, "claimed by both"),
        ({"x": {"metadata": {}}, "y": {"metadata": {}}}, "matches none"),
    ],
)
def test_unusable_replies_name_the_encoder(params: Any, reason: str) -> None:
    with pytest.raises(UpstreamBadReply, match=reason) as info:
        match_reply(*call(2, E1), params)
    assert info.value.server == E1
    assert E1 in info.value.logged
    assert E1 not in info.value.message  # what the client reads (issue 29, item 15)


def test_missing_entries_are_not_an_error() -> None:
    assert match_reply(*call(2), None) == {}
    assert match_reply(*call(2), {}) == {}


def test_part_metadata_is_all_or_nothing_per_modality() -> None:
    keys = [("image", "a"), ("image", "b"), ("audio", "c")]
    handles = {
        ("image", "a"): Handle("ha", {"metadata": {"g": 1}}),
        ("image", "b"): Handle("hb", {"metadata": {}}),
        ("audio", "c"): Handle("hc", {"metadata": {"n": [3]}}),
    }
    assert part_metadata(keys, handles, rewrite=True) == [None, None, {"n": [3]}]
    assert part_metadata(keys, handles, rewrite=True, keep_raw=frozenset({"audio"})) == [None, None, None]
    assert part_metadata(keys, handles, rewrite=False) == [None, None, None]
    assert transfer_params(handles) == {
        "ha": {"metadata": {"g": 1}},
        "hb": {"metadata": {}},
        "hc": {"metadata": {"n": [3]}},
    }


def test_configuration_doc_lists_every_option_and_variable() -> None:
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    for name in EPDConfig.model_fields:
        assert f"`{name}`" in doc, f"docs/configuration.md does not document {name}"
        assert f"`{EPDConfig.env_var(name)}`" in doc, (
            f"docs/configuration.md misses {EPDConfig.env_var(name)}"
        )
