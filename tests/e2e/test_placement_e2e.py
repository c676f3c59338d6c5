"""Issue 30 on real vLLM: adaptive placement on a PD with ECExampleConnector (``pd_adaptive``): a small
request encoded here and a large one on the encoders each equal the single instance, image and video;
with every encoder held busy, work is placed here and still answers exactly; one request with a modality
placed here and another on an encoder is exact. (On a Mooncake PD adaptive never places here:
tests/e2e/test_mooncake_e2e.py.)

pd_adaptive: ``placement_pd_idle_load`` 0 (the tests send one request at a time, and an idle PD would
keep everything here), ``placement_small_tokens`` 300 (the seed image is 234 vision tokens on the tiny model),
``placement_encoder_busy_calls`` 1 and a probe each second, so one request an encoder is busy with, seen
in its ``GET /load`` (``--enable-server-load-tracking``), saturates it.
"""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from epd_lab.seed import seed_image, seed_request

from .conftest import Deployment
from .slow_media import slow_media_host
from .test_modalities import VIDEO_OPTIONS, data_url, request, video_part
from .test_vllm_e2e import MODEL, assert_same, chat, chat_calls, record

pytestmark = pytest.mark.e2e

# Each video case its own options: a video already encoded for this PD would be reused, not placed.
OTHER_VIDEO_OPTIONS = {
    "media_io_kwargs": {"video": {"num_frames": 4}},
    "mm_processor_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 9408}},
}
MIXED_OPTIONS = {
    "media_io_kwargs": {"video": {"num_frames": 4}},
    "mm_processor_kwargs": {"size": {"shortest_edge": 3136, "longest_edge": 6272}},
}


def placement(deployment: Deployment) -> dict[str, Any]:
    page: dict[str, Any] = httpx.get(f"{deployment.pd_adaptive.url}/epd/status", timeout=30).json()
    return dict(page["placement"])


def decided(deployment: Deployment, run: Any) -> tuple[Any, dict[str, int]]:
    """What ``run()`` returned, and the placement decisions it added."""
    before = placement(deployment)["decisions"]
    result = run()
    after = placement(deployment)["decisions"]
    return result, {key: after[key] - before.get(key, 0) for key in after if after[key] != before.get(key, 0)}


def encoder_calls(deployment: Deployment) -> int:
    return sum(chat_calls(server) for server in deployment.encoders)


@contextmanager
def encoders_held_busy(deployment: Deployment, seconds: float = 6.0) -> Iterator[None]:
    """Every encoder busy with one request of the test's own (its image host answers late), until the PD's
    placement sees them saturated (its probe reads their GET /load)."""
    image = base64.b64decode(seed_image(shift=221).split(",", 1)[1])
    with slow_media_host(image, seconds) as (url, _):
        threads = [
            threading.Thread(
                target=httpx.post,
                args=(f"{encoder.url}/v1/chat/completions",),
                kwargs={"json": seed_request(MODEL, images=[url]), "timeout": 120},
                daemon=True,
            )
            for encoder in deployment.encoders
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + seconds - 1
        while not placement(deployment)["encoders_saturated"]:
            assert time.monotonic() < deadline, placement(deployment)
            time.sleep(0.2)
        yield
        for thread in threads:
            thread.join(timeout=120)
    deadline = time.monotonic() + 10
    while placement(deployment)["encoders_saturated"]:  # until a probe saw them free again
        assert time.monotonic() < deadline, placement(deployment)
        time.sleep(0.2)


def test_a_small_request_placed_here_and_a_large_one_remotely_each_equal_the_single_instance(
    deployment: Deployment,
) -> None:
    small = seed_request(MODEL, images=[seed_image(shift=246)])
    large = seed_request(MODEL, images=[seed_image(shift=241 + i) for i in range(4)])
    for name, body, where, calls in (("small", small, "local_small", 0), ("large", large, "remote_large", 1)):
        baseline = chat(deployment.single, body)
        before = encoder_calls(deployment)
        response, decisions = decided(deployment, lambda body=body: chat(deployment.pd_adaptive, body))
        record(f"adaptive placement, {name} image request", response, baseline)
        assert_same(response, baseline)
        assert decisions == {where: 1}, decisions
        assert encoder_calls(deployment) - before >= calls
        if not calls:
            assert encoder_calls(deployment) == before  # encoded here: no encoder call


def test_video_placed_remotely_then_here_while_the_encoders_are_busy_equals_the_single_instance(
    deployment: Deployment,
) -> None:
    body = request([video_part(data_url(deployment.video, "video/mp4"))], VIDEO_OPTIONS)
    baseline = chat(deployment.single, body)
    response, decisions = decided(deployment, lambda: chat(deployment.pd_adaptive, body))
    record("adaptive placement, video on an encoder", response, baseline)
    assert_same(response, baseline)
    assert decisions == {"remote_size_unknown": 1}, decisions
    # Other options, so that nothing of the first is reused and the placement is decided again.
    body = request([video_part(data_url(deployment.video, "video/mp4"))], OTHER_VIDEO_OPTIONS)
    baseline = chat(deployment.single, body)
    with encoders_held_busy(deployment):
        response, decisions = decided(deployment, lambda: chat(deployment.pd_adaptive, body))
    record("adaptive placement, video here (encoders busy)", response, baseline)
    assert_same(response, baseline)
    assert decisions == {"local_encoders_saturated": 1}, decisions


def test_with_every_encoder_held_busy_a_large_request_is_placed_here_and_answers_exactly(
    deployment: Deployment,
) -> None:
    body = seed_request(MODEL, images=[seed_image(shift=231 + i) for i in range(4)])
    baseline = chat(deployment.single, body)
    with encoders_held_busy(deployment):
        before = encoder_calls(deployment)
        response, decisions = decided(deployment, lambda: chat(deployment.pd_adaptive, body))
        assert encoder_calls(deployment) == before
    record("adaptive placement, 4 images here (encoders busy)", response, baseline)
    assert_same(response, baseline)
    assert decisions == {"local_encoders_saturated": 1}, decisions


def test_a_request_with_one_modality_placed_here_and_another_remotely_is_exact(
    deployment: Deployment,
) -> None:
    video = video_part(data_url(deployment.video, "video/mp4"))
    picture = {"type": "image_url", "image_url": {"url": seed_image(shift=236)}}
    body = request([picture, video], MIXED_OPTIONS)
    baseline = chat(deployment.single, body)
    response, decisions = decided(deployment, lambda: chat(deployment.pd_adaptive, body))
    record("adaptive placement, image here + video on an encoder", response, baseline)
    assert_same(response, baseline)
    assert decisions == {"local_small": 1, "remote_size_unknown": 1}, decisions
