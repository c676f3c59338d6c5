"""What ``epd-middleware check --pd`` learns from the running PD server: its status page read and
judged (PD's own model, PD's own verdict on every encoder), and ``--canary``'s equivalence probe run
there once. Each answer is a finding or a reason, never an exception."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import anyio

from ._compat import Expectation
from ._http import HTTPError
from .config import EPDConfig
from .host import vllm_api_keys
from .transport import Transport

__all__ = ["MAX_ANSWER", "Findings", "pd_expectation", "pd_status", "pd_verdicts", "run_canary"]

# The largest answer the command reads from any server: a status page of thousands of servers, or a
# /v1/models of many models, is far smaller; a server that says more is not read to the end.
MAX_ANSWER = 8 * 1024 * 1024
# A probe run on a real model: two prompts per encoder and variant, a few tokens each.
_CANARY_SECONDS = 300.0


class Findings(NamedTuple):
    """Problems (the exit status is 1), warnings, and lines to show, from one look at PD."""

    problems: list[str]
    warnings: list[str]


def _headers(config: EPDConfig) -> dict[str, str]:
    keys = (*config.api_keys, *vllm_api_keys())
    return {"authorization": f"Bearer {keys[0]}"} if keys else {}


async def _ask(
    client: Transport, method: str, url: str, headers: dict[str, str], limit: float
) -> tuple[Any, str | None]:
    """A JSON object from ``url``, or why there is none."""
    try:
        with anyio.fail_after(limit):
            status, body = await client.request(method, url, headers=headers)
    except TimeoutError:
        return None, f"no answer within {limit:g} s"
    except HTTPError as exc:
        return None, exc.reason
    if status != 200:
        return None, f"HTTP {status} (is the middleware loaded there, and EPD_API_KEYS one of its keys?)"
    if len(body) > MAX_ANSWER:  # a transport other than the command's own reads without its bound
        return None, f"answer body too large (over {MAX_ANSWER // 1024 // 1024} MiB)"
    try:
        page = json.loads(body)
    except (ValueError, RecursionError):
        # Python's json recurses per level: a page nested thousands deep is no page.
        return None, "not the middleware's answer (not JSON, or nested too deep)"
    if not isinstance(page, dict):
        return None, "not the middleware's answer (no JSON object)"
    return page, None


async def pd_status(
    config: EPDConfig, client: Transport, url: str, limit: float | None = None
) -> tuple[dict[str, Any] | None, str | None]:
    """The PD's status page as the middleware inside it writes it, or why it could not be read: its
    ``model_runner`` is a string or null and its ``known_problems`` a list of strings (either may be
    missing, from an older middleware)."""
    limit = config.health_check_timeout if limit is None else limit
    page, error = await _ask(client, "GET", f"{url.rstrip('/')}{config.status_path}", _headers(config), limit)
    if error is not None:
        return None, error.replace("the middleware's answer", "the middleware's status page")
    not_the_page = "not the middleware's status page"
    if not isinstance(page.get("model_runner"), str | None):
        return None, f"{not_the_page} (model_runner is not a string)"
    known = page.get("known_problems", [])
    if not isinstance(known, list) or not all(isinstance(line, str) for line in known):
        return None, f"{not_the_page} (known_problems is not a list of strings)"
    return page, None


def pd_expectation(page: dict[str, Any]) -> Expectation | None:
    """What PD serves, as its encoders must serve it: its names and model path (None: the page does not
    say, an older middleware or a PD that has not learnt it yet)."""
    model = page.get("model")
    if not isinstance(model, dict):
        return None
    names, root = model.get("names"), model.get("root")
    if not isinstance(names, list) or not names or not all(isinstance(name, str) for name in names):
        return None
    return Expectation(frozenset(names), root if isinstance(root, str) and root else None)


def pd_verdicts(page: dict[str, Any], shown: str, checked: Sequence[str]) -> Findings:
    """PD's own view of its encoders: one it does not use (ejected, another model, silent about it, out
    of the pool for answers that differ) is a problem, whatever the command's own questions found; an
    encoder PD has that the command was not given, or the other way round, a warning (the command's
    environment is not PD's)."""
    problems: list[str] = []
    warnings: list[str] = []
    encoders = page.get("encoders")
    if not isinstance(encoders, dict):
        # An older middleware's page, or a PD whose page was cut down: nothing to judge by.
        return Findings([], [f"pd {shown}: its status page names no encoders: PD's own verdicts not read"])
    members = []
    for url, state in encoders.items():
        if not isinstance(state, dict) or not state.get("member", True):
            continue
        members.append(url)
        if state.get("healthy") is not True:
            why = state.get("why_not")
            problems.append(f"pd {shown}: encoder {url}: {why if isinstance(why, str) else 'not healthy'}")
    equivalence = page.get("equivalence")
    verdicts = equivalence.get("encoders") if isinstance(equivalence, dict) else None
    if verdicts is not None and not isinstance(verdicts, dict):
        problems.append(f"pd {shown}: status page: not the middleware's status page (equivalence.encoders)")
        verdicts = None
    for url, verdict in (verdicts or {}).items():
        if isinstance(verdict, dict) and verdict.get("result") == "mismatch":
            problems.append(
                f"pd {shown}: encoder {url}: its answers differ from PD's own: {verdict.get('detail')}"
            )
    missing = sorted(set(members) - set(checked))
    extra = sorted(set(checked) - set(members))
    if missing:
        warnings.append(f"pd {shown} uses encoder(s) this command was not given: {', '.join(missing)}")
    if extra and members:
        warnings.append(f"pd {shown} does not use encoder(s) this command was given: {', '.join(extra)}")
    return Findings(problems, warnings)


async def run_canary(
    config: EPDConfig, client: Transport, url: str, shown: str, limit: float
) -> tuple[dict[str, Any] | None, Findings]:
    """Run the equivalence probe once on PD (``POST <status_path>/equivalence``): its report, and what
    it means: a mismatch, a disagreement, an error or a skipped run is a problem (nothing was proven),
    an encoder that could only be unproven (a Mooncake consumer with one encoder) a warning."""
    path = config.status_path.rstrip("/") + "/equivalence"
    report, error = await _ask(
        client, "POST", f"{url.rstrip('/')}{path}", _headers(config), max(limit, _CANARY_SECONDS)
    )
    if error is not None:
        return None, Findings([f"pd {shown}: canary: {error}"], [])
    problems: list[str] = []
    warnings: list[str] = []
    if report.get("skipped"):
        problems.append(f"pd {shown}: canary not run: {report['skipped']}")
    if report.get("mode") == "encoders_compared":
        warnings.append(
            f"pd {shown}: this PD cannot encode (a Mooncake consumer): its encoders were compared with "
            "each other, a weaker proof (encoders broken alike agree)"
        )
    encoders = report.get("encoders")
    if not isinstance(encoders, dict):
        return report, Findings([f"pd {shown}: canary: not the middleware's report (encoders)"], warnings)
    for encoder, verdict in encoders.items():
        result = verdict.get("result") if isinstance(verdict, dict) else None
        detail = verdict.get("detail") if isinstance(verdict, dict) else None
        if result == "unproven":
            warnings.append(f"pd {shown}: canary: encoder {encoder}: unproven: {detail}")
        elif result != "match":
            problems.append(f"pd {shown}: canary: encoder {encoder}: {result}: {detail}")
    if not problems and not encoders:
        problems.append(f"pd {shown}: canary: no encoder was probed")
    if not problems and report.get("ok") is not True:
        # A report that says not ok, whatever its verdicts say: nothing is proven.
        problems.append(f"pd {shown}: canary: the report is not ok ({report.get('ok')!r})")
    return report, Findings(problems, warnings)
