"""The engine's prefill: prompts of one length, one output token each (so the time is the prompt
steps'), with the dense attention of prompt steps before index_topk (MTPSERVE_DENSE_PROMPTS) on
and off, alternated in one process; and whether the two gave the same tokens.

    python benchmarks/bench_prefill.py [--model DIR | --default-model] [--device cpu|cuda]
        [--prompt-lens 32,120] [--num-prompts 8] [--repeat 3]

Prints a table: prefill tokens/s (the best of `--repeat` rounds, each of new prompts: none is
served from the prefix cache), dense over sparse.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from kernels.settings import reload_settings
from workers.default_model import default_model_path, tiny_model_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tiny checkpoint)")
    ap.add_argument("--default-model", action="store_true", help="use the shipped default model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompt-lens", default="32,120")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    model = args.model or (default_model_path() if args.default_model else tiny_model_path())
    engines = {}
    for mode in ("on", "off"):
        os.environ["MTPSERVE_DENSE_PROMPTS"] = mode
        reload_settings()
        engines[mode] = LLM(model, device=args.device, num_draft_tokens=0)
    os.environ.pop("MTPSERVE_DENSE_PROMPTS")
    reload_settings()
    runner = engines["on"].engine.executor.worker.runner
    topk = runner.model.config.index_topk
    print(f"model {model}, device {runner.device}, index_topk {topk}, {args.num_prompts} prompts")
    print("\n| prompt tokens | dense tok/s | sparse tok/s | dense / sparse | same tokens |")
    print("|---|---|---|---|---|")
    vocab = engines["on"].engine.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for length in (int(n) for n in args.prompt_lens.split(",")):
        g = torch.Generator().manual_seed(length)
        best, tokens = {}, {}
        for _ in range(args.repeat):
            # New prompts each round (the same for both engines): a prompt seen before would
            # be served from the prefix cache.
            prompts = [
                torch.randint(3, vocab, (length,), generator=g).tolist()
                for _ in range(args.num_prompts)
            ]
            for mode, llm in engines.items():
                start = time.perf_counter()
                outs = llm.generate(prompts, params)
                seconds = time.perf_counter() - start
                best[mode] = min(best.get(mode, seconds), seconds)
                tokens.setdefault(mode, []).extend(o.token_ids for o in outs)
        rates = {mode: length * args.num_prompts / s for mode, s in best.items()}
        note = "" if length <= topk else f" (dense: the first {topk} of each)"
        print(
            f"| {length}{note} | {rates['on']:.0f} | {rates['off']:.0f} | "
            f"{rates['on'] / rates['off']:.2f}x | {tokens['on'] == tokens['off']} |"
        )


if __name__ == "__main__":
    main()
