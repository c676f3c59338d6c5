"""What operators read about the metrics, held to what the code emits (issue 37): docs/observability.md's
metric table names every metric the package exports with the labels it has, and every value of the
labels whose values the code fixes (request and call outcomes, blames, stages, results, sources, roles,
placements) is documented, and nothing else: read from the code itself (the package's literal calls into
``Stats``, the error classes' outcomes, ``BLAMES``, ``RESULTS``), so a value added to the code and not to
the docs, or one the docs keep after the code dropped it, fails here."""

from __future__ import annotations

import ast
import inspect
import re
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import prometheus_client
import pytest

import epd_middleware
from epd_middleware import errors
from epd_middleware._blame import BLAMES
from epd_middleware._comparison import RESULTS
from epd_middleware._metrics import ROLES, Stats, _Prometheus, _request_labels

ROOT: Final = Path(__file__).parent.parent
PACKAGE: Final = Path(epd_middleware.__file__).parent
OBSERVABILITY: Final = ROOT / "docs" / "observability.md"


# --- What the code emits ---


def families() -> dict[str, frozenset[str]]:
    """Every metric family ``_Prometheus`` declares, by the name the docs give it (a counter's with
    ``_total``, a histogram's bare), with its labels (``le`` left out): made on a registry of their own,
    each given one sample so that its labels show."""
    registry = prometheus_client.CollectorRegistry()

    def maker(cls: Any) -> Callable[..., Any]:
        def make(name: str, documentation: str, labelnames: tuple[str, ...] = (), **kwargs: Any) -> Any:
            metric = cls(name, documentation, labelnames, registry=registry, **kwargs)
            child = metric.labels(*labelnames) if labelnames else metric
            {"Histogram": lambda: child.observe(1), "Gauge": lambda: child.set(1)}.get(
                cls.__name__, lambda: child.inc()
            )()
            return metric

        return make

    _Prometheus(
        types.SimpleNamespace(
            Counter=maker(prometheus_client.Counter),
            Gauge=maker(prometheus_client.Gauge),
            Histogram=maker(prometheus_client.Histogram),
        )
    )
    return {
        f"{family.name}_total" if family.type == "counter" else family.name: frozenset(
            label for sample in family.samples for label in sample.labels if label != "le"
        )
        for family in registry.collect()
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
