"""Where greedy texts part: with MTP against without, and batched against one request at a time.

    python benchmarks/greedy_agreement.py [--model DIR | --default-model] [--num-draft-tokens 3]
        [--num-prompts 64] [--prompt-len 32] [--max-tokens 128] [--device auto] [--dtype auto]

Three offline greedy runs of the same token-id prompts (EOS ignored), one engine each:
  plain     MTP off, every prompt submitted at once (the engine batches them);
  mtp       MTP with `--num-draft-tokens`, every prompt at once;
  alone     MTP off, one prompt at a time (batch 1 every step).
Prints, per pair, how many prompts got identical tokens and, for those that did not, the
median position of the first difference. `mtp` against `plain` is the lossless check (same
batching); `alone` against `plain` shows what batch composition alone does to greedy text on
this device and dtype (kernels pick tiles and split-K by row count, so a sum's order, and its
last bits, can follow the batch: exact on CPU fp32, not promised in bf16 on a GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.load_test import make_prompts, model_vocab_size


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(name: str, a: list[list[int]], b: list[list[int]]) -> str:
    firsts = [d for d in (first_difference(x, y) for x, y in zip(a, b)) if d is not None]
    same = len(a) - len(firsts)
    where = ""
    if firsts:
        where = f", first difference at token {statistics.median(firsts):.0f} (median)"
    return f"{name}: {same} of {len(a)} prompts identical{where}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--default-model", action="store_true")
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()

    from cluster.llm import LLM
    from cluster.sampling_params import SamplingParams
    from workers.default_model import default_model_path, tiny_model_path

    model = args.model or (default_model_path() if args.default_model else tiny_model_path())
    prompts = make_prompts(model_vocab_size(model), args.num_prompts, args.prompt_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    options = dict(device=args.device, dtype=args.dtype, max_num_seqs=max(8, args.num_prompts))

    def run(num_draft_tokens: int, one_at_a_time: bool) -> list[list[int]]:
        llm = LLM(model, num_draft_tokens=num_draft_tokens, **options)
        try:
            if one_at_a_time:
                return [llm.generate([p], params)[0].token_ids for p in prompts]
            return [out.token_ids for out in llm.generate(prompts, params)]
        finally:
            llm.engine.shutdown()

    plain = run(0, False)
    mtp = run(args.num_draft_tokens, False)
    alone = run(0, True)
    print(f"greedy_agreement: {model}, {args.num_prompts} prompts x {args.max_tokens} tokens")
    print(compare(f"mtp k={args.num_draft_tokens} vs plain (both batched)", mtp, plain))
    print(compare("plain one at a time vs plain batched", alone, plain))
    return 0


if __name__ == "__main__":
    sys.exit(main())
