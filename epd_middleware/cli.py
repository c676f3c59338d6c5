"""epd-middleware check: what an operator runs before and after a rollout.

    epd-middleware check [--encoders URLS] [--prefill URLS] [--expected-model NAME]
                         [--expected-root PATH] [--pd URL [--canary]] [--timeout SECONDS] [--json]
    python -m epd_middleware check ...

Reads the same EPD_* environment as the middleware (flags override it), looks up the dns+http:// names,
and asks every encoder and prefill server once for GET /health and GET /v1/models. Prints one line per
server (URL, reachable, model, health latency, verdict), one "problem:" line per problem (a bad server,
a name that does not resolve, a status page that cannot be read) and one "warning:" line per warning
(an unknown EPD_* variable with the option it is nearest to, a URL whose /v1 is stripped, contradicting
timeouts; warnings do not change the exit status).

Exit status: 0 when every server is reachable and serves the expected model, from one model path (PD
derives every embedding's hash from its own: servers of one name from two paths are not all usable, and
without --expected-root or --pd nobody said which is right); without --expected-model, when they all
serve the same (a lone server without an expectation is a warning: reachable, not known to be right);
1 when any is not; 2 when the configuration itself is wrong (the
environment, --pd or --timeout: every mistake named, one line each on stderr); 141 (128 + SIGPIPE)
when whoever reads the output goes away before it is written, as in "check | head -1", quietly.

--json prints one JSON object of the same shape for every exit: ok, configuration_errors, warnings,
servers (each with its verdict, its model or null, and its served models), problems (the lines the
text names, configuration errors included) and pd.

--timeout SECONDS: how long each server (and each name lookup) has to answer each question; by default
EPD_HEALTH_CHECK_TIMEOUT.

--pd URL also reads the running PD server's status page (EPD_STATUS_PATH, with the first of
EPD_API_KEYS, else VLLM_API_KEY, where keys are set). PD's own model (its served names and model path)
is what every server must serve; an --expected-model PD does not serve is a problem. PD's own verdict on
each encoder counts too: one PD does not use (ejected, another model, out of the pool for answers that
differ from its own) is a problem, whatever the command's own questions found. What the middleware knows
about vLLM there (the model runner, known problems such as ECMooncakeConnector on the V1 runner) comes
out as warnings; a status page that cannot be read (no answer, not JSON, nested too deep, of the wrong
shape, over 8 MiB) is a problem. The URL is http(s)://HOST[:PORT]; a password in it is never shown.

--canary (with --pd) runs PD's equivalence probe once (POST EPD_STATUS_PATH/equivalence): every
encoder's answer to a built-in image prompt, through the real path (encoder, EC storage or push, PD's
engine), compared with PD's own answer. A mismatch, a run PD skipped (busy) or could not make is a
problem: the gate to run after every rollout.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import anyio

from ._addresses import masked, port_number
from ._compat import Expectation, ModelCheck, check_models
from ._discovery import NXDOMAIN, Discovery
from ._http import HTTPClient, HTTPError
from ._logs import logger
from ._metrics import Stats
from ._pd_check import MAX_ANSWER, pd_expectation, pd_status, pd_verdicts, run_canary
from ._pool import PoolPolicy, ServerPool
from ._version import __version__
from .config import ConfigurationError, EPDConfig, unknown_variables
from .transport import Transport

__all__ = ["MAX_ANSWER", "PIPE_CLOSED", "ServerReport", "check_fleet", "main"]

# The exit status when the reader of the output has gone (``check | head -1``): 128 + SIGPIPE, what a
# shell reports for a command a closed pipe ends. Not 0 or 1 (Python's own exit status on EPIPE): those
# are verdicts, and a reader that left has seen none.
PIPE_CLOSED = 128 + 13


@dataclass(frozen=True, slots=True)
class ServerReport:
    role: str
    url: str
    reachable: bool
    model: str | None  # what it serves, for people; None when it did not say (unreachable)
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


async def _unresolved(url: str, limit: float) -> str | None:
    """Why ``url``'s host cannot be looked up, or None when it can (or is an address). The HTTP client
    says only "connection failed (gaierror)" for a name that does not resolve, which reads like a server
    that is down; the command looks the name up first to say which of the two it is."""
    host = urlsplit(url).hostname or ""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return None
    try:
        with anyio.fail_after(limit):
            await anyio.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except TimeoutError:
        return f"host {host} not resolved within {limit:g} s"
    except socket.gaierror as exc:
        return f"host {host} cannot be resolved ({exc.strerror})"
    except (OSError, UnicodeError) as exc:  # the IDNA encoding refuses some names
        return f"host {host} cannot be resolved ({type(exc).__name__})"
    return None


def _empty_answer(url: str, why: str | None) -> str:
    """What an empty DNS answer means for the operator: the two kinds have different fixes."""
    host = urlsplit(url).hostname or ""
    if why == NXDOMAIN:
        # The Kubernetes DNS specification (kubernetes/dns, since 2018) has kube-dns and CoreDNS answer
        # NXDOMAIN for a headless Service without a ready endpoint, not NODATA: from the answer alone a
        # missing Service and one whose pods are all unready look the same.
        return (
            f"DNS has no such name {host} (NXDOMAIN): no Service of that name in the namespaces searched "
            "(a typo, or another namespace: give NAME.NAMESPACE), or a headless Service none of whose pods "
            f"is ready (Kubernetes' DNS answers NXDOMAIN for one); kubectl get endpointslices -l "
            f"kubernetes.io/service-name={host.split('.')[0]} tells which"
        )
    return (
        f"DNS knows the name {host} but it has no A or AAAA record (NOERROR, no answer): it is not a "
        "Service's name (a namespace's name answers so: give the Service's), or names something other "
        "than servers; a headless Service without ready pods answers NXDOMAIN instead"
    )


async def check_fleet(
    config: EPDConfig,
    client: Transport,
    expected: str | Expectation | None,
    limit: float | None = None,
) -> tuple[list[ServerReport], list[str]]:
    """One report per server, and the problems found before any server was asked (DNS). ``expected``: a
    model name, or names and a model path (PD's own), that every server must serve. ``limit``: the
    seconds each server and each lookup has for each question (default: ``health_check_timeout``)."""
    headers = {"authorization": config.encoder_authorization} if config.encoder_authorization else {}
    expectation = Expectation(frozenset({expected})) if isinstance(expected, str) and expected else None
    if isinstance(expected, Expectation):
        expectation = expected
    limit = config.health_check_timeout if limit is None else limit
    problems: list[str] = []
    servers: list[tuple[str, str]] = []
    for role, urls in (("encoder", config.encoders), ("prefill", config.prefill)):
        pool = ServerPool(role, PoolPolicy(limit), Stats())
        discovery = Discovery(
            pool, urls, config.dns_refresh_interval, min(config.dns_timeout, limit), config.dns_nameservers
        )
        if discovery.dynamic:
            await discovery.refresh()
            for name, state in discovery.snapshot().items():
                if state["last_error"]:
                    problems.append(f"{role} {name}: DNS lookup failed: {state['last_error']}")
                elif not state["addresses"]:
                    problems.append(f"{role} {name}: {_empty_answer(name, state['empty_answer'])}")
        servers.extend((role, url) for url in pool.members)

    results: dict[tuple[str, str], tuple[tuple[str, float], Any]] = {}
    unresolved: dict[tuple[str, str], str] = {}

    async def one(role: str, url: str) -> None:
        reason = await _unresolved(url, limit)
        if reason is not None:
            unresolved[(role, url)] = reason
            return
        health = await _health(client, url, headers, limit)
        models = await check_models(client, url, expectation, headers, limit)
        results[(role, url)] = (health, models)

    async with anyio.create_task_group() as group:
        for role, url in servers:
            group.start_soon(one, role, url)

    answered = [results[key][1] for key in servers if key in results]
    served_sets = {models.served for models in answered if models.state != "unreachable"}
    roots = _roots_of_the_name(expectation, results)
    reports = []
    for role, url in servers:
        if (role, url) in unresolved:
            verdict = f"not usable: {unresolved[(role, url)]}"
            reports.append(ServerReport(role, url, False, None, None, verdict, False))
            continue
        (health, health_ms), models = results[(role, url)]
        reachable = models.state != "unreachable" or health == "ok"
        verdict = _verdict(health, models, expectation, roots, several_models=len(served_sets) > 1)
        reports.append(
            ServerReport(
                role,
                url,
                reachable,
                models.served if models.state != "unreachable" else None,
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


def _verdict(
    health: str, models: ModelCheck, expectation: Expectation | None, roots: set[str], *, several_models: bool
) -> str:
    """One server's verdict from its answers: its model (against the expectation, and the model paths
    the others serve the name from), then its health."""
    if models.state == "unreachable":
        return f"not usable: {models.served}"
    if models.state == "mismatch":
        return f"serves another model (expected {expectation.describe() if expectation else ''})"
    if len(roots) > 1:
        # PD derives every embedding's hash from its own model path: of servers that serve its name from
        # different paths, it uses only those of its own, and which that is, nobody said here.
        names = ", ".join(sorted(expectation.names)) if expectation else ""
        mine = sorted(root for name, root in models.models if expectation and name in expectation.names)
        return (
            f"serves {names} from {', '.join(mine) or 'no path'}, other servers from "
            f"{', '.join(sorted(roots - set(mine)))}: PD uses only those of its own model path "
            "(give --expected-root, or --pd to take PD's own)"
        )
    if health != "ok":
        return f"health check: {health}"
    if expectation is None and several_models:
        return "serves a model the other servers do not (give --expected-model to say which is right)"
    return "ok"


def _roots_of_the_name(
    expectation: Expectation | None, results: dict[tuple[str, str], tuple[tuple[str, float], Any]]
) -> set[str]:
    """The model paths the servers serve the expected name from, where the expectation names no path
    (more than one: the servers are not all the model PD would accept)."""
    if expectation is None or expectation.root is not None:
        return set()
    return {
        root
        for _, models in results.values()
        if models.state == "ok"
        for name, root in models.models
        if name in expectation.names and root
    }


def _table(reports: Sequence[ServerReport], problems: Sequence[str], *, verified: bool = True) -> str:
    rows = [("ROLE", "URL", "REACHABLE", "MODEL", "HEALTH MS", "VERDICT")]
    for report in reports:
        rows.append(
            (
                report.role,
                report.url,
                "yes" if report.reachable else "no",
                "-" if report.model is None else report.model,
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
    if problems:
        lines.append(f"{len(problems)} problem(s)")
    else:
        lines.append("all servers ok" if verified else "no problem found, but the model is not verified")
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


def _pd_url(text: str, warnings: list[str]) -> str:
    """``--pd``'s URL as the command asks it; ValueError naming what is wrong. Every message, and every
    line that names the URL later, shows it masked (:func:`masked`): a password in it is never repeated.
    A trailing /v1 (an OpenAI-style base URL) is stripped with a warning, as the middleware does with
    encoder URLs: the status page is no /v1 route."""
    shown = masked(text)
    if "://" not in text:
        # "pd:8000" would be read as scheme "pd" and fail as a server that cannot be reached.
        raise ValueError(f"--pd {shown!r} is not a URL (no scheme); give it as http://{shown}")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--pd {shown!r} is not an http(s) URL with a host")
    port = parts.netloc.rpartition("]")[2].rpartition(":")
    if port[1] and port_number(port[2]) is None:
        raise ValueError(f"--pd {shown!r}: the port must be a number from 1 to 65535")
    if parts.query or parts.fragment:
        raise ValueError(f"--pd {shown!r} must not carry a query or fragment")
    url = text.rstrip("/")
    if parts.path.rstrip("/").endswith("/v1"):
        url = url.removesuffix("/v1")
        warnings.append(f"pd URL {masked(url)}/v1: the status page is not under /v1; using {masked(url)}")
    return url


def _timeout(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"--timeout {text!r}: give the seconds each server has to answer, a number above 0")
    return seconds


class _Collected(logging.Handler):
    """The middleware's WARNING lines, as the command's warnings (``epd: ...`` without the prefix)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage().removeprefix("epd: "))


