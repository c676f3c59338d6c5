"""The middleware inside real vLLM 0.32 (CPU) servers, against real vLLM encoders, compared with a
single-instance deployment of the same tiny model (greedy decoding, so outputs must match exactly)."""

from __future__ import annotations

import json
import shutil
import time
from typing import Any

import httpx
import pytest

from epd_lab import servers as lab
from epd_lab.seed import NON_DEFAULT_OPTIONS, PROMPT, seed_image, seed_request
from epd_middleware import _selection as selection
from epd_middleware._plan import MediaItem, plan_calls

from .conftest import API_KEY, Deployment

pytestmark = pytest.mark.e2e

MODEL = lab.SERVED_MODEL
AUTH = {"authorization": f"Bearer {API_KEY}"}
REPORT: list[dict[str, Any]] = []


image = seed_image


def post(
    server: lab.VLLMServer, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    start = time.perf_counter()
    response = httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=300)
    response.elapsed_s = time.perf_counter() - start  # type: ignore[attr-defined]
    return response


def chat(
    server: lab.VLLMServer, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    return post(server, "/v1/chat/completions", body, headers)


def encode_directly(
    deployment: Deployment, url: str, uuid: str, options: dict[str, Any] | None
) -> dict[str, Any]:
    """Ask an encoder for one image, as the middleware would, but from the test."""
    content = [{"type": "image_url", "image_url": {"url": url}, "uuid": uuid}]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 1,
        **(options or {}),
    }
    reply: dict[str, Any] = httpx.post(
        f"{deployment.encoders[0].url}/v1/chat/completions", json=body, timeout=300
    ).json()
    return reply


def metadata_only_body(uuid: str, reply: dict[str, Any], options: dict[str, Any] | None) -> dict[str, Any]:
    """The seed request with the image replaced by a metadata-only reference and the encoder's handles."""
    [entry] = reply["ec_transfer_params"].values()
    body = seed_request(MODEL, images=[], options=options)
    body["messages"][0]["content"].insert(
        0, {"type": "image_embeds", "image_embeds": entry["metadata"], "uuid": uuid}
    )
    body["ec_transfer_params"] = reply["ec_transfer_params"]
    return body


def record(case: str, response: httpx.Response, baseline: httpx.Response | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"case": case, "status": response.status_code, "seconds": response.elapsed_s}  # type: ignore[attr-defined]
    if response.status_code == 200:
        body = response.json()
        row["prompt_tokens"] = body["usage"]["prompt_tokens"]
        row["output"] = body["choices"][0]["message"]["content"]
        if baseline is not None:
            row["match"] = same_answer(response, baseline)
    else:
        row["output"] = response.text[:200]
    REPORT.append(row)
    return row


def same_answer(response: httpx.Response, baseline: httpx.Response) -> bool:
    a, b = response.json(), baseline.json()
    return bool(a["choices"][0]["message"] == b["choices"][0]["message"] and a["usage"] == b["usage"])


def assert_same(response: httpx.Response, baseline: httpx.Response) -> None:
    assert response.status_code == 200, response.text
    assert baseline.status_code == 200, baseline.text
    a, b = response.json(), baseline.json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"] == b["usage"]


def assert_fails(case: str, server: lab.VLLMServer, body: dict[str, Any]) -> None:
    """A request that must not succeed: an error status, or the engine dying under it."""
    try:
        response = chat(server, body)
    except httpx.HTTPError as exc:  # the engine may die mid-request
        REPORT.append({"case": case, "status": 0, "output": repr(exc)})
        return
    record(case, response)
    assert response.status_code != 200


@pytest.mark.compat
def test_default_options_equal_the_single_instance(deployment: Deployment) -> None:
    body = seed_request(MODEL)
    baseline = chat(deployment.single, body)
    record("single instance, default", baseline)
    response = chat(deployment.pd, body, AUTH)
    record("E + PD (plugin), default", response, baseline)
    assert_same(response, baseline)


@pytest.mark.compat
def test_non_default_options_equal_the_single_instance_and_take_effect(deployment: Deployment) -> None:
    default = chat(deployment.single, seed_request(MODEL))
    body = seed_request(MODEL, options=NON_DEFAULT_OPTIONS)
    baseline = chat(deployment.single, body)
    record("single instance, non-default", baseline)
    response = chat(deployment.pd, body, AUTH)
    record("E + PD (plugin), non-default", response, baseline)
    assert_same(response, baseline)
    assert response.json()["usage"]["prompt_tokens"] < default.json()["usage"]["prompt_tokens"]


