"""`GET /metrics` on the HTTP port, scraped with prometheus_client's parser after known requests.

The MTP app of this module (only its tests talk to it): colocated, two replicas, MTP k = 2 on a
tiny checkpoint whose MTP layer echoes the target (so drafts are accepted as well as rejected),
an API key (the scrape carries none). Requests go one at a time, so each runs alone in its
engine as in the offline reference: the spec-decode counters must equal the offline engine's,
summed over both replicas. Then a client disconnects mid-stream: the abort is counted, and so
are its rounds. The session app (two deployments, MTP off) shows no spec-decode numbers.
The Grafana dashboard queries only names that /metrics serves.
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from pathlib import Path

import httpx
import openai
import pytest
import torch
from conftest import app_args

pytestmark = pytest.mark.timeout(300)

APP = "metricsapp"
KEY = "metrics-key"
NUM_DRAFTS = 2
NUM_REPLICAS = 2
MAX_TOKENS = 12
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"


def _prompts() -> list[list[int]]:
    """Token ids: a repeated token (the tiny model then repeats too, and its echoing MTP layer
    gets drafts at both positions accepted) and random ones (mostly rejected)."""
    g = torch.Generator().manual_seed(0)
    return [[7] * 8] + [torch.randint(3, 500, (12,), generator=g).tolist() for _ in range(3)]


@pytest.fixture(scope="module")
def echo_model_dir(tmp_path_factory) -> str:
    from workers.tiny_model import make_tiny_model

    return make_tiny_model(str(tmp_path_factory.mktemp("echo-model")), seed=0, mtp_echo=0.1)


@pytest.fixture(scope="module")
def mtp_app(serve_url, echo_model_dir):
    """(base URL, model name) of the colocated two-replica MTP app."""
    from ray import serve

    from deploy.app import build_app

    args = {
        **app_args(echo_model_dir),
        "num_draft_tokens": NUM_DRAFTS,
        "colocate": True,
        "num_replicas": NUM_REPLICAS,
        "api_key": KEY,
    }
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    url = f"{serve_url}/{APP}"
    headers = {"Authorization": f"Bearer {KEY}"}
    yield url, httpx.get(f"{url}/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]
    serve.delete(APP)


Samples = dict[tuple[str, frozenset], float]


def scrape(url: str) -> Samples:
    """Every sample of `url`/metrics, parsed by prometheus_client, keyed by (name, labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{url}/metrics", timeout=30)  # no API key: scrapers carry none
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """`mtpserve:<name>` summed over replicas (and over labels not given)."""
    return sum(
        value
        for (sample_name, sample_labels), value in samples.items()
        if sample_name == f"mtpserve:{name}" and set(labels.items()) <= sample_labels
    )


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (sample_name, labels), value in samples.items():
        if sample_name == f"mtpserve:{name}":
            out[dict(labels)[label]] += value
    return dict(out)


def wait_for(url: str, done, timeout_s: float = 60.0) -> Samples:
    """Scrape until `done(samples)`: replicas report about once a second."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if done(samples):
            return samples
        assert time.monotonic() < deadline, sorted({name for name, _ in samples})
        time.sleep(0.5)


def _offline_spec(model_dir: str, prompts: list[list[int]]):
    """The offline engine's MTP counters over `prompts`, each run alone."""
    from cluster.llm import LLM
    from cluster.sampling_params import SamplingParams

    llm = LLM(model_dir, device="cpu", num_draft_tokens=NUM_DRAFTS)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt in prompts:
        llm.generate([prompt], params)
    return llm.stats().spec


def _check_spec_consistent(samples: Samples, num_rounds: float, num_requests: int) -> None:
    drafts = total(samples, "spec_decode_num_drafts_total")
    draft_tokens = total(samples, "spec_decode_num_draft_tokens_total")
    accepted = total(samples, "spec_decode_num_accepted_tokens_total")
    per_position = by_label(samples, "spec_decode_num_accepted_tokens_per_pos_total", "position")
    assert sorted(per_position) == [str(i) for i in range(NUM_DRAFTS)]
    ordered = [per_position[str(i)] for i in range(NUM_DRAFTS)]
    assert ordered == sorted(ordered, reverse=True)  # position i needs 0..i-1 accepted
    assert sum(ordered) == accepted <= draft_tokens <= NUM_DRAFTS * drafts
    # Every round but a request's last (when one token is left to generate) verifies drafts.
    assert 0 <= num_rounds - drafts <= num_requests


def test_metrics_cover_every_replica_and_count_mtp_rounds_and_aborts(mtp_app, echo_model_dir):
    url, model = mtp_app
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
    prompts = _prompts()
    usages = []
    for prompt in prompts:  # one at a time: each runs alone in its engine, as offline
        response = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        usages.append(response.usage)
    generated = sum(u.completion_tokens for u in usages)
    assert generated == len(prompts) * MAX_TOKENS
    n = len(prompts)

    samples = wait_for(
        url,
        lambda s: (
            total(s, "request_success_total", finished_reason="length") == n
            and total(s, "e2e_request_latency_seconds_count") == n
            and len(by_label(s, "num_requests_running", "replica")) == NUM_REPLICAS
        ),
    )
    # Both replicas, whichever served the requests: one series each, summed to the totals.
    assert set(by_label(samples, "num_requests_running", "model_name")) == {model}
    assert total(samples, "generation_tokens_total") == generated
    assert total(samples, "prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert total(samples, "prefix_cache_queries_total") == sum(u.prompt_tokens for u in usages)
    assert by_label(samples, "request_success_total", "finished_reason") == {
        "stop": 0,
        "length": n,
        "abort": 0,
        "error": 0,
    }
    assert total(samples, "kv_cache_usage_perc") == 0.0  # every block freed
    assert total(samples, "time_to_first_token_seconds_count") == n
    # One inter-token latency per token after a request's first.
    assert total(samples, "inter_token_latency_seconds_count") == generated - n
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        count = total(samples, f"{name}_seconds_count")
        assert 0 < total(samples, f"{name}_seconds_sum") / count < 10, name
        assert total(samples, f"{name}_seconds_bucket", le="+Inf") == count

    # MTP: exactly the offline engine's rounds, summed over the replicas.
    spec = _offline_spec(echo_model_dir, prompts)
    assert total(samples, "spec_decode_num_drafts_total") == spec.num_drafts
    assert total(samples, "spec_decode_num_draft_tokens_total") == spec.num_draft_tokens
    assert total(samples, "spec_decode_num_accepted_tokens_total") == spec.num_accepted_drafts
    per_position = by_label(samples, "spec_decode_num_accepted_tokens_per_pos_total", "position")
    assert [per_position[str(i)] for i in range(NUM_DRAFTS)] == spec.num_accepted_per_position
    assert spec.num_accepted_per_position[-1] > 0  # the echo prompt: both positions accepted
    assert spec.num_accepted_drafts < spec.num_draft_tokens  # and some rejected
    # A request's tokens: one from its prefill, then (accepted + 1) per round.
    num_rounds = generated - n - spec.num_accepted_drafts
    _check_spec_consistent(samples, num_rounds, n)

    # A client that goes away mid-stream: counted as an abort, its rounds counted too.
    body = {"model": model, "prompt": prompts[0], "max_tokens": 2000, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0.0}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                break  # a chunk with text, then hang up
    after = wait_for(
        url,
        lambda s: (
            total(s, "request_success_total", finished_reason="abort") == 1
            and total(s, "num_requests_running") == 0
            and total(s, "e2e_request_latency_seconds_count") == n + 1
        ),
    )
    assert total(after, "request_success_total", finished_reason="length") == n
    num_aborted_tokens = total(after, "generation_tokens_total") - generated
    assert 1 <= num_aborted_tokens < 2000
    assert total(after, "time_to_first_token_seconds_count") == n + 1
    accepted = total(after, "spec_decode_num_accepted_tokens_total")
    assert total(after, "spec_decode_num_drafts_total") > spec.num_drafts  # its rounds counted
    _check_spec_consistent(after, generated + num_aborted_tokens - (n + 1) - accepted, n + 1)
    assert total(after, "kv_cache_usage_perc") == 0.0


def test_mtp_off_reports_no_acceptance(serve_url, client, served_model, model_server):
    """The session app: two deployments, MTP off. No spec-decode series (no made-up acceptance),
    the engine's tokens per round exactly 1, and /metrics answers from the ingress."""
    before = model_server.engine_stats.remote().result()  # the truth; /metrics may lag it
    response = client.completions.create(
        model=served_model["id"], prompt="Once upon a time", max_tokens=5, temperature=0.0
    )
    expected = before["num_generation_tokens"] + response.usage.completion_tokens
    after = wait_for(serve_url, lambda s: total(s, "generation_tokens_total") == expected)
    assert not [name for name, _ in after if "spec_decode" in name]
    engine = httpx.get(f"{serve_url}/health", timeout=30).json()["engine"]
    assert engine["mean_tokens_per_round"] == 1.0
    assert engine["acceptance_per_position"] == []


def test_dashboard_queries_only_served_metrics(mtp_app):
    url, _ = mtp_app
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    queried = {name for expr in exprs for name in re.findall(r"mtpserve:[a-zA-Z0-9_:]+", expr)}
    served = {name for name, _ in scrape(url)}
    assert queried and queried <= served, sorted(queried - served)
    # What the dashboard is for: acceptance, accepted length per position, TTFT, ITL, KV, tokens/s.
    for name in (
        "mtpserve:spec_decode_num_accepted_tokens_total",
        "mtpserve:spec_decode_num_accepted_tokens_per_pos_total",
        "mtpserve:time_to_first_token_seconds_bucket",
        "mtpserve:inter_token_latency_seconds_bucket",
        "mtpserve:kv_cache_usage_perc",
        "mtpserve:generation_tokens_total",
    ):
        assert name in queried, name


def test_latency_histogram_exposes_what_prometheus_client_would():
    """The replica's own histogram against prometheus_client's on the same observations (values
    on bucket bounds, between them, above the last; `count` equal ones at once): the same bucket,
    sum and count samples."""
    from prometheus_client import CollectorRegistry, Histogram

    from deploy.metrics import ITL_BUCKETS_S, LatencyHistogram

    registry = CollectorRegistry(auto_describe=False)
    reference = Histogram(
        "h", "doc", ["model_name"], registry=registry, buckets=ITL_BUCKETS_S
    ).labels("m")
    ours = LatencyHistogram("h", "doc", ITL_BUCKETS_S, "m")
    g = torch.Generator().manual_seed(0)
    values = [0.0, 0.001, 0.0025, 80.0, 200.0] + (torch.rand(300, generator=g) * 0.3).tolist()
    for i, value in enumerate(values):
        count = 1 + i % 3
        ours.observe(value, count)
        for _ in range(count):
            reference.observe(value)

    def samples(families):
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in families
            for s in family.samples
            if not s.name.endswith("_created")
        }

    want, got = samples(registry.collect()), samples(ours.collect())
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12), key