@contextmanager
def _collected() -> Iterator[list[str]]:
    """The WARNING lines the middleware logs meanwhile (the configuration's own: a URL whose /v1 it
    strips); the command lists them rather than letting them go to a log nobody reads here."""
    handler = _Collected()
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


class _Outcome(NamedTuple):
    """What one run of the command found."""

    reports: list[ServerReport]
    problems: list[str]
    warnings: list[str]
    pd: dict[str, Any] | None
    # Whether every server's model was checked against something: an expectation, PD's own model, or
    # the other servers (a lone server without either is reachable, not known to be right).
    verified: bool


async def _run(args: argparse.Namespace, config: EPDConfig, pd_url: str | None, limit: float) -> _Outcome:
    client = HTTPClient(connect_timeout=min(config.connect_timeout, limit), max_body=MAX_ANSWER)
    try:
        expected: str | Expectation | None = args.expected_model or config.expected_model
        problems: list[str] = []
        warnings: list[str] = []
        page, pd = None, None
        if pd_url is not None:
            page, pd = await _read_pd(config, client, pd_url, limit, problems)
        if page is not None:
            expected = _pd_expected(page, expected, args.expected_root, masked(pd_url or ""), problems)
        elif isinstance(expected, str) and args.expected_root:
            expected = Expectation(frozenset({expected}), args.expected_root)
        reports, found = await check_fleet(config, client, expected, limit)
        problems.extend(found)
        if page is not None:
            verdicts = pd_verdicts(page, masked(pd_url or ""), [report.url for report in reports])
            problems.extend(verdicts.problems)
            warnings.extend(verdicts.warnings)
        if args.canary and pd_url is not None and page is not None:
            report, canary = await run_canary(config, client, pd_url, masked(pd_url), limit)
            problems.extend(canary.problems)
            warnings.extend(canary.warnings)
            if pd is not None:
                pd["canary"] = report
        reachable = len({report.url for report in reports if report.reachable})
        verified = bool(expected) or reachable > 1
        if not verified and reachable:
            warnings.append(
                "one server and no expected model: nothing to compare what it serves with (give "
                "--expected-model, or --pd to take PD's own): it is reachable, not known to be right"
            )
        return _Outcome(reports, problems, warnings, pd, verified)
    finally:
        await client.aclose()


