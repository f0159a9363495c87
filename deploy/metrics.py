"""Prometheus metrics of the model-server deployment, exported through `ray.serve.metrics`.

Serve adds the deployment, replica and application tags; we add the served model's name. Ray's
metrics agent exposes them on each node's metrics export port (Prometheus text format) with a
`ray_` prefix, e.g. `ray_mtpserve_time_to_first_token_seconds_bucket`.
"""

from __future__ import annotations

from ray.serve import metrics

# Seconds; TTFT spans queueing plus prefill, TPOT one decode round divided by its accepted tokens.
TTFT_BOUNDARIES_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
TPOT_BOUNDARIES_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
# Tokens gained per MTP round (1 = no draft accepted; at most num_draft_tokens + 1).
ACCEPTED_LENGTH_BOUNDARIES = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0]


class EngineMetrics:
    """One set of metrics per model-server replica."""

    def __init__(self, model_name: str):
        tags = ("model",)
        self.time_to_first_token_s = metrics.Histogram(
            "mtpserve_time_to_first_token_seconds",
            description="Time from the engine receiving a request to its first output token.",
            boundaries=TTFT_BOUNDARIES_S,
            tag_keys=tags,
        )
        self.time_per_output_token_s = metrics.Histogram(
            "mtpserve_time_per_output_token_seconds",
            description="Mean time per output token after the first, per finished request.",
            boundaries=TPOT_BOUNDARIES_S,
            tag_keys=tags,
        )
        self.mtp_accepted_length = metrics.Histogram(
            "mtpserve_mtp_accepted_length",
            description="Mean tokens gained per MTP round, per finished request.",
            boundaries=ACCEPTED_LENGTH_BOUNDARIES,
            tag_keys=tags,
        )
        self.num_waiting = metrics.Gauge(
            "mtpserve_num_waiting_requests",
            description="Requests queued in the engine.",
            tag_keys=tags,
        )
        self.num_running = metrics.Gauge(
            "mtpserve_num_running_requests", description="Requests being decoded.", tag_keys=tags
        )
        self.kv_usage = metrics.Gauge(
            "mtpserve_kv_cache_usage",
            description="Fraction of KV blocks in use (0..1).",
            tag_keys=tags,
        )
        self.mean_tokens_per_round = metrics.Gauge(
            "mtpserve_mtp_mean_tokens_per_round",
            description="Engine-wide mean tokens gained per MTP round.",
            tag_keys=tags,
        )
        self.num_prompt_tokens = metrics.Counter(
            "mtpserve_prompt_tokens",
            description="Prompt tokens of requests the engine accepted.",
            tag_keys=tags,
        )
        self.num_generation_tokens = metrics.Counter(
            "mtpserve_generation_tokens",
            description="Output tokens streamed to callers (aborted requests' included).",
            tag_keys=tags,
        )
        self.prefix_cache_queries = metrics.Counter(
            "mtpserve_prefix_cache_queries",
            description="Prompt tokens looked up in the prefix cache (each admission).",
            tag_keys=tags,
        )
        self.prefix_cache_hits = metrics.Counter(
            "mtpserve_prefix_cache_hits",
            description="Prompt tokens found in the prefix cache (not recomputed).",
            tag_keys=tags,
        )
        self.num_finished = metrics.Counter(
            "mtpserve_requests_finished",
            description="Finished requests by finish reason.",
            tag_keys=("model", "finish_reason"),
        )
        for metric in (
            self.time_to_first_token_s,
            self.time_per_output_token_s,
            self.mtp_accepted_length,
            self.num_waiting,
            self.num_running,
            self.kv_usage,
            self.mean_tokens_per_round,
            self.num_prompt_tokens,
            self.num_generation_tokens,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.num_finished,
        ):
            metric.set_default_tags({"model": model_name})
        # The engine's prefix-cache counters are cumulative; the Prometheus counters move by
        # the difference since the last report.
        self._reported_prefix_cache = (0, 0)

    def record_engine_stats(self, stats: dict) -> None:
        """`stats` is `model_server.engine_stats_dict(engine.stats())`."""
        self.num_waiting.set(stats["num_waiting"])
        self.num_running.set(stats["num_running"])
        self.kv_usage.set(stats["kv_usage"])
        self.mean_tokens_per_round.set(stats["mean_tokens_per_round"])
        queried = stats.get("prefix_cache_queried_tokens", 0)
        hit = stats.get("prefix_cache_hit_tokens", 0)
        last_queried, last_hit = self._reported_prefix_cache
        if queried < last_queried:  # a restarted engine counts from zero again
            last_queried, last_hit = 0, 0
        if queried > last_queried:
            self.prefix_cache_queries.inc(queried - last_queried)
        if hit > last_hit:
            self.prefix_cache_hits.inc(hit - last_hit)
        self._reported_prefix_cache = (queried, hit)
