"""The cyclic garbage collector in a serving process, with and without the long-lived objects
frozen (`workers.long_lived`: what the engine process and each rank's actor do after warm-up,
and `LLM.generate` for the length of its call).

    python benchmarks/bench_gc.py [--model DIR] [--device cpu|cuda] [--passes 4]
        [--num-prompts 256] [--max-tokens 32] [--max-num-seqs 16] [--executor MODULE:CLASS]

Builds one offline engine, then: the objects the collector tracks and what one full collection
of them costs; then passes of generation, alternately with the objects alive before the pass
scanned (`LLM.generate`'s steps without its freeze) and frozen (`frozen_for_the_call`, what
`LLM.generate` does), each with the collections that came during it (generation 2: a full one),
its wall time and tokens/s. Prints tables.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from workers.default_model import default_model_path, tiny_model_path


class Collections:
    """The collector's runs while installed: (generation, seconds) each."""

    def __init__(self):
        self.runs: list[tuple[int, float]] = []
        self._started_s = 0.0

    def __enter__(self):
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started_s = time.perf_counter()
        else:
            self.runs.append((info["generation"], time.perf_counter() - self._started_s))

    def of(self, generation: int) -> tuple[int, float, float]:
        """(count, total ms, longest ms) of one generation's runs."""
        times = [s * 1e3 for g, s in self.runs if g == generation]
        return len(times), sum(times), max(times, default=0.0)


def generate_scanned(llm: LLM, prompts, params) -> int:
    """`LLM.generate`'s steps without its freeze: -> the output tokens."""
    for prompt in prompts:
        llm.engine.add_request(prompt, params)
    tokens = 0
    while llm.engine.has_unfinished:
        for out in llm.engine.step(lambda request: request.is_finished):
            tokens += len(out.token_ids) if out.finished else 0
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tiny checkpoint)")
    ap.add_argument("--default-model", action="store_true", help="use the shipped default model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--passes", type=int, default=4, help="unfrozen and frozen in turn")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument(
        "--executor",
        default=None,
        help="the engine's executor, e.g. benchmarks.null_executor:NullExecutor (no model)",
    )
    args = ap.parse_args()
    model = args.model or (default_model_path() if args.default_model else tiny_model_path())
    options = {"executor": args.executor} if args.executor else {}
    llm = LLM(
        model,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_queued_requests=max(256, args.num_prompts),
        **options,
    )
    rng = random.Random(0)
    vocab = llm.engine.vocab_size
    prompts = [
        [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[: args.max_num_seqs], params)  # warm-up
    gc.collect()
    tracked = len(gc.get_objects())
    full_ms = []
    for frozen in (False, True):
        if frozen:
            gc.freeze()
        started_s = time.perf_counter()
        gc.collect()
        full_ms.append((time.perf_counter() - started_s) * 1e3)
    gc.unfreeze()
    print(
        f"model={model} device={args.device} prompts={args.num_prompts}x{args.prompt_len} "
        f"max_tokens={args.max_tokens} max_num_seqs={args.max_num_seqs} "
        f"executor={args.executor or 'default'}"
    )
    print(
        f"objects tracked after warm-up: {tracked:,}; one full collection: "
        f"{full_ms[0]:.1f} ms, {full_ms[1]:.2f} ms with them frozen"
    )
    print(
        "| pass | long-lived objects | wall s | tok/s | full collections (count, total ms, "
        "longest ms) | younger collections |"
    )
    print("|---|---|---|---|---|---|")
    for i in range(args.passes):
        frozen = i % 2 == 1
        with Collections() as runs:
            started_s = time.perf_counter()
            if frozen:
                outs = llm.generate(prompts, params)  # frozen for the call
                tokens = sum(len(o.token_ids) for o in outs)
            else:
                tokens = generate_scanned(llm, prompts, params)
            wall_s = time.perf_counter() - started_s
        count, total_ms, longest_ms = runs.of(2)
        younger = runs.of(0)[0] + runs.of(1)[0]
        print(
            f"| {i + 1} | {'frozen' if frozen else 'scanned'} | {wall_s:.2f} | "
            f"{tokens / wall_s:.0f} | {count}, {total_ms:.1f}, {longest_ms:.1f} | {younger} |"
        )


if __name__ == "__main__":
    main()
