"""Bounded load test of the OpenAI HTTP path on loopback, and its time-to-first-token overhead.

    python -m benchmarks.load_test [--model DIR] [--concurrency 64] [--duration 60]
        [--max-tokens 32] [--prompt-len 32] [--ttft-samples 20] [--url URL] [--markdown PATH]

Three phases, one table:
  1. Direct TTFT: an in-process `AsyncEngine` on the model, `--ttft-samples` sequential requests
     with max_tokens=1 (so the first token is the whole request); time from `generate()` to the
     first output with a token. The engine is shut down before phase 2 (2 cores: no overlap).
  2. HTTP TTFT: the same prompts, sequential, `POST /v1/completions` with `stream: true` and
     max_tokens=1 on an idle server (a fresh local Ray + the Serve app, or `--url`); time from
     sending the request to the first SSE chunk with a choice. Overhead = HTTP - direct, medians.
  3. Load: `--concurrency` closed-loop clients, each streaming completions of `--max-tokens`
     (greedy, ignore_eos) back to back for `--duration` seconds (no new request after that; the
     ones in flight finish). An error is a non-200, an error event, a transport failure, or a
     completion whose usage is not exactly `--max-tokens` tokens. Afterwards `GET /health` must
     show no running/waiting requests and every KV block free, within `--drain-timeout` s.

Exit status 1 if there was any error or the KV pool did not come back to full.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: bench_serve reuses this module where httpx is absent
    import httpx


@dataclass
class LoadResult:
    concurrency: int
    duration_s: float  # wall time from the first request to the last one finishing
    num_requests: int = 0
    num_errors: int = 0
    num_output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)  # per request, to the first text chunk
    tpot_s: list[float] = field(default_factory=list)  # per request, after the first chunk
    first_errors: list[str] = field(default_factory=list)  # up to 5, for the report

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.duration_s if self.duration_s else 0.0

    def record_error(self, message: str) -> None:
        self.num_errors += 1
        if len(self.first_errors) < 5:
            self.first_errors.append(message)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))  # the smallest rank covering q percent
    return ordered[rank - 1]


def make_prompts(vocab_size: int, num_prompts: int, prompt_len: int, seed: int = 0):
    """Random token-id prompts (ids 3.. to stay clear of special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)]


# --- HTTP ------------------------------------------------------------------------------------


# The temperature of every benchmark request (0: greedy). An environment variable, so that
# client processes started by spawn see what the benchmark's command line said.
TEMPERATURE_ENV = "MTPSERVE_BENCH_TEMPERATURE"


def bench_temperature() -> float:
    return float(os.environ.get(TEMPERATURE_ENV, "0"))


