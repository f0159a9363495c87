"""The step loop's own cost, without a model: offline, on a thread, in a process of its own; and
what a step's deltas cost to pickle in each form.

    python benchmarks/bench_engine_loop.py [--tokens 3000] [--repeat 2] [--concurrency 1,8,32,64]
        [--step-s 0.0002]

Part 1: one greedy request of `--tokens` tokens on the model-less executor of
`benchmarks/null_executor.py` whose step returns at once (`--step-s S`: sleeps S seconds, as a
device step would), so what is timed per step is the loop (and the step's S):
`LLMEngine.step()` driven here (offline), `AsyncEngine` with the loop on a thread, and with the
loop in its own process (`cluster/engine_process.py`), streamed and not. Parts 2 and 4 always
take steps that return at once: their figure is host work alone.
Part 2: the offline engine's host work per decode step with `--concurrency` requests decoding
at once (the scheduler, the detokenizer, the outputs: what a step costs the host besides the
model, not overlapped with the device), per step and per request. Part 3: pickling and
unpickling 128 outputs of one step as RequestOutputs, as plain delta tuples
(`cluster.outputs.make_request_delta`'s form) and as a NamedTuple of the same fields; and a
decode step's StepInput (what the executor sends every rank) for 64 requests at 32k tokens,
with every block table whole (a request's first step) and with the tables held by the ranks
(the blocks a step allocates, most often none). Part 4
(`--long-output N`, 0 skips it): the offline engine's host work per decode step with
`--long-concurrency` requests decoding N tokens each, by how far they are: work that grows with
a completion's length shows as a rising row.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import sys
import time
from typing import Any, NamedTuple

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NULL_EXECUTOR = "benchmarks.null_executor:NullExecutor"


def _config(num_tokens: int, max_num_seqs: int = 64):
    from cluster.config import EngineConfig
    from workers.default_model import tiny_model_path

    return EngineConfig(
        tiny_model_path(),
        device="cpu",
        num_draft_tokens=0,
        executor=NULL_EXECUTOR,
        max_model_len=num_tokens + 64,
        max_num_seqs=max_num_seqs,
    )


def loop_us_per_step(num_tokens: int, mode: str, stream: bool) -> float:
    from cluster.async_engine import AsyncEngine
    from cluster.engine import LLMEngine
    from cluster.sampling_params import SamplingParams

    config = _config(num_tokens)
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    if mode == "offline":
        engine = LLMEngine(config)
        engine.add_request([5, 6, 7], params, "r")
        started = time.perf_counter()
        while engine.has_unfinished:
            engine.step()
        elapsed = time.perf_counter() - started
        engine.shutdown()
        return elapsed / num_tokens * 1e6

    async def run() -> float:
        engine = AsyncEngine(config, 800.0, own_process=mode == "process")
        started = time.perf_counter()
        async for _ in engine.generate([5, 6, 7], params, stream=stream):
            pass
        elapsed = time.perf_counter() - started
        await engine.shutdown()
        return elapsed

    return asyncio.run(run()) / num_tokens * 1e6


def host_us_per_step(concurrency: int, num_steps: int = 1000) -> float:
    """The offline engine's step with `concurrency` requests decoding (32-token prompts)."""
    from cluster.engine import LLMEngine
    from cluster.sampling_params import SamplingParams

    engine = LLMEngine(_config(num_steps + 100, max(64, concurrency)))
    params = SamplingParams(max_tokens=num_steps + 50, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(list(range(5, 37)), params, f"r{i}")
    for _ in range(20):  # the prefills, and then decodes only
        engine.step()
    started = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    elapsed = time.perf_counter() - started
    engine.shutdown()
    return elapsed / num_steps * 1e6


class _DeltaTuple(NamedTuple):
    request_id: str
    new_token_ids: list
    new_text: str
    finished: bool
    finish_reason: Any
    stop_reason: Any
    new_logprobs: Any
    num_prompt_tokens: int
    num_cached_tokens: int
    spec: Any
    error: Any
    is_first: bool


def host_us_by_length(concurrency: int, num_tokens: int, num_marks: int = 6) -> list:
    """-> [(output tokens per request so far, host us per step over the stretch before)]."""
    from cluster.engine import LLMEngine
    from cluster.sampling_params import SamplingParams

    engine = LLMEngine(_config(num_tokens + 100, max(64, concurrency)))
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(list(range(5, 37)), params, f"r{i}")
    stretch = num_tokens // num_marks
    rows, steps = [], 0
    started = time.perf_counter()
    while engine.has_unfinished:
        engine.step()
        steps += 1
        if steps % stretch == 0:
            now = time.perf_counter()
            rows.append((steps, (now - started) / stretch * 1e6))
            started = now
    engine.shutdown()
    return rows


def step_input_wire_us(
    num_seqs: int = 64, context: int = 32768, block: int = 64, rounds: int = 200
) -> list[tuple[str, float, float, int]]:
    from workers.batch import SeqWork, StepInput

    num_blocks = context // block + 1
    rows = []
    for name, held in (("whole tables", False), ("tables held", True)):
        step = StepInput(
            [
                SeqWork(
                    f"cmpl-{i:024d}-0",
                    [5],
                    context,
                    [] if held else list(range(i * num_blocks, (i + 1) * num_blocks)),
                    0,
                    True,
                    block_table_start=num_blocks if held else 0,
                )
                for i in range(num_seqs)
            ]
        )
        started = time.perf_counter()
        for _ in range(rounds):
            blob = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        dumps = (time.perf_counter() - started) / rounds * 1e6
        started = time.perf_counter()
        for _ in range(rounds):
            pickle.loads(blob)
        loads = (time.perf_counter() - started) / rounds * 1e6
        rows.append(
            (f"StepInput, {num_seqs} x {context // 1024}k, {name}", dumps, loads, len(blob))
        )
    return rows


def wire_us(num_outputs: int = 128, rounds: int = 500) -> list[tuple[str, float, float, int]]:
    from cluster.outputs import RequestOutput

    deltas = [
        (f"cmpl-{i:024d}-0", [5], "abc", False, None, None, None, 32, 0, None, None, False)
        for i in range(num_outputs)
    ]
    outputs = [
        RequestOutput(
            request_id=d[0],
            prompt_token_ids=list(range(32)),
            token_ids=list(range(64)),
            new_token_ids=[5],
            text="x" * 200,
            new_text="abc",
            finished=False,
            num_prompt_tokens=32,
        )
        for d in deltas
    ]
    rows = []
    for name, step in (
        ("RequestOutput", outputs),
        ("delta tuple", deltas),
        ("NamedTuple", [_DeltaTuple(*d) for d in deltas]),
    ):
        started = time.perf_counter()
        for _ in range(rounds):
            blob = pickle.dumps(("step", step), protocol=pickle.HIGHEST_PROTOCOL)
        dumps = (time.perf_counter() - started) / rounds * 1e6
        started = time.perf_counter()
        for _ in range(rounds):
            pickle.loads(blob)
        loads = (time.perf_counter() - started) / rounds * 1e6
        rows.append((name, dumps, loads, len(blob)))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--concurrency", default="1,8,32,64", help="part 2's levels")
    ap.add_argument("--long-output", type=int, default=0, help="part 4's tokens per request")
    ap.add_argument("--long-concurrency", type=int, default=32)
    ap.add_argument(
        "--step-s", type=float, default=0.0, help="part 1's executor step, seconds (0: none)"
    )
    args = ap.parse_args(argv)
    os.environ["NULL_STEP_S"] = str(args.step_s)
    print("| loop | streamed | us per step |\n|---|---|---|")
    for _ in range(args.repeat):
        print(f"| offline | - | {loop_us_per_step(args.tokens, 'offline', False):.1f} |")
        for mode in ("thread", "process"):
            for stream in (True, False):
                us = loop_us_per_step(args.tokens, mode, stream)
                print(f"| {mode} | {'yes' if stream else 'no'} | {us:.1f} |", flush=True)
    os.environ["NULL_STEP_S"] = "0"  # parts 2 and 4: the host's work alone
    print("\n| decoding | host us per step | per request |\n|---|---|---|")
    for _ in range(args.repeat):
        for c in (int(level) for level in args.concurrency.split(",")):
            us = host_us_per_step(c)
            print(f"| {c} | {us:.1f} | {us / c:.2f} |", flush=True)
    print("\n| 128 outputs as | pickle us | unpickle us | bytes |\n|---|---|---|---|")
    for name, dumps, loads, size in wire_us() + step_input_wire_us():
        print(f"| {name} | {dumps:.1f} | {loads:.1f} | {size} |")
    if args.long_output:
        c = args.long_concurrency
        print(f"\n{c} requests of {args.long_output} tokens\n")
        print("| output tokens so far | host us per step | per request |\n|---|---|---|")
        for _ in range(args.repeat):
            for tokens, us in host_us_by_length(c, args.long_output):
                print(f"| {tokens} | {us:.1f} | {us / c:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