@pytest.mark.compat
def test_handle_reaches_pd_under_the_derived_hash_and_pd_gets_no_pixels(deployment: Deployment) -> None:
    url = image(shift=7)
    uuid = lab.lab_uuid("image", (url,))
    before = deployment.stored_hashes()
    body = seed_request(MODEL, images=[url], options=NON_DEFAULT_OPTIONS)
    response = chat(deployment.pd, body, AUTH)
    record("E + PD, derived-hash check", response, chat(deployment.single, body))
    assert response.status_code == 200, response.text
    new = deployment.stored_hashes() - before
    assert uuid not in new, "the embedding must be stored under vLLM's derived hash, not the uuid"
    assert len(new) == 1
    [derived] = new

    # The encoder reports that same hash for that uuid and those options...
    reply = encode_directly(deployment, url, uuid, NON_DEFAULT_OPTIONS)
    assert list(reply["ec_transfer_params"]) == [derived]

    # ...and the body the middleware gives PD, a metadata-only reference without a single pixel, is
    # enough: PD answers it exactly like the single instance answers the image.
    rewritten = metadata_only_body(uuid, reply, NON_DEFAULT_OPTIONS)
    assert "base64" not in json.dumps(rewritten)
    direct = chat(deployment.pd, rewritten, AUTH)
    record("PD, metadata-only body (no pixels)", direct, response)
    assert_same(direct, response)


