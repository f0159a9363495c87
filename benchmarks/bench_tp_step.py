"""Per-step host overhead of tensor parallelism: one sequence's decode step at TP=1 and TP=2, by
each step transport of the Ray executor, and an empty step's round trip (transport alone).

    python benchmarks/bench_tp_step.py [--model DIR] [--device auto|cpu|cuda] [--steps 200]
        [--transports socket,graph,calls] [--tp-sizes 1,2] [--num-draft-tokens 0] [--json PATH]

Rows: in-process TP=1 (no Ray at all), then TP=1 and TP=2 through the Ray executor for each
transport. Columns: median decode-step ms (greedy, one sequence, `--steps` tokens after a
warm-up), median empty-step ms (a StepInput with no sequences: the executor's message to every
rank and rank 0's answer, nothing computed), and the step's overhead over in-process TP=1.
The issue's target: TP=2 within 0.3 ms of TP=1 per step (tiny model, two H200s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(config, num_steps: int, num_empty: int) -> tuple[float, float]:
    """-> (median decode-step ms at one sequence, median empty-step ms)."""
    from cluster.engine import LLMEngine
    from cluster.sampling_params import SamplingParams
    from workers.batch import StepInput

    engine = LLMEngine(config)
    try:
        warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        engine.add_request(list(range(3, 35)), warm)
        while engine.has_unfinished:
            engine.step()
        params = SamplingParams(max_tokens=num_steps + 1, temperature=0.0, ignore_eos=True)
        engine.add_request(list(range(5, 37)), params)
        engine.step()  # the prefill
        step_ms = []
        while engine.has_unfinished:
            started = time.perf_counter()
            engine.step()
            step_ms.append((time.perf_counter() - started) * 1e3)
        empty_ms = []
        for _ in range(num_empty):
            started = time.perf_counter()
            engine.executor.execute(StepInput([]))
            empty_ms.append((time.perf_counter() - started) * 1e3)
        return statistics.median(step_ms), statistics.median(empty_ms) if empty_ms else 0.0
    finally:
        engine.shutdown()
        del engine
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next layout's ranks size their KV from free memory


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tiny checkpoint)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--empty-steps", type=int, default=300)
    ap.add_argument("--transports", default="socket,graph,calls")
    ap.add_argument("--tp-sizes", default="1,2", help="1 alone on a one-GPU machine")
    ap.add_argument("--num-draft-tokens", type=int, default=0)
    ap.add_argument("--actor-num-cpus", type=float, default=0.5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import ray
    import torch

    from cluster.config import EngineConfig
    from workers.default_model import tiny_model_path

    model = args.model or tiny_model_path()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 2, 2),
        include_dashboard=False,
        log_to_driver=False,
    )
    base = EngineConfig(
        model=model,
        device=device,
        num_draft_tokens=args.num_draft_tokens,
        max_num_seqs=8,
        actor_num_cpus=args.actor_num_cpus,
    )
    rows = []
    step_ms, _ = measure(base.replace(executor="inprocess"), args.steps, 0)
    rows.append({"layout": "TP=1 in-process", "step_ms": step_ms, "empty_ms": None})
    print(f"TP=1 in-process: {step_ms:.3f} ms/step", flush=True)
    for transport in args.transports.split(","):
        for tp in [int(t) for t in args.tp_sizes.split(",")]:
            config = base.replace(executor="ray", tp_size=tp, step_transport=transport)
            step_ms, empty_ms = measure(config, args.steps, args.empty_steps)
            label = f"TP={tp} Ray, {transport}"
            rows.append({"layout": label, "step_ms": step_ms, "empty_ms": empty_ms})
            print(f"{label}: {step_ms:.3f} ms/step, empty {empty_ms:.3f} ms", flush=True)
    ray.shutdown()

    reference = rows[0]["step_ms"]
    print(f"\nmodel={model} device={device} k={args.num_draft_tokens} one sequence")
    print("| layout | decode step (ms) | over in-process TP=1 (ms) | empty step (ms) |")
    print("|---|---|---|---|")
    for r in rows:
        empty = "-" if r["empty_ms"] is None else f"{r['empty_ms']:.3f}"
        print(f"| {r['layout']} | {r['step_ms']:.3f} | {r['step_ms'] - reference:+.3f} | {empty} |")
    by_layout = {r["layout"]: r["step_ms"] for r in rows}
    for transport in args.transports.split(","):
        tp1, tp2 = (by_layout.get(f"TP={tp} Ray, {transport}") for tp in (1, 2))
        if tp1 is not None and tp2 is not None:
            print(f"TP=2 - TP=1 by {transport}: {tp2 - tp1:+.3f} ms/step")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model, "device": device, "args": vars(args), "rows": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