def completion_body(model: str, prompt: list[int], max_tokens: int, stream: bool) -> dict:
    """A /v1/completions body of exactly `max_tokens` tokens (EOS ignored), greedy unless
    `bench_temperature()` says otherwise, streamed with its usage last, or not."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": bench_temperature(),
        "ignore_eos": True,
    }
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def stream_completion(
    http: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, float, int, str]:
    """One streamed greedy completion. Returns (ttft_s, total_s, completion_tokens, text);
    raises on any failure."""
    body = completion_body(model, prompt, max_tokens, stream=True)
    sent = time.perf_counter()
    ttft_s = None
    usage = None
    text = []
    async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"error event: {chunk['error']}")
            if chunk.get("choices"):
                if ttft_s is None:
                    ttft_s = time.perf_counter() - sent
                text.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                usage = chunk["usage"]
    total_s = time.perf_counter() - sent
    if ttft_s is None or usage is None:
        raise RuntimeError("stream ended without a choice or without usage")
    return ttft_s, total_s, usage["completion_tokens"], "".join(text)


async def http_ttft(url: str, model: str, prompts: list[list[int]]) -> list[float]:
    """Sequential max_tokens=1 requests on an idle server; one warm-up request first."""
    import httpx

    async with httpx.AsyncClient(timeout=120) as http:
        await stream_completion(http, url, model, prompts[0], 1)
        return [(await stream_completion(http, url, model, p, 1))[0] for p in prompts]


async def run_load(
    url: str,
    model: str,
    prompts: list[list[int]],
    concurrency: int,
    duration_s: float,
    max_tokens: int,
    outputs: dict[int, set[str]] | None = None,
) -> LoadResult:
    """`concurrency` closed-loop clients for `duration_s`. `outputs`, if given, collects each
    prompt index's completion texts (greedy: one text per prompt is expected)."""
    import httpx

    result = LoadResult(concurrency=concurrency, duration_s=0.0)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    started = time.perf_counter()
    deadline = started + duration_s

    async def client(client_index: int, http: httpx.AsyncClient) -> None:
        request_index = client_index
        while time.perf_counter() < deadline:
            prompt_index = request_index % len(prompts)
            request_index += concurrency
            result.num_requests += 1
            try:
                ttft_s, total_s, num_tokens, text = await stream_completion(
                    http, url, model, prompts[prompt_index], max_tokens
                )
            except Exception as exc:  # noqa: BLE001 - every failure is counted
                result.record_error(f"{type(exc).__name__}: {exc}")
                continue
            if num_tokens != max_tokens:
                result.record_error(f"{num_tokens} tokens, expected {max_tokens}")
                continue
            result.num_output_tokens += num_tokens
            result.ttft_s.append(ttft_s)
            if num_tokens > 1:
                result.tpot_s.append((total_s - ttft_s) / (num_tokens - 1))
            if outputs is not None:
                outputs.setdefault(prompt_index, set()).add(text)

    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30), limits=limits) as http:
        await asyncio.gather(*(client(i, http) for i in range(concurrency)))
    result.duration_s = time.perf_counter() - started
    return result


