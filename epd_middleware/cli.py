"""``epd-middleware check``: what an operator runs before and after a rollout.

    epd-middleware check [--encoders URLS] [--prefill URLS] [--expected-model NAME] [--pd URL] [--json]
    python -m epd_middleware check ...

Reads the same ``EPD_*`` environment as the middleware (flags override it), looks up the ``dns+http://``
names, and asks every encoder and prefill server once for ``GET /health`` and ``GET /v1/models``. Prints
one line per server (URL, reachable, model, health latency, verdict) and exits 0 when every server is
reachable and serves the expected model (without ``--expected-model``: when they all serve the same), 1
when any is not, 2 when the configuration itself is wrong (every mistake named, one line each; with
``--json`` also as ``configuration_errors`` on stdout). Warnings (unknown ``EPD_*`` variables,
contradicting timeouts) are printed and do not change the exit status.

``--pd URL`` also reads the running PD server's status page (``status_path``, with the first of
``EPD_API_KEYS``, else ``VLLM_API_KEY``, where keys are set): what the middleware inside it knows about
vLLM there (the model runner, known problems such as ECMooncakeConnector on the V1 runner) comes out as
warnings; a status page that cannot be read (no answer, not JSON, nested too deep, of the wrong shape,
over :data:`MAX_ANSWER`) is a problem.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import anyio

from . import __version__
from ._addresses import masked
from ._compat import Expectation, check_models
from ._discovery import Discovery
from ._http import HTTPClient, HTTPError
from ._metrics import Stats
from ._pool import PoolPolicy, ServerPool
from .config import ConfigurationError, EPDConfig, unknown_variables
from .host import vllm_api_keys
from .transport import Transport

__all__ = ["MAX_ANSWER", "ServerReport", "check_fleet", "main"]

# The largest answer the command reads from any server: a status page of thousands of servers, or a
# /v1/models of many models, is far smaller; a server that says more is not read to the end.
MAX_ANSWER = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServerReport:
    role: str
    url: str
    reachable: bool
    model: str  # what it serves, for people
    health_ms: float | None
    verdict: str
    ok: bool
    # What it serves, for scripts: one {"name", "root"} per model it lists (empty when it did not say).
    served: tuple[dict[str, str], ...] = ()
    # What it must serve: {"names": [...], "root": ...}, or None when nothing was expected.
    expected: dict[str, Any] | None = None


async def _health(client: Transport, url: str, headers: dict[str, str], limit: float) -> tuple[str, float]:
    started = time.perf_counter()
    try:
        with anyio.fail_after(limit):
            status, _ = await client.request("GET", f"{url}/health", headers=headers)
    except TimeoutError:
        return f"no answer within {limit:g} s", limit * 1000
    except HTTPError as exc:
        return exc.reason, (time.perf_counter() - started) * 1000
    elapsed = (time.perf_counter() - started) * 1000
    return ("ok" if status == 200 else f"HTTP {status}"), elapsed


async def check_fleet(
    config: EPDConfig, client: Transport, expected: str | None
) -> tuple[list[ServerReport], list[str]]:
    """One report per server, and the problems found before any server was asked (DNS)."""
    headers = {"authorization": config.encoder_authorization} if config.encoder_authorization else {}
    expectation = Expectation(frozenset({expected})) if expected else None
    timeout = config.health_check_timeout
    problems: list[str] = []
    servers: list[tuple[str, str]] = []
    for role, urls in (("encoder", config.encoders), ("prefill", config.prefill)):
        pool = ServerPool(role, PoolPolicy(timeout), Stats())
        discovery = Discovery(
            pool, urls, config.dns_refresh_interval, config.dns_timeout, config.dns_nameservers
        )
        if discovery.dynamic:
            await discovery.refresh()
            for name, state in discovery.snapshot().items():
                if state["last_error"]:
                    problems.append(f"{role} {name}: DNS lookup failed: {state['last_error']}")
                elif not state["addresses"]:
                    problems.append(f"{role} {name}: DNS answered no address")
        servers.extend((role, url) for url in pool.members)

    results: dict[tuple[str, str], tuple[tuple[str, float], Any]] = {}

    async def one(role: str, url: str) -> None:
        health = await _health(client, url, headers, timeout)
        models = await check_models(client, url, expectation, headers, timeout)
        results[(role, url)] = (health, models)

    async with anyio.create_task_group() as group:
        for role, url in servers:
            group.start_soon(one, role, url)

    served_sets = {results[key][1].served for key in servers if results[key][1].state != "unreachable"}
    reports = []
    for role, url in servers:
        (health, health_ms), models = results[(role, url)]
        reachable = models.state != "unreachable" or health == "ok"
        if models.state == "unreachable":
            verdict = f"not usable: {models.served}"
        elif models.state == "mismatch":
            verdict = f"serves another model (expected {expected})"
        elif health != "ok":
            verdict = f"health check: {health}"
        elif expectation is None and len(served_sets) > 1:
            verdict = "serves a model the other servers do not (give --expected-model to say which is right)"
        else:
            verdict = "ok"
        reports.append(
            ServerReport(
                role,
                url,
                reachable,
                models.served if models.state != "unreachable" else "-",
                round(health_ms, 1) if health == "ok" else None,
                verdict,
                verdict == "ok",
                tuple({"name": name, "root": root} for name, root in models.models),
                {"names": sorted(expectation.names), "root": expectation.root} if expectation else None,
            )
        )
    if not servers and not problems:
        problems.append("no encoder or prefill server configured")
    return reports, problems


def _table(reports: Sequence[ServerReport], problems: Sequence[str]) -> str:
    rows = [("ROLE", "URL", "REACHABLE", "MODEL", "HEALTH MS", "VERDICT")]
    for report in reports:
        rows.append(
            (
                report.role,
                report.url,
                "yes" if report.reachable else "no",
                report.model,
                "-" if report.health_ms is None else f"{report.health_ms:.1f}",
                report.verdict,
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(5)]
    lines = [
        "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[5]])
        for row in rows
    ]
    lines.extend(f"problem: {problem}" for problem in problems)
    bad = sum(not report.ok for report in reports) + len(problems)
    lines.append("all servers ok" if not bad else f"{bad} problem(s)")
    return "\n".join(lines)


def _environment(args: argparse.Namespace) -> dict[str, str]:
    environ = dict(os.environ)
    for name, value in (("ENCODERS", args.encoders), ("PREFILL", args.prefill)):
        if value is not None:
            environ[f"EPD_{name}"] = value
    return environ


def _server_problems(environ: dict[str, str]) -> list[str]:
    """What in the vLLM server's own environment keeps the middleware from ever running."""
    if environ.get("VLLM_USE_RUST_FRONTEND", "").strip().lower() in ("1", "true", "yes"):
        return [
            "VLLM_USE_RUST_FRONTEND is set: vLLM 0.33's Rust HTTP frontend serves the API and never "
            "loads the epd plugin or --middleware, so encoder disaggregation would be off; unset it on "
            "the PD server"
        ]
    return []


