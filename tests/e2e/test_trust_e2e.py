"""Issue 35 on real vLLM: blame in both directions, and content uuids no one can name in advance.

- An encoder that answers "the client's fault" (501) to everything is found out after its first answers
  (its share of them is evidence, its canary fails), counted and ejected; its requests fail over.
- A client key a gateway throttles (429 on every encoder) is the client's answer, and ejects no encoder.
- An embedding planted on an encoder under the public, unkeyed uuid of someone's image never reaches PD.

The first two run on one extra PD (the plugin, ``forward_authorization``, a canary key) whose encoders are
the deployment's two real encoders behind a loopback gateway (tests/e2e/gateway.py); the third on the
deployment's own PD and encoders. Answers are compared with the single instance (greedy, exact).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from epd_lab import servers as lab
from epd_lab.seed import SQUARES, data_url, png_rgba, seed_request
from epd_middleware._plan import content_uuid

from .conftest import Deployment
from .gateway import BROKEN_MESSAGE, THROTTLED_MESSAGE, Gateway
from .test_vllm_e2e import (
    AUTH,
    MODEL,
    REPORT,
    _sample,
    assert_same,
    chat,
    metadata_only_body,
    planned_calls,
    record,
    same_answer,
)

pytestmark = pytest.mark.e2e

OVER_QUOTA = "over-quota"
HONEST = {"authorization": "Bearer honest-client"}
THROTTLED = {"authorization": f"Bearer {OVER_QUOTA}"}
CANARY_KEY = "canary-key-of-the-operator"
BROKEN = 1  # the gateway port (and encoder) made to answer 501
# Seconds to wait for a state the middleware reaches on its own (an ejection, a cool-down's end).
SETTLE_S = 180.0


class TrustPD:
    def __init__(self, gateway: Gateway, server: lab.VLLMServer) -> None:
        self.gateway, self.server = gateway, server

    def status(self) -> dict[str, Any]:
        page: dict[str, Any] = httpx.get(f"{self.server.url}/epd/status", timeout=30).json()
        return page

    def encoder(self, port: int) -> dict[str, Any]:
        state: dict[str, Any] = self.status()["encoders"][self.gateway.urls[port]]
        return state

    def metric(self, name: str, port: int, **labels: str) -> float:
        text = httpx.get(f"{self.server.url}/metrics", timeout=30).text
        return _sample(text, name, encoder=self.gateway.urls[port], **labels)


@pytest.fixture(scope="module")
def trust_pd(deployment: Deployment) -> Iterator[TrustPD]:
    """A PD with the plugin whose encoders are the two gateway ports, forwarding the client's key, the
    canary carrying the operator's key (which the gateway passes), probing each second. Its ejections
    last 10 s at most, so an encoder back to health is back in the pool soon."""
    gateway = Gateway([server.url for server in deployment.encoders], OVER_QUOTA)
    server = lab.pd_server(
        deployment.python,
        deployment.model,
        deployment.single.log_dir,
        deployment.storage,
        gateway.urls,
        via="plugin",
        name="pd-trust",
        extra_env={
            "EPD_FORWARD_AUTHORIZATION": "true",
            "EPD_CANARY_API_KEY": CANARY_KEY,
            "EPD_HEALTH_CHECK_INTERVAL": "1",
            "EPD_MAX_EJECT_COOLDOWN": "10",
        },
    )
    try:
        lab.start_all([server], timeout=900)
        yield TrustPD(gateway, server)
    finally:
        server.stop()
        gateway.close()


def trust_image(shift: int) -> str:
    """A variant of the seed image of this file's own: its squares moved ``shift`` pixels to the right
    (the other e2e files move them diagonally), so no other test sends it and stores its embedding
    first (every lab PD shares one uuid key: what one stores, all reuse)."""
    return data_url(png_rgba(squares=[((x + shift, y), color) for (x, y), color in SQUARES]))


def images_first_on(encoders: list[str], port: int, shifts: range, count: int) -> list[str]:
    """``count`` distinct images (of ``shifts``) that content affinity sends to ``encoders[port]`` first."""
    found = [url for shift in shifts if planned_calls(encoders, [url := trust_image(shift)])[port]]
    assert len(found) >= count, (len(found), count)
    return found[:count]


def wait_for(what: str, check: Any, timeout: float = SETTLE_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


def test_an_encoder_answering_501_to_everything_is_found_out_ejected_and_its_requests_fail_over(
    trust_pd: TrustPD, deployment: Deployment
) -> None:
    """Before: a server's 501 was the request's fault, always: an encoder answering it to every call was
    never counted, never ejected, and every request it ranked first got its 501. Now its first answers
    pass (no evidence yet), then its share of them has it doubted, its canary fails: counted, failed
    over, ejected; every later request equals the single instance. It runs first on the extra PD: the
    encoder has given no answers before it breaks (a long record of successes would let more of its
    501s through before its share reaches half)."""
    gateway, pd = trust_pd.gateway, trust_pd.server
    # Every image ranks the broken encoder first: each request is one more of its answers.
    urls = images_first_on(gateway.urls, BROKEN, range(1, 260), 15)
    more = iter(images_first_on(gateway.urls, BROKEN, range(260, 320), 5))
    mark = gateway.mark()
    gateway.broken.add(BROKEN)
    outcomes: list[int] = []
    try:
        for index, url in enumerate(urls):
            body = seed_request(MODEL, images=[url])
            baseline = chat(deployment.single, body)
            response = chat(pd, body, HONEST)
            record(f"501-encoder behind the gateway, request {index}", response, baseline)
            outcomes.append(response.status_code)
            if response.status_code != 200:
                # Its answer, as vLLM's own would reach a client: the status and the message.
                assert response.status_code == 501, response.text
                assert response.json()["error"]["message"] == BROKEN_MESSAGE
                continue
            assert_same(response, baseline)
        failed = [index for index, status in enumerate(outcomes) if status != 200]
        # Only its first answers, before they are evidence (a share of a few answers at least).
        assert failed == list(range(len(failed))), outcomes
        assert len(failed) <= 3, outcomes

        def ejected() -> dict[str, Any] | None:
            state = trust_pd.encoder(BROKEN)
            if not state["healthy"]:
                return state
            # Its cool-down ended and no request tried it since: one more makes it try (and fail) again.
            body = seed_request(MODEL, images=[next(more)])
            response = chat(pd, body, HONEST)
            outcomes.append(response.status_code)
            assert_same(response, chat(deployment.single, body))
            return None

        state = wait_for("the broken encoder's ejection", ejected)
        # Its 501s were shown its own by its canary: counted as "unmasked", which the alert
        # EPDEncoderHidesItsFailures reads.
        assert state["failures_by_blame"].get("unmasked", 0) >= 3, state
        assert "canary" in (state["why_not"] or ""), state
        good = trust_pd.encoder(1 - BROKEN)
        assert good["healthy"], good
        assert good["failures_by_blame"].get("server", 0) == 0, good
        server_failures = trust_pd.metric("epd_encoder_failures_total", BROKEN, blame="unmasked")
        ejections = trust_pd.metric("epd_encoder_ejection_checks_total", BROKEN, result="ejected")
        assert server_failures >= 3
        assert ejections >= 1
        # The canary carried the operator's key, never the client's.
        canaries = gateway.chat_calls(BROKEN, canary=True, since=mark)
        assert canaries
        assert {call.authorization for call in canaries} == {f"Bearer {CANARY_KEY}"}
        assert not gateway.chat_calls(1 - BROKEN, canary=True, since=mark)
        client_calls = [len(gateway.chat_calls(port, canary=False, since=mark)) for port in (0, 1)]
        REPORT.append(
            {
                "case": "501-encoder: failed, calls, canaries",
                "status": 200,
                "output": f"failed {failed} of {len(outcomes)}; client calls per encoder {client_calls}; "
                f"canaries {len(canaries)}; server failures {server_failures:g}; ejections {ejections:g}; "
                f"blame {state['failures_by_blame']}",
            }
        )
    finally:
        gateway.broken.discard(BROKEN)


def test_a_throttled_client_key_is_the_clients_answer_and_ejects_no_encoder(
    trust_pd: TrustPD, deployment: Deployment
) -> None:
    """Before: a 429 to a forwarded client key counted against the encoder, and the canary confirming its
    ejection carried that same throttled key: a client over its quota could eject encoders from under
    honest clients. Now each such request is tried once on the other encoder, the same 429 there is the
    client's answer (the gateway's words), and no encoder is counted a failure or ejected."""
    gateway, pd = trust_pd.gateway, trust_pd.server
    # The previous test's broken encoder is sound again; its last ejection ends within 10 s.
    wait_for(
        "both encoders in the pool",
        lambda: all(trust_pd.encoder(port)["healthy"] for port in (0, 1)),
    )
    before = {
        port: (
            trust_pd.metric("epd_encoder_failures_total", port, blame="server"),
            trust_pd.metric("epd_encoder_ejection_checks_total", port, result="ejected"),
            trust_pd.encoder(port)["failures_by_blame"],
        )
        for port in (0, 1)
    }
    mark = gateway.mark()
    shifts = iter(range(320, 540))
    throttled = honest = 0
    for round_ in range(6):
        # Three over-quota requests in a row between honest ones: had each counted against the encoders
        # (as before), the first three would have ejected one.
        for _ in range(3 if round_ < 4 else 0):
            response = chat(pd, seed_request(MODEL, images=[trust_image(next(shifts))]), THROTTLED)
            record("over-quota key behind the gateway", response)
            assert response.status_code == 429, response.text
            assert response.json()["error"]["message"] == THROTTLED_MESSAGE
            throttled += 1
        body = seed_request(MODEL, images=[trust_image(next(shifts))])
        baseline = chat(deployment.single, body)
        response = chat(pd, body, HONEST)
        record("honest key beside an over-quota one", response, baseline)
        assert_same(response, baseline)
        honest += 1
    page = trust_pd.status()
    for port in (0, 1):
        state = page["encoders"][gateway.urls[port]]
        assert state["healthy"], (port, state)
        assert state["failures_by_blame"].get("server", 0) == before[port][2].get("server", 0), state
        assert trust_pd.metric("epd_encoder_failures_total", port, blame="server") == before[port][0]
        assert trust_pd.metric("epd_encoder_ejection_checks_total", port, result="ejected") == before[port][1]
    # Each over-quota request: once on each encoder (one may not have the key list yet), no more.
    refused = [call for call in gateway.chat_calls(since=mark) if call.status == 429]
    assert len(refused) == 2 * throttled
    assert {call.port for call in refused} == {0, 1}
    assert all(call.authorization == f"Bearer {OVER_QUOTA}" for call in refused)
    # Never the client's key in a canary (none was needed: no server was blamed).
    assert all(call.authorization == f"Bearer {CANARY_KEY}" for call in gateway.chat_calls(canary=True))
    credentials = {
        port: page["encoders"][gateway.urls[port]]["failures_by_blame"].get("credentials", 0)
        - before[port][2].get("credentials", 0)
        for port in (0, 1)
    }
    assert sum(credentials.values()) == 2 * throttled, credentials
    served = [
        sum(call.status == 200 for call in gateway.chat_calls(port, canary=False, since=mark))
        for port in (0, 1)
    ]
    REPORT.append(
        {
            "case": "over-quota key: 429s, honest served",
            "status": 200,
            "output": f"429 x {throttled} (gateway refusals {len(refused)}), honest {honest}/{honest} equal; "
            f"honest calls per encoder {served}; credentials blamed {credentials}",
        }
    )


def test_an_embedding_planted_under_the_public_uuid_never_reaches_pd(deployment: Deployment) -> None:
    """Before: the content uuid was the public, unkeyed hash of the image's URL, so anyone who could
    reach an encoder could have another image encoded under the uuid a victim's image would get, and the
    victim's request loaded that embedding from the shared storage instead of its own. Now the uuid is
    keyed by the fleet's secret: the planted file sits in the storage, unused."""
    victim = trust_image(505)
    victim_body = seed_request(MODEL, images=[victim])
    victim_baseline = chat(deployment.single, victim_body)
    assert victim_baseline.status_code == 200, victim_baseline.text
    # An image whose answer differs from the victim's (random weights: not every one does).
    planted = planted_baseline = None
    for shift in (0, 260, 120, 400, 40, 180):
        candidate = trust_image(shift)
        answer = chat(deployment.single, seed_request(MODEL, images=[candidate]))
        if answer.status_code == 200 and not same_answer(answer, victim_baseline):
            planted, planted_baseline = candidate, answer
            break
    assert planted is not None, "no image answered unlike the victim"
    assert planted_baseline is not None
    public = content_uuid("image", (victim,))
    keyed = lab.lab_uuid("image", (victim,))
    assert public != keyed
    # The attacker's call, straight to an encoder, as the middleware would make it.
    content = [{"type": "image_url", "image_url": {"url": planted}, "uuid": public}]
    reply: dict[str, Any] = httpx.post(
        f"{deployment.encoders[0].url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1},
        timeout=300,
    ).json()
    assert list(reply["ec_transfer_params"]) == [public], reply
    plant = deployment.storage / public / "encoder_cache.safetensors"
    assert plant.is_file()
    planted_bytes = plant.read_bytes()

    response = chat(deployment.pd, victim_body, AUTH)
    record("victim's image after a plant under its public uuid", response, victim_baseline)
    assert_same(response, victim_baseline)
    assert not same_answer(response, planted_baseline)
    assert (deployment.storage / keyed / "encoder_cache.safetensors").is_file()
    assert plant.read_bytes() == planted_bytes  # still there, untouched: it was never the victim's

    # The plant was a working embedding: a PD that loaded it under that uuid answers as the planted image.
    loaded = chat(deployment.pd, metadata_only_body(public, reply, None), AUTH)
    record("the planted embedding, referenced under its uuid", loaded, planted_baseline)
    assert_same(loaded, planted_baseline)
