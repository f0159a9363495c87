"""The model runner's host work per decode step, by phase, batch size and context.

    python benchmarks/bench_runner_host.py [--device cpu|cuda] [--path graph|eager] [--drafts K]
        [--temperature T [--top-p P] [--seed S] [--sampler graph|eager]] [--model DIR] [--overlap]

Runs `ModelRunner.execute` on decode steps of the tiny checkpoint (or `--model`'s) with the model
replaced by a stand-in whose forward and LM head return preallocated hidden states and logits of the
right shapes. The stand-in removes every layer, the LM head and the KV cache reads and writes (no
block id is ever dereferenced, so the tables can be as long as the context asks for a pool that does
not exist); what is left is what the runner itself does each step: building the step's tensors and
host-to-device copies, copying them into the decode graph's static inputs, launching the graph, the
argmax and its device-to-host copy, the acceptance loop and the results. The figure is the time the
GPU waits for the host in a real step. The timed steps send no block-table entries (the runner holds
the tables from the row's first step), as a decode step that allocates no block does.

Paths: `graph` (the default) is the CUDA-graph decode path. On CUDA the graph is really captured
and replayed (it holds only what the runner adds around the model, nothing of the model); on CPU,
which has no graphs, the capture runs the stand-in once and the replay does nothing, so the host
work around it is the same code. `eager` times the eager path (prefill and mixed steps use it).

Phases (microseconds per step, exclusive of one another; they sum to the whole step):
  prepare  the runner's `_prepare`: the step's packed host buffer (eager path: and its copy)
  inputs   `DecodeGraphs.load`: the one copy into the graph's static inputs
  launch   `_forward`: the graph replay (eager path: the stand-in forward and LM head calls),
           the argmax and the start of its copy to the host
  sample   `_sample`: acceptance per request, waiting for the sampled tokens, the results
  rest     the rest of `execute` (forgetting finished requests, the StepOutput)
With `--drafts K` every request verifies K drafts (K + 1 tokens per sequence) and the step asks
for no proposal, so the MTP layer's own work is not in the figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections import defaultdict

import torch

from workers.batch import SamplingSpec, SeqWork, StepInput
from workers.default_model import tiny_model_path
from workers.loader import load_model
from workers.model_runner import ModelRunner

BLOCK = 64
BATCHES = (1, 8, 32, 64)
CONTEXTS = (1024, 32768)
PHASES = ("prepare", "inputs", "launch", "sample", "rest")


class StandInModel:
    """The model's surface that the runner's decode path uses, with no layers behind it: the
    forward returns rows of a preallocated hidden-state tensor, the LM head rows of preallocated
    logits (random, so argmaxes differ per row)."""

    def __init__(self, model, max_rows: int, device: torch.device):
        self.config, self.dtype, self.mtp = model.config, model.dtype, None
        self.kv_caches, self.index_caches = model.kv_caches, model.index_caches
        g = torch.Generator().manual_seed(0)
        self.hidden = torch.randn(max_rows, model.config.hidden_size, generator=g).to(device)
        self.logits = torch.randn(max_rows, model.config.vocab_size, generator=g).to(device)

    def __call__(self, input_ids: torch.Tensor, meta) -> torch.Tensor:
        return self.forward(input_ids, meta)

    def forward(self, input_ids: torch.Tensor, meta) -> torch.Tensor:
        return self.hidden[: input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[: hidden.shape[0]]


class _NoReplay:
    def replay(self) -> None:
        pass


class PhaseClock:
    """Exclusive time per phase: a wrapped call's time less that of the wrapped calls inside it."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self._stack: list[float] = []  # time spent in children, per open call

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                children = self._stack.pop()
                self.totals[phase] += elapsed - children
                if self._stack:
                    self._stack[-1] += elapsed

        return timed


