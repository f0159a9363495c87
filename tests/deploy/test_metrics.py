"""Our Prometheus metrics reach Ray's metrics export port: after known requests to an app of
this test's own (so no other test's requests count), the token counters equal exactly their
tokens, the TTFT / TPOT histograms count them with plausible values, and the KV-usage gauge is a
fraction.

Ray exports application metrics with a `ray_` prefix on each node's `metrics_export_port`, some
seconds after they are recorded; Serve tags each with its application. The test polls, bounded.
"""

from __future__ import annotations

import math
import re
import time
from collections import defaultdict

import httpx
import pytest
from conftest import app_args

pytestmark = pytest.mark.timeout(180)

SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+"
    r"(?P<value>\S+)"
)
APP = "metricsapp"
PROMPTS = ["The capital of France is", "Once upon a time there", "def fibonacci(n):"]
MAX_TOKENS = 7


@pytest.fixture(scope="module")
def metrics_app(serve_url, tiny_model_dir):
    """(base URL, model name) of an app whose metrics only this test's requests move."""
    from ray import serve

    from deploy.app import build_app

    serve.run(build_app(app_args(tiny_model_dir)), name=APP, route_prefix=f"/{APP}")
    url = f"{serve_url}/{APP}"
    yield url, httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
    serve.delete(APP)


def metrics_url(ray_session) -> str:
    node = next(n for n in ray_session.nodes() if n["Alive"])
    return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"


def scrape(url: str, model: str) -> dict[str, float]:
    """Our samples (`ray_mtpserve_*`) of this test's app for `model`, summed over replicas,
    keyed by name plus the labels that matter (`le`, `finish_reason`)."""
    totals: dict[str, float] = defaultdict(float)
    for line in httpx.get(url, timeout=10).text.splitlines():
        match = SAMPLE.match(line)
        if not match or not match["name"].startswith("ray_mtpserve_"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"] or ""))
        if labels.get("model") != model or labels.get("application") != APP:
            continue
        key = match["name"] + "".join(
            f"|{k}={labels[k]}" for k in ("le", "finish_reason") if k in labels
        )
        totals[key] += float(match["value"])
    return dict(totals)


def _counter(samples: dict[str, float], name: str) -> float:
    """Ray may export a counter with or without Prometheus' `_total` suffix."""
    return samples.get(f"ray_{name}_total", samples.get(f"ray_{name}", 0.0))


def test_token_counters_and_latency_histograms_reach_prometheus(
    ray_session, metrics_app, tiny_model_dir
):
    import openai
    from transformers import AutoTokenizer

    app_url, model = metrics_app
    client = openai.OpenAI(base_url=f"{app_url}/v1", api_key="unused", max_retries=0, timeout=60)
    url = metrics_url(ray_session)
    prompt_tokens = 0
    for prompt in PROMPTS:
        response = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert response.usage.completion_tokens == MAX_TOKENS
        prompt_tokens += response.usage.prompt_tokens
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)
    generated = len(PROMPTS) * MAX_TOKENS

    deadline = time.monotonic() + 90
    while True:
        after = scrape(url, model)
        if (
            _counter(after, "mtpserve_generation_tokens") >= generated
            and _counter(after, "mtpserve_prompt_tokens") >= prompt_tokens
            and after.get("ray_mtpserve_time_per_output_token_seconds_count", 0) >= len(PROMPTS)
            and after.get("ray_mtpserve_kv_cache_usage") == 0.0  # every block freed
        ):
            break
        assert time.monotonic() < deadline, sorted(after)
        time.sleep(1)

    # Counters: exactly our tokens (only this test talks to this app).
    assert _counter(after, "mtpserve_generation_tokens") == generated
    assert _counter(after, "mtpserve_prompt_tokens") == prompt_tokens
    finished = {k: v for k, v in after.items() if k.startswith("ray_mtpserve_requests_finished")}
    assert sum(v for k, v in finished.items() if "finish_reason=length" in k) == len(PROMPTS), (
        finished
    )

    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds"):
        count = after[f"ray_mtpserve_{name}_count"]
        total_s = after[f"ray_mtpserve_{name}_sum"]
        assert count == len(PROMPTS), name
        # Plausible: positive, and a tiny model on CPU is well under 10 s per token/request.
        assert 0 < total_s / count < 10, (name, total_s / count)
        buckets = sorted(
            (float(k.split("|le=")[1]), v)
            for k, v in after.items()
            if k.startswith(f"ray_mtpserve_{name}_bucket|le=")
        )
        assert buckets and buckets[-1][0] == math.inf
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative
        assert buckets[-1][1] == after[f"ray_mtpserve_{name}_count"]
