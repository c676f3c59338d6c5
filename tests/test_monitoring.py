"""What operators read and watch, held to what the code and the manifests do (issue 37).

The metric table of docs/observability.md names every metric the package exports with the labels it has,
and every value of the labels whose values the code fixes (request and call outcomes, blames, stages,
results, sources, roles, placements), and nothing else: read from the code itself (the package's literal
calls into ``Stats``, the error classes' outcomes, ``BLAMES``, ``RESULTS``), so a value added to the code
and not to the docs, or one the docs keep after the code dropped it, fails here. Prometheus scrapes every
vLLM server of every overlay (deploy/kubernetes/monitoring beside it) under its role's job, and reaches it
past the NetworkPolicies; every alert links a runbook section that exists and says what to do; the
dashboard lists a fleet before its first request and charts the latencies a client feels."""

from __future__ import annotations

import ast
import functools
import inspect
import json
import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import prometheus_client
import pytest

import epd_middleware
from epd_middleware import EPDMiddleware, errors
from epd_middleware._blame import BLAMES
from epd_middleware._comparison import RESULTS
from epd_middleware._metrics import ROLES, Stats, _Prometheus, _request_labels
from epd_middleware._version import __version__

from . import test_deploy as deploy
from .fakes import FakeEngine

ROOT: Final = Path(__file__).parent.parent
PACKAGE: Final = Path(epd_middleware.__file__).parent
OBSERVABILITY: Final = ROOT / "docs" / "observability.md"


# --- What the code emits ---


def families() -> dict[str, frozenset[str]]:
    """Every metric family ``_Prometheus`` declares, by the name the docs give it (a counter's with
    ``_total``, a histogram's bare), with its labels (``le`` left out), from one sample each."""
    return {
        f"{family.name}_total" if family.type == "counter" else family.name: frozenset(
            label for sample in family.samples for label in sample.labels if label != "le"
        )
        for family in deploy.sampled_registry().collect()
    }


def stats_calls(method: str) -> Iterator[ast.Call]:
    """Every call of ``Stats.<method>`` in the package: on a receiver named ``...stats`` (the pipeline's,
    a pool's, ``self._stats``), or on ``self`` inside ``Stats`` itself."""
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr != method:
                continue
            receiver = ast.unparse(node.func.value)
            if receiver.endswith("stats") or (path.name == "_metrics.py" and receiver == "self"):
                yield node


def literal_arguments(method: str, position: int, keyword: str | None = None) -> set[str]:
    """The string literals the package passes to ``Stats.<method>`` at ``position`` (or as ``keyword``);
    ``f"error_{...}"`` stands for every ``error_<status>``."""
    values = set()
    for call in stats_calls(method):
        arguments = [a.value for a in call.keywords if a.arg == keyword] if keyword else []
        if len(call.args) > position:
            arguments.append(call.args[position])
        for argument in arguments:
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                values.add(argument.value)
            elif isinstance(argument, ast.JoinedStr):
                [head, *_] = argument.values
                assert isinstance(head, ast.Constant), ast.unparse(argument)
                assert isinstance(head.value, str), ast.unparse(argument)
                values.add(head.value + "000")
    return values


def request_outcomes() -> set[str]:
    return {_request_labels(outcome)[0] for outcome in literal_arguments("request", 0)}


def call_outcomes() -> set[str]:
    """``ok``, and the ``outcome`` of every failure a call may raise: ``UpstreamError``'s own (the default
    of a failure of no more specific kind) and each subclass's."""

    def subclasses(cls: type[errors.UpstreamError]) -> Iterator[type[errors.UpstreamError]]:
        for sub in cls.__subclasses__():
            yield sub
            yield from subclasses(sub)

    outcomes = {errors.UpstreamError.outcome} | {cls.outcome for cls in subclasses(errors.UpstreamError)}
    # The call sites: "ok" after an answer, the error's outcome after a failure, nothing else.
    assert literal_arguments("call", 2) == {"ok"}
    return {"ok"} | outcomes