@pytest.mark.compat
def test_streaming_gives_the_same_text(deployment: Deployment) -> None:
    body = seed_request(MODEL, options=NON_DEFAULT_OPTIONS)
    plain = chat(deployment.pd, body, AUTH)
    text = []
    with httpx.stream(
        "POST",
        f"{deployment.pd.url}/v1/chat/completions",
        json={**body, "stream": True},
        headers=AUTH,
        timeout=300,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    text.append(choice.get("delta", {}).get("content") or "")
    assert "".join(text) == plain.json()["choices"][0]["message"]["content"]
    REPORT.append({"case": "E + PD, streaming", "status": 200, "output": "".join(text), "match": True})


def chat_calls(server: lab.VLLMServer) -> int:
    """Chat completions the server answered, whatever the status."""
    return access_log_count(server, '"POST /v1/chat/completions HTTP/1.1"')


def served_requests(server: lab.VLLMServer) -> int:
    """Chat completions the server answered 200."""
    return access_log_count(server, '"POST /v1/chat/completions HTTP/1.1" 200')


def access_log_count(server: lab.VLLMServer, line: str) -> int:
    """Lines of the server's access log holding ``line``, once that stopped growing (uvicorn writes a
    line after the response went out, so the last one may still be on its way)."""
    count = -1
    for _ in range(10):
        latest = server.log_path.read_text(errors="replace").count(line)
        if latest == count:
            return count
        count = latest
        time.sleep(0.5)  # twelve servers share two cores here: a line can come late
    return count


def test_responses_style_input_image_part_equals_the_single_instance(deployment: Deployment) -> None:
    url = image(shift=15)
    before = deployment.stored_hashes()
    body = seed_request(MODEL, images=[], options=NON_DEFAULT_OPTIONS)
    body["messages"][0]["content"].insert(0, {"type": "input_image", "image_url": url, "detail": "auto"})
    baseline = chat(deployment.single, body)
    response = chat(deployment.pd, body, AUTH)
    record("E + PD, input_image part, non-default", response, baseline)
    assert_same(response, baseline)
    assert len(deployment.stored_hashes() - before) == 1  # encoded remotely


def affinity_calls(deployment: Deployment, urls: list[str]) -> list[int]:
    """Encoder calls per encoder that content affinity plans for these images (no options, idle)."""
    return planned_calls([server.url for server in deployment.encoders], urls)


def planned_calls(encoders: list[str], urls: list[str]) -> list[int]:
    """Calls per encoder (in ``encoders``' order) that content affinity plans for these images."""
    items = [MediaItem(lab.lab_uuid("image", (url,)), "image", {}) for url in urls]
    rankings = selection.affinity(items, encoders, {}, max_inflight=64, max_batch_size=8)
    calls = plan_calls(items, rankings, 8)
    return [sum(call.encoder == url for call in calls) for url in encoders]


def test_several_images_in_one_request_go_where_affinity_sends_them(deployment: Deployment) -> None:
    urls = [image(shift=20), image(shift=40), image(shift=60)]
    before = deployment.stored_hashes()
    calls_before = [served_requests(server) for server in deployment.encoders]
    body = seed_request(MODEL, images=urls)
    baseline = chat(deployment.single, body)
    record("single instance, 3 images", baseline)
    response = chat(deployment.pd, body, AUTH)
    record("E + PD (2 encoders), 3 images", response, baseline)
    assert_same(response, baseline)
    new = deployment.stored_hashes() - before
    assert new == {lab.lab_uuid("image", (url,)) for url in urls}
    calls_after = [served_requests(server) for server in deployment.encoders]
    made = [after - before for after, before in zip(calls_after, calls_before, strict=True)]
    assert made == affinity_calls(deployment, urls)  # each image on its rendezvous encoder, batched


def test_the_same_image_in_two_requests_reuses_the_cache(deployment: Deployment) -> None:
    body = seed_request(MODEL, images=[image(shift=90)])
    first = chat(deployment.pd, body, AUTH)
    stored = deployment.stored_hashes()
    time.sleep(1.5)  # let the CPU workers go idle, so the timing compares like with like
    second = chat(deployment.pd, body, AUTH)
    record("E + PD, same image, 1st request", first)
    record("E + PD, same image, 2nd request", second, first)
    assert_same(second, first)
    assert deployment.stored_hashes() == stored, "the second request must use the same cache key"


FALLBACK_LOG = "left to the local engine"


@pytest.mark.compat
def test_middleware_flag_loading_equals_the_single_instance(deployment: Deployment) -> None:
    url = image(shift=110)
    before = deployment.stored_hashes()
    body = seed_request(MODEL, options=NON_DEFAULT_OPTIONS, images=[url])
    baseline = chat(deployment.single, body)
    response = chat(deployment.pd_flag, body)
    record("E + PD (--middleware), non-default", response, baseline)
    assert_same(response, baseline)
    # Encoded remotely, not by the local fallback this PD allows.
    assert FALLBACK_LOG not in deployment.pd_flag.log_path.read_text(errors="replace")
    assert len(deployment.stored_hashes() - before) == 1


@pytest.mark.compat
def test_an_encoder_serving_another_model_is_refused_with_a_clear_line(deployment: Deployment) -> None:
    """pd_flag lists the two encoders and the audio encoder (--served-model-name tiny-qwen2-audio,
    another model path): the middleware asked each for /v1/models at start-up, says which one it will
    not use and why, and requests are answered through the right ones."""
    other = deployment.audio_encoder
    log = deployment.pd_flag.log_path.read_text(errors="replace")
    assert f"encoder {other.url} is not used: it serves tiny-qwen2-audio" in log
    status = httpx.get(f"{deployment.pd_flag.url}/epd/status", timeout=30).json()
    assert status["encoders"][other.url]["model"]["state"] == "mismatch"
    assert {status["encoders"][server.url]["model"]["state"] for server in deployment.encoders} == {"ok"}
    before = served_requests(other)
    for shift in (141, 147, 153):
        body = seed_request(MODEL, images=[image(shift=shift)])
        baseline = chat(deployment.single, body)
        response = chat(deployment.pd_flag, body)
        record(f"wrong-model encoder listed, shift {shift}", response, baseline)
        assert_same(response, baseline)
    assert served_requests(other) == before
    assert FALLBACK_LOG not in deployment.pd_flag.log_path.read_text(errors="replace")


@pytest.mark.compat
def test_the_line_per_request_is_written_where_vllm_logs_requests(deployment: Deployment) -> None:
    """pd runs with vLLM's defaults, pd_flag with --enable-log-requests: the middleware's INFO line
    about each request it encoded follows what vLLM was told, read from vLLM's own command line through
    the plugin and through --middleware. Before, pd wrote one for every request."""
    for server, written in ((deployment.pd, False), (deployment.pd_flag, True)):
        request_id = f"line-per-request-{server.name}"
        body = seed_request(MODEL, images=[image(shift=157)])
        response = chat(server, body, {**AUTH, "x-request-id": request_id})
        assert response.status_code == 200, response.text
        deadline = time.monotonic() + (10 if written else 2)  # vLLM's handlers may write a moment later
        while True:
            log = server.log_path.read_text(errors="replace")
            found = f"request {request_id}: 1 media item(s), 1 encoder call(s) answered by" in log
            if found or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert found is written, server.name


def test_unauthenticated_request_does_no_encoder_work(deployment: Deployment) -> None:
    before = deployment.stored_hashes()
    response = chat(deployment.pd, seed_request(MODEL, images=[image(shift=130)]))
    assert response.status_code == 401
    assert deployment.stored_hashes() == before


@pytest.mark.compat
def test_plugin_loaded_inside_vllm(deployment: Deployment) -> None:
    log = deployment.pd.log_path.read_text(errors="replace")
    assert "Loaded endpoint plugin epd" in log
    # The middleware read the connector's storage from the server's own configuration.
    assert f"checking embeddings under {deployment.storage}" in log


def test_metrics_and_status_inside_vllm(deployment: Deployment) -> None:
    """The epd_* metrics appear in vLLM's own /metrics; the status page is behind vLLM's API key."""
    chat(deployment.pd, seed_request(MODEL, images=[image(shift=170)]), AUTH)
    metrics = httpx.get(f"{deployment.pd.url}/metrics", timeout=30).text
    assert _sample(metrics, "epd_requests_total", outcome="encoded") >= 1
    assert "epd_encoder_call_duration_seconds_bucket" in metrics
    assert "vllm:" in metrics  # the same page as vLLM's own metrics
    assert httpx.get(f"{deployment.pd.url}/epd/status", timeout=30).status_code == 401
    status = httpx.get(f"{deployment.pd.url}/epd/status", headers=AUTH, timeout=30).json()
    assert set(status["encoders"]) == {server.url for server in deployment.encoders}
    assert status["counters"]["encoded"] >= 1
    assert status["embedding_storage_checked"] == str(deployment.storage)


def test_two_api_server_processes_each_run_their_own_middleware(deployment: Deployment) -> None:
    """--api-server-count 2: every process builds its own app and middleware. Requests still equal the
    single instance, the status page is per process (it says which), /metrics sums all processes."""
    before = _encoded_total(deployment.pd_multi)
    for index in range(4):
        body = seed_request(MODEL, images=[image(shift=420 + index)])
        baseline = chat(deployment.single, body)
        response = chat(deployment.pd_multi, body)
        record(f"E + PD (2 API servers), request {index}", response, baseline)
        assert_same(response, baseline)
    assert _encoded_total(deployment.pd_multi) == before + 4
    seen: dict[int, int] = {}
    for _ in range(24):  # new connection each time: the kernel spreads them over the processes
        status = httpx.get(f"{deployment.pd_multi.url}/epd/status", timeout=30).json()
        seen[status["pid"]] = status["counters"].get("encoded", 0)
    assert len(seen) in (1, 2)
    if len(seen) == 2:  # both processes answered: their own counts add up to what /metrics sums
        assert sum(seen.values()) == before + 4
    else:
        assert sum(seen.values()) <= before + 4


def test_affinity_sends_an_image_to_one_encoder_from_two_api_server_processes(deployment: Deployment) -> None:
    """The same image, sent again and again to a PD with two API-server processes (each with its own
    middleware, its own reuse cache): every encoder call for it lands on the one encoder affinity ranks
    first, and each process encodes it at most once."""
    url = image(shift=471)
    [expected] = [index for index, calls in enumerate(affinity_calls(deployment, [url])) if calls]
    before = [served_requests(server) for server in deployment.encoders]
    body = seed_request(MODEL, images=[url])
    baseline = chat(deployment.single, body)
    for _ in range(8):  # a new connection each time: the kernel spreads them over both processes
        assert_same(chat(deployment.pd_multi, body), baseline)
    made = [
        served_requests(server) - count for server, count in zip(deployment.encoders, before, strict=True)
    ]
    assert 1 <= made[expected] <= 2, made
    assert made[1 - expected] == 0, made
    REPORT.append(
        {"case": "affinity, 8 x same image, 2 API servers", "status": 200, "output": f"calls {made}"}
    )


def test_multi_turn_chat_sends_each_new_image_to_an_encoder_once(deployment: Deployment) -> None:
    """Four turns, one new image each, non-default options, every turn resending the whole chat: each
    turn equals the single instance and the encoders get exactly one image per turn. Then the first
    image's stored embedding is deleted and the last turn sent again: that image is encoded again (and
    only it), still equal."""
    urls = [image(shift=shift) for shift in (301, 307, 313, 319)]
    messages: list[dict[str, Any]] = []
    stored: list[set[str]] = []
    body: dict[str, Any] = {}
    for turn, url in enumerate(urls, start=1):
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": PROMPT},
                ],
            }
        )
        body = {"model": MODEL, "messages": list(messages), "temperature": 0, "seed": 42, "max_tokens": 8}
        body.update(NON_DEFAULT_OPTIONS)
        baseline = chat(deployment.single, body)
        # The middleware's own counters: exact, where the encoders' access logs can lag under load.
        calls, reused, hashes = (
            pd_counter(deployment, "encoder_calls_ok"),
            pd_counter(deployment, "reused_items"),
            deployment.stored_hashes(),
        )
        response = chat(deployment.pd, body, AUTH)
        record(f"multi-turn, turn {turn} ({turn} images)", response, baseline)
        assert_same(response, baseline)
        assert pd_counter(deployment, "encoder_calls_ok") == calls + 1  # one image: this turn's
        assert pd_counter(deployment, "reused_items") == reused + turn - 1  # every earlier image
        stored.append(deployment.stored_hashes() - hashes)
        assert len(stored[-1]) == 1  # this turn's image, under the hash derived from the options
        messages.append({"role": "assistant", "content": baseline.json()["choices"][0]["message"]["content"]})
    [first] = stored[0]
    shutil.rmtree(deployment.storage / first)
    baseline = chat(deployment.single, body)
    calls, reused = pd_counter(deployment, "encoder_calls_ok"), pd_counter(deployment, "reused_items")
    response = chat(deployment.pd, body, AUTH)
    record("multi-turn, turn 4 again, turn 1 evicted", response, baseline)
    assert_same(response, baseline)
    assert pd_counter(deployment, "encoder_calls_ok") == calls + 1
    assert pd_counter(deployment, "reused_items") == reused + 3
    assert first in deployment.stored_hashes()


