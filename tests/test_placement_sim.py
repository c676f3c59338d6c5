"""The simulated GPU of the placement benchmark (tests/load/fake_pd_engine.py) charges what the benchmark
says it charges: a local encode runs inside a step, so every running request's next token waits for it
(the serial delay the placement choice is about); an embedding made elsewhere costs its load in a step
of its own, and the request is prefilled only from the next. Without these, the benchmark would compare
the policies on a model that does not have the cost they trade. Steps are checked as the engine plans
and accounts them (the GPU clock), never against the wall clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from tests.load.fake_pd_engine import TEMPLATE_TOKENS, Engine, GPUCosts, Item, Sequence, sequence_of
from tests.load.vision_tokens import png_data_url

pytestmark = pytest.mark.anyio

COSTS = GPUCosts(
    step_fixed_s=0.010,
    context_token_s=1e-6,
    prefill_token_s=1e-5,
    vit_fixed_s=0.004,
    vit_token_s=1e-4,
    load_setup_s=0.001,
    link_bytes_per_s=1e9,
    embedding_bytes_per_token=1000,
    step_token_budget=8192,
    max_num_seqs=16,
)


_STREAMS: list[MemoryObjectSendStream[float] | MemoryObjectReceiveStream[float]] = []


@pytest.fixture(autouse=True)
def _close_streams() -> Iterator[None]:
    """The token streams of the sequences a test made, kept open (a sequence whose reader is gone counts
    as its caller gone) and closed after it."""
    yield
    for end in _STREAMS:
        end.close()
    _STREAMS.clear()


def sequence(
    tokens: int, raw: bool, max_tokens: int = 8
) -> tuple[Sequence, MemoryObjectReceiveStream[float]]:
    """A prompt of one image of ``tokens`` (raw: encoded here; else a reference) and 16 text tokens."""
    sender, receiver = anyio.create_memory_object_stream[float](math.inf)
    _STREAMS.extend((sender, receiver))
    return Sequence(tokens + 16, (Item(0, tokens, raw),), max_tokens, sender), receiver


def stream() -> MemoryObjectSendStream[float]:
    sender, receiver = anyio.create_memory_object_stream[float](math.inf)
    _STREAMS.extend((sender, receiver))
    return sender


async def test_a_local_encode_holds_the_step_every_running_request_waits_for() -> None:
    """The step that prefills a raw image encodes it first, and the running request's token of that
    step comes only at its end: fixed + its context + the prefill + the whole encode."""
    engine = Engine(COSTS)
    running, _ = sequence(256, raw=False)
    engine.add(running)
    engine.finish(engine.plan(), 0.0)  # its load
    engine.finish(engine.plan(), 0.0)  # its prefill: running now
    assert engine.running == [running]

    raw, _ = sequence(256, raw=True)
    engine.add(raw)
    step = engine.plan()

    assert step.decode == [running]
    assert step.encode == [(raw, 0)]
    assert step.prefill == [(raw, 272)]
    context = running.prompt_tokens + running.generated
    assert step.duration == pytest.approx(
        COSTS.step_fixed_s
        + context * COSTS.context_token_s
        + 272 * COSTS.prefill_token_s
        + COSTS.vit_fixed_s
        + 256 * COSTS.vit_token_s
    )
    engine.finish(step, 1.0)
    assert running.generated == 2
    assert raw.generated == 1  # its first token in the same step
    assert engine.accounting.encoded_tokens == 256


async def test_a_reference_pays_its_load_in_an_extra_step() -> None:
    """Media encoded elsewhere: the first step loads its embedding (setup + bytes over the link) and
    prefills nothing of it; the next prefills it without any encode."""
    engine = Engine(COSTS)
    ref, _ = sequence(1369, raw=False)
    engine.add(ref)
    load = engine.plan()
    assert load.load == [ref]
    assert load.prefill == []
    assert load.encode == []
    assert load.duration == pytest.approx(COSTS.load_setup_s + 1369 * 1000 / 1e9)
    engine.finish(load, 0.0)
    prefill = engine.plan()
    assert prefill.prefill == [(ref, 1385)]
    assert prefill.encode == []
    assert engine.accounting.loaded_tokens == 1369


async def test_an_image_past_the_encoder_budget_ends_the_chunk_before_it() -> None:
    """As vLLM's scheduler: a step encodes at most its budget of vision tokens; the prefill chunk stops
    before an image that does not fit, and the image is encoded, whole, in a later step."""
    costs = GPUCosts(**{**COSTS.__dict__, "step_token_budget": 2000})
    engine = Engine(costs)
    seq = Sequence(2 * 1369 + 16, (Item(0, 1369, True), Item(1369, 1369, True)), 4, stream())
    engine.add(seq)
    first = engine.plan()
    assert first.encode == [(seq, 0)]
    assert first.prefill == [(seq, 1369)]
    engine.finish(first, 0.0)
    second = engine.plan()
    assert second.encode == [(seq, 1)]
    assert second.prefill == [(seq, 1385)]


async def test_the_step_loop_delays_running_tokens_by_the_encode(anyio_backend: str) -> None:
    """On the running loop: the gap between a running request's tokens around a local encode is at least
    that step's planned duration (the GPU clock; the engine's own record)."""
    engine = Engine(COSTS.scaled(0.1), record=True)
    running, tokens = sequence(64, raw=True, max_tokens=12)
    newcomer, _ = sequence(1024, raw=True, max_tokens=2)
    async with anyio.create_task_group() as group:
        group.start_soon(engine.run)
        engine.add(running)
        times = []
        async with tokens:
            async for at in tokens:
                times.append(at)
                if len(times) == 3:
                    engine.add(newcomer)
        group.cancel_scope.cancel()
    encode_steps = [(start, end, step) for start, end, step in engine.log if step.encode]
    assert len(encode_steps) == 2  # its own, then the newcomer's
    _start, end, step = encode_steps[1]
    assert running in step.decode
    assert step.encode == [(newcomer, 0)]
    assert end in times
    gap = times[times.index(end)] - times[times.index(end) - 1]
    # The GPU clock chains steps end to start, so the gap is the step (to the float's rounding) or more.
    assert gap >= step.duration - 1e-9
    assert step.duration >= step.encode_s > 1024 * COSTS.scaled(0.1).vit_token_s
    assert newcomer.generated == 2
    assert engine.num_unfinished_requests() == 0


async def test_the_engine_reads_the_request_as_vllm_would() -> None:
    """Raw images count their tokens from their size (Qwen2.5-VL: 448x448 -> 256), references from the
    encoder's image_grid_thw; a reference the transfer parameters do not name is refused."""
    sender = stream()
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": png_data_url(448, 448, 1)}, "uuid": "a"},
                    {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 74, 74]}, "uuid": "b"},
                    {"type": "text", "text": "x" * 40},
                ],
            }
        ],
        "ec_transfer_params": {"b": {"metadata": {}}},
        "max_tokens": 5,
    }
    seq = sequence_of(body, sender)
    assert seq.items == (Item(0, 256, True), Item(256, 1369, False))
    assert seq.prompt_tokens == 256 + 1369 + TEMPLATE_TOKENS + 10
    body["ec_transfer_params"] = {}
    with pytest.raises(Exception, match="not in ec_transfer_params"):
        sequence_of(body, sender)