async def _read_pd(
    config: EPDConfig, client: Transport, pd_url: str, limit: float, problems: list[str]
) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """PD's status page and what the command reports of it, or a problem saying why it was not read."""
    error = await _unresolved(pd_url, limit)
    page = None
    if error is None:
        page, error = await pd_status(config, client, pd_url, limit)
    if error is not None:
        problems.append(f"pd {masked(pd_url)}: status page: {error}")
        return None, None
    assert page is not None
    expectation = pd_expectation(page)
    return page, {
        "url": masked(pd_url),
        "model_runner": page.get("model_runner"),
        "known_problems": page.get("known_problems", []),
        "model": {"names": sorted(expectation.names), "root": expectation.root} if expectation else None,
    }


def _pd_expected(
    page: dict[str, Any],
    expected: str | Expectation | None,
    root: str | None,
    shown: str,
    problems: list[str],
) -> str | Expectation | None:
    """What the servers must serve when PD said what it serves: PD's own names and model path, checked
    against what the operator expected."""
    own = pd_expectation(page)
    if own is None:
        return Expectation(frozenset({expected}), root) if isinstance(expected, str) and root else expected
    if isinstance(expected, str) and expected not in own.names:
        problems.append(f"pd {shown} serves {own.describe()}, not the expected model {expected}")
    if root and own.root and root != own.root:
        problems.append(f"pd {shown} serves its model from {own.root}, not the expected root {root}")
    return own


