"""The offline engine's tokens/s on sampling requests, with the sampler's CUDA graphs and without.

    python benchmarks/bench_sampler_graphs.py [--model DIR] [--concurrency 1,8,32,128]
        [--temperature 1.0] [--top-p 1.0] [--num-draft-tokens K] [--passes 3]
    python benchmarks/bench_sampler_graphs.py --device-time [--vocab 129280]

`--device-time`: no engine; the device time of one sampler graph replay per row bucket, without
and with truncation (the sort), at a vocabulary's width (DeepSeek-V3.2's by default), against
the time to read the rows' logits and noise once from HBM.

One engine, warmed once; at each concurrency c, c requests of `--max-tokens` tokens (EOS ignored)
decode together, with the runner's `sampler_graphs` on and off alternated `--passes` times, so
both sides share the process, the warm-up and the host's drift. Prints tok/s and the engine's
mean step per side and pass, and each side's median. CUDA only (no graphs elsewhere).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from workers.default_model import tiny_model_path


def device_time(vocab: int) -> None:
    from workers.cuda_graph import DecodeGraphs, SamplerGraphs
    from workers.model_runner import SAMPLER_GRAPH_MAX_ROWS

    device = torch.device("cuda")
    sampler = SamplerGraphs(DecodeGraphs(None, 1, 1, device), vocab, SAMPLER_GRAPH_MAX_ROWS)
    bandwidth = 4.27e12  # H200 HBM3e, bytes/s
    print(f"vocabulary {vocab}: one replay, us (median of 20); read = logits + noise at HBM speed")
    print("| rows | temperature only | top-k / top-p (sort) | read |")
    print("|---|---|---|---|")
    for size in sampler.buckets:
        settings, noise = sampler.inputs(size)
        sampler.logits(size).normal_()
        noise.exponential_()
        settings[2].fill_(0.9)  # top-p on every row
        cells = []
        for truncates in (False, True):
            sampler.replay(size, truncates)
            times = []
            for _ in range(20):
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                start.record()
                sampler.replay(size, truncates)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            cells.append(f"{statistics.median(times):.1f}")
        read = size * (2 * vocab + 1) * 4 / bandwidth * 1e6
        print(f"| {size} | " + " | ".join(cells) + f" | {read:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device-time", action="store_true", help="sampler replays alone")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tiny checkpoint)")
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--num-draft-tokens", type=int, default=0)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    if args.device_time:
        device_time(args.vocab)
        return
    levels = [int(c) for c in args.concurrency.split(",")]
    llm = LLM(
        args.model or tiny_model_path(),
        device="cuda",
        num_draft_tokens=args.num_draft_tokens,
        max_num_seqs=max(levels),
    )
    runner = llm.engine.executor.worker.runner
    graphs = runner.sampler_graphs
    assert graphs is not None, "no sampler graphs: CUDA graphs are off"
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, llm.engine.vocab_size, (args.prompt_len,), generator=g).tolist()
        for _ in range(max(levels))
    ]
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        ignore_eos=True,
    )
    print(
        f"temperature {args.temperature}, top-p {args.top_p}, k {args.num_draft_tokens}, "
        f"{args.max_tokens} tokens per request; tok/s (mean step ms)"
    )
    print("| concurrency | side | " + " | ".join(f"pass {p + 1}" for p in range(args.passes)))
    print("|---|---|" + "---|" * args.passes + " median tok/s |")
    for c in levels:
        results: dict[str, list[tuple[float, float]]] = {"graphs": [], "eager": []}
        llm.generate(prompts[:c], params)  # this level's shapes once before timing
        for _ in range(args.passes):
            for side in results:
                runner.sampler_graphs = graphs if side == "graphs" else None
                steps_before = llm.engine.stats().num_steps
                start = time.perf_counter()
                outs = llm.generate(prompts[:c], params)
                wall = time.perf_counter() - start
                steps = llm.engine.stats().num_steps - steps_before
                tokens = sum(len(o.token_ids) for o in outs)
                results[side].append((tokens / wall, wall / max(steps, 1) * 1e3))
        runner.sampler_graphs = graphs
        for side, runs in results.items():
            cells = " | ".join(f"{t:,.0f} ({ms:.2f})" for t, ms in runs)
            median = statistics.median(t for t, _ in runs)
            print(f"| {c} | {side} | {cells} | {median:,.0f} |")


if __name__ == "__main__":
    main()