async def wait_for_idle_full_kv(url: str, timeout_s: float) -> dict:
    """Polls `GET /health` until no request runs or waits and every KV block is free; returns
    the last engine stats (the caller checks them: on timeout they show what was left)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=30) as http:
        while True:
            engine = (await http.get(f"{url}/health")).json()["engine"]
            idle = engine["num_running"] == 0 and engine["num_waiting"] == 0
            if idle and engine["num_free_blocks"] == engine["num_total_blocks"]:
                return engine
            if time.monotonic() > deadline:
                return engine
            await asyncio.sleep(0.2)


# --- direct engine ---------------------------------------------------------------------------


async def engine_ttft(engine_config: dict, prompts: list[list[int]]) -> list[float]:
    """Sequential max_tokens=1 requests on an in-process AsyncEngine; one warm-up first."""
    from cluster.async_engine import AsyncEngine
    from cluster.config import EngineConfig
    from cluster.sampling_params import SamplingParams

    engine = AsyncEngine(EngineConfig.from_dict(engine_config))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def one(prompt: list[int]) -> float:
        started = time.perf_counter()
        ttft_s = None
        async for out in engine.generate(prompt, params):
            if ttft_s is None and out.new_token_ids:
                ttft_s = time.perf_counter() - started
        assert ttft_s is not None
        return ttft_s

    try:
        await one(prompts[0])
        return [await one(p) for p in prompts]
    finally:
        await engine.shutdown()


def model_vocab_size(model_dir: str) -> int:
    from workers.loader import load_config

    return load_config(model_dir).vocab_size


def _free_port() -> int:
    from deploy.local_server import spare_ports

    return spare_ports()[0]


# --- the command -----------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def markdown_table(report: dict) -> str:
    load = report["load"]
    kv_after = report["kv_after"]
    streams = (
        f"{load['concurrency']} streams x {report['duration_s']:.0f} s "
        f"(wall {load['duration_s']:.1f} s)"
    )
    rows = [
        ("model", report["model"]),
        ("concurrency x duration", streams),
        ("prompt / output tokens per request", f"{report['prompt_len']} / {report['max_tokens']}"),
        ("requests completed", str(load["num_requests"] - load["num_errors"])),
        ("errors", str(load["num_errors"])),
        ("output tokens/s (all streams)", f"{report['output_tokens_per_s']:.1f}"),
        (
            "TTFT under load p50 / p90 / p99 (ms)",
            " / ".join(_ms(report["load_ttft_s"][k]) for k in ("p50", "p90", "p99")),
        ),
        ("time per output token under load p50 (ms)", _ms(report["load_tpot_p50_s"])),
        (
            "KV blocks free after the load",
            f"{kv_after['num_free_blocks']} / {kv_after['num_total_blocks']}",
        ),
        ("idle TTFT, direct AsyncEngine, median (ms)", _ms(report["engine_ttft_p50_s"])),
        ("idle TTFT, HTTP streaming, median (ms)", _ms(report["http_ttft_p50_s"])),
        ("HTTP path TTFT overhead, median (ms)", _ms(report["ttft_overhead_s"])),
    ]
    lines = ["| metric | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the default model)")
    ap.add_argument(
        "--url",
        default=None,
        help="an mtpserve server already serving --model (default: start one here)",
    )
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--ttft-samples", type=int, default=20)
    ap.add_argument("--drain-timeout", type=float, default=60.0)
    ap.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    ap.add_argument(
        "--port", type=int, default=0, help="HTTP port of the server started here (0: a free one)"
    )
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--markdown", default=None, help="write the table here")
    args = ap.parse_args(argv)

    from workers.default_model import default_model_path

    model = args.model or default_model_path()
    vocab_size = model_vocab_size(model)
    prompts = make_prompts(vocab_size, args.ttft_samples, args.prompt_len)
    # Same engine settings for the direct and the served engine; room for every stream at once.
    engine = {
        "max_num_seqs": max(args.concurrency, 1),
        "max_queued_requests": max(256, args.concurrency),
    }

    engine_ttfts = asyncio.run(
        engine_ttft({"model": model, "device": args.device, **engine}, prompts)
    )

    import httpx

    started_here = args.url is None
    if started_here:
        from deploy.app import AppArgs
        from deploy.local_server import deploy, shutdown, start_local_ray

        start_local_ray("local")
        port = args.port or _free_port()
        url = deploy(
            AppArgs(
                model=model,
                device=args.device,
                engine=engine,
                actor_num_cpus=0.25,
                replica_num_cpus=0.25,
                ingress_num_cpus=0.25,
            ),
            "127.0.0.1",
            port,
        )
    else:
        url = args.url.rstrip("/").removesuffix("/v1")
    try:
        served_model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        http_ttfts = asyncio.run(http_ttft(url, served_model, prompts))
        load_prompts = make_prompts(vocab_size, 64, args.prompt_len, seed=1)
        load = asyncio.run(
            run_load(
                url, served_model, load_prompts, args.concurrency, args.duration, args.max_tokens
            )
        )
        kv_after = asyncio.run(wait_for_idle_full_kv(url, args.drain_timeout))
    finally:
        if started_here:
            shutdown()

    report = {
        "model": model,
        "device": args.device,
        "duration_s": args.duration,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "load": {k: v for k, v in asdict(load).items() if k not in ("ttft_s", "tpot_s")},
        "output_tokens_per_s": load.output_tokens_per_s,
        "load_ttft_s": {f"p{q}": percentile(load.ttft_s, q) for q in (50, 90, 99)},
        "load_tpot_p50_s": percentile(load.tpot_s, 50),
        "kv_after": kv_after,
        "engine_ttft_p50_s": statistics.median(engine_ttfts),
        "http_ttft_p50_s": statistics.median(http_ttfts),
        "ttft_overhead_s": statistics.median(http_ttfts) - statistics.median(engine_ttfts),
        "engine_ttft_s": engine_ttfts,
        "http_ttft_s": http_ttfts,
    }
    table = markdown_table(report)
    print(table)
    if load.first_errors:
        print("first errors:", *load.first_errors, sep="\n  ", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    kv_full = kv_after["num_free_blocks"] == kv_after["num_total_blocks"]
    idle = kv_after["num_running"] == 0 and kv_after["num_waiting"] == 0
    return 0 if load.num_errors == 0 and kv_full and idle else 1


if __name__ == "__main__":
    sys.exit(main())
