"""Issue 29 on real vLLM: one client's bad media takes no encoder from another client, and a client
reference removed while its request is prepared never reaches the engine (which keeps serving).

The PD under test is the plugin deployment with two real encoders (ECExampleConnector, shared storage),
compared with the single instance of the same tiny model: bad requests get the single instance's answer,
good ones its output.
"""

from __future__ import annotations

import base64
import shutil
import threading
import time
from typing import Any

import httpx
import pytest

from epd_lab.seed import seed_image, seed_request

from .conftest import Deployment
from .slow_media import slow_media_host
from .test_vllm_e2e import AUTH, MODEL, access_log_count, assert_same, chat, encode_directly, record

pytestmark = pytest.mark.e2e

NOT_BASE64 = "data:image/png,not-base64-at-all"
UNRESOLVABLE = "http://images.nope.invalid/cat.png"


def refusals(server: Any) -> int:
    """Chat completions the server answered 500 or 501."""
    return sum(
        access_log_count(server, f'"POST /v1/chat/completions HTTP/1.1" {code}') for code in (500, 501)
    )


def status(server: Any) -> dict[str, Any]:
    reply: dict[str, Any] = httpx.get(f"{server.url}/epd/status", headers=AUTH, timeout=30).json()
    return reply


def test_a_client_repeating_bad_media_takes_no_encoder_from_another_client(deployment: Deployment) -> None:
    """Before: each bad request failed over to the other encoder and counted a failure on both; 3 such
    requests ejected both, and the next honest request got 503 where a single instance answers it."""
    bad_bodies = {
        "non-base64 data URL": seed_request(MODEL, images=[NOT_BASE64]),
        "unresolvable image host": seed_request(MODEL, images=[UNRESOLVABLE]),
    }
    single_answers = {name: chat(deployment.single, body) for name, body in bad_bodies.items()}
    assert single_answers["non-base64 data URL"].status_code == 501
    assert single_answers["unresolvable image host"].status_code == 500
    honest = [seed_request(MODEL, images=[seed_image(shift=177 + 10 * i)]) for i in range(6)]
    baselines = [chat(deployment.single, body) for body in honest]
    refusals_before = sum(refusals(server) for server in deployment.encoders)
    attacks: list[tuple[str, int, dict[str, Any]]] = []
    stop = threading.Event()

    def attacker() -> None:
        while not stop.is_set():
            for name, body in bad_bodies.items():
                response = chat(deployment.pd, body, AUTH)
                attacks.append((name, response.status_code, response.json()))

    thread = threading.Thread(target=attacker, daemon=True)
    started = time.monotonic()
    thread.start()
    try:
        for body, baseline in zip(honest, baselines, strict=True):
            response = chat(deployment.pd, body, AUTH)
            record("honest client beside an attacker", response, baseline)
            assert_same(response, baseline)
        while len(attacks) < 6:  # at least 3 of each kind, as in the attack that emptied the pool
            time.sleep(0.5)
    finally:
        stop.set()
        thread.join(timeout=120)
    elapsed = time.monotonic() - started
    for name, code, answer in attacks:
        expected = single_answers[name]
        assert (code, answer) == (expected.status_code, expected.json()), name
    page = status(deployment.pd)
    for url in (server.url for server in deployment.encoders):
        state = page["encoders"][url]
        assert state["healthy"], (url, state)
        assert state["consecutive_failures"] == 0
    blamed = sum(state["failures_by_blame"].get("request", 0) for state in page["encoders"].values())
    assert blamed >= len(attacks)
    # Not one call per encoder: a data URL vLLM refuses costs one call; a media host that does not
    # resolve costs two (one encoder's failure to fetch may be its own egress: a second one confirms it).
    expected = sum(1 if name == "non-base64 data URL" else 2 for name, _, _ in attacks)
    # Issue 35: an encoder whose share of "the client's fault" answers stands out from the other's (content
    # affinity sends the data URL to one of them) is doubted, and one second opinion a health-check
    # interval vindicates it: bounded by the time the attack ran, never one per bad request (CI saw 13
    # for 12).
    doubts = 1 + int(elapsed / page["config"]["health_check_interval"])
    extra = sum(refusals(server) for server in deployment.encoders) - refusals_before - expected
    assert 0 <= extra <= doubts, (extra, doubts, len(attacks))


def test_a_client_reference_removed_while_its_request_is_prepared_is_refused_and_the_engine_lives(
    deployment: Deployment,
) -> None:
    """Before: references were checked once, before the encoder calls; one removed during a slow call
    reached the engine, whose core died on it."""
    uuid = "e2e-reference-removed-mid-request"
    reply = encode_directly(deployment, seed_image(shift=251), uuid, None)
    [(mm_hash, entry)] = reply["ec_transfer_params"].items()
    assert (deployment.storage / mm_hash).is_dir()
    image = base64.b64decode(seed_image(shift=252).split(",", 1)[1])

    def cleanup() -> None:  # removes the referenced embedding while the sibling's fetch waits
        shutil.rmtree(deployment.storage / mm_hash, ignore_errors=True)

    with slow_media_host(image, 1.0, on_get=cleanup) as (url, asked):
        body = seed_request(MODEL, images=[url])
        body["messages"][0]["content"].insert(
            0, {"type": "image_embeds", "image_embeds": entry["metadata"], "uuid": uuid}
        )
        response = chat(deployment.pd, body, AUTH)
        assert asked.is_set()  # the sibling call was under way when it went
    record("client reference removed mid-request", response)
    assert response.status_code == 400, response.text
    assert "no longer has" in response.json()["error"]["message"]
    # The engine keeps serving.
    body = seed_request(MODEL, images=[seed_image(shift=253)])
    baseline = chat(deployment.single, body)
    after = chat(deployment.pd, body, AUTH)
    record("E + PD after a reference removed mid-request", after, baseline)
    assert_same(after, baseline)


def test_by_default_a_clients_own_embedding_is_refused_and_the_engine_lives(deployment: Deployment) -> None:
    """vLLM's --enable-mm-embeds trusts an embedding's shape: a reference claiming a grid its stored
    embedding does not have would crash the engine core. pd-adaptive runs the default
    (client_embeddings=refuse): refused at once, and the next request is answered exactly."""
    uuid = "e2e-client-embedding-refused"
    reply = encode_directly(deployment, seed_image(shift=255), uuid, None)
    [(_, entry)] = reply["ec_transfer_params"].items()
    lie = {**entry["metadata"], "image_grid_thw": [1, 200, 200]}
    body = seed_request(MODEL, images=[])
    body["messages"][0]["content"].insert(0, {"type": "image_embeds", "image_embeds": lie, "uuid": uuid})
    response = chat(deployment.pd_adaptive, body)
    record("a client's own embedding, by default", response)
    assert response.status_code == 400, response.text
    assert "client_embeddings=refuse" in response.json()["error"]["message"]
    body = seed_request(MODEL, images=[seed_image(shift=256)])
    assert_same(chat(deployment.pd_adaptive, body), chat(deployment.single, body))
