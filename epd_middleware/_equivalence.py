"""The equivalence probe: proof, on the running fleet, that E + PD answers what PD alone would.

At start-up and every ``equivalence_interval`` seconds, for each encoder, a built-in prompt (an image
and a paragraph of text; once with the defaults, once with non-default media options) runs twice through
this server's engine, greedy, a few tokens with their top logprobs: once with the image encoded by that
encoder and handed over through the EC connector (the path client requests take: this middleware's own
encode stage, pinned to the encoder), once with the image left for the engine to encode itself. The two
answers must agree: the same prompt length, the same tokens, logprobs within a tolerance. Where this
server cannot encode (a Mooncake consumer waits for a push of every item), each encoder's answer is
compared with the other encoders' instead. That is a weaker proof: encoders broken alike agree.

Neither path may read the other's work, or an earlier run's: each runs under a ``cache_salt`` of its own
(vLLM's prefix cache) and a media uuid of its own (the engine's encoder cache, the encoder's, the EC
storage), drawn afresh every run.

The probe is the server's own request, made in this process and handed to the wrapped app
(:mod:`._probe_paths`): it takes none of the slots the middleware keeps for clients (``pending``), and
it carries vLLM's own key through vLLM's own checks. It does not run while the engine is busy
(``equivalence_max_pd_load``), and says so.
"""

from __future__ import annotations

import base64
import json
import math
import secrets
import struct
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from ._comparison import Outcome, ProbeAnswer, default_tolerance, judged_against, judged_among
from ._logs import logger
from ._probe_paths import Cost, Engine, PathFailed, ask_engine, through_encoder
from ._protocol import CACHE_SALT, MODEL, UUID
from ._sampling import sampled_requests
from ._surfaces import ParsedRequest, openai_chat
from .host import Host

if TYPE_CHECKING:
    from ._pipeline import Pipeline

__all__ = [
    "DEFAULT_OPTIONS",
    "Engine",
    "Equivalence",
    "EquivalencePolicy",
    "Verdict",
    "probe_fields",
    "probe_image",
]

# The non-default options of the second run: generic vLLM media options that change what the encoder
# sees (the probe image is transparent outside its squares, so the background colour matters).
DEFAULT_OPTIONS: Mapping[str, Any] = {"media_io_kwargs": {"image": {"rgba_background_color": [0, 0, 0]}}}
# Long enough that the prompt fills whole KV-cache blocks (about 120 tokens on Qwen's tokenizer besides
# the image: vLLM's blocks are 16 tokens on GPUs, 128 on its CPU backend), so that the two paths'
# prompts would share prefix-cache blocks but for their salts, and a test can see that they do not.
_PROMPT = (
    "Describe this image: the shapes you see, their colours, where each one sits in the picture, "
    "which of them overlap, what lies between them and around them, and whether the background shows "
    "through anywhere. Then say which shape is the largest, which is the smallest, which colour covers "
    "the most of the picture and which the least, and whether anything in the picture is cut off at its "
    "edges. Name every colour by its plain name, give the positions as left, right, top and bottom, and "
    "keep the whole answer to a few short sentences, without guessing at anything the picture does not "
    "show."
)
_TOP_LOGPROBS = 5


# The probe's request -------------------------------------------------------------------------------------


def probe_image(side: int = 112) -> str:
    """The probe's image as a data URL: four coloured squares on a transparent field (so the background
    colour option changes what is encoded), ``side`` pixels square (112: 16 vision tokens for Qwen2-VL,
    within every vision model's minimum). Made here: no file ships with the package."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    colours = (b"\xd0\x30\x30\xff", b"\x30\xa0\x30\xff", b"\x30\x30\xd0\xff", b"\xe0\xc0\x20\x90")
    quarter, rows = side // 4, []
    for y in range(side):
        row = bytearray(b"\0")
        for x in range(side):
            inside = quarter // 2 <= x % (side // 2) < quarter * 3 // 2 + quarter // 2
            inside = inside and quarter // 2 <= y % (side // 2) < quarter * 3 // 2 + quarter // 2
            row += colours[(y >= side // 2) * 2 + (x >= side // 2)] if inside else b"\0\0\0\0"
        rows.append(bytes(row))
    header = struct.pack(">IIBBBBB", side, side, 8, 6, 0, 0, 0)
    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"".join(rows)))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()


_IMAGE = probe_image()


def probe_fields(
    model: str, options: Mapping[str, Any], tokens: int, salt: str, uuid: str | None = None
) -> dict[str, Any]:
    """The probe's chat request: greedy, ``tokens`` tokens with their top logprobs, under its own
    ``salt``; ``uuid``: the image's (the PD-alone path pins one of its own; the E + PD path's is the
    middleware's, keyed by the salt)."""
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": _IMAGE}}
    if uuid is not None:
        part[UUID] = uuid
    return {
        MODEL: model,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": _PROMPT}]}],
        "temperature": 0,
        "seed": 0,
        "max_tokens": tokens,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": _TOP_LOGPROBS,
        CACHE_SALT: salt,
        **options,
    }