def _payload(
    configuration_errors: Sequence[str],
    warnings: Sequence[str],
    reports: Sequence[ServerReport],
    problems: Sequence[str],
    pd: dict[str, Any] | None,
    *,
    verified: bool = False,
) -> str:
    """The JSON of every exit, one shape: a script reads the same keys whether the configuration or a
    server is at fault. ``verified``: every server's model was checked against something (an expected
    model, PD's own, the other servers)."""
    payload = {
        "ok": not problems,
        "verified": verified and not problems,
        "configuration_errors": list(configuration_errors),
        "warnings": list(warnings),
        "servers": [asdict(report) for report in reports],
        "problems": list(problems),
        "pd": pd,
    }
    return json.dumps(payload, indent=1)


class _Parser(argparse.ArgumentParser):
    def print_help(self, file: Any = None) -> None:
        # argparse drops an OSError writing its help, so --help into a closed pipe would exit 0 where
        # stdout is unbuffered and 141 where it is buffered (the error then comes at the flush): written
        # here, a closed pipe ends --help as it ends the check.
        (file or sys.stdout).write(self.format_help())


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="epd-middleware", description="epd-middleware operator commands")
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
        "--expected-root",
        metavar="PATH",
        help="the model path every server must serve it from, as PD derives hashes from it "
        "(default: PD's own with --pd; without either, the servers must agree on one)",
    )
    check.add_argument(
        "--pd",
        help="the PD server's URL: read its status page for its own model, its verdict on every encoder "
        "and what it knows about vLLM there",
    )
    check.add_argument(
        "--canary",
        action="store_true",
        help="with --pd: run PD's equivalence probe once (E + PD against PD alone) and fail on a mismatch",
    )
    check.add_argument(
        "--timeout",
        metavar="SECONDS",
        help="how long each server has to answer each question (default: EPD_HEALTH_CHECK_TIMEOUT)",
    )
    check.add_argument("--json", action="store_true", help="print JSON for scripts")
    check.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio", help=argparse.SUPPRESS)
    return parser


