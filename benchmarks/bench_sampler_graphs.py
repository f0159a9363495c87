"""The offline engine's tokens/s on sampling requests, with the sampler's CUDA graphs and without.

    python benchmarks/bench_sampler_graphs.py [--model DIR] [--concurrency 1,8,32,128]
        [--temperature 1.0] [--top-p 1.0] [--num-draft-tokens K] [--passes 3]
    python benchmarks/bench_sampler_graphs.py --device-time [--vocab 129280] [--device cpu]
        [--max-rows N] [--logits peaked|normal]

`--device-time`: no engine; the time of the sampler alone per row bucket (one graph replay on
CUDA, the eager function on CPU), without truncation, with top-p by the sort of whole rows and
among candidates (with the share of rows that fit among them), at a vocabulary's width
(DeepSeek-V3.2's by default), against the time to read the rows' logits and noise once from
HBM.

One engine, warmed once; at each concurrency c, c requests of `--max-tokens` tokens (EOS ignored)
decode together, with the runner's `sampler_graphs` on and off alternated `--passes` times, so
both sides share the process, the warm-up and the host's drift. Prints tok/s and the engine's
mean step per side and pass, and each side's median. CUDA only (no graphs elsewhere).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from workers.default_model import tiny_model_path


def _peaked_logits(rows: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Probability ~ 1 / rank^2 over a random order of the vocabulary per row (a confident next
    token: the top 10 hold ~94%); `--logits normal` takes N(0, 1) logits instead, a flat row
    whose top-p nucleus is most of the vocabulary (random weights' rows)."""
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32, device=device)
    order = torch.rand(rows, vocab, device=device).argsort(-1)
    return (-2.0 * ranks.log())[order]


def _time(fn, device: torch.device, repeats: int) -> float:
    """Median wall (CPU) or device (CUDA events) time of fn, us."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times)


def device_time(vocab: int, device: torch.device, max_rows: int, logits_kind: str) -> None:
    """Per row bucket: the sampler's time with no truncation, with top-p 0.9 by the sort of
    whole rows, and among `CANDIDATES` candidates (`workers.sampler.candidate_probs`), with the
    share of rows exact among them (the rest would be redone with the sort: not included). On
    CUDA one graph replay each (`SamplerGraphs`), on CPU the eager function."""
    from workers.cuda_graph import DecodeGraphs, SamplerGraphs
    from workers.sampler import CANDIDATES, sample_rows

    cuda = device.type == "cuda"
    repeats = 20 if cuda else 5
    decode = DecodeGraphs(None, 1, 1, device)
    sorting = SamplerGraphs(decode, vocab, max_rows, candidates=0) if cuda else None
    among = SamplerGraphs(decode, vocab, max_rows, candidates=CANDIDATES) if cuda else None
    bandwidth = 4.27e12  # H200 HBM3e, bytes/s
    what = "one graph replay" if cuda else "the eager function"
    print(
        f"vocabulary {vocab}, {logits_kind} logits, {device.type}: {what}, us (median of "
        f"{repeats}); read = logits + noise at the H200's HBM speed"
    )
    print(f"| rows | temperature only | top-p 0.9: sort | among {CANDIDATES} | exact | read |")
    print("|---|---|---|---|---|---|")
    buckets = [b for b in (1 << i for i in range(16)) if b < max_rows] + [max_rows]
    for size in buckets:
        if logits_kind == "peaked":
            logits = _peaked_logits(size, vocab, device)
        else:
            logits = torch.randn(size, vocab, device=device)
        noise = torch.empty(size, vocab + 1, device=device).exponential_()
        settings = torch.tensor([[1.0], [vocab - 1], [0.9], [-1]], dtype=torch.float64)
        settings = settings.repeat(1, size).to(device)
        cells = []
        for truncates, candidates in ((False, None), (True, None), (True, CANDIDATES)):
            if cuda:
                graphs = among if candidates else sorting
                graphs.logits(size).copy_(logits)
                graphs.inputs(size)[0].copy_(settings)
                graphs.inputs(size)[1].copy_(noise)
                run = functools.partial(graphs.replay, size, truncates)
            else:
                run = functools.partial(sample_rows, logits, settings, noise, truncates, candidates)
            cells.append(_time(run, device, repeats))
            out = run()
        exact = out[2].float().mean().item()
        read = size * (2 * vocab + 1) * 4 / bandwidth * 1e6
        print(
            f"| {size} | {cells[0]:.1f} | {cells[1]:.1f} | {cells[2]:.1f} | {exact:.2f} "
            f"| {read:.1f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device-time", action="store_true", help="sampler replays alone")
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="--device-time's")
    ap.add_argument("--max-rows", type=int, default=None, help="--device-time's largest bucket")
    ap.add_argument("--logits", default="peaked", choices=["peaked", "normal"])
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
        from workers.model_runner import SAMPLER_GRAPH_MAX_ROWS

        default_rows = SAMPLER_GRAPH_MAX_ROWS if args.device == "cuda" else 64
        device = torch.device(args.device)
        device_time(args.vocab, device, args.max_rows or default_rows, args.logits)
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
