"""What a new request's prefill costs the requests already decoding: one engine step of B
decoding requests alone, against the same step when one request arrives before it.

    python benchmarks/bench_mixed_step.py [--model DIR | --default-model] [--device auto]
        [--batches 1,8,32,128] [--prompt-len 32] [--steps 30] [--num-draft-tokens 0]

A decode step of same-length sequences replays a CUDA graph (with MTP: the verify and the
proposal). A step that also carries a prefill replays the one-token decode graph with every
token as a row when they fit its largest row bucket (`ModelRunner._graph_key`; with MTP the
proposal after it replays a rows graph too), and otherwise runs the whole batch eagerly: under a
steady stream of arrivals (what a server sees) that is most steps. Per batch size B: the median
`LLMEngine.step()` time of decode-only steps, of steps carrying one arriving request's prefill of
`--prompt-len` tokens (as the engine runs them, and with the rows graphs switched off:
`ModelRunner.prefill_in_graphs`, the whole step eager), their ratios to the decode step, and the
prefill's own step time alone (one request, nothing decoding). Greedy, ignore_eos.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from cluster.config import EngineConfig
from cluster.engine import LLMEngine
from cluster.sampling_params import SamplingParams
from workers.default_model import default_model_path, tiny_model_path


def _sync(device: str) -> None:
    if device != "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_step(engine: LLMEngine, device: str) -> float:
    _sync(device)
    started = time.perf_counter()
    engine.step()
    _sync(device)
    return time.perf_counter() - started


def measure(engine: LLMEngine, prompts, batch: int, steps: int, device: str) -> dict:
    """Median step seconds: decode only, with one arrival, and the arrival's prefill alone."""
    long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    tag = f"b{batch}"
    for i in range(batch):
        engine.add_request(prompts[i % len(prompts)], long, f"{tag}-{i}")
    while any(r.is_prefilling for r in engine.scheduler.running) or engine.scheduler.num_waiting:
        engine.step()
    for _ in range(3):  # warm
        engine.step()
    decode = [timed_step(engine, device) for _ in range(steps)]
    runner = getattr(getattr(engine.executor, "worker", None), "runner", None)
    mixed, mixed_eager = [], []
    for j in range(2 * steps):
        # One token: the arrival finishes within the step it prefills, so the batch stays B.
        if runner is not None:
            runner.prefill_in_graphs = j % 2 == 0
        engine.add_request(prompts[j % len(prompts)], one, f"{tag}-arrival-{j}")
        (mixed if j % 2 == 0 else mixed_eager).append(timed_step(engine, device))
    if runner is not None:
        runner.prefill_in_graphs = True
    for i in range(batch):
        engine.abort(f"{tag}-{i}")
    while engine.has_unfinished:
        engine.step()
    alone = []
    for j in range(steps):
        engine.add_request(prompts[j % len(prompts)], one, f"{tag}-alone-{j}")
        alone.append(timed_step(engine, device))
    return {
        "decode_s": statistics.median(decode),
        "mixed_s": statistics.median(mixed),
        "mixed_eager_s": statistics.median(mixed_eager),
        "prefill_alone_s": statistics.median(alone),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tiny checkpoint)")
    ap.add_argument("--default-model", action="store_true", help="the shipped default model")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--num-draft-tokens", type=int, default=0, help="MTP drafts (0: off)")
    args = ap.parse_args()
    model = args.model or (default_model_path() if args.default_model else tiny_model_path())
    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device=args.device,
            num_draft_tokens=args.num_draft_tokens,
            max_num_seqs=max(batches) + 1,
        )
    )
    device = engine.config.device
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, engine.vocab_size, (args.prompt_len,), generator=g).tolist()
        for _ in range(64)
    ]
    print(
        f"model={model} device={device} prompt_len={args.prompt_len} steps={args.steps} "
        f"k={args.num_draft_tokens}"
    )
    print(
        "| decoding | decode step ms | with one arrival ms | x | the same step eager ms | x "
        "| the prefill alone ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for batch in batches:
        r = measure(engine, prompts, batch, args.steps, device)
        print(
            f"| {batch} | {r['decode_s'] * 1e3:.3f} | {r['mixed_s'] * 1e3:.3f} "
            f"| {r['mixed_s'] / r['decode_s']:.2f} | {r['mixed_eager_s'] * 1e3:.3f} "
            f"| {r['mixed_eager_s'] / r['decode_s']:.2f} | {r['prefill_alone_s'] * 1e3:.3f} |",
            flush=True,
        )
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