async def pd_status(
    config: EPDConfig, client: Transport, url: str
) -> tuple[dict[str, Any] | None, str | None]:
    """The PD's status page as the middleware inside it writes it, or why it could not be read. Any
    answer is a page or a reason, never an exception: its ``model_runner`` is a string or null and its
    ``known_problems`` a list of strings (either may be missing, from an older middleware)."""
    keys = (*config.api_keys, *vllm_api_keys())
    headers = {"authorization": f"Bearer {keys[0]}"} if keys else {}
    limit = config.health_check_timeout
    try:
        with anyio.fail_after(limit):
            status, body = await client.request(
                "GET", f"{url.rstrip('/')}{config.status_path}", headers=headers
            )
    except TimeoutError:
        return None, f"no answer within {limit:g} s"
    except HTTPError as exc:
        return None, exc.reason
    if status != 200:
        return None, f"HTTP {status} (is the middleware loaded there, and EPD_API_KEYS one of its keys?)"
    if len(body) > MAX_ANSWER:  # a transport other than the command's own reads without its bound
        return None, f"answer body too large (over {MAX_ANSWER // 1024 // 1024} MiB)"
    not_the_page = "not the middleware's status page"
    try:
        page = json.loads(body)
    except (ValueError, RecursionError):
        # Python's json recurses per level: a page nested thousands deep is no page.
        return None, f"{not_the_page} (not JSON, or nested too deep)"
    if not isinstance(page, dict):
        return None, f"{not_the_page} (no JSON object)"
    if not isinstance(page.get("model_runner"), str | None):
        return None, f"{not_the_page} (model_runner is not a string)"
    known = page.get("known_problems", [])
    if not isinstance(known, list) or not all(isinstance(line, str) for line in known):
        return None, f"{not_the_page} (known_problems is not a list of strings)"
    return page, None