def pd_counter(deployment: Deployment, name: str) -> int:
    """One of the middleware's own counters on the plugin PD (one API-server process)."""
    status = httpx.get(f"{deployment.pd.url}/epd/status", headers=AUTH, timeout=30).json()
    return int(status["counters"].get(name, 0))


def _encoded_total(server: lab.VLLMServer) -> float:
    return _sample(
        httpx.get(f"{server.url}/metrics", timeout=30).text, "epd_requests_total", outcome="encoded"
    )


def _sample(metrics: str, name: str, **labels: str) -> float:
    """The value of the series ``name`` whose labels include ``labels``, in Prometheus' text format
    (label order is the exporter's: multiprocess mode sorts them), 0 when absent."""
    wanted = {f'{key}="{value}"' for key, value in labels.items()}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            series, _, value = line.rpartition(" ")
            if wanted <= set(series[len(name) + 1 : -1].split(",")):
                return float(value)
    return 0.0


KV_HIT = "External Cache Hit"  # vLLM's KV ExampleConnector found the prefill's KV cache


def log_count(server: lab.VLLMServer, text: str) -> int:
    return server.log_path.read_text(errors="replace").count(text)


@pytest.mark.compat
@pytest.mark.parametrize("options", [None, NON_DEFAULT_OPTIONS], ids=["default", "non-default"])
# Shifts stay under 540: beyond it every square leaves the 800x600 canvas and all images are the same.
def test_remote_prefill_e_p_d_equals_the_single_instance(
    deployment: Deployment, options: dict[str, Any] | None
) -> None:
    """E -> P -> D: the middleware on D encodes on E, prefills on P (kv_producer), D decodes from P's KV."""
    body = seed_request(MODEL, images=[image(shift=65 if options is None else 75)], options=options)
    baseline = chat(deployment.single, body)
    prefills, hits = served_requests(deployment.control), log_count(deployment.pd_decode, KV_HIT)
    encoded = sum(served_requests(server) for server in deployment.encoders)
    response = chat(deployment.pd_decode, body)
    record(f"E + P + D, {'non-default' if options else 'default'}", response, baseline)
    assert_same(response, baseline)
    assert served_requests(deployment.control) == prefills + 1  # P prefilled it
    assert log_count(deployment.pd_decode, KV_HIT) == hits + 1  # D took P's KV cache
    assert sum(served_requests(server) for server in deployment.encoders) == encoded + 1


