"""End-to-end decode on one GPU: a DeepSeek-V3.2-width slice against its HBM floor and against
transformers' DeepseekV32ForCausalLM on the same weights, with MTP and PDL on and off.

    PYTHONPATH=$PWD python benchmarks/bench_decode.py [--layers 4] [--out results.md]

The slice: DeepSeek-V3.2's real widths (hidden 7168, 128 heads, q/kv LoRA 1536/512, rope 64, indexer
64x128 top-2048, 256 routed experts top-8 of inter 2048 + 1 shared, vocab 129280), `--layers` layers
(the first dense, the rest MoE) plus the MTP layer, deterministic random bf16 weights made on the
GPU (with `--fp8`, made FP8 module by module as DeepSeek ships them, UE8M0 scales: the slice then
fits an 80 GB GPU; `--fp8-scales amax` quantizes the bf16 slice). KV caches hold random entries: a
decode step's cost does not depend on their values. Step times are CUDA-graph replays of the target
forward + LM head (what the engine replays each decode step), timed with CUDA events; "engine" rows
are the model runner's whole step (host bookkeeping and sampling included), timed by the wall clock.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import statistics
import subprocess
import time

import torch

from benchmarks.bench_kernels import copy_bandwidth_gbs, with_pdl
from benchmarks.bench_runner_host import next_step
from kernels.settings import reload_settings
from workers.batch import SamplingSpec, SeqWork, StepInput
from workers.cuda_graph import DecodeGraphs
from workers.model import DeepseekV32ForCausalLM
from workers.model_runner import ModelRunner
from workers.step_tensors import pack_step

CUDA = torch.device("cuda")
BF16 = torch.bfloat16
GREEDY = SamplingSpec()
BLOCK = 64
BATCHES = (1, 8, 32)
CONTEXTS = (1024, 8192, 32768)


def slice_config(num_layers: int):
    """DeepSeek-V3.2's dimensions, `num_layers` layers of which the first is dense."""
    from transformers import DeepseekV32Config

    from workers.model_config import DEEPSEEK_V32

    return DeepseekV32Config(
        **dict(DEEPSEEK_V32, num_hidden_layers=num_layers, first_k_dense_replace=1)
    )


@torch.no_grad()
def build_model(config) -> DeepseekV32ForCausalLM:
    with torch.device(CUDA):
        model = DeepseekV32ForCausalLM(config, dtype=BF16, with_mtp=True)
    model.rotary.to(CUDA)  # its buffers are computed on the CPU
    model.mtp.embed_tokens = model.model.embed_tokens
    model.mtp.shared_head.head = model.lm_head
    gen = torch.Generator(CUDA).manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name.rsplit(".", 2)[-2] or name.endswith("layernorm.weight"):
            p.fill_(1.0)
        elif name.endswith(("bias", "e_score_correction_bias")):
            p.zero_()
        else:
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    return model.eval()


@torch.no_grad()
def to_fp8(model, pow2_scales: bool = True) -> int:
    """Quantize every layer a DeepSeek FP8 checkpoint ships in FP8 (the linears the model
    multiplies by, the routed experts) to block-scaled FP8 kept in HBM, as the loader keeps a
    real checkpoint's; the LM head, embeddings, norms and router stay as they are. Scales are
    powers of two (UE8M0) as DeepSeek-V3.1 and later ship them, or amax / 448 (V3's) with
    `pow2_scales=False`. Returns the layers converted."""
    from functools import partial

    from kernels.fp8 import quantize_fp8_reference as quantize
    from workers.loader import scales_loaded

    quantize_fp8_reference = partial(quantize, pow2_scales=pow2_scales)

    converted = 0
    for module in list(model.modules()):
        if not getattr(module, "quantizable", hasattr(module, "w13")) or not hasattr(
            module, "use_fp8"
        ):
            continue
        if hasattr(module, "w13"):
            w13, w2 = module.w13.data, module.w2.data
            inter = w2.shape[2]
            module.use_fp8()
            for e in range(w13.shape[0]):
                for part in range(2):
                    rows = w13[e, part * inter : (part + 1) * inter]
                    q, scale = quantize_fp8_reference(rows)
                    module.w13.data[e, part * inter : (part + 1) * inter] = q
                    module.w13_scale_inv.data[e, part] = scale
                q, scale = quantize_fp8_reference(w2[e])
                module.w2.data[e], module.w2_scale_inv.data[e] = q, scale
        else:
            weight = module.weight.data
            if not module.use_fp8():
                continue
            q, scale = quantize_fp8_reference(weight)
            module.weight.data.copy_(q)
            module.weight_scale_inv.data.copy_(scale)
        converted += 1
    scales_loaded(model)
    torch.cuda.empty_cache()
    return converted