async def _run(
    args: argparse.Namespace, config: EPDConfig
) -> tuple[list[ServerReport], list[str], dict[str, Any] | None]:
    client = HTTPClient(
        connect_timeout=min(config.connect_timeout, config.health_check_timeout), max_body=MAX_ANSWER
    )
    try:
        expected = args.expected_model or config.expected_model
        reports, problems = await check_fleet(config, client, expected)
        pd = None
        if args.pd:
            shown = masked(args.pd)  # the command line's URL may carry a password
            page, error = await pd_status(config, client, args.pd)
            if error is not None:
                problems.append(f"pd {shown}: status page: {error}")
            else:
                assert page is not None
                pd = {
                    "url": shown,
                    "model_runner": page.get("model_runner"),
                    "known_problems": page.get("known_problems", []),
                }
        return reports, problems, pd
    finally:
        await client.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="epd-middleware", description="epd-middleware operator commands")
    parser.add_argument("--version", action="version", version=f"epd-middleware {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "check",
        help="ask every encoder and prefill server whether it is up and serves the right model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    check.add_argument("--encoders", help="comma-separated encoder URLs (default: EPD_ENCODERS)")
    check.add_argument("--prefill", help="comma-separated prefill URLs (default: EPD_PREFILL)")
    check.add_argument(
        "--expected-model", help="the model every server must serve (default: EPD_EXPECTED_MODEL)"
    )
    check.add_argument(
        "--pd", help="the PD server's URL: read its status page for what it knows about vLLM there"
    )
    check.add_argument("--json", action="store_true", help="print JSON for scripts")
    check.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # Warnings are this command's output, not log lines on stderr beside it.
    logging.getLogger("epd_middleware").addHandler(logging.NullHandler())
    environ = _environment(args)
    errors = _server_problems(environ)
    warnings = unknown_variables(environ)
    config: EPDConfig | None = None
    try:
        config = EPDConfig.from_env(environ)
        warnings.extend(config.warnings())
    except ConfigurationError as exc:
        errors = [*exc.problems, *errors]
    if errors or config is None:
        if args.json:
            payload = {"ok": False, "configuration_errors": errors, "warnings": warnings, "servers": []}
            print(json.dumps(payload, indent=1))
        for error in errors:
            print(f"epd-middleware check: {error}", file=sys.stderr)
        return 2
    reports, problems, pd = anyio.run(_run, args, config, backend=args.backend)
    if pd is not None:
        warnings.extend(f"pd {pd['url']}: {problem}" for problem in pd["known_problems"])
    ok = all(report.ok for report in reports) and not problems
    if args.json:
        payload = {
            "ok": ok,
            "configuration_errors": [],
            "warnings": warnings,
            "servers": [asdict(report) for report in reports],
            "problems": problems,
            "pd": pd,
        }
        print(json.dumps(payload, indent=1))
    else:
        print("\n".join([*(f"warning: {warning}" for warning in warnings), _table(reports, problems)]))
    return 0 if ok else 1
