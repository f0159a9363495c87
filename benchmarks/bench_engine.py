"""Engine tokens/s with MTP off (steps overlapping or not: `EngineConfig.overlap_steps`) and on
(k = 1..3, top-k sharing off/on), greedy or sampled.

    python benchmarks/bench_engine.py [--model DIR] [--device cpu|cuda] [--num-prompts 16]
        [--temperature T [--top-p P]] [--no-mtp]

Prints a table; "same": the tokens equal the first row's (sampled requests are seeded, so
overlap keeps them; MTP keeps their distribution, not their tokens). On the tiny random
checkpoint the MTP layer is untrained, so acceptance is ~0 and MTP only costs time; the numbers
are for the record (the trained default model is the one whose acceptance means something).
"""

from __future__ import annotations

import argparse
import time

import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from workers.default_model import default_model_path, tiny_model_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tiny checkpoint)")
    ap.add_argument("--default-model", action="store_true", help="use the shipped default model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: seeded sampling")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--no-mtp", action="store_true", help="only the rows of MTP off")
    args = ap.parse_args()
    model = args.model or (default_model_path() if args.default_model else tiny_model_path())

    llm0 = LLM(model, device=args.device, num_draft_tokens=0, overlap_steps="off")
    vocab = llm0.engine.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
        for _ in range(args.num_prompts)
    ]
    sampled = dict(temperature=args.temperature, top_p=args.top_p, seed=0)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        ignore_eos=True,
        **(sampled if args.temperature > 0 else dict(temperature=0.0)),
    )
    print(
        f"model={model} device={args.device} prompts={args.num_prompts}x{args.prompt_len} "
        f"max_tokens={args.max_tokens} temperature={args.temperature} top_p={args.top_p}"
    )
    print(
        f"{'k':>2} {'share':>5} {'overlap':>7} {'tok/s':>9} {'tokens/round':>13} "
        f"{'acceptance':>22} {'same':>5}"
    )
    reference = None
    runs = [(0, False, "off"), (0, False, "on")]
    if not args.no_mtp:
        runs += [(1, False, "-"), (2, False, "-"), (3, False, "-"), (3, True, "-")]
    for k, share, overlap in runs:
        if k == 0 and overlap == "off":
            llm = llm0
        elif k == 0:
            llm = LLM(model, device=args.device, num_draft_tokens=0, overlap_steps=overlap)
        else:
            llm = LLM(model, device=args.device, num_draft_tokens=k, share_topk=share)
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        tokens = [o.token_ids for o in outs]
        reference = reference or tokens
        stats = llm.stats()
        acc = ",".join(f"{a:.2f}" for a in stats.acceptance_per_position) or "-"
        print(
            f"{k:>2} {str(share):>5} {overlap:>7} {sum(map(len, tokens)) / elapsed:>9.1f} "
            f"{stats.mean_tokens_per_round:>13.2f} {acc:>22} {str(tokens == reference):>5}"
        )


if __name__ == "__main__":
    main()