def weight_bytes(model, batch: int) -> dict[str, float]:
    """HBM bytes of the weights one decode step of `batch` sequences must read."""
    cfg = model.config
    dense, moe, other = 0, 0, 0
    for module in model.model.layers:
        kv_b = module.self_attn.kv_b_proj
        kv_b_copy = kv_b.is_fp8 and not kv_b.reads_fp8(batch)  # the step reads its bf16 copy
        if kv_b_copy:
            dequantized = kv_b.model_dtype_weight()
            dense += dequantized.numel() * dequantized.element_size()
        for name, p in module.named_parameters():
            nbytes = p.numel() * p.element_size()
            if kv_b_copy and name.startswith("self_attn.kv_b_proj."):
                continue
            if ".experts." in f".{name}":
                # Expected distinct experts among batch x top-8 picks (uniform routing).
                n = cfg.n_routed_experts
                distinct = n * (1 - (1 - cfg.num_experts_per_tok / n) ** batch)
                moe += nbytes * distinct / n
            else:
                dense += nbytes
    other += model.lm_head.weight.numel() * 2 + batch * cfg.hidden_size * 2  # head + embed rows
    return {"layers": dense + moe, "head": other}


def kv_bytes(config, batch: int, context: int, num_layers: int) -> float:
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    per_token = min(config.index_topk, context) * latent * 2 + context * config.index_head_dim * 2
    return batch * per_token * num_layers


