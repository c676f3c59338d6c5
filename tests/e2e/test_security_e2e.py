"""Issue 20 on real vLLM: the identifier the middleware derives is the one vLLM derives (vLLM's own code,
on generated cases), a client's reference to an embedding PD does not have is refused and the engine
lives on, and bodies only Python's json reads are encoded remotely like any other."""

from __future__ import annotations

import codecs
import json
import os
import random
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from epd_lab.seed import NON_DEFAULT_OPTIONS, seed_request
from epd_middleware._identifiers import IdentifierRule

from .conftest import Deployment
from .test_vllm_e2e import AUTH, MODEL, assert_same, chat, image, record, served_requests

pytestmark = pytest.mark.e2e

HERE = Path(__file__).parent


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 2 else 6)
    if kind == 0:
        return rng.randrange(-(2**40), 2**40)
    if kind == 1:
        return rng.choice([0.5, 1.0, -2.25, 1e300, 3.0])
    if kind == 2:
        return rng.choice(["a", "ü", "键", "", "image"])
    if kind == 3:
        return rng.choice([True, False])
    if kind == 4:
        return None
    if kind == 5:
        return rng.choice([2**63 + 1, -(2**63), 7])
    if kind == 6:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {
        rng.choice(["x", "y", "fps", "num_frames", "size"]): _value(rng, depth + 1)
        for _ in range(rng.randrange(3))
    }


def generated_cases(count: int) -> list[dict[str, Any]]:
    rng = random.Random(20)
    keys = ["size", "max_pixels", "images_kwargs", "videos_kwargs", "audio_kwargs", "sampling_rate", "fps"]
    io_keys = ["num_frames", "fps", "rgba_background_color", "hw_decoders", "pool_size", "device", "x"]
    cases = []
    for _ in range(count):
        modality = rng.choice(["image", "video", "audio"])
        fields: dict[str, Any] = {}
        if rng.random() < 0.7:
            fields["mm_processor_kwargs"] = {rng.choice(keys): _value(rng) for _ in range(rng.randrange(3))}
        if rng.random() < 0.6:
            fields["media_io_kwargs"] = {
                rng.choice(["image", "video", "audio"]): {rng.choice(io_keys): _value(rng) for _ in range(2)}
                for _ in range(rng.randrange(1, 3))
            }
        server = {}
        if rng.random() < 0.3:
            server = {modality: {rng.choice(io_keys): _value(rng) for _ in range(2)}}
        cases.append(
            {
                "model": rng.choice(["/models/tiny-qwen2-vl", "Qwen/Qwen2.5-VL-3B-Instruct"]),
                "algorithm": rng.choice(["blake3", "sha256", "sha512"]),
                "modality": modality,
                "uuid": f"{rng.getrandbits(64):016x}",
                "fields": fields,
                "server_media_io": server,
            }
        )
    return cases


def test_the_identifier_the_middleware_derives_is_the_one_vllm_derives() -> None:
    """Where the middleware names an identifier, vLLM's own code gives the same (400 generated cases);
    where it says it does not know, that is allowed (it then makes no reference)."""
    python = os.environ.get("EPD_VLLM_PYTHON")
    if not python:
        pytest.skip("EPD_VLLM_PYTHON is not set")
    cases = generated_cases(400)
    done = subprocess.run(
        [python, str(HERE / "vllm_identifiers.py")],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    expected = json.loads(done.stdout)
    known = 0
    for case, vllms in zip(cases, expected, strict=True):
        ours = IdentifierRule(case["model"], case["algorithm"], case["server_media_io"]).identifier(
            case["modality"], case["uuid"], case["fields"]
        )
        if ours is not None:
            known += 1
            assert ours == vllms, case
    assert known > 300  # the rule knows most cases, not only the easy ones


def test_a_client_reference_to_a_missing_embedding_is_refused_and_the_engine_lives(
    deployment: Deployment,
) -> None:
    """Sent to a PD without the middleware, this kills vLLM's engine core (the negative controls show
    it); through the middleware it is a 400 naming the part, and the server goes on serving."""
    body = seed_request(MODEL, images=[])
    reference = {
        "type": "image_embeds",
        "image_embeds": {"image_grid_thw": [1, 4, 4]},
        "uuid": "never-stored",
    }
    body["messages"][0]["content"].insert(0, reference)
    body["ec_transfer_params"] = {"never-stored": {"metadata": {"image_grid_thw": [1, 4, 4]}}}
    refused = chat(deployment.pd, body, AUTH)
    record("PD, client reference to a missing embedding", refused)
    assert refused.status_code == 400, refused.text
    assert "messages[0].content[0]" in refused.json()["error"]["message"]
    alive = seed_request(MODEL, options=NON_DEFAULT_OPTIONS)
    baseline = chat(deployment.single, alive)
    after = chat(deployment.pd, alive, AUTH)
    record("PD, serving after the refused reference", after, baseline)
    assert_same(after, baseline)


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-32"])
def test_a_body_only_pythons_json_reads_is_encoded_remotely_and_equals_the_single_instance(
    deployment: Deployment, encoding: str
) -> None:
    """Before: such a body skipped the middleware, its image encoded by PD itself."""
    body = seed_request(MODEL, images=[image(shift=400 + len(encoding))])
    baseline = chat(deployment.single, body)
    encoded = sum(served_requests(server) for server in deployment.encoders)
    raw = json.dumps(body).encode(encoding)
    assert encoding != "utf-8-sig" or raw.startswith(codecs.BOM_UTF8)
    response = httpx.post(
        f"{deployment.pd.url}/v1/chat/completions",
        content=raw,
        headers={**AUTH, "content-type": "application/json"},
        timeout=300,
    )
    response.elapsed_s = 0.0  # type: ignore[attr-defined]
    record(f"E + PD, {encoding} body", response, baseline)
    assert_same(response, baseline)
    assert sum(served_requests(server) for server in deployment.encoders) == encoded + 1