def placements() -> tuple[set[str], set[str]]:
    """(where, why) of every placement decision: the ``("local" | "remote", why)`` pairs of _placement.py,
    a conditional why standing for both of its branches."""
    wheres: set[str] = set()
    whys: set[str] = set()
    tree = ast.parse((PACKAGE / "_placement.py").read_text())
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Tuple) and len(node.elts) == 2):
            continue
        where, why = node.elts
        if not (isinstance(where, ast.Constant) and where.value in ("local", "remote")):
            continue
        wheres.add(str(where.value))
        branches = [why.body, why.orelse] if isinstance(why, ast.IfExp) else [why]
        for branch in branches:
            assert isinstance(branch, ast.Constant), ast.unparse(why)
            assert isinstance(branch.value, str), ast.unparse(why)
            whys.add(branch.value)
    assert literal_arguments("placement", 0) == set()  # every decision goes through those pairs
    return wheres, whys


def emitted() -> dict[tuple[str, str], set[str]]:
    """(metric, label) -> every value the code gives it, for the labels whose values the code fixes."""
    where, why = placements()
    equivalence_sources = literal_arguments("equivalence", 2, keyword="source") | {
        inspect.signature(Stats.equivalence).parameters["source"].default
    }
    return {
        ("epd_requests_total", "outcome"): request_outcomes(),
        ("epd_encoder_call_duration_seconds", "outcome"): call_outcomes(),
        ("epd_encoder_failures_total", "blame"): set(BLAMES),
        ("epd_encoder_ejection_checks_total", "result"): literal_arguments("ejection_check", 2),
        ("epd_stage_duration_seconds", "stage"): literal_arguments("stage", 0),
        ("epd_dns_lookups_total", "outcome"): literal_arguments("dns_lookup", 1),
        ("epd_dns_lookups_total", "role"): set(ROLES),
        ("epd_scheduler_forged_targets_total", "role"): literal_arguments("forged_target", 0),
        ("epd_pool_members", "role"): set(ROLES),
        ("epd_equivalence_checks_total", "result"): set(RESULTS),
        ("epd_equivalence_checks_total", "source"): equivalence_sources,
        ("epd_equivalence_mismatched", "source"): equivalence_sources,
        ("epd_placement_total", "where"): where,
        ("epd_placement_total", "why"): why,
    }


# --- What the docs say ---


def outside_parentheses(text: str) -> str:
    """``text`` without what parentheses hold (the explanations of values), nested ones too."""
    kept, depth = [], 0
    for character in text:
        depth += character == "("
        if depth == 0:
            kept.append(character)
        depth -= character == ")" and depth > 0
    return "".join(kept)


def labels_cell(cell: str) -> dict[str, set[str]]:
    """The labels a metric-table cell names, each with its documented values. ```label``` names a label,
    ```label`: `a`, `b``` gives its values, ``;`` separates labels that have values; what parentheses
    hold explains, and is no value."""
    found: dict[str, set[str]] = {}
    for segment in outside_parentheses(cell).split(";"):
        before, colon, after = segment.partition(":")
        names = re.findall(r"`([a-z_]+)`", before)
        for label in names:
            found.setdefault(label, set())
        if colon and names:
            found[names[-1]] |= set(re.findall(r"`([^`]+)`", after))
    return found


