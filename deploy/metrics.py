"""Prometheus metrics: vLLM's names under `mtpserve:`, served as `GET /metrics` on the HTTP port,
every engine replica of the app in one scrape.

Path of a number:
  1. the engine counts as it steps (`cluster.engine.EngineStats`: requests, tokens, MTP rounds,
     prefix-cache lookups, cumulative); the replica times each request (TTFT, inter-token, e2e)
     into prometheus_client histograms (`ReplicaMetrics`);
  2. about once a second each replica pushes its whole registry, cumulative, to the app's
     `MetricsHub` deployment (`MetricsReport`);
  3. `GET /metrics` on any ingress replica asks the hub, which renders every replica's latest
     report with a `replica` label, through prometheus_client.

Why a hub: a scrape reaches one ingress replica, and a `DeploymentHandle` reaches one replica of
the engine deployment, never all; replicas come and go with autoscaling. Pushing cumulative
snapshots makes the hub stateless beyond "latest report per replica": a lost report costs
freshness, not counts, and a replica that stops reporting (scaled down, replaced) drops out
after `STALE_AFTER_S`. Values lag the engine by up to `REPORT_PERIOD_S`.

Why not Ray's metrics export (`ray.serve.metrics`, the previous home of these numbers): it is
served on each node's own randomly chosen port, not the API's, and Ray 2.60 rebuilds a
histogram's `_sum` from bucket midpoints: a per-request "accepted length" histogram of values
exactly 1.0 (MTP off) read as a mean of 0.5 there.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
import uuid

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

PREFIX = "mtpserve:"
REPORT_PERIOD_S = 1.0
STALE_AFTER_S = 30.0
# Every finish reason the engine has (cluster.request.RequestStatus); each is exported from the
# start, at 0, so rate() sees the first one happen.
FINISH_REASONS = ("stop", "length", "abort", "error")

# vLLM's buckets, with finer low ones: a decode step on a GPU is a few milliseconds, and with
# MTP a token costs a fraction of a step.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS_S = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MetricsReport:
    """One replica's registry, cumulative, as prometheus_client collected it."""

    replica_id: str
    families: list[Metric]


def engine_families(model_name: str, stats: dict) -> list[Metric]:
    """The engine's numbers (`model_server.engine_stats_dict`) as metric families. Spec-decode
    families only when MTP is on (as vLLM registers them only with a speculative config): with
    MTP off there is no acceptance to report, rather than a made-up one."""
    label = ["model_name"]

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=label)
        family.add_metric([model_name], value)
        return family

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=label)
        family.add_metric([model_name], value)
        return family

    families: list[Metric] = [
        gauge("num_requests_running", "Requests being decoded.", stats["num_running"]),
        gauge("num_requests_waiting", "Requests queued in the engine.", stats["num_waiting"]),
        gauge("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", stats["kv_usage"]),
        counter(
            "prompt_tokens",
            "Prompt tokens of requests that produced their first token.",
            stats["num_prompt_tokens"],
        ),
        counter(
            "generation_tokens",
            "Tokens generated, aborted requests' included.",
            stats["num_generation_tokens"],
        ),
        counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats["prefix_cache_queried_tokens"],
        ),
        counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not recomputed).",
            stats["prefix_cache_hit_tokens"],
        ),
    ]
    finished = CounterMetricFamily(
        PREFIX + "request_success",
        "Finished requests, by finish reason (abort: the client went away).",
        labels=["model_name", "finished_reason"],
    )
    num_finished = stats["num_finished"]
    for reason in dict.fromkeys([*FINISH_REASONS, *num_finished]):
        finished.add_metric([model_name, reason], num_finished.get(reason, 0))
    families.append(finished)
    num_draft_tokens = stats.get("num_draft_tokens", 0)
    if num_draft_tokens > 0:
        spec = stats["spec"]
        proposed = spec["num_proposed_per_position"]
        families += [
            counter(
                "spec_decode_num_drafts",
                "MTP rounds that verified at least one draft token.",
                proposed[0] if proposed else 0,
            ),
            counter(
                "spec_decode_num_draft_tokens",
                "Draft tokens verified.",
                spec["num_draft_tokens"],
            ),
            counter(
                "spec_decode_num_accepted_tokens",
                "Draft tokens accepted.",
                spec["num_accepted_drafts"],
            ),
        ]
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = the first draft).",
            labels=["model_name", "position"],
        )
        accepted = spec["num_accepted_per_position"]
        for position in range(max(num_draft_tokens, len(accepted))):
            value = accepted[position] if position < len(accepted) else 0
            per_position.add_metric([model_name, str(position)], value)
        families.append(per_position)
    return families


