"""Where a request's time goes, from the servers' own ``/metrics``: the mean of each latency histogram
over one benchmark run (the change in its ``_sum`` over the change in its ``_count``).

vLLM's per-request histograms (end to end, time to first token, queue, prefill, decode; and its
inter-token latency, per token) tell an encoder's share from PD's, and a PD's queue from its prefill;
the middleware's stage histograms (the parse, the encode stage as a whole, each encoder call, the
rewrite) tell its share of PD's wait. Read
around a run of ``vllm bench serve`` on each server of a front, they say where the client's TTFT went,
which no client-side figure can: two fronts with the same TTFT may differ in what the encoder took and
what the front took around it.

Means, not percentiles: a histogram's buckets are too coarse for a few milliseconds' difference, while
its sum and count are exact. Every series of a name is added up (vLLM labels by model and engine; a
fleet's encoders are several servers), so a mean is over every request any of them served in the run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["MEASURES", "Snapshot", "means_ms", "parse", "scrape"]

# (histogram, label that picks a series or None, what the figure is called)
MEASURES: tuple[tuple[str, tuple[str, str] | None, str], ...] = (
    ("vllm:e2e_request_latency_seconds", None, "e2e"),
    ("vllm:time_to_first_token_seconds", None, "TTFT"),
    ("vllm:request_queue_time_seconds", None, "queue"),
    ("vllm:request_prefill_time_seconds", None, "prefill"),
    ("vllm:request_decode_time_seconds", None, "decode"),
    ("vllm:inter_token_latency_seconds", None, "ITL"),
    ("epd_stage_duration_seconds", ("stage", "parse"), "epd parse"),
    ("epd_stage_duration_seconds", ("stage", "encode"), "epd encode"),
    ("epd_encoder_call_duration_seconds", None, "epd encoder call"),
    ("epd_stage_duration_seconds", ("stage", "rewrite"), "epd rewrite"),
    ("epd_stage_duration_seconds", ("stage", "prefill"), "epd prefill"),
)


class Total(NamedTuple):
    seconds: float
    observations: float


Snapshot = dict[str, Total]  # measure name -> every matching series' sum and count, added up


def parse(text: str) -> Snapshot:
    """The measures found in one Prometheus text exposition; a measure the server does not export is
    absent (a plain vLLM has no ``epd_*``, an older one may lack a histogram)."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for histogram, label, name in MEASURES:
            if family.name != histogram:
                continue
            for sample in family.samples:
                if label is not None and sample.labels.get(label[0]) != label[1]:
                    continue
                if sample.name == histogram + "_sum":
                    sums[name] = sums.get(name, 0.0) + sample.value
                elif sample.name == histogram + "_count":
                    counts[name] = counts.get(name, 0.0) + sample.value
    return {name: Total(sums[name], counts.get(name, 0.0)) for name in sums}


def add(snapshots: Iterable[Snapshot]) -> Snapshot:
    total: dict[str, Total] = {}
    for snapshot in snapshots:
        for name, (seconds, count) in snapshot.items():
            before = total.get(name, Total(0.0, 0.0))
            total[name] = Total(before.seconds + seconds, before.observations + count)
    return total


def scrape(urls: Iterable[str], timeout: float = 10.0) -> Snapshot:
    """The measures of every server at ``urls`` (base URLs; ``/metrics`` is added), added up."""
    snapshots = []
    with httpx.Client(timeout=timeout) as client:
        for url in urls:
            reply = client.get(url.rstrip("/") + "/metrics")
            reply.raise_for_status()
            snapshots.append(parse(reply.text))
    return add(snapshots)


def means_ms(before: Mapping[str, Total], after: Mapping[str, Total]) -> dict[str, dict[str, float]]:
    """Each measure's mean over what happened between two snapshots, in ms, with how many observations
    it is over; a measure nothing observed in between is left out. A counter that went down (the server
    restarted between the snapshots) gives no figure rather than a wrong one."""
    out: dict[str, dict[str, float]] = {}
    for name, (seconds, count) in after.items():
        earlier = before.get(name, Total(0.0, 0.0))
        observed = count - earlier.observations
        if observed <= 0 or seconds < earlier.seconds:
            continue
        out[name] = {"ms": round((seconds - earlier.seconds) * 1000 / observed, 2), "count": observed}
    return out