def test_remote_prefill_text_only_and_streaming(deployment: Deployment) -> None:
    """With remote prefill every request goes through P, text-only too; streaming works on D."""
    text = " ".join(["Describe a red square, a green circle and a blue triangle on white paper."] * 3)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": 16,
    }
    baseline = chat(deployment.single, body)
    prefills, hits = served_requests(deployment.control), log_count(deployment.pd_decode, KV_HIT)
    response = chat(deployment.pd_decode, body)
    record("P + D, text only", response, baseline)
    assert_same(response, baseline)
    assert served_requests(deployment.control) == prefills + 1
    assert log_count(deployment.pd_decode, KV_HIT) == hits + 1

    streamed = []
    image_body = seed_request(MODEL, images=[image(shift=85)])
    plain = chat(deployment.single, image_body)
    with httpx.stream(
        "POST",
        f"{deployment.pd_decode.url}/v1/chat/completions",
        json={**image_body, "stream": True},
        timeout=300,
    ) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    streamed.append(choice.get("delta", {}).get("content") or "")
    assert "".join(streamed) == plain.json()["choices"][0]["message"]["content"]
    REPORT.append({"case": "E + P + D, streaming", "status": 200, "output": "".join(streamed), "match": True})


def anthropic(
    server: lab.VLLMServer, body: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    return post(server, "/v1/messages", body, headers)


def messages_body(url: str) -> dict[str, Any]:
    media_type, data = url.removeprefix("data:").split(";base64,", 1)
    return {
        "model": MODEL,
        "max_tokens": 16,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}},
                    {"type": "text", "text": PROMPT},
                ],
            }
        ],
    }