def _check(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    # Warnings are this command's output, not log lines on stderr beside it.
    logger.addHandler(logging.NullHandler())
    environ = _environment(args)
    errors = _server_problems(environ)
    warnings = unknown_variables(environ)
    config: EPDConfig | None = None
    with _collected() as logged:
        try:
            config = EPDConfig.from_env(environ)
        except ConfigurationError as exc:
            errors = [*exc.problems, *errors]
    # from_env logs the unknown variables too: each is listed once.
    warnings.extend(line for line in logged if line not in warnings)
    if config is not None:
        warnings.extend(config.warnings())
    timeout = config.health_check_timeout if config is not None else 0.0
    if args.timeout is not None:
        try:
            timeout = _timeout(args.timeout)
        except ValueError as exc:
            errors.append(str(exc))
    pd_url = None
    if args.pd is not None:
        try:
            pd_url = _pd_url(args.pd, warnings)
        except ValueError as exc:
            errors.append(str(exc))
    elif args.canary:
        errors.append("--canary runs PD's equivalence probe: give the PD server's URL with --pd")
    if errors or config is None:
        if args.json:
            print(_payload(errors, warnings, [], errors, None))
        for line in [*(f"warning: {warning}" for warning in warnings), *errors]:
            print(f"epd-middleware check: {line}", file=sys.stderr)
        return 2
    outcome = anyio.run(_run, args, config, pd_url, timeout, backend=args.backend)
    reports, pd = outcome.reports, outcome.pd
    if pd is not None:
        warnings.extend(f"pd {pd['url']}: {problem}" for problem in pd["known_problems"])
    warnings.extend(outcome.warnings)
    # Every problem the text counts, a bad server as much as an unreadable status page.
    problems = [f"{r.role} {r.url}: {r.verdict}" for r in reports if not r.ok] + outcome.problems
    if args.json:
        print(_payload([], warnings, reports, problems, pd, verified=outcome.verified))
    else:
        table = _table(reports, problems, verified=outcome.verified)
        print("\n".join([*(f"warning: {warning}" for warning in warnings), table]))
    return 0 if not problems else 1


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            return _check(argv)
        finally:
            # Here, not at the interpreter's exit: a reader that has gone is seen while it can be
            # answered (argparse's --help and usage errors leave by SystemExit through here too).
            sys.stdout.flush()
    except BrokenPipeError:
        # Python's own answer is a traceback ("Exception ignored ... BrokenPipeError") and exit 120. What
        # is left unwritten goes nowhere, so that the interpreter's last flush finds no closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            os.dup2(devnull, stream.fileno())
        os.close(devnull)
        return PIPE_CLOSED
