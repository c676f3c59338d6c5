"""A fake PD engine with one simulated GPU, for the placement benchmark (benchmarks/placement.py): the
local encode shares the GPU with the decode steps, as in vLLM, so that placing media locally costs what
it costs there.

One step loop holds the GPU (vLLM's engine core): each step decodes one token of every running request,
prefills waiting requests up to the step's token budget (chunked prefill), and runs, inside the same
step, the vision encoder on every raw image whose placeholder the step prefills, as vLLM's model runner
does before the language model's forward (``gpu_model_runner.py`` ``_execute_mm_encoder``). Every running
request's next token therefore waits for that encode: the serial delay local placement costs. A
request whose media arrived as references (``image_embeds`` and ``ec_transfer_params``) pays the load of
its embeddings instead (setup plus bytes over the link) in one step of its own, and is prefilled from
the step after: the extra step a hop costs. Step time::

    fixed + context tokens of the decoding requests x per-token KV read + prefill tokens x per-token
    + (vision encoder fixed + vision tokens x per-token, where the step encodes) + each load

The steps are chained on the GPU's own clock (a step starts where the last one ended, while there is
work; the event loop's lateness is forgiven up to a step's fixed time), so that a busy event loop does
not stretch the simulated GPU.

    python -m tests.load.fake_pd_engine PORT --encoders URL[,URL] --placement P --costs JSON
                                             [--options JSON]

serves the engine under uvicorn with EPDMiddleware in front of it, the middleware told the engine's
load and prefill backlog through ``Host(engine_load=..., engine_queued_tokens=...)`` as vLLM's state
tells them (``engine_client.get_num_unfinished_requests()``, ``get_num_queued_tokens()``).
``GET /engine/stats`` answers the GPU's accounting.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from tests.load.vision_tokens import FACTOR, MAX_PIXELS, MIN_PIXELS, image_tokens, png_size, tokens_of_grid

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Prompt tokens of a request besides its images: the chat template, and the question at ~4 characters a
# token.
TEMPLATE_TOKENS = 16


@dataclass(frozen=True)
class GPUCosts:
    """What the simulated GPU charges, in seconds and bytes (benchmarks/placement.py says where each
    figure comes from)."""

    step_fixed_s: float
    context_token_s: float
    prefill_token_s: float
    vit_fixed_s: float
    vit_token_s: float
    load_setup_s: float
    link_bytes_per_s: float
    embedding_bytes_per_token: int
    step_token_budget: int
    max_num_seqs: int

    def scaled(self, factor: float) -> GPUCosts:
        """Every time ``factor`` times longer (the link ``factor`` times slower); counts unchanged."""
        times = {name: getattr(self, name) * factor for name in _TIMES}
        return replace(self, **times, link_bytes_per_s=self.link_bytes_per_s / factor)

    def load_s(self, tokens: int) -> float:
        return self.load_setup_s + tokens * self.embedding_bytes_per_token / self.link_bytes_per_s


_TIMES = ("step_fixed_s", "context_token_s", "prefill_token_s", "vit_fixed_s", "vit_token_s", "load_setup_s")


@dataclass(frozen=True)
class Item:
    """One image of a prompt: where its placeholder starts, how many tokens it takes, and whether it
    came raw (encoded here) or as a reference to an embedding made elsewhere."""

    start: int
    tokens: int
    raw: bool


@dataclass(eq=False)
class Sequence:
    prompt_tokens: int
    items: tuple[Item, ...]
    max_tokens: int
    tokens: MemoryObjectSendStream[float]
    loaded: bool = False
    prefilled: int = 0
    generated: int = 0
    encoded: set[int] = field(default_factory=set)
    aborted: bool = False
    added: float = 0.0

    @property
    def reference_tokens(self) -> int:
        return sum(item.tokens for item in self.items if not item.raw)


@dataclass
class Step:
    """One step as planned: what it does and how long it holds the GPU."""

    duration: float = 0.0
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[tuple[Sequence, int]] = field(default_factory=list)
    encode: list[tuple[Sequence, int]] = field(default_factory=list)
    load: list[Sequence] = field(default_factory=list)
    encode_s: float = 0.0
    prefill_s: float = 0.0
    load_s: float = 0.0


@dataclass
class Accounting:
    """The GPU's time by what it did, and the steps (for the status of a run and for tests)."""

    steps: int = 0
    busy_s: float = 0.0
    encode_s: float = 0.0
    prefill_s: float = 0.0
    load_s: float = 0.0
    encoded_tokens: int = 0
    loaded_tokens: int = 0
    requests: int = 0
    local_requests: int = 0
    reference_requests: int = 0
    # From a request's arrival at the engine to its first token, summed (the engine's part of TTFT).
    first_token_s: float = 0.0
    first_tokens: int = 0
    # The unfinished requests (the load the middleware reads) integrated over the GPU's busy time.
    unfinished_s: float = 0.0