def _bench_serve():
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve.py"
    spec = importlib.util.spec_from_file_location("bench_serve_for_test", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    return bench


def test_bench_serve_reads_the_replicas_latency_sums_and_counts():
    """bench_serve's client-against-replica table reads the TTFT and end-to-end histograms out of
    /metrics as the hub renders them (two replicas, merged): their sums and counts, added."""
    from deploy.metrics import ReplicaMetrics, render

    bench = _bench_serve()

    replicas = [ReplicaMetrics("m"), ReplicaMetrics("m")]
    replicas[0].first_tokens(1, 0.25)
    replicas[0].first_tokens(3, 0.5)
    replicas[1].first_tokens(1, 1.0)
    replicas[1].e2e_request_latency_s.observe(2.0)
    text = render([r.report(f"replica-{i}") for i, r in enumerate(replicas)]).decode()
    totals = bench.histogram_totals(text)
    assert totals == {"ttft_sum": 1.75, "ttft_count": 3.0, "e2e_sum": 2.0, "e2e_count": 1.0}
    later = {"ttft_sum": 2.75, "ttft_count": 5.0, "e2e_sum": 2.0, "e2e_count": 1.0}
    assert bench._mean_between(totals, later, "ttft") == 0.5
    assert bench._mean_between(totals, later, "e2e") is None  # nothing ended in between


def test_bench_serve_counts_a_levels_engine_steps_from_the_engine_stats():
    """The steps table: the engine's counters as /health's engine numbers carry them (JSON of
    `EngineStats`), differenced over a level."""
    import dataclasses
    import json

    from cluster.engine import EngineStats

    bench = _bench_serve()

    def health(steps: int, prefill_steps: int, step_time_s: float, prefill_s: float) -> dict:
        stats = EngineStats(
            1,
            0,
            10,
            10,
            num_steps=steps,
            num_prefill_steps=prefill_steps,
            step_time_s=step_time_s,
            prefill_step_time_s=prefill_s,
        )
        return json.loads(json.dumps(dataclasses.asdict(stats)))

    row = bench.LevelResult("full", 32, num_output_tokens=640, wall_s=0.125)
    before = bench.step_counts(health(7, 3, 1.5, 0.5))
    after = bench.step_counts(health(27, 8, 1.6, 0.54))
    bench.steps_between(before, after, row)
    assert (row.num_steps, row.num_prefill_steps) == (20, 5)
    assert row.step_time_s == pytest.approx(0.1)
    assert row.prefill_step_time_s == pytest.approx(0.04)
    # 0.1 s over 20 steps: 5 ms a step; 0.1 of the level's 0.125 s: busy 80% of it; the 5
    # steps with a prompt took 0.04 s (8 ms each), the 15 without 0.06 s (4 ms each)
    assert (
        bench.steps_table([row.summary()]).splitlines()[-1]
        == "| full | 32 | 1 | 20 | 5 (25%) | 32.0 | 5.00 | 8.00 / 4.00 | 80% |"
    )
    older = {
        k: v
        for k, v in health(27, 8, 0.0, 0.0).items()
        if k not in ("step_time_s", "prefill_step_time_s")
    }
    bench.steps_between(before, bench.step_counts(older), row := bench.LevelResult("full", 1))
    assert (row.num_steps, row.step_time_s, row.prefill_step_time_s) == (20, None, None)
    row.num_output_tokens, row.wall_s = 20, 1.0
    assert bench.steps_table([row.summary()]).splitlines()[-1].endswith("| - | - | - |")
    assert bench.step_counts({"num_running": 1}) is None  # an older server: no counts


def test_bench_serve_spreads_a_level_over_client_processes_and_merges_it_back():
    """Every request index is sent once across the processes, clients as even as they go, and
    the merged level counts every process's requests over the wall time from the first start
    to the last end; a prompt given two texts by two processes is caught."""
    bench = _bench_serve()
    for concurrency, num_requests, processes in [
        (128, 1280, 8),
        (32, 320, 3),
        (8, 80, 8),
        (1, 10, 8),
        (5, 7, 2),
        (3, 8, 5),
    ]:
        shares = bench.client_shares(concurrency, num_requests, processes)
        assert len(shares) == min(processes, concurrency)
        assert sum(c for c, _, _ in shares) == concurrency
        assert max(c for c, _, _ in shares) - min(c for c, _, _ in shares) <= 1
        indices = [i for _, n, first in shares for i in range(first, first + n)]
        assert indices == list(range(num_requests))
    assert bench.client_shares(32, 320, 3) == [(11, 110, 0), (11, 110, 110), (10, 100, 220)]
    assert bench.num_client_processes(None, 2) == 1
    assert bench.num_client_processes(None, 16) == 8
    assert bench.num_client_processes(None, 64) == 8
    assert bench.num_client_processes(3, 64) == 3

    a = bench.LevelResult("stream", 2, num_requests=4, num_output_tokens=40, wall_s=2.0)
    a.started_s, a.ttft_s, a.latency_s = 10.0, [0.1, 0.2], [1.0, 1.0, 1.0, 1.0]
    a.record_text(0, "x")
    a.record_error("HTTP 500: one")
    b = bench.LevelResult("stream", 1, num_requests=2, num_output_tokens=20, wall_s=2.5)
    b.started_s, b.ttft_s, b.latency_s = 10.5, [0.3], [1.5, 1.5]
    b.record_text(1, "y")
    merged = bench.merge_levels([a, b])
    assert (merged.concurrency, merged.num_requests, merged.num_output_tokens) == (3, 6, 60)
    assert (merged.started_s, merged.wall_s) == (10.0, 3.0)  # 10.0 .. 13.0
    assert merged.tokens_per_s == 20.0
    assert sorted(merged.ttft_s) == [0.1, 0.2, 0.3] and len(merged.latency_s) == 6
    assert (merged.num_errors, merged.first_errors) == (1, ["HTTP 500: one"])
    assert merged.texts == {0: "x", 1: "y"} and not merged.mismatched_prompts
    c = bench.LevelResult("stream", 1, started_s=11.0)
    c.record_text(0, "z")
    assert bench.merge_levels([a, c]).mismatched_prompts == {0}


def test_bench_serve_gives_each_pinned_engine_a_core_of_its_own():
    """`--pin-engines` on a machine of 8 cores with two hardware threads each (CPU i and i + 8
    share a core): each engine gets one CPU of a core whose sibling nobody gets."""
    bench = _bench_serve()

    def siblings(cpu: int) -> set[int]:
        return {cpu % 8, cpu % 8 + 8}

    engines, rest = bench.engine_cpus_for(set(range(16)), siblings, 2)
    assert engines == [15, 14] and rest == set(range(16)) - {6, 14, 7, 15}
    engines, rest = bench.engine_cpus_for(set(range(16)), siblings, 1)
    assert engines == [15] and rest == set(range(16)) - {7, 15}
    # Without hardware threads a core is a CPU.
    engines, rest = bench.engine_cpus_for(set(range(4)), lambda c: {c}, 2)
    assert engines == [3, 2] and rest == {0, 1}
    # Too few to leave two CPUs for the rest: nothing chosen.
    assert bench.engine_cpus_for(set(range(2)), lambda c: {c}, 1) is None
    assert bench.engine_cpus_for({0, 1, 2, 3}, lambda c: {c % 2, c % 2 + 2}, 2) is None


def test_bench_serve_brackets_a_level_with_the_offline_engine_before_and_after():
    """--bracket: a served row's ratio is to the mean of the offline rows before and after it
    (a drift steady over the level cancels); the offline-after row shows after / before."""
    bench = _bench_serve()

    def row(path: str, repeat: int, tokens_per_s: float, ttft_s: float | None) -> dict:
        level = bench.LevelResult(path, 32, num_requests=64, num_output_tokens=int(tokens_per_s))
        level.wall_s, level.repeat = 1.0, repeat
        if ttft_s is not None:
            level.ttft_s = [ttft_s]
        return level.summary()

    rows = []
    for repeat, (before, served, after) in enumerate([(100, 90, 80), (100, 95, 90)]):
        rows += [
            row("offline", repeat, before, 0.010),
            row("stream", repeat, served, 0.014),
            row("offline-after", repeat, after, 0.008),
        ]
    lines = bench.table(rows).splitlines()
    assert lines[3].split("|")[6].strip() == "1.00"  # 90 against (100 + 80) / 2
    assert lines[4].split("|")[6].strip() == "0.80"  # the drift: 80 after 100
    assert lines[6].split("|")[6].strip() == "1.00"  # 95 against (100 + 90) / 2
    passes = bench.passes_table(rows).splitlines()
    assert len(passes) == 3  # the stream row alone: the offline rows are the bases
    # median ratio 1.00; TTFT over offline's: 14 ms against a mean of 9
    assert passes[-1] == "| stream | 32 | 2 | 1.00 (1.00-1.00) | 5.0 |"
    # Without --bracket the same served rows compare with the offline row before them alone.
    plain = [r for r in rows if r["path"] != "offline-after"]
    assert bench.table(plain).splitlines()[3].split("|")[6].strip() == "0.90"