def assert_same_message(case: str, response: httpx.Response, baseline: httpx.Response) -> None:
    REPORT.append(
        {
            "case": case,
            "status": response.status_code,
            "seconds": response.elapsed_s,  # type: ignore[attr-defined]
            "prompt_tokens": response.json().get("usage", {}).get("input_tokens", "-")
            if response.status_code == 200
            else "-",
            "match": response.status_code == 200
            and baseline.status_code == 200
            and response.json()["content"] == baseline.json()["content"],
            "output": response.json()["content"][0].get("text", "")
            if response.status_code == 200
            else response.text[:200],
        }
    )
    assert response.status_code == 200, response.text
    assert baseline.status_code == 200, baseline.text
    assert response.json()["content"] == baseline.json()["content"]
    assert response.json()["usage"]["input_tokens"] == baseline.json()["usage"]["input_tokens"]


@pytest.mark.compat
def test_anthropic_messages_equal_the_single_instance_and_pd_loads_the_embedding(
    deployment: Deployment,
) -> None:
    body = messages_body(image(shift=45))
    baseline = anthropic(deployment.single, body)
    before = deployment.stored_hashes()
    response = anthropic(deployment.pd, body, AUTH)
    assert_same_message("E + PD, Anthropic Messages", response, baseline)
    [stored] = deployment.stored_hashes() - before  # the encoder hashed the image as PD does ...
    # ... and PD took that embedding from the connector instead of running its own encoder.
    assert log_count(deployment.pd, f"Success load encoder cache for hash {stored}") == 1


def test_anthropic_messages_through_remote_prefill(deployment: Deployment) -> None:
    body = messages_body(image(shift=55))
    baseline = anthropic(deployment.single, body)
    hits = log_count(deployment.pd_decode, KV_HIT)
    response = anthropic(deployment.pd_decode, body)
    assert_same_message("E + P + D, Anthropic Messages", response, baseline)
    assert log_count(deployment.pd_decode, KV_HIT) == hits + 1


def responses_body(url: str, options: dict[str, Any] | None) -> dict[str, Any]:
    content = [{"type": "input_image", "image_url": url}, {"type": "input_text", "text": PROMPT}]
    return {
        "model": MODEL,
        "input": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_output_tokens": 16,
        **(options or {}),
    }