def build_runner(
    device: torch.device,
    path: str,
    max_batch: int,
    max_rows: int,
    clock,
    sampler: str = "graph",
    model_dir: str | None = None,
    room: int = 0,  # positions past the largest context the tables must hold
):
    model_dir = model_dir or tiny_model_path()
    model, _ = load_model(model_dir, torch.float32, device, enable_mtp=False)
    max_context = max(CONTEXTS) + BLOCK + room
    runner = ModelRunner(model, 2, BLOCK, device, 0, max_context)
    stand_in = StandInModel(model, max_rows, device)
    stand_in.forward = clock.wrap("launch", stand_in.forward)
    stand_in.compute_logits = clock.wrap("launch", stand_in.compute_logits)
    runner.model = stand_in
    if path == "graph":
        from workers.cuda_graph import DecodeGraphs

        graphs = DecodeGraphs(stand_in, max_batch, max_context // BLOCK + 1, device)
        if device.type == "cuda":
            torch.cuda.CUDAGraph.replay = clock.wrap("launch", torch.cuda.CUDAGraph.replay)
        else:
            _NoReplay.replay = clock.wrap("launch", _NoReplay.replay)
            graphs.capture_graph = lambda forward: (_NoReplay(), forward())
        graphs.load = clock.wrap("inputs", graphs.load)
        runner.graphs = graphs
        if device.type == "cuda" and sampler == "graph":
            from workers.cuda_graph import SamplerGraphs
            from workers.model_runner import SAMPLER_GRAPH_MAX_ROWS

            vocab = model.config.vocab_size
            runner.sampler_graphs = SamplerGraphs(graphs, vocab, SAMPLER_GRAPH_MAX_ROWS)
    runner._prepare = clock.wrap("prepare", runner._prepare)
    runner._forward = clock.wrap("launch", runner._forward)
    runner._sample = clock.wrap("sample", runner._sample)
    runner.execute = clock.wrap("rest", runner.execute)
    return runner


def decode_step(
    batch: int,
    context: int,
    drafts: int,
    vocab: int,
    held: bool,
    sampling: SamplingSpec,
    room: int = 0,
) -> StepInput:
    """`held`: the runner holds the tables from an earlier step, so the step sends none of
    their entries (as the engine sends a decode step that allocates no block); else every
    table whole (a request's first step). `room`: positions past the step the tables hold."""
    blocks_per_seq = (context + drafts + room) // BLOCK + 1
    seqs = [
        SeqWork(
            f"r{b}",
            [(7 * b + j) % vocab for j in range(drafts + 1)],
            context,
            [] if held else list(range(1 + b * blocks_per_seq, 1 + (b + 1) * blocks_per_seq)),
            drafts,
            True,
            sampling,
            block_table_start=blocks_per_seq if held else 0,
        )
        for b in range(batch)
    ]
    return StepInput(seqs)


def next_step(step: StepInput, output) -> StepInput:
    """The decode step after `step` (one token a sequence), fed the tokens it sampled, as the
    engine feeds them."""
    seqs = [
        dataclasses.replace(
            s,
            token_ids=[r.sampled_token_ids[-1]],
            start_position=s.start_position + len(s.token_ids),
            block_ids=[],
            block_table_start=s.block_table_start + len(s.block_ids),
        )
        for s, r in zip(step.seqs, output.results)
    ]
    return StepInput(seqs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--path", choices=("graph", "eager"), default="graph")
    ap.add_argument("--drafts", type=int, default=0, help="drafts verified per request")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per row")
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request samples at this temperature (with --top-p); 0: greedy",
    )
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument(
        "--sampler",
        choices=("graph", "eager"),
        default="graph",
        help="sampling requests drawn in the sampler's CUDA graphs (CUDA, graph path) or eagerly",
    )
    ap.add_argument(
        "--seed", type=int, default=None, help="with --temperature: every request seeded"
    )
    ap.add_argument(
        "--model", default=None, help="checkpoint whose config (vocabulary) the runner takes"
    )
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="the runner launches each next step ahead (EngineConfig.overlap_steps); the timed "
        "steps are consecutive decodes, each fed the tokens of the one before",
    )
    args = ap.parse_args()
    sampling = SamplingSpec(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    device = torch.device(args.device)
    torch.set_num_threads(1)
    clock = PhaseClock()
    q = args.drafts + 1
    consecutive = args.overlap and args.drafts == 0
    room = args.steps + 16 if consecutive else 0
    runner = build_runner(
        device, args.path, max(BATCHES), max(BATCHES) * q, clock, args.sampler, args.model, room
    )
    vocab = runner.model.config.vocab_size
    how = f"temperature {args.temperature}, top-p {args.top_p}" if args.temperature else "greedy"
    how += "" if args.seed is None or not args.temperature else f", seed {args.seed}"
    if args.temperature:
        how += f", sampler {'graphs' if runner.sampler_graphs is not None else 'eager'}"
    print(f"device {device}, {args.path} path, {q} token(s) per sequence, {how}, us per step")
    print("| batch | context | " + " | ".join(PHASES) + " | whole step |")
    print("|---|---|" + "---|" * (len(PHASES) + 1))
    runner.overlap = args.overlap
    for batch in BATCHES:
        for context in CONTEXTS:
            first = decode_step(batch, context, args.drafts, vocab, False, sampling, room)
            output = runner.execute(first)
            step = decode_step(batch, context, args.drafts, vocab, True, sampling, room)
            if consecutive:
                step = next_step(first, output)
            for _ in range(10):
                output = runner.execute(step)
                step = next_step(step, output) if consecutive else step
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            clock.totals.clear()
            start = time.perf_counter()
            for _ in range(args.steps):
                output = runner.execute(step)
                step = next_step(step, output) if consecutive else step
            whole = (time.perf_counter() - start) / args.steps * 1e6
            cells = [f"{clock.totals[p] / args.steps * 1e6:.1f}" for p in PHASES]
            print(f"| {batch} | {context} | " + " | ".join(cells) + f" | {whole:.1f} |")
            done = [s.request_id for s in step.seqs]
            runner.execute(StepInput([], finished_request_ids=done))  # the next row starts over


if __name__ == "__main__":
    main()