class Engine:
    """The simulated engine: ``add`` a sequence, its tokens come out of the stream it was given, each as
    the GPU clock's time when the step that made it ended."""

    def __init__(self, costs: GPUCosts, *, record: bool = False) -> None:
        self.costs = costs
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.accounting = Accounting()
        self.record = record
        self.log: list[tuple[float, float, Step]] = []
        self._wake = anyio.Event()

    def num_unfinished_requests(self) -> int:
        """As vLLM's ``engine_client.get_num_unfinished_requests()``: every request the engine holds."""
        return len(self.waiting) + len(self.running)

    def num_queued_tokens(self) -> int:
        """As vLLM's ``engine_client.get_num_queued_tokens()``: the prompt tokens of the requests still
        in prefill."""
        return sum(seq.prompt_tokens for seq in self.waiting if not seq.aborted)

    def add(self, sequence: Sequence) -> None:
        sequence.loaded = sequence.reference_tokens == 0
        sequence.added = anyio.current_time()
        self.waiting.append(sequence)
        account = self.accounting
        account.requests += 1
        account.local_requests += any(item.raw for item in sequence.items)
        account.reference_requests += any(not item.raw for item in sequence.items)
        self._wake.set()

    def plan(self) -> Step:
        """The next step, as vLLM's scheduler builds it: the running requests decode first, then waiting
        requests are prefilled in arrival order within the token budget; a raw image is encoded in the
        step that prefills its placeholder (the whole image, within the encoder's budget, the same as
        the token budget; an image that does not fit ends the chunk before it)."""
        costs, step = self.costs, Step()
        budget = costs.step_token_budget
        step.decode = [seq for seq in self.running if not seq.aborted][:budget]
        budget -= len(step.decode)
        # Loads take no tokens of the budget: the connector moves the bytes, the step waits for them.
        step.load = [seq for seq in self.waiting if not seq.loaded and not seq.aborted]
        encoder_budget = costs.step_token_budget
        seats = costs.max_num_seqs - len(self.running)
        for seq in self.waiting:
            if seq.aborted or not seq.loaded:
                continue
            if budget <= 0 or (seq.prefilled == 0 and seats <= 0):
                break
            end = seq.prefilled + min(seq.prompt_tokens - seq.prefilled, budget)
            encodes = []
            for index, item in enumerate(seq.items):  # in placeholder order
                if not item.raw or index in seq.encoded or item.start >= end:
                    continue
                if item.tokens > encoder_budget:
                    end = item.start  # the chunk stops before the image that does not fit
                    break
                encoder_budget -= item.tokens
                encodes.append((seq, index))
            if end <= seq.prefilled:
                break  # as vLLM: a request that cannot progress in this step stops the waiting queue
            step.encode += encodes
            step.prefill.append((seq, end - seq.prefilled))
            seats -= seq.prefilled == 0
            budget -= end - seq.prefilled
        prefill_tokens = sum(chunk for _, chunk in step.prefill)
        if step.decode or step.prefill:
            context = sum(seq.prompt_tokens + seq.generated for seq in step.decode)
            step.prefill_s = prefill_tokens * costs.prefill_token_s
            step.duration += costs.step_fixed_s + context * costs.context_token_s + step.prefill_s
        if step.encode:
            tokens = sum(seq.items[index].tokens for seq, index in step.encode)
            step.encode_s = costs.vit_fixed_s + tokens * costs.vit_token_s
            step.duration += step.encode_s
        step.load_s = sum(costs.load_s(seq.reference_tokens) for seq in step.load)
        step.duration += step.load_s
        return step

    def finish(self, step: Step, end: float) -> None:
        """The step ended at ``end`` on the GPU clock: its tokens go out."""
        account = self.accounting
        account.steps += 1
        account.busy_s += step.duration
        account.unfinished_s += step.duration * self.num_unfinished_requests()
        account.encode_s += step.encode_s
        account.prefill_s += step.prefill_s
        account.load_s += step.load_s
        for seq, index in step.encode:
            seq.encoded.add(index)
            account.encoded_tokens += seq.items[index].tokens
        for seq in step.load:
            seq.loaded = True
            account.loaded_tokens += seq.reference_tokens
        for seq in step.decode:
            seq.generated += 1
            self._emit(seq, end)
        for seq, chunk in step.prefill:
            seq.prefilled += chunk
            if seq.prefilled == seq.prompt_tokens:
                self.waiting.remove(seq)
                self.running.append(seq)
                seq.generated = 1  # the step that completes a prefill samples the first token
                account.first_token_s += max(0.0, end - seq.added)
                account.first_tokens += 1
                self._emit(seq, end)
        for seq in [*self.running, *self.waiting]:
            if seq.aborted or seq.generated >= seq.max_tokens:
                seq.tokens.close()
                (self.running if seq in self.running else self.waiting).remove(seq)

    def _emit(self, seq: Sequence, at: float) -> None:
        try:
            seq.tokens.send_nowait(at)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            seq.aborted = True  # the caller left

    async def run(self) -> None:
        """The step loop: the GPU, for as long as the engine runs."""
        gpu_clock: float | None = None
        while True:
            if not self.waiting and not self.running:
                self._wake = anyio.Event()
                await self._wake.wait()
                gpu_clock = None
                continue
            step = self.plan()
            now = anyio.current_time()
            # While the GPU has work, a step starts where the last ended; the event loop's lateness is
            # forgiven up to one step's fixed time, so that a late wake-up does not stretch the GPU.
            start = now if gpu_clock is None else max(gpu_clock, now - self.costs.step_fixed_s)
            end = start + step.duration
            if step.duration > 0:
                await anyio.sleep_until(end)
            else:
                await anyio.lowlevel.checkpoint()
            gpu_clock = end
            if self.record:
                self.log.append((start, end, step))
            self.finish(step, end)