def metric_rows() -> list[tuple[list[str], dict[str, set[str]]]]:
    """docs/observability.md's metric table: each row's metrics and its labels cell, read."""
    section = OBSERVABILITY.read_text().split("## Prometheus metrics", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `epd_"):
            names, _, labels, _ = (cell.strip() for cell in line.strip().strip("|").split("|"))
            rows.append((re.findall(r"`(epd_\w+)`", names), labels_cell(labels)))
    return rows


def documented() -> dict[str, dict[str, set[str]]]:
    """Metric -> label -> its documented values. A row naming several metrics (the prefill ones) gives
    each the row's labels."""
    table: dict[str, dict[str, set[str]]] = {}
    for names, labels in metric_rows():
        for name in names:
            assert name not in table, f"{name} has two rows"
            table[name] = labels
    return table


def test_every_exported_metric_is_documented_with_its_labels() -> None:
    code, docs = families(), documented()
    assert set(docs) == set(code), (sorted(set(code) - set(docs)), sorted(set(docs) - set(code)))
    for names, labels in metric_rows():
        # A row's labels are those of its metrics together (the prefill row stands for seven).
        wanted = set().union(*(code[name] for name in names))
        assert set(labels) == wanted, (names, sorted(labels), sorted(wanted))


def test_every_label_value_the_code_emits_is_documented_and_no_other() -> None:
    """Issue 37: the table left out the call outcome "failed" (which EPDEncoderErrorRatioHigh counts),
    the blames "media", "doubted" and "unmasked" (EPDEncoderHidesItsFailures watches that one), the
    request outcome "media_refused_elsewhere", and the equivalence metrics' "source" label."""
    docs = documented()
    for (metric, label), values in emitted().items():
        assert values, (metric, label)  # the reading of the code found them
        assert docs[metric][label] == values, (
            f"{metric}{{{label}}}: documented, not emitted: {sorted(docs[metric][label] - values)}; "
            f"emitted, not documented: {sorted(values - docs[metric][label])}"
        )


@pytest.mark.parametrize(
    ("cell", "expected"),
    [
        (
            "`outcome`: `a`, `b` (`not-a-value`); `code`: for an error, its status (`400`)",
            {"outcome": {"a", "b"}, "code": set()},
        ),
        (
            "`encoder`, `outcome`: `ok`, `busy` (nothing sent (not blamed), `x`)",
            {"encoder": set(), "outcome": {"ok", "busy"}},
        ),
        ("`encoder` / `prefill`", {"encoder": set(), "prefill": set()}),
        ("", {}),
    ],
)
def test_the_reading_of_a_labels_cell(cell: str, expected: dict[str, set[str]]) -> None:
    assert labels_cell(cell) == expected


# --- Who is scraped: every vLLM server of every overlay, under the job the alerts and the dashboard name ---

# Prometheus as the Prometheus Operator runs it (every pod of a Prometheus is labelled
# app.kubernetes.io/name=prometheus: pkg/prometheus/server/statefulset.go's podSelectorLabels), in the
# namespace deploy/kubernetes/monitoring/networkpolicy.yaml admits it from.
PROMETHEUS_POD: Final = {"app.kubernetes.io/name": "prometheus"}
PROMETHEUS_NAMESPACE: Final = {"kubernetes.io/metadata.name": "monitoring"}
# The job each role's series carry: epd-pd is what EPDMiddlewareNotLoaded selects.
JOBS: Final = {"epd-pd": "epd-pd", "epd-encoder": "epd-encoder", "epd-prefill": "epd-prefill"}


@pytest.fixture(scope="module", params=deploy.OVERLAYS)
def rendered(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    return deploy.render_with_monitoring(request.param, tmp_path_factory.mktemp("kustomize"))


def scrapes(objects: list[dict[str, Any]], server: dict[str, Any]) -> list[tuple[str, int, str]]:
    """(monitor, container port, job) of every scrape of ``server``'s pods: a ServiceMonitor's through the
    Services it selects (job: the Service's name, or its jobLabel's value), a PodMonitor's on the pods it
    selects (job: the pods' jobLabel value, or namespace/name), as prometheus-operator configures them."""
    labels = deploy.pod_labels(server)
    named = {p["name"]: p["containerPort"] for p in deploy.container(server)["ports"]}
    found = []
    for name, monitor in deploy.of_kind(objects, "ServiceMonitor").items():
        for service in deploy.of_kind(objects, "Service").values():
            service_labels = service["metadata"].get("labels", {})
            if not deploy.label_selector_matches(monitor["spec"]["selector"], service_labels):
                continue
            if not deploy.selects(service["spec"]["selector"], labels):
                continue
            job_label = monitor["spec"].get("jobLabel")
            job = service_labels[job_label] if job_label else service["metadata"]["name"]
            for endpoint in monitor["spec"]["endpoints"]:
                assert endpoint.get("path", "/metrics") == "/metrics", name
                [port] = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
                found.append((f"ServiceMonitor/{name}", named[port["targetPort"]], job))
    for name, monitor in deploy.of_kind(objects, "PodMonitor").items():
        if not deploy.label_selector_matches(monitor["spec"]["selector"], labels):
            continue
        job_label = monitor["spec"].get("jobLabel")
        job = labels[job_label] if job_label else f"<namespace>/{name}"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint.get("path", "/metrics") == "/metrics", name
            found.append((f"PodMonitor/{name}", named[endpoint["port"]], job))
    return found


def admits_prometheus(objects: list[dict[str, Any]], server: dict[str, Any], port: int) -> bool:
    """Whether Prometheus reaches ``port`` of the server's pods: no ingress policy isolates them, or one
    of those that do admits Prometheus' pods from their namespace on it."""
    labels = deploy.pod_labels(server)
    policies = [
        policy
        for policy in deploy.of_kind(objects, "NetworkPolicy").values()
        if "Ingress" in policy["spec"].get("policyTypes", [])
        and deploy.label_selector_matches(policy["spec"]["podSelector"], labels)
    ]
    if not policies:
        return True
    for rule in (rule for policy in policies for rule in policy["spec"].get("ingress", [])):
        ports = deploy.admitted_ports(rule, server)
        for peer in rule.get("from", []):
            in_namespace = "namespaceSelector" in peer and deploy.label_selector_matches(
                peer["namespaceSelector"], PROMETHEUS_NAMESPACE
            )
            by_label = deploy.label_selector_matches(peer.get("podSelector", {}), PROMETHEUS_POD)
            if in_namespace and by_label and (ports is None or port in ports):
                return True
    return False


def test_prometheus_scrapes_every_vllm_server_of_the_fleet(rendered: list[dict[str, Any]]) -> None:
    """Issue 37: only the PD servers were scraped, so the encoders' and prefill servers' queues and
    latencies were nowhere to be seen. Every vLLM server is now scraped, once, on the port vLLM serves
    /metrics on (its --port), under its role's job, and Prometheus is admitted past the NetworkPolicies
    that isolate the encoder and prefill pods, on that port."""
    servers = list(deploy.vllm_servers(rendered))
    assert {server["metadata"]["name"] for server in servers} >= {"epd-pd", "epd-encoder"}
    for server in servers:
        name = server["metadata"]["name"]
        [(monitor, port, job)] = scrapes(rendered, server)
        assert port == deploy.vllm_port(server), (name, monitor)
        assert job == JOBS[name], (name, monitor, job)
        assert admits_prometheus(rendered, server, port), f"{name}: Prometheus cannot reach port {port}"
    # The check itself: a policy admitting only the PD pods keeps Prometheus out.
    [encoder] = [s for s in servers if s["metadata"]["name"] == "epd-encoder"]
    alone = [o for o in rendered if o["metadata"]["name"] != "epd-prometheus-scrape"]
    assert not admits_prometheus(alone, encoder, deploy.vllm_port(encoder))


# --- Runbooks: every alert's runbook_url is a section of the docs that says what to do ---

RUNBOOK_URL: Final = re.compile(
    r"https://github\.com/epd-middleware/epd-middleware/blob/main/(docs/[\w-]+\.md)#([\w-]+)"
)


def github_anchors(markdown: str) -> dict[str, tuple[int, str]]:
    """The anchors GitHub gives a Markdown file's headings (lower case, punctuation but - and _ dropped,
    spaces as -, a repeated one suffixed -1, -2 ...), each with its heading's level and text."""
    anchors: dict[str, tuple[int, str]] = {}
    seen: dict[str, int] = {}
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"(#{1,6}) +(.*?) *#*$", line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading[2].lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors[slug if count == 0 else f"{slug}-{count}"] = (len(heading[1]), heading[2])
    return anchors


def section(markdown: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of its level or above."""
    lines = markdown.splitlines()
    [start] = [
        i for i, line in enumerate(lines) if re.match(r"#+ ", line) and line.split(" ", 1)[1] == heading
    ]
    level = len(lines[start].split(" ", 1)[0])
    end = next(
        (i for i in range(start + 1, len(lines)) if re.match(rf"#{{1,{level}}} ", lines[i])), len(lines)
    )
    return "\n".join(lines[start + 1 : end])


def alerts() -> list[dict[str, Any]]:
    [rule] = deploy.of_kind(deploy.render(deploy.MONITORING), "PrometheusRule").values()
    return [entry for group in rule["spec"]["groups"] for entry in group["rules"] if "alert" in entry]


def test_every_alert_links_its_runbook_and_the_runbook_says_what_to_do() -> None:
    """Issue 37: no alert had a runbook_url, so the page that woke someone did not say where to look.
    Each now names a section of the docs (which must exist: a renamed heading breaks the link) that says
    what the alert means, how to confirm it and what to do; each alert its own, and every runbook an
    alert's."""
    linked = set()
    for alert in alerts():
        name = alert["alert"]
        match = RUNBOOK_URL.fullmatch(alert["annotations"].get("runbook_url", ""))
        assert match is not None, (
            f"{name}: no runbook_url in the docs ({alert['annotations'].get('runbook_url')})"
        )
        path, anchor = ROOT / match[1], match[2]
        assert path.is_file(), f"{name}: {match[1]} does not exist"
        text = path.read_text()
        anchors = github_anchors(text)
        assert anchor in anchors, f"{name}: {match[1]} has no heading #{anchor}"
        _, heading = anchors[anchor]
        assert heading == name, f"{name}'s runbook is the section of another: {heading}"
        body = section(text, heading)
        for part in ("**What it means.**", "**How to confirm.**", "**What to do.**"):
            assert part in body, f"{name}: its runbook lacks {part}"
        linked.add((match[1], heading))
    runbooks = section(OBSERVABILITY.read_text(), "Runbooks")
    written = {("docs/observability.md", h) for h in re.findall(r"^### (.+)$", runbooks, re.MULTILINE)}
    assert written == linked, written ^ linked


def test_the_anchors_are_githubs() -> None:
    text = "# Title\n## The `check` command\n## Scheduler headers and the allowlist\n"
    text += "## Title\n```\n# no\n```\n"
    assert list(github_anchors(text)) == [
        "title",
        "the-check-command",
        "scheduler-headers-and-the-allowlist",
        "title-1",
    ]


# --- The dashboard: a fresh one shows the fleet, and the latencies a client feels ---


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(deploy.DASHBOARD.read_text())
    return loaded


def test_the_namespace_picker_lists_a_fleet_before_its_first_request() -> None:
    """Issue 37: the picker read label_values(epd_requests_total, namespace), and a labelled counter has
    no series until its first request: a fresh dashboard offered no namespace and every panel stayed
    empty. It now reads a series the middleware sets when it is built."""
    [variable] = [v for v in dashboard()["templating"]["list"] if v["name"] == "namespace"]
    query = re.fullmatch(r"label_values\((\w+), *namespace\)", variable["query"]["query"])
    assert query is not None
    assert variable["definition"] == variable["query"]["query"]
    # What a PD's /metrics holds once the middleware is built and before any request: the metrics
    # declared on a registry of their own, and what building the middleware sets (Stats.loaded).
    registry = prometheus_client.CollectorRegistry()
    prom = _Prometheus(
        types.SimpleNamespace(
            **{
                kind: functools.partial(getattr(prometheus_client, kind), registry=registry)
                for kind in ("Counter", "Gauge", "Histogram")
            }
        )
    )
    stats = Stats()
    stats._prom = prom
    stats.loaded(__version__)
    present = {sample.name for family in registry.collect() for sample in family.samples}
    assert query[1] in present
    assert "epd_requests_total" not in present  # why the old picker was empty
    # And building the middleware is what sets it.
    EPDMiddleware(FakeEngine().app(), encoders=["http://enc-0:8001"])
    assert prometheus_client.REGISTRY.get_sample_value(query[1], {"version": __version__}) == 1


def test_the_dashboard_charts_time_to_first_token_and_end_to_end_latency_per_role() -> None:
    """Issue 37: no panel showed a latency a client feels. vLLM's own histograms, on every role (the
    encoders and prefill servers are scraped too), grouped by job."""
    exported = deploy.exported_series() | deploy.VLLM_SERIES
    charted: dict[str, set[str]] = {}
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            query = deploy.check_promql(target["expr"], exported)
            for metric in query.metrics:
                charted.setdefault(metric, set()).update(query.grouping)
    for metric in ("vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket"):
        assert metric in charted, metric
        assert {"le", "job"} <= charted[metric], (metric, charted[metric])
