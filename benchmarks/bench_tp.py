"""Tensor parallelism: step latency and tokens/s at TP=1 vs TP=2 (and TP=2/EP=2), and top-k
broadcast from TP rank 0 vs running the indexer on every rank. Greedy, MTP on.

    python benchmarks/bench_tp.py --model DIR [--device cuda] [--num-prompts 8] [--max-tokens 64]
    python benchmarks/bench_tp.py --device cpu --num-prompts 2 --max-tokens 8   # CPU smoke check

Prints one table row per layout: median decode-step latency (ms), tokens/s over the whole run,
and whether the tokens equal TP=1's. Then the bare broadcast of an int32 [T, index_topk] top-k
tensor inside the TP group (NCCL on GPU, gloo on CPU), which is what the broadcast adds per
indexer layer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from cluster.config import EngineConfig
from cluster.engine import LLMEngine
from cluster.sampling_params import SamplingParams
from workers.default_model import tiny_model_path

# tp, ep, topk_broadcast, label
LAYOUTS = [
    (1, 1, None, "TP=1"),
    (2, 1, True, "TP=2, top-k broadcast"),
    (2, 1, False, "TP=2, indexer on every rank"),
    (2, 2, True, "TP=2 EP=2, top-k broadcast"),
    (2, 2, False, "TP=2 EP=2, indexer on every rank"),
]


def run_layout(config: EngineConfig, prompts, params) -> tuple[list[list[int]], float, float]:
    """-> (tokens per prompt, median decode-step ms, tokens/s)."""
    engine = LLMEngine(config)
    try:
        for p in prompts[:2]:  # warm-up: first-call allocations, kernel compiles
            engine.add_request(p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished:
            engine.step()
        ids = [engine.add_request(p, params) for p in prompts]
        final, decode_ms = {}, []
        start = time.perf_counter()
        while engine.has_unfinished:
            prefilling = engine.scheduler.num_waiting > 0
            t0 = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            if not prefilling:
                decode_ms.append((time.perf_counter() - t0) * 1e3)
        elapsed = time.perf_counter() - start
        tokens = [final[i].token_ids for i in ids]
        median = statistics.median(decode_ms) if decode_ms else float("nan")
        return tokens, median, sum(map(len, tokens)) / elapsed
    finally:
        engine.shutdown()


def _time_broadcast(actor, shapes: list[tuple[int, int]], iters: int) -> list[float]:
    """Inside a rank: microseconds per tp_broadcast of an int32 top-k tensor of each shape."""
    import torch

    from parallel.collectives import tp_broadcast

    device = actor.device
    out = []
    for shape in shapes:
        x = torch.zeros(shape, dtype=torch.int32, device=device)
        for _ in range(5):
            tp_broadcast(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            tp_broadcast(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / iters * 1e6)
    return out


def bench_broadcast(config: EngineConfig, index_topk: int, iters: int) -> None:
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engine = LLMEngine(config)
    try:
        shapes = [(t, index_topk) for t in (1, 32, 128)]
        per_rank = ray.get(
            [w.run.remote(_time_broadcast, shapes, iters) for w in engine.executor.workers]
        )
        print(f"\ntop-k broadcast inside the TP group ({iters} iterations, eager, rank 0's time):")
        print(f"{'tokens':>7} {'shape':>14} {'us':>9}")
        for shape, us in zip(shapes, per_rank[0]):
            print(f"{shape[0]:>7} {str(list(shape)):>14} {us:>9.1f}")
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tiny checkpoint)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-draft-tokens", type=int, default=2)
    ap.add_argument("--share-topk", action="store_true")
    ap.add_argument(
        "--actor-num-cpus",
        type=float,
        default=None,
        help="CPU request per rank (default: 1 on GPU, 0.5 on CPU)",
    )
    ap.add_argument("--broadcast-iters", type=int, default=200)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    args = ap.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    model = args.model or tiny_model_path()
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    actor_cpus = args.actor_num_cpus or (1.0 if on_gpu else 0.5)
    base = EngineConfig(
        model=model,
        device=args.device,
        dtype=args.dtype,
        num_draft_tokens=args.num_draft_tokens,
        share_topk=args.share_topk,
        actor_num_cpus=actor_cpus,
        step_timeout_s=600,
        enforce_eager=args.enforce_eager,
    )
    from workers.loader import load_config

    model_config = load_config(model)
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, model_config.vocab_size, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    print(
        f"model={model} device={'cuda' if on_gpu else 'cpu'} prompts={args.num_prompts}x"
        f"{args.prompt_len} max_tokens={args.max_tokens} k={args.num_draft_tokens} "
        f"share_topk={args.share_topk} index_topk={model_config.index_topk} "
        f"cuda_graphs={on_gpu and not args.enforce_eager}"
    )
    print(f"{'layout':<34} {'decode step ms':>15} {'tok/s':>9} {'same as TP=1':>13}")
    reference = None
    for tp, ep, broadcast, label in LAYOUTS:
        config = base.replace(tp_size=tp, ep_size=ep, topk_broadcast=broadcast)
        tokens, step_ms, tok_s = run_layout(config, prompts, params)
        reference = reference or tokens
        print(f"{label:<34} {step_ms:>15.2f} {tok_s:>9.1f} {str(tokens == reference):>13}")
    bench_broadcast(base.replace(tp_size=2), model_config.index_topk, args.broadcast_iters)


if __name__ == "__main__":
    main()