# The HTTP side ---------------------------------------------------------------------------------------


class BadRequest(Exception):
    pass


def sequence_of(body: dict[str, Any], send: MemoryObjectSendStream[float]) -> Sequence:
    """The prompt of a chat request as the engine sees it: its images (raw, encoded here, or references
    to embeddings named in ``ec_transfer_params``) and its text."""
    params = body.get("ec_transfer_params") or {}
    items: list[Item] = []
    text_chars, at = 0, 0
    for message in body["messages"]:
        content = message["content"]
        if isinstance(content, str):
            text_chars += len(content)
            continue
        for part in content:
            kind = part.get("type")
            if kind == "text":
                text_chars += len(part["text"])
            elif kind == "image_url":
                tokens = image_tokens(*png_size(part["image_url"]["url"]))
                items.append(Item(at, tokens, raw=True))
                at += tokens
            elif kind == "image_embeds":
                if part.get("uuid") not in params:
                    raise BadRequest(f"reference {part.get('uuid')!r} not in ec_transfer_params")
                tokens = tokens_of_grid(part["image_embeds"]["image_grid_thw"])
                items.append(Item(at, tokens, raw=False))
                at += tokens
            else:
                raise BadRequest(f"part type {kind!r}")
    prompt = at + TEMPLATE_TOKENS + math.ceil(text_chars / 4)
    return Sequence(prompt, tuple(items), int(body.get("max_tokens") or 16), send)


