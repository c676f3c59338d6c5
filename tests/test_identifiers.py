"""The identifier vLLM's engine gives an item, derived as vLLM derives it: golden values computed by vLLM
0.32's own ``ProcessorInputs.get_mm_hashes`` (with ``merge_media_io_kwargs`` for the server's options), and
the cases the middleware does not claim to know."""

from __future__ import annotations

from typing import Any

import pytest

from epd_middleware._identifiers import IdentifierRule, hash_kwargs
from epd_middleware.host import Host

# (model path, hasher, modality, uuid, request fields, server --media-io-kwargs, what vLLM derives)
GOLDEN: list[tuple[str, str, str, str, dict[str, Any], dict[str, Any], str]] = [
    ("Qwen/Qwen2.5-VL-3B-Instruct", "blake3", "image", "abc123", {}, {}, "abc123"),
    (
        "Qwen/Qwen2.5-VL-3B-Instruct",
        "blake3",
        "image",
        "abc123",
        {"mm_processor_kwargs": {"max_pixels": 1003520}},
        {},
        "e9f7f2204fdf943b5592aaa55a2f2581884efe0bae505e4a2b8d879e89712769",
    ),
    (
        "/models/tiny-qwen2-vl",
        "blake3",
        "image",
        "9f3c0a7be1d24c6f8a5b0c1d2e3f4a5b",
        {"mm_processor_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 50176}}},
        {},
        "56012f786be19a747bb314df51f8fcee88cc2859cc5187852641f0361069f74d",
    ),
    (
        "m",
        "blake3",
        "image",
        "u",
        {"mm_processor_kwargs": {"images_kwargs": {"max_pixels": 1003520, "do_resize": True}}},
        {},
        "1093c64d28ded7f7f5bc1e4a310c15c9a889c2ddec9052419c2990550c37e26a",
    ),
    ("m", "blake3", "image", "u", {"mm_processor_kwargs": {"videos_kwargs": {"fps": 2}}}, {}, "u"),
    (
        "m",
        "blake3",
        "image",
        "u",
        {"media_io_kwargs": {"image": {"rgba_background_color": [255, 255, 255]}}},
        {},
        "1ab33719ff8ff931aa797119a9b3bb3035e7b19e1f894e502adb145e73bde65c",
    ),
    ("m", "blake3", "image", "u", {"media_io_kwargs": {"video": {"num_frames": 8}}}, {}, "u"),
    (
        "m",
        "blake3",
        "image",
        "u",
        {},
        {"image": {"rgba_background_color": [0, 0, 0]}},
        "58bcf0b97e8d4a70b404df85c912b3c6560ca420003ca86dd82e75203d56e938",
    ),
    (
        "m",
        "blake3",
        "image",
        "u",
        {"media_io_kwargs": {"image": {"rgba_background_color": [1, 2, 3]}}},
        {"image": {"rgba_background_color": [0, 0, 0], "x": 1}},
        "c5f88fb58dc22b4e98069be45ee9acc2fa10764201dbf5e729bd30ef02bcf24f",
    ),
    (
        "m",
        "blake3",
        "image",
        "u",
        {"mm_processor_kwargs": {"flag": None, "scale": 0.5, "n": 1, "f": 1.0, "b": False}},
        {},
        "8ee733fda9b7c1b1bec734b9481ba567001c6c3b04e1e54b309dd0d49a126bab",
    ),
    (
        "m",
        "sha256",
        "image",
        "u",
        {
            "mm_processor_kwargs": {
                "big": 9223372036854775813,
                "neg": -7,
                "nested": [{"a": None}, [1, 2.5]],
                "ключ": "vü",
            }
        },
        {},
        "8d1da24541cc14fe515a903e46709e5c13e32d395f27a171dc828408a1a04eff",
    ),
    (
        "m",
        "sha512",
        "audio",
        "aud",
        {
            "mm_processor_kwargs": {"audio_kwargs": {"sampling_rate": 16000}, "images_kwargs": {"x": 1}},
            "media_io_kwargs": {"audio": {"y": 1}},
        },
        {},
        "61f4697e83058fc2139ba0e1c6487958331ea73d78ef99cb43ffe531f0321cd202e57297080e1ea1b9beafbb4edfb20be2cdf207c3dbe3c33a3d00eadf83624a",
    ),
    (
        "m",
        "blake3",
        "audio",
        "aud",
        {"mm_processor_kwargs": {"sampling_rate": 16000}},
        {},
        "90b8504e6bf998077b3a272e7a4a9621dc0204c12a8b10e37cf3307452b71e11",
    ),
    (
        "m",
        "blake3",
        "video",
        "vid",
        {
            "media_io_kwargs": {"video": {"num_frames": 4}},
            "mm_processor_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 12544}},
        },
        {},
        "7ac3f0ea45f45c88952d8fccd87c1f49012ed96224f5220a7640127ba824488d",
    ),
    (
        "m",
        "blake3",
        "video",
        "vid",
        {"media_io_kwargs": {"video": {"num_frames": 4}}},
        {"video": {"fps": 2, "x": 1}},
        "b75c3423149a266d67950bfd4afbc50fbce538bfe3006b23438079c473c7686d",
    ),
    (
        "m",
        "blake3",
        "video",
        "vid",
        {"media_io_kwargs": {"video": {"fps": 1}}},
        {"video": {"num_frames": 16}},
        "6e834006e64aa15e0d39bd44e219d08945578579463700ee777622ff64e3a684",
    ),
    (
        "m",
        "blake3",
        "video",
        "vid",
        {
            "media_io_kwargs": {
                "video": {"fps": 1, "num_frames": 3, "hw_decoders": 2, "pool_size": 4, "device": "cpu"}
            }
        },
        {"video": {"num_frames": 16}},
        "20f0fcef19aa3ba6bb0a4bfd0eeb4ad9abce9b9b9a9e23131ac7b58560612d11",
    ),
    ("m", "blake3", "video", "vid", {"media_io_kwargs": {"video": {"hw_decoders": 2}}}, {}, "vid"),
    ("m", "blake3", "video", "vid", {"mm_processor_kwargs": {"images_kwargs": {"x": 1}}}, {}, "vid"),
    ("m", "blake3", "image", "u", {"mm_processor_kwargs": {}, "media_io_kwargs": {"image": {}}}, {}, "u"),
    (
        "m",
        "blake3",
        "image",
        "u",
        {"mm_processor_kwargs": {"images_kwargs": {}}},
        {},
        "1a986a72a4f7cf341aeedd3e239c31d60cd93118a44e2b7578f21d77ffe682e7",
    ),
]


@pytest.mark.parametrize(("model", "algorithm", "modality", "uuid", "fields", "server", "expected"), GOLDEN)
def test_identifiers_are_vllms(
    model: str,
    algorithm: str,
    modality: str,
    uuid: str,
    fields: dict[str, Any],
    server: dict[str, Any],
    expected: str,
) -> None:
    assert IdentifierRule(model, algorithm, server).identifier(modality, uuid, fields) == expected


def test_without_hash_factors_the_uuid_is_the_identifier_even_without_a_model_path() -> None:
    outside = IdentifierRule()
    assert outside.identifier("image", "u", {"priority": 3, "session_id": "s", "cache_salt": "x"}) == "u"
    assert outside.identifier("image", "u", {"mm_processor_kwargs": {"videos_kwargs": {"fps": 2}}}) == "u"
    # With factors, the model path is part of the hash: not known outside vLLM.
    assert outside.identifier("image", "u", {"mm_processor_kwargs": {"max_pixels": 1}}) is None
    assert not outside.derives_options


@pytest.mark.parametrize(
    ("modality", "fields"),
    [
        # A request choosing a video decoder: vLLM keeps or strips it by its loader registry.
        ("video", {"media_io_kwargs": {"video": {"backend": "opencv", "num_frames": 4}}}),
        # Per-video frame-rate lists: Qwen3-VL hashes each video again with its own entry.
        ("video", {"mm_processor_kwargs": {"videos_kwargs": {"fps": [1, 2]}}}),
        # Shapes vLLM refuses to validate.
        ("image", {"mm_processor_kwargs": [1]}),
        ("image", {"media_io_kwargs": {"image": 5}}),
        # Ints beyond 64 bits: vLLM's hasher serialises them by object identity.
        ("image", {"mm_processor_kwargs": {"big": 2**70}}),
        ("image", {"mm_processor_kwargs": {"bad": "\ud800"}}),
        ("vision_chunk", {}),
    ],
)
def test_what_is_not_known_is_said(modality: str, fields: dict[str, Any]) -> None:
    assert IdentifierRule("/models/m").identifier(modality, "u", fields) is None


def test_server_frame_rate_lists_and_tower_adapters_make_identifiers_unknown() -> None:
    assert IdentifierRule("/models/m", video_lists=True).identifier("video", "u", {}) is None
    assert IdentifierRule("/models/m", video_lists=True).identifier("image", "u", {}) == "u"
    tower = IdentifierRule("/models/m", unknown_because="LoRA adapters on the vision tower")
    assert tower.identifier("image", "u", {}) is None
    assert not tower.derives_options


def test_the_rule_of_a_vllm_server_is_read_from_its_configuration() -> None:
    from types import SimpleNamespace

    config = SimpleNamespace(
        model_config=SimpleNamespace(
            model="/models/m",
            multimodal_config=SimpleNamespace(
                mm_hasher_algorithm="sha256",
                media_io_kwargs={"image": {"x": 1}},
                mm_processor_kwargs={"videos_kwargs": {"num_frames": [4, 8]}},
            ),
        ),
        lora_config=None,
    )
    rule = Host.of_vllm(config).identifiers
    assert (rule.model, rule.algorithm, dict(rule.server_media_io), rule.video_lists) == (
        "/models/m",
        "sha256",
        {"image": {"x": 1}},
        True,
    )
    assert rule.identifier("image", "u", {}) == hash_kwargs(
        "sha256", model_id="/models/m", image="u", media_io_kwargs={"image": {"x": 1}}
    )
