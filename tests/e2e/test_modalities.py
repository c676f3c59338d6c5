"""Video and audio end to end on real vLLM 0.32 (CPU), not only images: a 16-frame clip through the tiny
Qwen2-VL, a 2-second tone through a tiny Qwen2-Audio, and image + video in one request, each through
E + PD with the middleware and compared with a single instance (greedy decoding: outputs must match)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from epd_lab import servers as lab
from epd_lab.seed import seed_image

from .conftest import API_KEY, AUDIO_MODEL, Deployment
from .test_vllm_e2e import assert_fails, assert_same, chat, record, served_requests

pytestmark = pytest.mark.e2e

MODEL = lab.SERVED_MODEL
AUTH = {"authorization": f"Bearer {API_KEY}"}
# num_frames alone leaves this clip at 416 prompt tokens; the size cap makes each frame smaller.
VIDEO_OPTIONS = {
    "media_io_kwargs": {"video": {"num_frames": 4}},
    "mm_processor_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 12544}},
}
AUDIO_OPTIONS = {"mm_processor_kwargs": {"sampling_rate": 16000}}
LOADED = "Success load encoder cache for hash"


def data_url(path: Path, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(path.read_bytes()).decode()


def video_part(url: str) -> dict[str, Any]:
    return {"type": "video_url", "video_url": {"url": url}}


def audio_part(deployment: Deployment, kind: str) -> dict[str, Any]:
    if kind == "input_audio":
        data = base64.b64encode(deployment.audio.read_bytes()).decode()
        return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    return {"type": "audio_url", "audio_url": {"url": data_url(deployment.audio, "audio/wav")}}


def request(
    parts: list[dict[str, Any]], options: dict[str, Any] | None = None, model: str = MODEL
) -> dict[str, Any]:
    content = [*parts, {"type": "text", "text": "What happens here?"}]
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "seed": 42,
        "max_tokens": 8,
        **(options or {}),
    }


def encode_on(
    encoder: lab.VLLMServer, part: dict[str, Any], options: dict[str, Any] | None
) -> dict[str, Any]:
    """What the middleware asks an encoder, from the test: the part with its uuid, the options."""
    body = {
        "model": encoder.served_name,
        "messages": [{"role": "user", "content": [part]}],
        "max_tokens": 1,
        **(options or {}),
    }
    reply: dict[str, Any] = httpx.post(f"{encoder.url}/v1/chat/completions", json=body, timeout=300).json()
    return reply


def loaded(server: lab.VLLMServer, mm_hash: str) -> bool:
    return f"{LOADED} {mm_hash}" in server.log_path.read_text(errors="replace")


def test_video_equals_the_single_instance_and_pd_gets_no_frames(deployment: Deployment) -> None:
    tokens = [video_case(deployment, options) for options in (None, VIDEO_OPTIONS)]
    assert tokens[1] < tokens[0]  # the options took effect, on E and PD alike (416 -> 68 on this clip)


def video_case(deployment: Deployment, options: dict[str, Any] | None) -> int:
    """One video request through E + PD against the single instance; its prompt tokens."""
    url = data_url(deployment.video, "video/mp4")
    uuid = lab.lab_uuid("video", (url,))
    body = request([video_part(url)], options)
    baseline = chat(deployment.single, body)
    record(f"single instance, video, {'non-default' if options else 'default'}", baseline)
    before = deployment.stored_hashes()
    encoded = sum(served_requests(server) for server in deployment.encoders)
    response = chat(deployment.pd, body, AUTH)
    record(f"E + PD, video, {'non-default' if options else 'default'}", response, baseline)
    assert_same(response, baseline)
    [stored] = deployment.stored_hashes() - before  # encoded remotely, once
    assert sum(served_requests(server) for server in deployment.encoders) == encoded + 1
    # PD loaded the embedding under the hash the encoder reported: the uuid without options, the hash
    # vLLM derives from model, uuid and options with them.
    assert (stored == uuid) == (options is None)
    assert loaded(deployment.pd, stored)

    # The body PD gets holds no frame at all: a metadata-only reference and the encoder's handle.
    reply = encode_on(deployment.encoders[0], {**video_part(url), "uuid": uuid}, options)
    [(reported, entry)] = reply["ec_transfer_params"].items()
    assert reported == stored
    reference = {"type": "video_embeds", "video_embeds": entry["metadata"], "uuid": uuid}
    rewritten = request([reference], options)
    rewritten["ec_transfer_params"] = reply["ec_transfer_params"]
    assert "base64" not in json.dumps(rewritten)
    direct = chat(deployment.pd, rewritten, AUTH)
    record("PD, video metadata-only body (no frames)", direct, baseline)
    assert_same(direct, baseline)
    tokens: int = response.json()["usage"]["prompt_tokens"]
    return tokens


def test_image_and_video_in_one_request_over_two_encoders(deployment: Deployment) -> None:
    video, picture = data_url(deployment.video, "video/mp4"), seed_image(shift=37)
    body = request([{"type": "image_url", "image_url": {"url": picture}}, video_part(video)], VIDEO_OPTIONS)
    body["messages"][0]["content"].reverse()  # text first, then video, then image: order is the client's
    baseline = chat(deployment.single, body)
    before = deployment.stored_hashes()
    response = chat(deployment.pd, body, AUTH)
    record("E + PD, image + video, non-default", response, baseline)
    assert_same(response, baseline)
    new = deployment.stored_hashes() - before
    assert 1 <= len(new) <= 2  # the image is new; the video too unless the test above stored it
    assert all(loaded(deployment.pd, mm_hash) for mm_hash in new)


@pytest.mark.parametrize("kind", ["input_audio", "audio_url"])
@pytest.mark.parametrize("options", [None, AUDIO_OPTIONS], ids=["default", "non-default"])
def test_audio_equals_the_single_instance_and_pd_gets_no_samples(
    deployment: Deployment, kind: str, options: dict[str, Any] | None
) -> None:
    part = audio_part(deployment, kind)
    body = request([part], options, AUDIO_MODEL)
    baseline = chat(deployment.audio_single, body)
    record(f"single instance, audio ({kind}), {'non-default' if options else 'default'}", baseline)
    before = deployment.stored_hashes(deployment.audio_storage)
    encoded = served_requests(deployment.audio_encoder)
    response = chat(deployment.audio_pd, body)
    record(f"E + PD, audio ({kind}), {'non-default' if options else 'default'}", response, baseline)
    assert_same(response, baseline)
    [stored] = deployment.stored_hashes(deployment.audio_storage) - before
    assert served_requests(deployment.audio_encoder) == encoded + 1
    content = (part["input_audio"]["data"], "wav") if kind == "input_audio" else (part["audio_url"]["url"],)
    uuid = lab.lab_uuid("audio", content)
    assert (stored == uuid) == (options is None)
    assert loaded(deployment.audio_pd, stored)

    reply = encode_on(deployment.audio_encoder, {**part, "uuid": uuid}, options)
    [(reported, entry)] = reply["ec_transfer_params"].items()
    assert reported == stored
    assert entry["metadata"], "the encoder reports what a metadata-only reference needs"
    reference = {"type": "audio_embeds", "audio_embeds": entry["metadata"], "uuid": uuid}
    rewritten = request([reference], options, AUDIO_MODEL)
    rewritten["ec_transfer_params"] = reply["ec_transfer_params"]
    assert "base64" not in json.dumps(rewritten)
    direct = chat(deployment.audio_pd, rewritten)
    record(f"PD, audio metadata-only body ({kind})", direct, baseline)
    assert_same(direct, baseline)


def test_zz_audio_reference_under_dropped_options_is_refused_by_the_middleware(
    deployment: Deployment,
) -> None:
    """What the middleware prevents, for audio: the encoder ran without the options, PD runs with them,
    so the engine would look for the embedding under the hash it derives from them, which nobody
    stored. Sent by a client straight to PD, the middleware finds it missing and refuses it (400); the
    engine, which would have died on it, goes on serving."""
    part, uuid = audio_part(deployment, "audio_url"), "audio-negative-control"
    reply = encode_on(deployment.audio_encoder, {**part, "uuid": uuid}, None)
    [(reported, entry)] = reply["ec_transfer_params"].items()
    assert reported == uuid
    reference = {"type": "audio_embeds", "audio_embeds": entry["metadata"], "uuid": uuid}
    body = request([reference], AUDIO_OPTIONS, AUDIO_MODEL)
    body["ec_transfer_params"] = reply["ec_transfer_params"]
    refused = chat(deployment.audio_pd, body)
    record("audio reference under dropped options", refused)
    assert refused.status_code == 400, refused.text
    assert "does not have" in refused.json()["error"]["message"]
    assert_fails("audio negative control (options dropped)", deployment.audio_pd, body)
    alive = request([audio_part(deployment, "input_audio")], AUDIO_OPTIONS, AUDIO_MODEL)
    assert_same(chat(deployment.audio_pd, alive), chat(deployment.audio_single, alive))