def chunk(content: str) -> bytes:
    payload = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}}],
    }
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


class Disconnected(Exception):
    pass


async def read_body(receive: Receive) -> bytes:
    parts, more = [], True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise Disconnected
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(parts)


async def answer(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class EngineClient:
    """What vLLM's app state holds as ``engine_client``, as far as the middleware reads it."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def get_num_unfinished_requests(self) -> int:
        return self._engine.num_unfinished_requests()

    def get_num_queued_tokens(self) -> int:
        return self._engine.num_queued_tokens()


class State:
    def __init__(self, engine: Engine) -> None:
        self.engine_client = EngineClient(engine)


class EngineApp:
    """The engine's OpenAI server, as far as the benchmark uses it: streaming chat completions."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.state = State(engine)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/health":
            await answer(send, 200, {})
        elif path == "/engine/stats":
            stats = {**asdict(self.engine.accounting), "unfinished": self.engine.num_unfinished_requests()}
            await answer(send, 200, stats)
        elif path == "/v1/chat/completions" and scope["method"] == "POST":
            await self._chat(receive, send)
        else:
            await answer(send, 404, {"error": {"message": "not found", "code": 404}})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    group.start_soon(self.engine.run)
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    group.cancel_scope.cancel()
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    async def _chat(self, receive: Receive, send: Send) -> None:
        try:
            body = json.loads(await read_body(receive))
        except Disconnected:
            return
        sender, receiver = anyio.create_memory_object_stream[float](math.inf)
        try:
            seq = sequence_of(body, sender)
        except (BadRequest, KeyError, TypeError, ValueError) as exc:
            await answer(send, 400, {"error": {"message": str(exc), "code": 400}})
            return
        self.engine.add(seq)
        streaming = bool(body.get("stream"))
        try:
            async with receiver:
                if not streaming:
                    count = 0
                    async for _ in receiver:
                        count += 1
                    message = {"role": "assistant", "content": "t" * count}
                    await answer(send, 200, {"choices": [{"index": 0, "message": message}]})
                    return
                headers = [(b"content-type", b"text/event-stream")]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                async for _ in receiver:
                    await send({"type": "http.response.body", "body": chunk("t"), "more_body": True})
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finally:
            seq.aborted |= seq.generated < seq.max_tokens


class AsVLLM:
    """The app as vLLM's server has it: ``scope["app"]`` is the server's app, whose state holds the
    engine client (Starlette sets it before any middleware runs)."""

    def __init__(self, app: Any, engine_app: EngineApp) -> None:
        self.app = app
        self.engine_app = engine_app
        self.state = engine_app.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self
        await self.app(scope, receive, send)


def main(argv: list[str]) -> None:
    import argparse

    import uvicorn

    from epd_middleware import EPDMiddleware, Host

    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--costs", required=True, help="GPUCosts as JSON")
    parser.add_argument("--encoders", default="")
    parser.add_argument("--placement", default="remote")
    parser.add_argument("--options", default="{}", help="more EPDMiddleware options as JSON")
    args = parser.parse_args(argv)
    engine = Engine(GPUCosts(**json.loads(args.costs)))
    engine_app = EngineApp(engine)
    # What vLLM's state tells the middleware in a real PD: the engine's load and prefill backlog (its
    # engine client) and step budget (max_num_batched_tokens), and the served model's image processor
    # (Qwen2.5-VL: 28 pixels a token side, its pixel bounds).
    host = Host(
        placement=args.placement,
        engine_load=engine.num_unfinished_requests,
        engine_queued_tokens=engine.num_queued_tokens,
        step_tokens=engine.costs.step_token_budget,
        vision_token_side=FACTOR,
        image_pixel_bounds=(MIN_PIXELS, MAX_PIXELS),
    )
    app = EPDMiddleware(
        engine_app,
        encoders=args.encoders.split(","),
        placement=args.placement,
        host=host,
        **json.loads(args.options),
    )
    uvicorn.run(
        AsVLLM(app, engine_app),
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        http="httptools",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
