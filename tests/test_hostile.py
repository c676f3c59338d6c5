"""Hostile input, generated: malformed and adversarial bodies never crash the middleware, never make it
answer 500, and never cause an encoder call for a request its limits reject."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from epd_middleware import EPDMiddleware

from .fakes import TEST_UUID_KEY, FakeEngine, scripted_receive
from .test_middleware import http_scope

pytestmark = pytest.mark.anyio

E0, E1 = "http://enc-0:8001", "http://enc-1:8001"
LIMITS = {"max_body_bytes": 400_000, "max_media_items": 16, "max_batch_size": 4, "uuid_key": TEST_UUID_KEY}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=20),
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
odd_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
urls = st.one_of(
    st.just("data:image/png;base64,iVBORw0KGgo="),
    st.builds(lambda s: "data:image/png;base64," + s, odd_text),
    st.builds(lambda s: "http://media/" + s, odd_text),
    json_values,
)
uuids = st.one_of(st.none(), st.just("same-uuid"), odd_text, json_values)
part_types = st.sampled_from(
    [
        "image_url",
        "audio_url",
        "video_url",
        "input_audio",
        "input_image",
        "image_embeds",
        "text",
        "image_pil",
        "weird",
    ]
)


@st.composite
def junk_parts(draw: st.DrawFn) -> Any:
    kind = draw(part_types)
    part: dict[str, Any] = {}
    if draw(st.booleans()):
        part["type"] = draw(st.one_of(st.just(kind), json_values))
    holder = draw(
        st.one_of(
            st.builds(lambda u: {"url": u}, urls),
            urls,
            st.builds(lambda d, f: {"data": d, "format": f}, urls, json_values),
            json_values,
        )
    )
    part[kind] = holder
    if draw(st.booleans()):
        part["uuid"] = draw(uuids)
    if draw(st.booleans()):
        part[draw(st.text(max_size=6))] = draw(json_values)
    return draw(st.one_of(st.just(part), json_values, odd_text))


good_urls = st.builds(lambda s: "data:image/png;base64," + s, st.text("ABCDEFGH+/=", min_size=1, max_size=12))
good_parts = st.one_of(
    st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, good_urls),
    st.builds(
        lambda u, i: {"type": "image_url", "image_url": {"url": u}, "uuid": i},
        good_urls,
        st.sampled_from(["a", "b"]),
    ),
    st.builds(lambda d: {"type": "input_audio", "input_audio": {"data": d, "format": "wav"}}, good_urls),
    st.builds(lambda u: {"type": "video_url", "video_url": {"url": u}}, good_urls),
    st.builds(lambda u: {"type": "input_image", "image_url": u}, good_urls),
    st.just({"type": "text", "text": "Describe."}),
)
# Mostly well-formed parts, so that most examples reach the encoders, with junk mixed in.
parts = st.one_of(good_parts, good_parts, good_parts, junk_parts())


@st.composite
def chat_bodies(draw: st.DrawFn) -> Any:
    user = st.fixed_dictionaries(
        {"role": st.just("user"), "content": st.lists(parts, min_size=1, max_size=6)}
    )
    messages = draw(
        st.lists(
            st.one_of(
                user,
                user,
                user,
                user,
                user,
                user,
                st.fixed_dictionaries(
                    {
                        "role": st.one_of(st.just("user"), json_values),
                        "content": st.lists(junk_parts(), max_size=4),
                    }
                ),
                st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(odd_text, json_values)}),
                json_values,
            ),
            min_size=1,
            max_size=3,
        )
    )
    body: dict[str, Any] = {
        "model": draw(st.one_of(st.just("m"), st.just("m"), json_values)),
        "messages": messages,
    }
    for name in ("ec_transfer_params", "mm_processor_kwargs", "media_io_kwargs", "priority", "cache_salt"):
        if draw(st.integers(0, 3)) == 0:
            body[name] = draw(json_values)
    return draw(st.one_of(st.just(body), st.just(body), st.just(body), st.just(messages), json_values))


@st.composite
def image_blocks(draw: st.DrawFn) -> Any:
    source = draw(
        st.one_of(
            st.builds(
                lambda d, m: {"type": "base64", "media_type": m, "data": d},
                st.text("ABCDEFGH+/=", min_size=1, max_size=12),
                st.one_of(st.just("image/png"), json_values),
            ),
            st.builds(lambda u: {"type": "url", "url": u}, urls),
            json_values,
        )
    )
    return {"type": "image", "source": source}


message_blocks = st.one_of(
    image_blocks(),
    image_blocks(),
    st.just({"type": "text", "text": "Describe."}),
    st.builds(
        lambda items: {"type": "tool_result", "tool_use_id": "t", "content": items},
        st.one_of(st.lists(st.one_of(image_blocks(), json_values), max_size=3), json_values),
    ),
    json_values,
)


@st.composite
def messages_bodies(draw: st.DrawFn) -> Any:
    message = st.fixed_dictionaries(
        {
            "role": st.one_of(st.sampled_from(["user", "assistant", "system"]), json_values),
            "content": st.one_of(st.lists(message_blocks, min_size=1, max_size=5), odd_text, json_values),
        }
    )
    body: dict[str, Any] = {
        "model": "m",
        "max_tokens": draw(st.one_of(st.just(16), json_values)),
        "messages": draw(st.lists(st.one_of(message, message, message, json_values), min_size=1, max_size=3)),
    }
    for name in ("ec_transfer_params", "kv_transfer_params", "stream", "system"):
        if draw(st.integers(0, 3)) == 0:
            body[name] = draw(json_values)
    return draw(st.one_of(st.just(body), st.just(body), st.just(body), json_values))


@st.composite
def responses_bodies(draw: st.DrawFn) -> Any:
    item = st.one_of(
        st.fixed_dictionaries(
            {
                "role": st.one_of(st.sampled_from(["user", "assistant", "system"]), json_values),
                "content": st.one_of(st.lists(parts, max_size=5), odd_text, json_values),
            }
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("function_call_output"),
                "call_id": st.just("c"),
                "output": st.one_of(st.lists(parts, max_size=3), json_values),
            }
        ),
        json_values,
    )
    body: dict[str, Any] = {
        "model": "m",
        "input": draw(st.one_of(st.lists(item, min_size=1, max_size=3), odd_text, json_values)),
    }
    for name in ("ec_transfer_params", "mm_processor_kwargs", "previous_response_id", "stream"):
        if draw(st.integers(0, 3)) == 0:
            body[name] = draw(json_values)
    return draw(st.one_of(st.just(body), st.just(body), st.just(body), json_values))


P0 = "http://prefill-0:8100"


def encoder_handler(calls: list[bytes]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host == "prefill-0":
            return httpx.Response(200, json={"kv_transfer_params": {"remote_engine_id": "p"}})
        calls.append(request.content)
        body = json.loads(request.content)
        entries = {
            part.get("uuid") or f"content-{index}": {
                "item_indices": [index],
                "metadata": {"image_grid_thw": [1, 2, 2]},
            }
            for index, part in enumerate(body["messages"][0]["content"])
        }
        return httpx.Response(200, json={"ec_transfer_params": entries})

    return httpx.MockTransport(handle)


async def drive(
    raw: bytes, path: str = "/v1/chat/completions", **options: Any
) -> tuple[int, list[bytes], list[bytes]]:
    """One request through the middleware scripted: (status, encoder calls, engine bodies)."""
    calls: list[bytes] = []
    engine = FakeEngine()
    middleware = EPDMiddleware(
        engine.app(),
        encoders=[E0, E1],
        http_client=httpx.AsyncClient(transport=encoder_handler(calls)),
        **{**LIMITS, **options},
    )
    receive = scripted_receive(raw)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with anyio.fail_after(10):
        await middleware(http_scope(raw, path=path), receive, send)
    status = next(message["status"] for message in sent if message["type"] == "http.response.start")
    return status, calls, [record.body for record in engine.received]


def check(
    status: int, calls: list[bytes], engine_bodies: list[bytes], raw: bytes, *, prefill: bool = False
) -> None:
    assert status != 500, "the middleware must never answer 500"
    if engine_bodies:
        assert status in (200, 400)  # the fake engine's answers
        [seen] = engine_bodies
        if seen != raw:
            rewritten = json.loads(seen)  # a rewritten body is valid JSON
            # Without remote prefill a body is only rewritten after encoder calls, or to drop the
            # client's own ec_transfer_params (the engine's are the middleware's alone).
            if not (calls or prefill):
                sent = json.loads(raw)
                sent.pop("ec_transfer_params", None)
                assert rewritten == sent
    else:
        assert status in (400, 413), status
        assert calls == [], "a request the limits reject must not reach an encoder"


SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=chat_bodies())
async def test_generated_bodies(body: Any) -> None:
    raw = json.dumps(body).encode()
    check(*(await drive(raw)), raw)


@SETTINGS
@given(body=st.one_of(chat_bodies(), responses_bodies()), long_url=st.booleans())
async def test_generated_bodies_with_long_strings(body: Any, long_url: bool) -> None:
    """The same hostile shapes, with strings long enough to stay raw (``_rawjson``)."""
    if isinstance(body, dict):
        body = {**body, "zz_pad": "A" * 20_000}
        if long_url and isinstance(body.get("messages"), list):
            long = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "QUJD" * 3000}}
            body["messages"] = [*body["messages"], {"role": "user", "content": [long]}]
    raw = json.dumps(body).encode()
    path = "/v1/responses" if isinstance(body, dict) and "input" in body else "/v1/chat/completions"
    check(*(await drive(raw, path=path)), raw)


@SETTINGS
@given(body=messages_bodies())
async def test_generated_messages_bodies(body: Any) -> None:
    raw = json.dumps(body).encode()
    check(*(await drive(raw, path="/v1/messages")), raw)


@SETTINGS
@given(body=responses_bodies())
async def test_generated_responses_bodies(body: Any) -> None:
    raw = json.dumps(body).encode()
    check(*(await drive(raw, path="/v1/responses")), raw)


PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


@SETTINGS
@given(
    body=st.one_of(chat_bodies(), messages_bodies(), responses_bodies()),
    surface=st.sampled_from(sorted(PATHS)),
)
async def test_generated_bodies_with_remote_prefill(body: Any, surface: str) -> None:
    raw = json.dumps(body).encode()
    path = PATHS[surface]
    result = await drive(raw, path=path, prefill=[P0])
    check(*result, raw, prefill=True)
    _, _, engine_bodies = result
    if engine_bodies and engine_bodies[0] != raw:
        sent = json.loads(engine_bodies[0])
        if not (surface == "responses" and sent.get("previous_response_id")):  # history stays here
            assert sent["kv_transfer_params"] == {"remote_engine_id": "p"}  # every rewritten body got P's


@SETTINGS
@given(raw=st.binary(max_size=300))
async def test_random_bytes(raw: bytes) -> None:
    check(*(await drive(raw)), raw)


@SETTINGS
@given(body=chat_bodies(), cut=st.integers(min_value=1, max_value=200))
async def test_truncated_json(body: Any, cut: int) -> None:
    raw = json.dumps(body).encode()[:-cut] or b"{"
    check(*(await drive(raw)), raw)


def _deep_part_body() -> bytes:
    deep = "[" * 900 + "]" * 900
    part = '{"type": "image_url", "image_url": {"url": "x", "deep": ' + deep + "}}"
    return ('{"messages": [{"content": [' + part + "]}]}").encode()


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000 + b"]" * 100_000,
        b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        _deep_part_body(),
    ],
)
async def test_deep_nesting(raw: bytes) -> None:
    check(*(await drive(raw)), raw)


async def test_thousands_of_media_items_are_rejected_before_any_encoder_call() -> None:
    parts_ = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{i:04d}"}} for i in range(3000)
    ]
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": parts_}]}).encode()
    status, calls, engine_bodies = await drive(raw, max_body_bytes=10_000_000)
    assert (status, calls, engine_bodies) == (400, [], [])


async def test_enormous_data_url_is_413_before_any_encoder_call() -> None:
    url = "data:image/png;base64," + "A" * 1_000_000
    raw = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
        }
    ).encode()
    status, calls, engine_bodies = await drive(raw)
    assert (status, calls, engine_bodies) == (413, [], [])


async def test_conflicting_uuids_never_share_an_embedding() -> None:
    # Two different images with the same client uuid in one request: two items, two uuids.
    content = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}, "uuid": "x"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}, "uuid": "x"},
    ]
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()
    status, _calls, [seen] = await drive(raw)
    assert status == 200
    parts_ = json.loads(seen)["messages"][0]["content"]
    assert parts_[0]["uuid"] != parts_[1]["uuid"]


@pytest.mark.parametrize(
    "params", [None, {}, {"a": 1}, {"a": {"metadata": None}}, {"x" * 1000: [1, {"b": None}]}]
)
async def test_client_ec_transfer_params_of_any_object_shape_never_reach_the_engine(params: Any) -> None:
    """Any object is taken (vLLM's type), and none of it reaches the engine: its ec_transfer_params are
    the middleware's handles alone (issue 29, item 6)."""
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    raw = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": content}], "ec_transfer_params": params}
    ).encode()
    status, calls, [seen] = await drive(raw)
    assert status == 200
    assert len(calls) == 1
    handles = json.loads(seen)["ec_transfer_params"]
    assert len(handles) == 1
    for key in params or {}:
        assert key not in handles


@SETTINGS
@given(body=chat_bodies(), encoding=st.sampled_from(["utf-8-sig", "utf-16", "utf-16-be", "utf-32-le"]))
async def test_every_encoding_vllm_reads_is_treated_as_utf_8(body: Any, encoding: str) -> None:
    """vLLM reads a body with json.loads, which takes a BOM, UTF-16 and UTF-32: the middleware must see
    in such a body exactly what it sees in the same JSON as UTF-8 (issue 20: it used to pass them on
    unread, media and all)."""
    text = json.dumps(body)
    plain = await drive(text.encode())
    other = await drive(text.encode(encoding))
    assert other[0] == plain[0]
    assert len(other[1]) == len(plain[1])
    if plain[2] and plain[2][0] != text.encode():
        assert json.loads(other[2][0]) == json.loads(plain[2][0])