def assert_same_response(case: str, response: httpx.Response, baseline: httpx.Response) -> None:
    def answer(reply: httpx.Response) -> tuple[Any, Any]:
        body = reply.json()
        texts = [part.get("text") for item in body["output"] for part in item.get("content", [])]
        return texts, (body["usage"]["input_tokens"], body["usage"]["output_tokens"])

    same = response.status_code == baseline.status_code == 200 and answer(response) == answer(baseline)
    REPORT.append(
        {
            "case": case,
            "status": response.status_code,
            "seconds": response.elapsed_s,  # type: ignore[attr-defined]
            "prompt_tokens": answer(response)[1][0] if response.status_code == 200 else "-",
            "match": same,
            "output": "".join(answer(response)[0]) if response.status_code == 200 else response.text[:200],
        }
    )
    assert response.status_code == 200, response.text
    assert baseline.status_code == 200, baseline.text
    assert answer(response) == answer(baseline)


@pytest.mark.compat
def test_openai_responses_equal_the_single_instance_and_pd_loads_the_embedding(
    deployment: Deployment,
) -> None:
    url = image(shift=25)
    body = responses_body(url, NON_DEFAULT_OPTIONS)
    baseline = post(deployment.single, "/v1/responses", body)
    before = deployment.stored_hashes()
    response = post(deployment.pd, "/v1/responses", body, AUTH)
    assert_same_response("E + PD, OpenAI Responses, non-default", response, baseline)
    [stored] = deployment.stored_hashes() - before  # the hash derived from the pinned uuid + options
    assert stored != lab.lab_uuid("image", (url,))
    assert log_count(deployment.pd, f"Success load encoder cache for hash {stored}") == 1


def test_openai_responses_through_remote_prefill(deployment: Deployment) -> None:
    body = responses_body(image(shift=35), None)
    baseline = post(deployment.single, "/v1/responses", body)
    hits = log_count(deployment.pd_decode, KV_HIT)
    response = post(deployment.pd_decode, "/v1/responses", body)
    assert_same_response("E + P + D, OpenAI Responses", response, baseline)
    assert log_count(deployment.pd_decode, KV_HIT) == hits + 1


def llmd_headers(deployment: Deployment, *, encoder: int | None, prefill: bool) -> dict[str, str]:
    """The headers llm-d's endpoint picker sets: ip:port of the chosen encode and prefill pods."""
    headers = {}
    if encoder is not None:
        headers["x-encoder-hosts-ports"] = f"127.0.0.1:{deployment.encoders[encoder].port}"
    if prefill:
        headers["x-prefiller-host-port"] = f"127.0.0.1:{deployment.control.port}"
    return headers


@pytest.mark.parametrize("options", [None, NON_DEFAULT_OPTIONS], ids=["default", "non-default"])
def test_llm_d_headers_route_encode_and_prefill_and_equal_the_single_instance(
    deployment: Deployment, options: dict[str, Any] | None
) -> None:
    """A server in llm-d scheduler mode with no pools at all: the headers the endpoint picker would set
    name encoder-1 and the prefill server (control); the media is encoded there, the request prefilled
    there, and D decodes from P's KV cache."""
    body = seed_request(MODEL, images=[image(shift=95 if options is None else 105)], options=options)
    baseline = chat(deployment.single, body)
    before = [served_requests(server) for server in deployment.encoders]
    prefills, hits = served_requests(deployment.control), log_count(deployment.pd_llmd, KV_HIT)
    response = chat(deployment.pd_llmd, body, llmd_headers(deployment, encoder=1, prefill=True))
    record(f"llm-d headers E + P + D, {'non-default' if options else 'default'}", response, baseline)
    assert_same(response, baseline)
    assert [served_requests(server) for server in deployment.encoders] == [before[0], before[1] + 1]
    assert served_requests(deployment.control) == prefills + 1
    assert log_count(deployment.pd_llmd, KV_HIT) == hits + 1

    # E / PD: only the encoder header, so this server prefills itself.
    body = seed_request(MODEL, images=[image(shift=115 if options is None else 125)], options=options)
    baseline = chat(deployment.single, body)
    prefills = served_requests(deployment.control)
    response = chat(deployment.pd_llmd, body, llmd_headers(deployment, encoder=1, prefill=False))
    record(f"llm-d headers E + PD, {'non-default' if options else 'default'}", response, baseline)
    assert_same(response, baseline)
    assert served_requests(deployment.encoders[1]) == before[1] + 2
    assert served_requests(deployment.control) == prefills


