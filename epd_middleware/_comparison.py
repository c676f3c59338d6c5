"""The comparison of two answers to the equivalence probe's prompt (:mod:`._equivalence`), and the
verdicts it gives an encoder: pure functions of the answers, tested without vLLM."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

__all__ = [
    "RESULTS",
    "Comparison",
    "Outcome",
    "ProbeAnswer",
    "Step",
    "answer_of",
    "compare",
    "default_tolerance",
    "judged_against",
    "judged_among",
]

# The logprob difference (in nats) two correct paths may show, by the model's dtype. The embedding the
# encoder computes went through another process (another GPU, batch shape and kernel choice) than the
# one PD computes, so it differs by rounding, which the layers carry to the logits: bfloat16 keeps 8
# significant bits (a relative rounding of 2^-8, 0.4 %, per operation), float16 11, float32 24. A wrong
# embedding (other weights, other processor options, a dropped option) moves logprobs by whole nats and
# changes tokens. Where the dtype is not known, the widest.
_TOLERANCE_BY_DTYPE = {"float32": 0.02, "float16": 0.1, "half": 0.1, "bfloat16": 0.25}
_WIDEST = 0.25
# Results a run gives each encoder (the metric's result label).
RESULTS = ("match", "mismatch", "disagree", "unproven", "error", "skipped")


# One encoder's result for one variant of the prompt: result, what differed (or how closely it agreed),
# the largest logprob difference seen (None: nothing compared).
Outcome = tuple[str, str, "float | None"]


def default_tolerance(dtype: str | None) -> float:
    """The tolerance for a model run in ``dtype`` (None: not known)."""
    return _TOLERANCE_BY_DTYPE.get(dtype or "", _WIDEST)


# The comparison (pure) ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    """One generated token: its text, its logprob, and the top logprobs at its position."""

    token: str
    logprob: float
    top: Mapping[str, float]


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    """What a probe request's answer says: its prompt's length in tokens, and each generated step."""

    prompt_tokens: int | None
    steps: tuple[Step, ...]

    @property
    def text(self) -> str:
        return "".join(step.token for step in self.steps)


def answer_of(reply: Any) -> ProbeAnswer:
    """The answer of a chat completion with logprobs (vLLM's JSON); ValueError naming what it lacks or
    what is off in it (whatever the engine wrote: a probe reads answers it did not check)."""
    try:
        content = reply["choices"][0]["logprobs"]["content"]
        if not isinstance(content, list):
            raise TypeError("logprobs.content is not a list")
        steps = [_step(entry) for entry in content]
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, OverflowError) as exc:
        raise ValueError(f"the answer has no logprobs ({type(exc).__name__}: {exc})") from None
    usage = reply.get("usage") if isinstance(reply, dict) else None
    prompt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    known = isinstance(prompt, int) and not isinstance(prompt, bool) and 0 <= prompt < 1 << 40
    return ProbeAnswer(prompt if known else None, tuple(steps))


def _step(entry: Any) -> Step:
    if not isinstance(entry, dict):
        raise TypeError("a logprobs entry is not an object")
    top: dict[str, float] = {}
    candidates = entry.get("top_logprobs") or ()
    if not isinstance(candidates, list):
        raise TypeError("top_logprobs is not a list")
    for candidate in candidates:
        if not isinstance(candidate, dict):
            raise TypeError("a top_logprobs entry is not an object")
        token, logprob = str(candidate["token"]), _finite(candidate["logprob"])
        top[token] = max(top.get(token, -math.inf), logprob)
    token, logprob = str(entry["token"]), _finite(entry["logprob"])
    top.setdefault(token, logprob)
    return Step(token, logprob, top)


def _finite(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError("a logprob is not a number")
    number = float(value)  # OverflowError for an integer past float's range
    if math.isnan(number):
        raise TypeError("a logprob is NaN")
    return min(max(number, -1e4), 0.0)  # vLLM writes -inf as -9999.0; either is "never"


class Comparison(NamedTuple):
    """Whether two answers agree, what differed (or how closely they agreed), the largest logprob
    difference seen, and how many positions were compared."""

    equal: bool
    detail: str
    max_difference: float
    compared: int


def compare(reference: ProbeAnswer, candidate: ProbeAnswer, tolerance: float) -> Comparison:
    """Compare ``candidate`` with ``reference``, position by position.

    The prompt lengths must be equal (a different image size or processor option changes the number of
    vision tokens). At each position the tokens must be equal, and the logprob of every token both list
    among their top ones within ``tolerance``. Greedy tokens may differ only at a near tie, as vLLM's own
    model tests allow for two runs of one model (``check_logprobs_close``: each token among the other's
    top logprobs), here also within ``tolerance`` of each other in the reference; the answers diverge
    there, so the comparison ends. Answers of different lengths differ (one stopped early)."""
    if reference.prompt_tokens != candidate.prompt_tokens:
        return Comparison(
            False,
            f"prompt of {candidate.prompt_tokens} tokens, against {reference.prompt_tokens}: the media "
            "came out a different size (processor options or defaults)",
            math.inf,
            0,
        )
    worst = 0.0
    for index, (ours, theirs) in enumerate(zip(reference.steps, candidate.steps, strict=False)):
        if ours.token != theirs.token:
            near = theirs.token in ours.top and ours.token in theirs.top
            gap = abs(ours.logprob - ours.top[theirs.token]) if near else math.inf
            if gap <= tolerance:
                return Comparison(
                    True,
                    f"{index} token(s) agree, then a near tie ({ours.token!r} or {theirs.token!r}, "
                    f"{gap:.3g} apart); largest logprob difference {worst:.3g}",
                    worst,
                    index,
                )
            return Comparison(
                False,
                f"token {index}: {theirs.token!r} where the reference has {ours.token!r} "
                f"(logprob {theirs.logprob:.3f} against {ours.logprob:.3f})",
                max(worst, abs(ours.logprob - theirs.logprob)),
                index,
            )
        shared = ours.top.keys() & theirs.top.keys()
        token, difference = max(
            ((token, abs(ours.top[token] - theirs.top[token])) for token in shared), key=lambda pair: pair[1]
        )
        worst = max(worst, difference)
        if difference > tolerance:
            return Comparison(
                False,
                f"token {index} ({ours.token!r}): the logprob of {token!r} is {theirs.top[token]:.3f} "
                f"against {ours.top[token]:.3f}, {difference:.3g} apart (tolerance {tolerance:g})",
                worst,
                index + 1,
            )
    compared = min(len(reference.steps), len(candidate.steps))
    if len(reference.steps) != len(candidate.steps):
        return Comparison(
            False,
            f"{len(candidate.steps)} token(s) where the reference has {len(reference.steps)}",
            worst,
            compared,
        )
    return Comparison(
        True, f"{compared} token(s) agree; largest logprob difference {worst:.3g}", worst, compared
    )


def judged_against(
    reference: ProbeAnswer, answer: ProbeAnswer | str, tolerance: float, against: str
) -> Outcome:
    if isinstance(answer, str):
        return "error", answer, None
    compared = compare(reference, answer, tolerance)
    if compared.equal:
        return "match", compared.detail, compared.max_difference
    return "mismatch", f"{compared.detail} (against {against})", compared.max_difference


def judged_among(answers: Mapping[str, ProbeAnswer | str], tolerance: float) -> dict[str, Outcome]:
    """Encoders compared with each other: each against the answer most of them agree with. An encoder
    outside a strict majority mismatches; where there is none, they disagree (which one is at fault
    cannot be told); a lone encoder is unproven."""
    given = {url: answer for url, answer in answers.items() if isinstance(answer, ProbeAnswer)}
    out: dict[str, Outcome] = {
        url: ("error", answer, None) for url, answer in answers.items() if isinstance(answer, str)
    }
    if len(given) < 2:
        for url in given:
            out[url] = (
                "unproven",
                "no other encoder answered to compare with (this server cannot encode)",
                None,
            )
        return out
    agreeing = {
        url: [other for other in given if compare(given[url], given[other], tolerance).equal] for url in given
    }
    leader = max(given, key=lambda url: len(agreeing[url]))
    majority = len(agreeing[leader]) * 2 > len(given)
    for url, answer in given.items():
        compared = compare(given[leader], answer, tolerance)
        if compared.equal and majority:
            out[url] = (
                "match",
                f"{compared.detail} (with {len(agreeing[leader]) - 1} other encoder(s))",
                compared.max_difference,
            )
        elif majority:
            out[url] = (
                "mismatch",
                f"{compared.detail} (against {len(agreeing[leader])} encoders that agree)",
                compared.max_difference,
            )
        else:
            out[url] = (
                "disagree",
                "the encoders' answers differ and no majority agrees: which is at fault cannot be told",
                compared.max_difference,
            )
    return out