class _EngineCollector:
    """Yields the families of the engine's latest stats (set by `ReplicaMetrics.update`)."""

    def __init__(self):
        self.families: list[Metric] = []

    def collect(self):
        return iter(self.families)


class LatencyHistogram:
    """A Prometheus histogram (one label, `model_name`) that takes `count` equal observations at
    once. The replica observes every step of every request, and prometheus_client's Histogram
    takes a lock and updates two values per observation, once per token; here one bisect and two
    additions per step, whatever its token count.
    No lock: the replica's event loop is the only thread that observes and collects."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], model: str):
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(buckets)
        self.model = model
        self.counts = [0] * (len(self.bounds) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count  # le: value <= bound
        self.sum += value * count

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric([self.model], buckets, self.sum)
        yield family


class ReplicaMetrics:
    """The metrics of one engine replica: the engine's counters and gauges, and the latency
    histograms this replica observes per request."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self._engine = _EngineCollector()
        self.registry.register(self._engine)

        def histogram(name: str, doc: str, buckets) -> LatencyHistogram:
            histogram = LatencyHistogram(PREFIX + name, doc, buckets, model_name)
            self.registry.register(histogram)
            return histogram

        self.time_to_first_token_s = histogram(
            "time_to_first_token_seconds",
            "Time from the engine replica receiving a request to its first token.",
            TTFT_BUCKETS_S,
        )
        self.inter_token_latency_s = histogram(
            "inter_token_latency_seconds",
            "Time between a request's consecutive tokens; the tokens of one MTP round share "
            "its time evenly.",
            ITL_BUCKETS_S,
        )
        self.e2e_request_latency_s = histogram(
            "e2e_request_latency_seconds",
            "Time from the engine replica receiving a request to its end (aborts included).",
            E2E_BUCKETS_S,
        )

    def update(self, stats: dict) -> None:
        """`stats` is `model_server.engine_stats_dict(engine.stats())`."""
        self._engine.families = engine_families(self.model_name, stats)

    # cluster.async_engine.TokenTimings: the engine tells these when each step's tokens came.

    def first_tokens(self, num_tokens: int, ttft_s: float) -> None:
        self.time_to_first_token_s.observe(ttft_s)
        if num_tokens > 1:
            self.later_tokens(num_tokens - 1, 0.0)

    def later_tokens(self, num_tokens: int, since_previous_s: float) -> None:
        """`num_tokens` arrived `since_previous_s` after the request's previous token."""
        if num_tokens > 0:
            self.inter_token_latency_s.observe(since_previous_s / num_tokens, num_tokens)

    def report(self, replica_id: str) -> MetricsReport:
        return MetricsReport(replica_id, list(self.registry.collect()))


def current_replica_id() -> str:
    """Serve's id of the replica this runs in (a random one outside Serve)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a replica (a test constructs the class directly)
        return uuid.uuid4().hex[:8]


class _MergedCollector:
    """Every replica's families, one family per name, each sample labelled with its replica.
    prometheus_client's `_created` samples (a process start time per series) are left out."""

    def __init__(self, reports: list[MetricsReport]):
        self._reports = reports

    def collect(self):
        merged: dict[str, Metric] = {}
        for report in self._reports:
            for family in report.families:
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue
                    labels = {**sample.labels, "replica": report.replica_id}
                    out.add_sample(sample.name, labels, sample.value)
        return iter(merged.values())


def render(reports: list[MetricsReport]) -> bytes:
    """The Prometheus text exposition of these reports."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_MergedCollector(reports))
    return generate_latest(registry)


class MetricsHub:
    """Serve deployment class (one replica per app; `deploy.app.build_app` binds it): the latest
    report of every engine replica, rendered on request."""

    def __init__(self):
        self._reports: dict[str, tuple[float, MetricsReport]] = {}

    async def report(self, report: MetricsReport) -> None:
        self._reports[report.replica_id] = (time.monotonic(), report)

    async def render(self) -> bytes:
        now = time.monotonic()
        for replica_id, (received_s, _) in list(self._reports.items()):
            if now - received_s > STALE_AFTER_S:
                del self._reports[replica_id]
        return render([report for _, (_, report) in sorted(self._reports.items())])