# The schedule and the verdicts --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EquivalencePolicy:
    """What the configuration says of the probe (``equivalence_*``)."""

    interval: float = 0.0  # 0: no schedule (a run on request still runs)
    tolerance: float | None = None  # None: by the model's dtype
    eject: bool = False
    tokens: int = 4
    options: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_OPTIONS))
    max_pd_load: int = 4


@dataclass
class Verdict:
    """One encoder's latest result: ``result`` (:data:`RESULTS`), what differed or how closely it
    agreed, per variant, when (Unix time), and the largest logprob difference."""

    result: str
    detail: str
    at: float
    variants: dict[str, str] = field(default_factory=dict)
    max_difference: float | None = None

    def view(self) -> dict[str, Any]:
        return {
            "result": self.result,
            "detail": self.detail,
            "at": round(self.at, 3),
            "variants": dict(self.variants),
            "max_logprob_difference": None
            if self.max_difference is None or math.isinf(self.max_difference)
            else round(self.max_difference, 6),
        }


class Equivalence:
    """The probe's schedule, its runs, and every encoder's latest verdict (one per middleware)."""

    def __init__(self, policy: EquivalencePolicy, pipeline: Pipeline) -> None:
        self.policy = policy
        self.pipeline = pipeline
        self.verdicts: dict[str, Verdict] = {}
        # The verdicts of sampled real requests (verify_share), per encoder: kept apart from the canary's.
        self.traffic: dict[str, Verdict] = {}
        self.traffic_cost = Cost()
        self.mode: str | None = None  # "pd_alone" or "encoders_compared", once a run said
        self.last_run: float | None = None
        self.finished_at: float | None = None  # time.monotonic() at the last run's end
        self.last_skip: str | None = None
        self.cost = Cost()
        self._lock = anyio.Lock()
        self._report: dict[str, Any] | None = None

    # Running ----------------------------------------------------------------------------------------

    async def run_forever(self, engine: Engine) -> None:
        """Run at start-up and every interval; a run skipped while the engine is busy is tried again
        within a tenth of the interval (at most 30 s). A run that fails in a way nobody foresaw is
        logged and the schedule goes on: it shares the lifespan with the health probes."""
        interval = self.policy.interval
        while True:
            try:
                report = await self.run_once(engine)
            except Exception:
                logger.exception("epd: the equivalence probe failed; trying again at the next interval")
                report = {}
            await anyio.sleep(min(interval / 10, 30.0) if report.get("skipped") else interval)

    async def run_once(self, engine: Engine, *, fresh_within: float = 0.0) -> dict[str, Any]:
        """One run over every encoder; its report. Runs never overlap: a caller that arrives while one
        runs gets that run's report, as does one within ``fresh_within`` seconds of the last one's end
        (a run that took longer than that gives no one a second at once)."""
        fresh = (
            self._report is not None
            and self.finished_at is not None
            and time.monotonic() - self.finished_at < fresh_within
        )
        if self._lock.locked() or fresh:
            async with self._lock:
                pass
            if self._report is not None:
                return self._report
            # The run waited for ended without a report (cancelled at shutdown): this caller's own.
        async with self._lock:
            try:
                self._report = await self._run(engine)
            finally:
                self.finished_at = time.monotonic()
            return self._report

    async def _run(self, engine: Engine) -> dict[str, Any]:
        pipeline, host = self.pipeline, engine.host
        encoders = self._encoders()
        busy = self._busy(host)
        model = self._model(host)
        if busy is not None or model is None or not encoders:
            why = busy or (
                "no encoder to probe" if model is not None else "this server's model is not known yet"
            )
            self.cost.skipped += 1
            self.last_skip = why
            for url in encoders:
                pipeline.stats.equivalence(url, "skipped")
            logger.info("epd: equivalence probe skipped: %s", why)
            return {"skipped": why, "ok": None, "encoders": {}}
        self.cost.runs += 1
        self.last_run, self.last_skip = time.time(), None
        self.mode = "pd_alone" if host.local_encoding_blocker is None else "encoders_compared"
        tolerance = (
            self.policy.tolerance if self.policy.tolerance is not None else default_tolerance(host.dtype)
        )
        variants: dict[str, Mapping[str, Any]] = {"default": {}}
        if self.policy.options and host.trusts_request_mm_kwargs:
            variants["options"] = self.policy.options
        results: dict[str, dict[str, Outcome]] = {url: {} for url in encoders}
        for name, options in variants.items():
            compared = await self._variant(engine, model, options, encoders, tolerance)
            for url, outcome in compared.items():
                results[url][name] = outcome
        # Where PD alone is the reference, an encoder is taken out only when another matched it: if
        # every encoder differs from PD alone, PD's own path (its processor, options or weights) is as
        # likely the odd one, and taking them all out would fail every client.
        matched = any(
            all(outcome[0] == "match" for outcome in outcome_of.values()) for outcome_of in results.values()
        )
        may_bar = self.mode != "pd_alone" or matched
        for url, outcome_of in results.items():
            self._judge(url, outcome_of, tolerance, may_bar=may_bar)
        if not may_bar and any(
            outcome[0] == "mismatch" for outcome_of in results.values() for outcome in outcome_of.values()
        ):
            logger.warning(
                "epd: no encoder's answer matches what PD alone answers: PD's own path (its processor, "
                "options or weights) may be the odd one%s",
                "; no encoder is taken out of the pool for it" if self.policy.eject else "",
            )
        report = {
            "ok": all(self.verdicts[url].result in ("match", "unproven") for url in encoders),
            "mode": self.mode,
            "tolerance": tolerance,
            "encoders": {url: self.verdicts[url].view() for url in encoders},
        }
        return report

    async def _variant(
        self,
        engine: Engine,
        model: str,
        options: Mapping[str, Any],
        encoders: Sequence[str],
        tolerance: float,
    ) -> dict[str, Outcome]:
        """Each encoder's (result, detail, largest difference) for one variant of the prompt."""
        nonce = secrets.token_hex(8)
        tokens = self.policy.tokens
        answers: dict[str, ProbeAnswer | str] = {}
        for index, url in enumerate(encoders):
            fields = probe_fields(model, options, tokens, f"epd-equivalence-{nonce}-e{index}")
            try:
                answers[url] = await through_encoder(
                    self.pipeline,
                    engine,
                    _parsed(fields),
                    url,
                    f"epd-equivalence-{nonce}-e{index}",
                    self.cost,
                )
            except PathFailed as exc:
                answers[url] = str(exc)
        if self.mode == "pd_alone":
            local = probe_fields(
                model, options, tokens, f"epd-equivalence-{nonce}-pd", f"epd-equivalence-{nonce}"
            )
            try:
                reference = await ask_engine(
                    self.pipeline,
                    engine,
                    json.dumps(local).encode(),
                    f"epd-equivalence-{nonce}-pd",
                    self.cost,
                )
            except PathFailed as exc:
                return {url: ("error", f"PD alone got no answer: {exc}", None) for url in encoders}
            return {
                url: judged_against(reference, answer, tolerance, "PD alone")
                for url, answer in answers.items()
            }
        return judged_among(answers, tolerance)

    # Real requests (verify_share) -------------------------------------------------------------------

    async def check_sampled_forever(self, engine: Engine) -> None:
        """Re-run the requests :class:`~._sampling.Sampler` took, one at a time, as they come."""
        sampler = self.pipeline.sampler
        while True:
            sampled = await sampler.next()
            try:
                await self.check_sampled(engine, sampled)
            except Exception:
                logger.exception("epd: a sampled equivalence check failed")
            finally:
                del sampled  # its media is the client's: nothing of it is kept past its check

    async def check_sampled(self, engine: Engine, request: ParsedRequest) -> Outcome | None:
        """One real request's prompt and media through both paths, at one token with its logprobs: its
        outcome, judged for the encoder that took it (None: skipped, the engine is busy or no encoder
        is there). The client's own request was answered before; nothing here reaches it."""
        sampler, host = self.pipeline.sampler, engine.host
        encoders = self._encoders()
        if self._busy(host) is not None or not encoders or host.local_encoding_blocker is not None:
            sampler.skipped += 1
            return None
        encoder = encoders[sampler.turn() % len(encoders)]
        nonce = secrets.token_hex(8)
        tolerance = (
            self.policy.tolerance if self.policy.tolerance is not None else default_tolerance(host.dtype)
        )
        remote, local = sampled_requests(request, nonce)
        try:
            candidate = await through_encoder(
                self.pipeline, engine, remote, encoder, f"epd-equivalence-{nonce}-e", self.traffic_cost
            )
        except PathFailed as exc:
            outcome: Outcome = ("error", str(exc), None)
        else:
            try:
                reference = await ask_engine(
                    self.pipeline, engine, local, f"epd-equivalence-{nonce}-pd", self.traffic_cost
                )
            except PathFailed as exc:
                outcome = ("error", f"PD alone got no answer: {exc}", None)
            else:
                outcome = judged_against(reference, candidate, tolerance, "PD alone")
        sampler.checked += 1
        self._judge_traffic(encoder, outcome, tolerance)
        return outcome

    def _judge_traffic(self, url: str, outcome: Outcome, tolerance: float) -> None:
        """A real request's verdict: counted and shown apart from the canary's; a mismatch is said and
        (with ``equivalence_eject``) acted on like the canary's, but a match brings no encoder back (one
        request's media proves less than the canary's run)."""
        result, detail, difference = outcome
        self.traffic[url] = Verdict(result, detail, time.time(), {"traffic": detail}, difference)
        self.pipeline.stats.equivalence(url, result, source="traffic")
        if result == "mismatch":
            logger.warning(
                "epd: encoder %s does not answer a sampled request as PD alone does: %s (tolerance %g)%s",
                url,
                detail,
                tolerance,
                "; taken out of the pool until the canary matches" if self.policy.eject else "",
            )
            # As for the canary: only where another encoder is known to answer as PD does.
            vouched = any(
                other != url
                and verdict.result == "match"
                and self.pipeline.encoders.usable(other, anyio.current_time())
                for other, verdict in self.verdicts.items()
            )
            if self.policy.eject and vouched:
                self.pipeline.encoders.bar(url, f"a sampled request's answer differs from PD's own: {detail}")
        elif result == "error":
            logger.info("epd: sampled equivalence check of encoder %s: %s", url, detail)

    # Judging ----------------------------------------------------------------------------------------

    def _judge(self, url: str, outcomes: Mapping[str, Outcome], tolerance: float, *, may_bar: bool) -> None:
        """The encoder's verdict over the variants: the worst of them; said, counted, and (with
        ``equivalence_eject``) acted on."""
        order = ("mismatch", "error", "disagree", "unproven", "match")
        result = min((outcome[0] for outcome in outcomes.values()), key=order.index)
        differences = [outcome[2] for outcome in outcomes.values() if outcome[2] is not None]
        details = {name: outcome[1] for name, outcome in outcomes.items()}
        detail = "; ".join(f"{name}: {text}" for name, text in details.items() if outcomes[name][0] == result)
        previous = self.verdicts.get(url)
        self.verdicts[url] = Verdict(
            result, detail, time.time(), details, max(differences) if differences else None
        )
        pool = self.pipeline.encoders
        self.pipeline.stats.equivalence(url, result)
        if result == "mismatch":
            logger.warning(
                "epd: encoder %s does not answer what %s: %s (tolerance %g)%s",
                url,
                "PD alone answers" if self.mode == "pd_alone" else "the other encoders answer",
                detail,
                tolerance,
                "; taken out of the pool until it does" if self.policy.eject and may_bar else "",
            )
            if self.policy.eject and may_bar:
                pool.bar(url, f"its answers differ from {self._reference()}: {detail}")
        elif result in ("error", "disagree"):
            logger.warning("epd: equivalence probe of encoder %s: %s", url, detail)
        else:
            if previous is None or previous.result != result:
                logger.info("epd: equivalence probe of encoder %s: %s (%s)", url, result, detail)
            if result == "match":  # "unproven" proves nothing: a barred encoder stays out
                pool.unbar(url)

    def _reference(self) -> str:
        return "PD's own" if self.mode == "pd_alone" else "the other encoders'"

    # What a run needs -------------------------------------------------------------------------------

    def _encoders(self) -> list[str]:
        """The encoders to probe: every member not ejected and serving this server's model (one taken
        out for a mismatch included: a match brings it back)."""
        pool, now = self.pipeline.encoders, anyio.current_time()
        return [
            url
            for url in pool.members
            if (health := pool.known(url)) is None
            or (health.ejected_until <= now and health.model != "mismatch")
        ]

    def _busy(self, host: Host) -> str | None:
        """Why the engine is too busy for a probe now (None: it is not): clients come first."""
        if host.shutting_down():
            return "this server is shutting down: its engine aborts every request added"
        load, policy = host.unfinished_requests(), self.policy
        if load is not None and load >= policy.max_pd_load:
            return f"the engine has {load} unfinished requests (equivalence_max_pd_load {policy.max_pd_load})"
        queued, step = host.queued_tokens(), host.step_tokens
        if queued is not None and step is not None and queued > step:
            return f"the engine has {queued} prompt tokens to prefill, more than one step ({step})"
        config = self.pipeline.config
        if self.pipeline.pending * 2 >= config.max_pending_requests:
            pending = self.pipeline.pending
            return (
                f"{pending} requests wait for encoders (max_pending_requests {config.max_pending_requests})"
            )
        return None

    def _model(self, host: Host) -> str | None:
        expectation = self.pipeline.expectation or host.expectation
        names = sorted(expectation.names) if expectation is not None else []
        return names[0] if names else None

    # The status page --------------------------------------------------------------------------------

    def status(self, host: Host) -> dict[str, Any]:
        policy, cost = self.policy, self.cost
        per_run = cost.requests / cost.runs if cost.runs else None
        tokens_per_run = (cost.prompt_tokens + cost.completion_tokens) / cost.runs if cost.runs else None
        return {
            "interval_s": policy.interval,
            "mode": self.mode or ("pd_alone" if host.local_encoding_blocker is None else "encoders_compared"),
            "weaker_proof": host.local_encoding_blocker is not None,
            "tolerance": policy.tolerance if policy.tolerance is not None else default_tolerance(host.dtype),
            "dtype": host.dtype,
            "eject": policy.eject,
            "last_run": self.last_run,
            "last_skipped": self.last_skip,
            "encoders": {url: verdict.view() for url, verdict in self.verdicts.items()},
            "sampled": {
                **self.pipeline.sampler.status(
                    {url: verdict.view() for url, verdict in self.traffic.items()}
                ),
                "requests": self.traffic_cost.requests,
                "prompt_tokens": self.traffic_cost.prompt_tokens,
                "completion_tokens": self.traffic_cost.completion_tokens,
            },
            "cost": {
                "runs": cost.runs,
                "skipped": cost.skipped,
                "requests": cost.requests,
                "prompt_tokens": cost.prompt_tokens,
                "completion_tokens": cost.completion_tokens,
                "requests_per_run": per_run,
                "tokens_per_run": tokens_per_run,
                "requests_per_hour": per_run * 3600 / policy.interval
                if per_run and policy.interval
                else None,
            },
        }


def _parsed(fields: dict[str, Any]) -> ParsedRequest:
    """The canary prompt as the chat surface reads a client's request."""
    request = openai_chat.SURFACE.parse(json.dumps(fields).encode())
    assert request is not None  # the probe's own body, with its image
    return request