class DecodeBench:
    """Sequences of a given context over random caches; times graph replays of one step."""

    def __init__(self, model, max_batch: int, max_context: int):
        self.model = model
        self.max_blocks = max_context // BLOCK + 2
        self.runner = ModelRunner(
            model, max_batch * self.max_blocks + 1, BLOCK, CUDA, 0, max_context
        )
        # Seeded, as the step's tokens are (`inputs`): the attention reads these caches, so with
        # the global generator every run's hidden states, and so its routing, differed.
        gen = torch.Generator(CUDA).manual_seed(1)
        for cache in self.runner.model.kv_caches + self.runner.model.index_caches:
            cache.normal_(generator=gen)

    def inputs(self, batch: int, context: int, tokens_per_seq: int):
        tables = (
            torch.arange(batch * self.max_blocks, device=CUDA, dtype=torch.int32).view(
                batch, self.max_blocks
            )
            + 1
        )[:, : (context + tokens_per_seq) // BLOCK + 1]
        positions = (context + torch.arange(tokens_per_seq, device=CUDA)).repeat(batch)
        seq = torch.arange(batch, device=CUDA).repeat_interleave(tokens_per_seq)
        slots = tables[seq, positions // BLOCK].long() * BLOCK + positions % BLOCK
        # Seeded: the same tokens (so, with random routers, the same experts) in every run of
        # a tree, and in two trees whose weights agree.
        gen = torch.Generator(CUDA).manual_seed(batch * 1009 + tokens_per_seq)
        ids = torch.randint(
            0, self.model.config.vocab_size, (batch * tokens_per_seq,), device=CUDA, generator=gen
        )
        return ids, positions, slots, tables

    def packed(self, graphs: DecodeGraphs, batch: int, context: int, q: int) -> torch.Tensor:
        """The decode graph's packed inputs for `inputs(batch, context, q)`, in pinned memory."""
        ids, _, _, tables = self.inputs(batch, context, q)
        ids, tables = ids.view(batch, q).tolist(), tables.tolist()
        seqs = [SeqWork(f"r{b}", ids[b], context, tables[b], q - 1, True) for b in range(batch)]
        layout = graphs.layout(batch, q)
        host = torch.empty(layout.numel, dtype=torch.long, pin_memory=True)
        pack_step(seqs, BLOCK, layout, host.numpy())
        return host

    def graph_ms(self, graphs: DecodeGraphs, batch: int, context: int, q: int, reps=20) -> float:
        """GPU time per step of the decode graph: the one copy of its packed inputs, the replay
        (`warmed_median` of windows of `reps` steps: measured first, a configuration looked
        slow)."""
        host = self.packed(graphs, batch, context, q)

        def step():
            graphs.load(host, batch, q)
            graphs.replay(batch, q)

        def window() -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                step()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / reps

        return warmed_median(window)

    def eager_step(self, batch: int, context: int, tokens_per_seq: int, dense: bool = True):
        """One eager forward of `tokens_per_seq` new tokens for each of `batch` sequences after
        `context` cached ones, and the LM head on each sequence's last token. More than one
        token a sequence is a step of prompt chunks: it runs inside `ops.prompt_step`, as the
        model runner runs one (an FP8 model's matmuls then take w8a8 by default), and where
        its tokens all lie before index_topk it attends densely as the runner's does with
        MTPSERVE_DENSE_PROMPTS on (`ModelRunner._dense_rows`; the default on the CPU in fp32
        only), unless `dense` is False."""
        from kernels import ops
        from workers.attention_metadata import AttentionMetadata, dense_spans

        ids, positions, slots, tables = self.inputs(batch, context, tokens_per_seq)
        seq = torch.arange(batch, device=CUDA).repeat_interleave(tokens_per_seq)
        last = torch.arange(1, batch + 1, device=CUDA) * tokens_per_seq - 1
        spans = None
        prompt = tokens_per_seq > 1
        if dense and prompt and context + tokens_per_seq <= self.model.config.index_topk:
            spans = dense_spans(
                [context] * batch, [tokens_per_seq] * batch, tables.tolist(), BLOCK, CUDA
            )

        @torch.no_grad()
        def step():
            meta = AttentionMetadata(positions, slots, seq, tables, dense=spans)
            with ops.prompt_step(prompt):
                hidden = self.model(ids, meta)
            self.model.compute_logits(hidden if tokens_per_seq == 1 else hidden[last])

        return step

    def prefill_ms(self, context: int, chunk: int, reps: int = 3, dense: bool = True) -> float:
        """One chunked-prefill step: `chunk` new tokens of one sequence after `context` cached
        ones (the engine prefills in chunks of max_num_batched_tokens), eager as the engine runs
        prefill (`dense`: see `eager_step`)."""
        return eager_ms(self.eager_step(1, context, chunk, dense), reps)

    def graphs(self, pdl: bool, max_batch: int) -> DecodeGraphs:
        with_pdl(pdl)
        return DecodeGraphs(self.model, max_batch, self.max_blocks, CUDA)

    def round_step(
        self, batch: int, context: int, k: int, share: bool, sampling: SamplingSpec = GREEDY
    ) -> StepInput:
        """One MTP round's step of `batch` sequences at `context`: verify 1 + k tokens
        (greedy unless `sampling` says otherwise)."""
        tables = self.inputs(batch, context, k + 1)[3].cpu().tolist()
        seqs = [
            SeqWork(f"r{b}", [5] + [7] * k, context, tables[b], k, True, sampling)
            for b in range(batch)
        ]
        return StepInput(seqs, k, share)

    def round_ms(
        self,
        batch: int,
        context: int,
        k: int,
        share: bool,
        reps: int = 5,
        sampling: SamplingSpec = GREEDY,
    ) -> float:
        """A whole MTP round through the runner: verify 1 + k, draft step 0, steps 1..k-1
        (`warmed_median` of windows of `reps` rounds, host time included)."""
        step = self.round_step(batch, context, k, share, sampling)
        return warmed_median(wall_window(lambda: self.runner.execute(step), reps))

    def decode_steps_ms(self, batch: int, context: int, overlap: bool, reps: int = 20) -> float:
        """Consecutive greedy decode steps through the runner, each fed the tokens the one
        before it sampled, as the engine feeds them (`next_step`; `warmed_median` of windows
        of `reps` steps, wall clock, host work included); with `overlap` the runner launches
        each next step before reading this one's tokens (`EngineConfig.overlap_steps`)."""
        room = 512  # positions past `context` the tables hold; then the sequences start over
        tables = self.inputs(batch, context, room)[3].cpu().tolist()
        first = StepInput(
            [SeqWork(f"d{b}", [5], context, tables[b], 0, True) for b in range(batch)]
        )
        self.runner.overlap = overlap
        state = {"step": first}

        def step() -> None:
            current = state["step"]
            if current.seqs[0].start_position >= context + room - 1:  # start over
                finished = [s.request_id for s in current.seqs]
                current = dataclasses.replace(first, finished_request_ids=finished)
            state["step"] = next_step(current, self.runner.execute(current))

        try:
            return warmed_median(wall_window(step, reps))
        finally:
            finished = [s.request_id for s in state["step"].seqs]
            self.runner.execute(StepInput([], finished_request_ids=finished))
            self.runner.overlap = False


def wall_window(step, reps: int):
    """A window for `warmed_median`: `reps` calls of `step`, wall clock, ms a call."""

    def window() -> float:
        start = time.perf_counter()
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3 / reps

    return window


def warmed_median(window, warm_s: float = 0.2, windows: int = 5) -> float:
    """The median of `windows` calls of `window` (each times a window of steps, in ms a step)
    after `window` has run for `warm_s`: the first window after a capture or an idle spell ran
    5-15% slow on the H200 (clocks ramping; BENCHMARKS.md, session 21)."""
    warm_until = time.perf_counter() + warm_s
    while time.perf_counter() < warm_until:
        window()
    return statistics.median(window() for _ in range(windows))


def eager_ms(step, reps: int) -> float:
    """Wall time per call of `step` after one warm-up call."""
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / reps


def transformers_step_ms(model, config, prompt_len: int = 1024, new_tokens: int = 8) -> float:
    """transformers' DeepseekV32ForCausalLM.generate on our very tensors (no copy), batch 1."""
    from transformers import DeepseekV32ForCausalLM as HF
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32RotaryEmbedding

    with torch.device("meta"):
        hf = HF(config)
    ours = dict(model.named_parameters(remove_duplicate=False))  # shared experts under each name
    for name, _ in list(hf.named_parameters()) + list(hf.named_buffers()):
        if "rotary_emb" in name:
            continue
        if name.endswith("experts.gate_up_proj"):
            t = ours[name.replace("gate_up_proj", "w13")]
        elif name.endswith("experts.down_proj"):
            t = ours[name.replace("down_proj", "w2")]
        elif re.search(r"mlp(\.shared_experts)?\.(gate|up)_proj\.weight$", name):
            fused = ours[re.sub(r"\.(gate|up)_proj\.weight$", ".gate_up_proj.weight", name)]
            half = fused.shape[0] // 2
            t = fused[:half] if name.endswith("gate_proj.weight") else fused[half:]
        else:
            t = ours[name]
        module_name, _, leaf = name.rpartition(".")
        module = hf.get_submodule(module_name)
        if leaf in module._parameters:
            module._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
        else:
            module._buffers[leaf] = t
    hf.model.rotary_emb = DeepseekV32RotaryEmbedding(config).to(CUDA)
    hf.eval()
    ids = torch.randint(0, config.vocab_size, (1, prompt_len), device=CUDA)
    hf.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
    timings = {}
    for n in (1, new_tokens):
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        timings[n] = time.perf_counter() - start
    return (timings[new_tokens] - timings[1]) * 1e3 / (new_tokens - 1)


def profile_step(
    bench: DecodeBench, batch: int = 1, context: int = 1024, tokens_per_seq: int = 1
) -> None:
    """The GPU kernels of one eager step, by total time: a decode step (against its graph
    replay), or with `tokens_per_seq` > 1 one prefill chunk of that many tokens. Without PDL:
    a kernel launched early under PDL is timed from its launch, so its wait for the kernel
    before it would count as its own time."""
    from torch.profiler import ProfilerActivity, profile

    with_pdl(False)
    step = bench.eager_step(batch, context, tokens_per_seq)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / 5
    launches = sum(e.count for e in events) / 5
    print(
        f"kernels per step {launches:.0f}, kernel time per step {total / 1e3:.3f} ms (eager, "
        "PDL off)"
    )
    print(f"{'us/step':>9} {'share':>6} {'count':>6}  kernel")
    for e in events:
        us = e.device_time_total / 5
        print(f"{us:9.1f} {us / total * 100:5.1f}% {e.count / 5:6.0f}  {e.key[:110]}")
    routed = routed_on_rank(bench.model, step)
    if routed is not None:
        print(routed)
    with_pdl(True)
    if tokens_per_seq == 1:
        graphs = bench.graphs(True, batch)
        print(f"graph replay {bench.graph_ms(graphs, batch, context, 1):.3f} ms/step")
        replay_timeline(bench, graphs, batch, context)


def replay_timeline(bench: DecodeBench, graphs: DecodeGraphs, batch: int, context: int) -> None:
    """Where a graph-replayed step's time goes, PDL on: each kernel's share of the replay's span
    is how far its end moved the latest end so far (under PDL a kernel starts early and waits, so
    its own duration overlaps the one before it), summed by kernel over five replays."""
    from torch.profiler import ProfilerActivity, profile

    graphs.load(bench.packed(graphs, batch, context, 1), batch, 1)
    for _ in range(3):
        graphs.replay(batch, 1)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graphs.replay(batch, 1)
            torch.cuda.synchronize()
            time.sleep(0.005)  # replays 5 ms apart: each one's span is its own
    kernels = sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA"),
        key=lambda e: e.time_range.start,
    )
    moved: dict[str, float] = {}
    counts: dict[str, int] = {}
    spans, gaps = [], 0.0
    first = latest = None
    for e in kernels:
        start, end = e.time_range.start, e.time_range.end
        if latest is None or start - latest > 2000:  # a replay starts (times in us)
            if latest is not None:
                spans.append(latest - first)
            first = latest = start
        gaps += max(0.0, start - latest)
        moved[e.name] = moved.get(e.name, 0.0) + max(0.0, end - latest)
        counts[e.name] = counts.get(e.name, 0) + 1
        latest = max(latest, end)
    if latest is not None:
        spans.append(latest - first)
    if not spans:
        print("the profiler saw no kernels inside the graph replays")
        return
    span = sum(spans) / len(spans)
    print(
        f"graph replay under the profiler: span {span / 1e3:.3f} ms over {len(spans)} replays, "
        f"{len(kernels) / len(spans):.0f} kernels each; idle between kernels "
        f"{gaps / len(spans):.1f} us"
    )
    print(f"{'us/step':>9} {'share':>6} {'count':>6}  kernel (how far it moved the step's end)")
    for name in sorted(moved, key=lambda n: -moved[n]):
        us = moved[name] / len(spans)
        print(f"{us:9.1f} {us / span * 100:5.1f}% {counts[name] / len(spans):6.0f}  {name[:110]}")


def routed_on_rank(model, step) -> str | None:
    """What the routed experts of this rank computed in `step` (one more eager run of it, the
    router's choices recorded): the MoE kernels' time follows it, and with random weights it
    moves with every weight drawn before the routers (a simulated rank of EP=8 holds one of the
    8 expert groups: a layer sends it ~2 experts or none), so profiles of two trees compare
    only with it beside them. None without routed experts."""
    from kernels import ops
    from workers.model import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return None
    chosen = []
    route = ops.moe_route

    def recording_route(*args, **kwargs):
        weights, ids = route(*args, **kwargs)
        chosen.append(ids)
        return weights, ids

    ops.moe_route = recording_route
    try:
        step()
        torch.cuda.synchronize()
    finally:
        ops.moe_route = route
    experts = layers[0].experts
    first, local = experts.first_expert, experts.num_local
    hit = pairs = 0
    for ids in chosen:
        mine = ids[(ids >= first) & (ids < first + local)]
        pairs += mine.numel()
        hit += mine.unique().numel()
    return (
        f"routed experts computed on this rank in the step: {hit} over {len(chosen)} MoE layer "
        f"runs ({hit / len(chosen):.2f} a layer; {pairs} token-expert pairs), experts "
        f"{first}-{first + local - 1} of {experts.num_experts}"
    )


def mtp_round_gaps(
    bench: DecodeBench, model, graphs, batch: int = 1, context: int = 1024, trace: str = ""
):
    """How much of an MTP round the GPU is busy: a round's wall time (`round_ms`, the engine's
    configuration: graphs, PDL on) against the GPU kernel time of the same rounds (the
    profiler's sum over 20 rounds; kernels PDL lets overlap count twice, so busy is an upper
    bound) and the verify step's graph replay alone. Wall minus busy is what the host adds:
    the waits for the verify's tokens and the drafts, and the work between them."""
    from torch.profiler import ProfilerActivity, profile

    from workers.mtp_proposer import MtpProposer

    bench.runner.graphs = graphs
    bench.runner.proposer = MtpProposer(model, BLOCK, graphs)
    print(f"MTP rounds at b={batch}, context {context} (graphs, PDL on):")
    print(
        "| k | share top-k | requests | round ms (wall) | GPU kernel ms | wall - kernel ms "
        "| verify graph ms |"
    )
    print("|---|---|---|---|---|---|---|")
    drawn = SamplingSpec(temperature=1.0)
    runs = [(k, share, GREEDY) for k in (1, 2, 3) for share in (False, True)]
    runs += [(k, False, drawn) for k in (1, 2, 3)]  # the proposal behind the batched draw
    for k, share, sampling in runs:
        wall = bench.round_ms(batch, context, k, share, sampling=sampling)
        step = bench.round_step(batch, context, k, share, sampling)
        seqs = step.seqs
        for _ in range(3):
            bench.runner.execute(step)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                bench.runner.execute(step)
            torch.cuda.synchronize()
        if trace and k == 1 and not share and sampling.greedy:  # the host side: the gaps
            activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            with profile(activities=activities, with_stack=True) as timeline:
                for _ in range(5):
                    bench.runner.execute(step)
                torch.cuda.synchronize()
            os.makedirs(trace, exist_ok=True)
            timeline.export_chrome_trace(os.path.join(trace, "mtp_round_k1.json"))
        busy = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
        busy_ms = busy / 20 / 1e3
        bench.runner.execute(StepInput([], finished_request_ids=[s.request_id for s in seqs]))
        with torch.inference_mode():  # the runner captured the verify graph in it
            verify = bench.graph_ms(graphs, batch, context, k + 1)
        kind = "greedy" if sampling.greedy else "sampled"
        print(
            f"| {k} | {share} | {kind} | {wall:.3f} | {busy_ms:.3f} | {wall - busy_ms:.3f} "
            f"| {verify:.3f} |"
        )


def pdl_per_kernel(bench: DecodeBench, batch: int = 1, contexts=(1024, 8192)) -> None:
    """The b=`batch` graph replay with PDL on for every kernel, off for all, and off for one
    Triton kernel at a time (MTPSERVE_PDL_OFF_KERNELS): which kernel's early launch costs more
    than it gains."""
    from torch.profiler import ProfilerActivity, profile

    step = bench.eager_step(batch, contexts[0], 1)
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = sorted(
        {
            e.key
            for e in prof.key_averages()
            if e.device_type.name == "CUDA" and re.fullmatch(r"_\w+_kernel", e.key)
        }
    )

    def replay_ms(pdl: bool, off: str = "") -> list[float]:
        os.environ["MTPSERVE_PDL_OFF_KERNELS"] = off
        graphs = bench.graphs(pdl, batch)
        times = [bench.graph_ms(graphs, batch, context, 1, reps=50) for context in contexts]
        del graphs
        torch.cuda.empty_cache()
        return times

    header = " | ".join(f"ms at {c // 1024}k" for c in contexts)
    print(f"\n| PDL | {header} |")
    print("|---|" + "---|" * len(contexts))
    rows = [("on for all", replay_ms(True)), ("off for all", replay_ms(False))]
    rows += [(f"off for {name}", replay_ms(True, name)) for name in names]
    rows.append(("on for all, again", replay_ms(True)))
    os.environ.pop("MTPSERVE_PDL_OFF_KERNELS")
    with_pdl(True)
    for label, times in rows:
        print(f"| {label} | " + " | ".join(f"{t:.3f}" for t in times) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--fp8", action="store_true", help="the slice with DeepSeek's block-scaled FP8 weights"
    )
    ap.add_argument(
        "--fp8-scales",
        choices=("ue8m0", "amax"),
        default="ue8m0",
        help="with --fp8: scales as powers of two (DeepSeek-V3.1 and later, V3.2 included) or "
        "amax / 448 (DeepSeek-V3)",
    )
    ap.add_argument(
        "--share-experts",
        action="store_true",
        help="every MoE layer (the MTP layer's too) holds the first one's routed-expert tensors: "
        "the bf16 slice (~97 GB) then fits an 80 GB GPU. A step still reads each layer's experts "
        "from HBM (gigabytes a layer against tens of MB of L2); compare runs with the same flag",
    )
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--prefill-only", action="store_true")
    ap.add_argument(
        "--tp", type=int, default=1, help="only the decode steps, TP=1 against TP=N (N GPUs)"
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="print the kernels of one 1k decode step (with --prefill-only: of one prefill "
        "chunk) and exit",
    )
    ap.add_argument(
        "--profile-batch", type=int, default=1, help="with --profile: the decode step's batch"
    )
    ap.add_argument(
        "--pdl-per-kernel",
        action="store_true",
        help="the b=1 step's graph replay with PDL off for one Triton kernel at a time, and exit",
    )
    ap.add_argument(
        "--trace",
        default="",
        help="with --mtp-gaps: a directory for a Chrome trace (host and GPU) of five k = 1 rounds",
    )
    ap.add_argument(
        "--mtp-gaps",
        action="store_true",
        help="MTP rounds at b=1: wall time against the GPU's kernel time and the verify graph, "
        "and exit",
    )
    args = ap.parse_args()
    lines = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    # GIT_COMMIT first: a copied tree may carry a stale .git.
    commit = (
        os.environ.get("GIT_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        or "?"
    )
    emit(
        f"device {torch.cuda.get_device_name()}, "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC,"
        f" commit {commit}, torch {torch.__version__}"
    )
    if args.tp > 1:
        # Each layout in its own processes, one after the other, so each has the GPUs to itself.
        steps, tp_steps = run_tp(1, args.layers), run_tp(args.tp, args.layers)
        emit(
            f"\n| batch | context | TP=1 step ms | TP={args.tp} step ms | TP={args.tp} tok/s |"
            " speed-up |"
        )
        emit("|---|---|---|---|---|---|")
        for key, ms in tp_steps.items():
            emit(
                f"| {key[0]} | {key[1]} | {steps[key]:.2f} | {ms:.2f} | {key[0] / ms * 1e3:.0f}"
                f" | {steps[key] / ms:.2f}x |"
            )
    else:
        bw = copy_bandwidth_gbs()
        torch.cuda.empty_cache()
        emit(f"copy bandwidth {bw:.0f} GB/s")
        run_single(args, emit, bw)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


def _tp_rank(rank: int, world: int, address: str, layers: int, results) -> None:
    """One TP rank: its shard of the slice (random weights of the sharded shapes; a step's cost
    does not depend on their values), top-k broadcast from rank 0 as the engine does at TP > 1,
    and the same graph-replayed steps as the single-GPU table."""
    from parallel.distributed import destroy_distributed, init_distributed

    def progress(what: str) -> None:  # a stalled run shows where it stalled
        print(f"[TP={world} rank {rank}] {what}", flush=True)

    torch.cuda.set_device(rank)
    if world > 1:
        init_distributed(rank, world, world, 1, address, torch.device("cuda", rank), 600)
        progress("joined the group")
    model = build_model(slice_config(layers))
    model.set_topk_source(0 if world > 1 else None)
    bench = DecodeBench(model, max(BATCHES), max(CONTEXTS))
    progress("model and caches built")
    # One eager step first, as the engine's workers run before they capture: the first
    # collectives happen outside any capture and on the default stream.
    bench.prefill_ms(0, 64, reps=1)
    progress("eager step done")
    graphs = bench.graphs(True, max(BATCHES))
    progress("graphs captured")
    times = {}
    for b in BATCHES:
        for c in CONTEXTS:
            times[(b, c)] = bench.graph_ms(graphs, b, c, 1)
            progress(f"batch {b}, context {c}: {times[(b, c)]:.2f} ms")
    torch.cuda.synchronize()
    if rank == 0:
        results.put(times)
    destroy_distributed()


def spawn_ranks(target, world: int, *args):
    """`target(rank, world, store_address, *args, results)` in `world` processes (spawned, one
    per GPU) -> what rank 0 put on `results`. Fails as soon as a rank dies."""
    import queue

    import torch.multiprocessing as mp

    from parallel.distributed import open_store

    address = open_store(world, 600)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=target, args=(rank, world, address, *args, results))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    while True:
        try:
            measured = results.get(timeout=5)
            break
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                for proc in procs:
                    proc.kill()
                raise RuntimeError(f"a rank exited with {failed[0]}") from None
    # The measurement is in; a rank that then stalls tearing NCCL down (seen on the two-GPU
    # machine: the run hung after every rank had printed its last step) must not hang the table.
    for proc in procs:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    return measured


def run_tp(world: int, layers: int) -> dict[tuple[int, int], float]:
    """Decode steps of the slice over `world` GPUs (tensor parallel, NCCL), one process each."""
    return spawn_ranks(_tp_rank, world, layers)


def run_single(args, emit, bw: float) -> None:
    """The single-GPU tables."""
    config = slice_config(args.layers)
    if args.share_experts and args.fp8 and args.fp8_scales != "ue8m0":
        raise SystemExit("--share-experts builds FP8 with UE8M0 scales only (--fp8-scales ue8m0)")
    if args.share_experts or (args.fp8 and args.fp8_scales == "ue8m0"):
        # Built module by module: the slice in bf16 first (~97 GB) fits no 80 GB GPU, and in
        # bf16 with its experts shared it does.
        from benchmarks.bench_rank_shard import build_shard

        model = build_shard(
            config,
            CUDA,
            lambda line: None,
            topk_source=None,
            fp8=args.fp8,
            share_experts=args.share_experts,
        )
        converted = sum(
            p.dtype == torch.float8_e4m3fn
            for n, p in model.named_parameters(remove_duplicate=False)  # shared: each layer's
            if n.endswith(("weight", "w13"))
        )
    else:
        model = build_model(config)
        if args.fp8:
            converted = to_fp8(model, pow2_scales=False)
    emit(
        f"slice: {args.layers} layers (1 dense + {args.layers - 1} MoE) + MTP, "
        f"{sum(p.numel() for p in model.parameters()) / 1e9:.1f} B params"
        + (
            f", {converted} layers in block-scaled FP8 ({args.fp8_scales} scales; LM head bf16)"
            if args.fp8
            else ""
        )
        + (", every MoE layer on the first one's routed experts" if args.share_experts else "")
    )
    bench = DecodeBench(model, max(BATCHES), max(CONTEXTS))
    if args.profile and args.prefill_only:
        profile_step(bench, 1, 0, args.prefill_chunk)
        return
    if args.profile:
        profile_step(bench, args.profile_batch)
        return
    if args.pdl_per_kernel:
        pdl_per_kernel(bench)
        return
    if args.mtp_gaps:
        mtp_round_gaps(bench, model, bench.graphs(True, max(BATCHES)), trace=args.trace)
        return
    # A chunk that ends before index_topk attends densely (the runner's rule with
    # MTPSERVE_DENSE_PROMPTS on; on CUDA the default is off); the same chunk on the sparse path,
    # the default, beside it.
    emit("\n| prefill chunk | after context | attention | ms | prefill tok/s |")
    emit("|---|---|---|---|---|")
    dense_until = config.index_topk
    for context in (0, 8192, 30720):
        paths = (True, False) if context + args.prefill_chunk <= dense_until else (False,)
        for dense in paths:
            ms = bench.prefill_ms(context, args.prefill_chunk, dense=dense)
            emit(
                f"| {args.prefill_chunk} | {context} | {'dense' if dense else 'sparse'} | "
                f"{ms:.1f} | {args.prefill_chunk / ms * 1e3:.0f} |"
            )
    if args.prefill_only:
        return
    graphs = {pdl: bench.graphs(pdl, max(BATCHES)) for pdl in (True, False)}

    emit(
        "\n| batch | context | step ms (PDL) | step ms (no PDL) | PDL gain | tok/s | HBM floor ms"
        " | x floor |"
    )
    emit("|---|---|---|---|---|---|---|---|")
    per_layer = {}
    for batch in BATCHES:
        for context in CONTEXTS:
            times = {
                pdl: (with_pdl(pdl), bench.graph_ms(graphs[pdl], batch, context, 1))[1]
                for pdl in (True, False)
            }
            wb = weight_bytes(model, batch)
            floor = (wb["layers"] + wb["head"] + kv_bytes(config, batch, context, args.layers)) / (
                bw * 1e6
            )
            emit(
                f"| {batch} | {context} | {times[True]:.2f} | {times[False]:.2f} | "
                f"{(1 - times[True] / times[False]) * 100:.1f}% | {batch / times[True] * 1e3:.0f}"
                f" | {floor:.2f} | {times[True] / floor:.2f} |"
            )
            per_layer[(batch, context)] = times[True]
    with_pdl(True)

    # Per-layer time: the same step with only the first 2 layers (dense + 1 MoE).
    layers = model.model.layers
    model.model.layers = layers[:2]
    short = bench.graphs(True, 1)
    t2 = bench.graph_ms(short, 1, 1024, 1)
    model.model.layers = layers
    t_full = per_layer[(1, 1024)]
    t_moe = (t_full - t2) / (args.layers - 2)
    t_61 = t2 + t_moe * (61 - 2)
    emit(
        f"\nbatch 1, context 1k: {args.layers} layers {t_full:.2f} ms, 2 layers {t2:.2f} ms -> "
        f"{t_moe:.3f} ms per MoE layer; a 61-layer model ~{t_61:.1f} ms/step "
        f"({1e3 / t_61:.0f} tok/s without MTP)"
    )

    # The engine's configuration: verify steps and whole proposals replay graphs, PDL on.
    from workers.mtp_proposer import MtpProposer

    bench.runner.graphs = graphs[True]
    bench.runner.proposer = MtpProposer(model, BLOCK, graphs[True])
    # Top-k sharing skips the MTP indexer's work, which grows with the context: hence 32k too.
    emit("\n| k | share top-k | round ms (b=1, 1k) | round ms (b=8, 1k) | round ms (b=1, 32k) |")
    emit("|---|---|---|---|---|")
    for k in (1, 2, 3):
        for share in (False, True):
            times = [bench.round_ms(b, c, k, share) for b, c in ((1, 1024), (8, 1024), (1, 32768))]
            emit(f"| {k} | {share} | " + " | ".join(f"{t:.2f}" for t in times) + " |")

    plain = bench.round_ms(1, 1024, 0, False)  # k = 0: one graph replay plus host work
    emit(f"\nengine step without MTP (b=1, 1k, whole runner step): {plain:.2f} ms")
    # Consecutive decode steps through the runner against the graph replay they wrap (issue
    # 15's 1.05x), with and without the next step launched ahead.
    emit("\n| batch | context | graph step ms | runner step ms | x | overlapped ms | x |")
    emit("|---|---|---|---|---|---|---|")
    for batch in (1, 8, 32):
        graph = bench.graph_ms(graphs[True], batch, 1024, 1)
        serial = bench.decode_steps_ms(batch, 1024, overlap=False)
        overlapped = bench.decode_steps_ms(batch, 1024, overlap=True)
        emit(
            f"| {batch} | 1024 | {graph:.3f} | {serial:.3f} | {serial / graph:.3f} "
            f"| {overlapped:.3f} | {overlapped / graph:.3f} |"
        )

    os.environ["MTPSERVE_FORCE_REFERENCE"] = "1"
    reload_settings()
    try:
        twins_ms = eager_ms(bench.eager_step(1, 1024, 1), reps=3)
        emit(f"twins (pure torch, eager), b=1, 1k: {twins_ms:.1f} ms/step")
    finally:
        os.environ.pop("MTPSERVE_FORCE_REFERENCE", None)
        reload_settings()

    if not args.skip_transformers:
        hf_ms = transformers_step_ms(model, config)
        emit(
            f"transformers generate, b=1, 1k prompt: {hf_ms:.1f} ms/step; ours (graph, PDL) "
            f"{per_layer[(1, 1024)]:.2f} ms/step: {hf_ms / per_layer[(1, 1024)]:.1f}x"
        )


if __name__ == "__main__":
    main()