def test_llm_d_forged_targets(deployment: Deployment) -> None:
    """A prefill target outside the allowlist gets 403 and nothing is called; an encoder outside it is
    dropped and the server encodes the image itself, equal to the single instance."""
    body = seed_request(MODEL, images=[image(shift=135)])
    served = [served_requests(server) for server in (*deployment.encoders, deployment.control)]
    single = served_requests(deployment.single)
    forged = {"x-prefiller-host-port": f"127.0.0.1:{deployment.single.port}"}
    response = chat(
        deployment.pd_llmd, body, {**llmd_headers(deployment, encoder=1, prefill=False), **forged}
    )
    record("llm-d forged prefiller", response)
    assert response.status_code == 403, response.text
    assert response.json()["error"]["type"] == "ForbiddenError"
    assert [served_requests(server) for server in (*deployment.encoders, deployment.control)] == served
    assert served_requests(deployment.single) == single

    baseline = chat(deployment.single, body)
    response = chat(deployment.pd_llmd, body, llmd_headers(deployment, encoder=0, prefill=False))
    record("llm-d forged encoder (local encode)", response, baseline)
    assert_same(response, baseline)
    assert [served_requests(server) for server in (*deployment.encoders, deployment.control)] == served


def test_zz_video_negative_control_dropping_the_options_fails(deployment: Deployment) -> None:
    """What the middleware prevents, for video: the encoder ran without the options, PD with them. The
    control server takes videos too, so this runs on it, before the image negative control."""
    from .test_modalities import VIDEO_OPTIONS, data_url, encode_on, request, video_part

    url, uuid = data_url(deployment.video, "video/mp4"), "video-negative-control"
    reply = encode_on(deployment.encoders[0], {**video_part(url), "uuid": uuid}, None)
    [(reported, entry)] = reply["ec_transfer_params"].items()
    assert reported == uuid
    body = request([{"type": "video_embeds", "video_embeds": entry["metadata"], "uuid": uuid}], VIDEO_OPTIONS)
    body["ec_transfer_params"] = reply["ec_transfer_params"]
    assert_fails("video negative control (options dropped)", deployment.control, body)


def test_zz_negative_control_dropping_the_options_fails(deployment: Deployment) -> None:
    """What the middleware prevents: the encoder ran without the options, PD runs with them."""
    url = image(shift=150)
    uuid = lab.lab_uuid("image", (url,))
    reply = encode_directly(deployment, url, uuid, None)
    [reported] = reply["ec_transfer_params"]
    assert reported == uuid  # no options: vLLM keeps the uuid
    body = metadata_only_body(uuid, reply, NON_DEFAULT_OPTIONS)
    assert_fails("negative control (options dropped)", deployment.control, body)


def test_zz_stopping_one_encoder_mid_run_loses_no_request(deployment: Deployment) -> None:
    """Two encoders, one stopped half-way: every request still answered, equal to the single instance."""
    urls = [image(shift=200 + 10 * i) for i in range(8)]
    for index, url in enumerate(urls):
        if index == 3:
            deployment.encoders[1].stop()
        body = seed_request(MODEL, images=[url])
        baseline = chat(deployment.single, body)
        response = chat(deployment.pd, body, AUTH)
        record(f"E + PD, encoder-1 stopped after 3, request {index}", response, baseline)
        assert_same(response, baseline)


def test_zz_stopping_every_encoder_falls_back_to_local_encoding(deployment: Deployment) -> None:
    """Both encoders down, on_encoder_failure='local': PD encodes itself, equal to the single instance."""
    deployment.encoders[0].stop()
    deployment.encoders[1].stop()
    for shift, options in ((300, None), (310, NON_DEFAULT_OPTIONS), (300, None)):
        body = seed_request(MODEL, images=[image(shift=shift)], options=options)
        baseline = chat(deployment.single, body)
        response = chat(deployment.pd_flag, body)
        record(f"E down, PD local fallback, {'non-default' if options else 'default'}", response, baseline)
        assert_same(response, baseline)
    assert FALLBACK_LOG in deployment.pd_flag.log_path.read_text(errors="replace")
