"""One rank of DeepSeek-V3.2 at TP=8/EP=8 on one GPU: the real model's shard, its decode steps,
and the collectives it would do, projected to tokens/s per GPU of an 8-GPU instance.

    # one GPU: the shard's decode steps (with 2+ GPUs visible it measures the collectives first)
    PYTHONPATH=$PWD python benchmarks/bench_rank_shard.py [--context 4096] [--out results.md]
        [--collectives-json collectives.json]
    # 2+ GPUs: only the collectives of one decode step (and one MTP round) per rank, over NCCL
    PYTHONPATH=$PWD python benchmarks/bench_rank_shard.py --collectives [--json collectives.json]
    # one GPU: the kernels of one eager decode step of the shard, by total time
    PYTHONPATH=$PWD python benchmarks/bench_rank_shard.py --profile [--profile-batch 1]
    # CPU: a tiny config's shard, its accounting against the plan and its collectives counted
    PYTHONPATH=$PWD python benchmarks/bench_rank_shard.py --device cpu --tiny

The shard: rank 0 of TP=8/EP=8 (an eighth of the heads, of the dense MLPs' and shared experts'
intermediate width and of the vocabulary, 32 of the 256 routed experts, the replicated LoRA and
indexer projections whole), built in one process as a simulated rank (parallel.state: modules
take the rank's shapes, collectives move nothing). Its weights are random, made on the device,
FP8 with 128x128 block scales wherever DeepSeek's checkpoints ship FP8 (as the loader keeps
them); the embedding, LM head, norms and router in their own dtypes. Rank 0 is also the rank
that runs every indexer and broadcasts top-k (the engine's default at TP > 1), so no rank does
more attention-side work. Its routed experts see whatever the random router sends them; how many
a step touches on the average and on the busiest rank is printed beside the table.

Step times are CUDA-graph replays as benchmarks/bench_decode.py times them (its DecodeBench),
KV caches random (latent and indexer keys in bf16, sized for the largest batch at --context:
the script prints their size and stops if they would not fit), PDL on; MTP rounds go through
the model runner, wall clock. The collectives are timed apart (`--collectives`, over the GPUs
visible, at the real model's per-rank message sizes) and added with no overlap assumed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

TP_SIZE = 8
EP_SIZE = 8
RANK = 0  # the simulated rank; also the top-k source (cluster.config: rank 0 at TP > 1)
BATCHES = (1, 32, 128)
CONTEXT = 4096
MTP_K = 1
BF16 = torch.bfloat16
PROGRESS_EVERY_LAYERS = 10
PLAN_TOLERANCE = 0.03  # the shard's bytes against `mtpserve plan`'s per rank
RANDOM_CHUNK = 1 << 28  # elements made at a time for an FP8 weight (a 512 MiB bf16 temporary)

# A config whose shard at TP=8/EP=8 has every part the real one has (1 dense + 1 MoE layer, the
# MTP layer, FP8 splits on 128 boundaries) at widths a CPU runs in moments.
TINY_OVERRIDES = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=1024,
    moe_intermediate_size=128,
    n_shared_experts=8,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=4,
    index_topk=16,
    index_head_dim=64,
    index_n_heads=8,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def shard_config(tiny: bool):
    """DeepSeek-V3.2's config (workers.model_config), or the tiny one."""
    from transformers import DeepseekV32Config

    from workers.model_config import DEEPSEEK_V32

    return DeepseekV32Config(**(dict(DEEPSEEK_V32, **TINY_OVERRIDES) if tiny else DEEPSEEK_V32))


def config_dict(tiny: bool) -> dict:
    """The config.json `mtpserve plan` reads for the same model: the config and DeepSeek's FP8
    quantization_config."""
    from workers.model_config import DEEPSEEK_V32_QUANTIZATION

    return dict(shard_config(tiny).to_dict(), quantization_config=DEEPSEEK_V32_QUANTIZATION)


@contextlib.contextmanager
def simulated_rank(tp_size: int = TP_SIZE, ep_size: int = EP_SIZE, tp_rank: int = RANK):
    """This process is rank tp_rank of tp_size (collectives move nothing) until the end."""
    from parallel.state import ParallelState, get_parallel_state, set_parallel_state

    previous = get_parallel_state()
    state = ParallelState(tp_rank=tp_rank, tp_size=tp_size, ep_size=ep_size, simulated=True)
    set_parallel_state(state)
    try:
        yield state
    finally:
        set_parallel_state(previous)


# --- the shard ------------------------------------------------------------------------------------


def _fill_random(name: str, p: torch.Tensor, params: dict, gen: torch.Generator) -> None:
    """Norms 1, biases 0; FP8 weights N(0, 1) with block scales the power of two nearest
    in**-0.5 (UE8M0 as DeepSeek-V3.2 ships them; they dequantize to about N(0, 1/in), like
    the bf16 ones); other weights N(0, 1/in)."""
    from kernels.fp8 import FP8_DTYPE

    if name.endswith("_scale_inv"):  # weight_scale_inv, w13_scale_inv, w2_scale_inv
        fan_in = params[name.removesuffix("_scale_inv")].shape[-1]
        p.fill_(2.0 ** round(math.log2(fan_in**-0.5)))
    elif name.endswith("bias"):
        p.zero_()
    elif "norm" in name.rsplit(".", 2)[-2]:
        p.fill_(1.0)
    elif p.dtype == FP8_DTYPE:
        flat = p.view(-1)
        for start in range(0, flat.numel(), RANDOM_CHUNK):
            part = flat[start : start + RANDOM_CHUNK]
            part.copy_(torch.randn(part.numel(), generator=gen, device=p.device, dtype=BF16))
    else:
        p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)


@torch.no_grad()
def build_shard(
    config,
    device: torch.device,
    progress=print,
    topk_source: int | None = RANK,
    fp8: bool = True,
    share_experts: bool = False,
):
    """Rank RANK's modules at the simulated rank's sizes (call inside `simulated_rank`), built
    on the meta device, made FP8 as DeepSeek ships them (`fp8`; else every weight bf16), then
    given random values on `device` module by module (nothing of its size ever on the host, nor
    in bf16 where it is FP8). `topk_source`: the TP rank whose indexer picks for all (None: each
    rank its own, as at TP=1). `share_experts`: every MoE layer (the MTP layer's too) holds the
    first one's routed-expert tensors, so a slice whose experts would not fit a GPU does (a step
    still reads each layer's experts from HBM: one layer's are gigabytes, L2 tens of MB)."""
    from workers.loader import scales_loaded
    from workers.memory_plan import use_fp8_as_shipped
    from workers.model import DeepseekV32ForCausalLM, Experts, Rotary

    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(config, dtype=BF16, with_mtp=True)
    if fp8:
        use_fp8_as_shipped(model)
    if share_experts:
        share_routed_experts(model)
    materialize(model, device)
    model.rotary = Rotary(config).to(device)  # left uninitialized: its buffer is computed
    model.set_topk_source(topk_source)
    gen = torch.Generator(device).manual_seed(0)
    params = dict(model.named_parameters())
    layers = model.model.layers
    parts = [("model.embed_tokens", model.model.embed_tokens)]
    parts += [(f"model.layers.{i}", layer) for i, layer in enumerate(layers)]
    parts += [("model.norm", model.model.norm), ("lm_head", model.lm_head), ("mtp", model.mtp)]
    started, made, filled = time.perf_counter(), 0, set()
    for prefix, module in parts:
        for name, p in module.named_parameters(prefix=prefix):
            if id(p) in filled:  # a shared expert tensor, made once
                continue
            filled.add(id(p))
            _fill_random(name, p, params, gen)
            made += p.numel() * p.element_size()
        i = int(prefix.rsplit(".", 1)[1]) + 1 if prefix.startswith("model.layers.") else None
        if i is not None and (i % PROGRESS_EVERY_LAYERS == 0 or i == len(layers)):
            progress(
                f"  layers {i}/{len(layers)} made: {made / 1e9:.1f} GB of weights, "
                f"{time.perf_counter() - started:.1f} s"
            )
    model.mtp.embed_tokens = model.model.embed_tokens  # tied as the loader ties them
    model.mtp.shared_head.head = model.lm_head
    if fp8:
        scales_loaded(model)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    shared = sum(isinstance(m, Experts) for m in model.modules()) if share_experts else 0
    progress(
        f"  shard made (MTP layer included): {made / 1e9:.2f} GB"
        + (f", {shared} MoE layers on one set of routed experts" if shared else "")
    )
    return model.eval()


def share_routed_experts(model) -> None:
    """Every `Experts` module after the first holds the first one's tensors (weights and FP8
    scales): same shapes, dtypes and layout, one copy in memory."""
    from workers.model import Experts

    experts = [m for m in model.modules() if isinstance(m, Experts)]
    for other in experts[1:]:
        for name, tensor in experts[0].named_parameters(recurse=False):
            setattr(other, name, tensor)


def materialize(model, device: torch.device) -> None:
    """`model.to_empty(device=device)` that keeps a tensor shared between modules shared (to_empty
    gives each holder a copy of its own). Parameters stay frozen."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in made:
                    empty = torch.empty_like(tensor, device=device)
                    if isinstance(tensor, torch.nn.Parameter):
                        empty = torch.nn.Parameter(empty, requires_grad=False)
                    made[id(tensor)] = empty
                table[key] = made[id(tensor)]


def bytes_by_dtype(model) -> dict[str, int]:
    """The shard's bytes by dtype name, as workers.memory_plan counts them: every parameter and
    buffer once (tied tensors once; buffers such as kv_b_proj's bf16 copy beside its FP8
    weight)."""
    by_dtype: dict[str, int] = {}
    held = {id(t): t for t in (*model.parameters(), *model.buffers())}
    for t in held.values():
        name = str(t.dtype).removeprefix("torch.")
        by_dtype[name] = by_dtype.get(name, 0) + t.numel() * t.element_size()
    return by_dtype


def plan_bytes_by_dtype(tiny: bool) -> dict[str, int]:
    """`mtpserve plan`'s weight bytes of one rank by dtype, for the same config.json."""
    from workers.memory_plan import plan_memory

    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump(config_dict(tiny), f)
        plan = plan_memory(model_dir, tp_size=TP_SIZE, ep_size=EP_SIZE)
    # The plan reports bytes over all ranks as per-rank bytes x tp_size.
    return {k: v // TP_SIZE for k, v in plan.weight_bytes_by_dtype.items()}


def compare_with_plan(ours: dict[str, int], plan: dict[str, int], emit) -> float:
    """Print the shard's bytes by dtype beside the plan's; returns the largest relative gap."""
    emit("\n| dtype | shard bytes | plan's bytes per rank | difference |")
    emit("|---|---|---|---|")
    worst = 0.0
    rows = [(name, ours.get(name, 0), plan.get(name, 0)) for name in sorted(set(ours) | set(plan))]
    rows.append(("total", sum(ours.values()), sum(plan.values())))
    for name, a, b in rows:
        gap = abs(a - b) / max(a, b, 1)
        worst = max(worst, gap)
        emit(f"| {name} | {a:,} | {b:,} | {gap * 100:.2f}% |")
    verdict = "agree" if worst <= PLAN_TOLERANCE else "DISAGREE"
    emit(
        f"shard {sum(ours.values()) / 1e9:.2f} GB; it and workers.memory_plan {verdict} "
        f"(largest gap {worst * 100:.2f}%, bound {PLAN_TOLERANCE * 100:.0f}%)"
    )
    return worst


# --- the collectives of a step ----------------------------------------------------------------


def step_collectives(
    config, batch: int, k: int = 0, share_topk: bool = False, tp_size: int = TP_SIZE
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(op, shape of one rank's tensor, dtype) of every collective one rank makes in a graphed
    decode step of `batch` sequences (k = 0), or in an MTP round (k > 0: the verify of 1 + k
    tokens per sequence and the whole proposal), in order, with rank 0 broadcasting top-k.

    The model's: the vocab-parallel embedding's all-reduce; per layer the indexer's top-k
    broadcast, the attention output's all-reduce (o_proj) and the MLP's or MoE's (one for the
    shared expert and the routed ones); the LM head's all-gather over the vocabulary.
    """
    hidden, topk = config.hidden_size, config.index_topk
    vocab_part = -(-config.vocab_size // tp_size)

    def forward(tokens: int, layers: int, indexer: bool = True) -> list:
        ops = [("all_reduce", (tokens, hidden), BF16)]  # the embedding
        for _ in range(layers):
            if indexer:
                ops.append(("broadcast", (tokens, topk), torch.int32))
            ops += [("all_reduce", (tokens, hidden), BF16)] * 2
        return ops

    def logits(rows: int) -> list:
        return [("all_gather", (rows, vocab_part), BF16)]

    tokens = batch * (1 + k)
    ops = forward(tokens, config.num_hidden_layers) + logits(tokens)
    if k:
        ops += forward(tokens, 1) + logits(batch)  # draft step 0 over every pair row
        for _ in range(1, k):
            ops += forward(batch, 1, indexer=not share_topk) + logits(batch)
    return ops


def recorded_collectives(model, state, batch: int, k: int = 0, share_topk: bool = False) -> list:
    """The collectives the simulated rank makes in one run of what the decode (and proposal)
    graphs capture: the same forward functions, run once eagerly."""
    from workers.cuda_graph import DecodeGraphs, ProposeGraphs

    device = model.model.embed_tokens.weight.device
    graphs = DecodeGraphs(model, batch, 1, device)
    state.simulated_collectives.clear()
    with torch.no_grad():
        layout, inputs = graphs._static_inputs(batch, 1 + k)
        outputs = graphs._forward(layout, inputs)
        if k:
            decided = torch.full((2, batch), -1, dtype=torch.long, device=device)
            propose = ProposeGraphs(model, graphs)
            propose.after_verify(layout, inputs, outputs, k, share_topk, decided)
    return list(state.simulated_collectives)


def summarize_collectives(ops: list) -> str:
    counts: dict[tuple, int] = {}
    for op in ops:
        counts[op] = counts.get(op, 0) + 1
    return ", ".join(
        f"{n} {op} {list(shape)} {str(dtype).removeprefix('torch.')}"
        for (op, shape, dtype), n in counts.items()
    )


# --- HBM floor ------------------------------------------------------------------------------------


def experts_touched(config, batch: int, trials: int = 200, seed: int = 0) -> tuple[float, float]:
    """Routed experts one decode step of `batch` tokens touches on a rank, under DeepSeek's
    group-limited routing of random scores (uniform routing): (mean over ranks, mean over
    trials of the busiest rank's). With EP=8 a rank's 32 experts are exactly one of the 8 groups.
    """
    from kernels.moe_routing import moe_route_reference

    gen = torch.Generator().manual_seed(seed)
    experts = config.n_routed_experts
    per_rank = experts // EP_SIZE
    mean, busiest = 0.0, 0.0
    for _ in range(trials):
        logits = torch.randn(batch, experts, generator=gen)
        _, ids = moe_route_reference(
            logits,
            torch.zeros(experts),
            config.n_group,
            config.topk_group,
            config.num_experts_per_tok,
            config.norm_topk_prob,
            config.routed_scaling_factor,
        )
        touched = torch.zeros(experts, dtype=torch.bool)
        touched[ids.flatten().long()] = True
        counts = touched.view(EP_SIZE, per_rank).sum(1).float()
        mean += counts.mean().item() / trials
        busiest += counts.max().item() / trials
    return mean, busiest


def floor_bytes(model, batch: int, context: int) -> dict[str, float]:
    """HBM bytes one decode step of the shard must read: every weight of the 61 layers, the
    routed experts only in the fraction 1 - (1 - 8/256)**batch that `batch` tokens touch
    (uniform, independent routing: bench_decode.weight_bytes), the LM head's vocabulary slice,
    the embedding rows; and the KV cache: per sequence and layer, index_topk latent rows plus
    every cached indexer key (rank 0 runs the indexer: bench_decode.kv_bytes)."""
    from benchmarks.bench_decode import kv_bytes, weight_bytes

    wb = weight_bytes(model, batch)
    config = model.config
    return {
        "weights": wb["layers"] + wb["head"],
        "kv": kv_bytes(config, batch, context, config.num_hidden_layers),
    }


# --- the collectives, timed over NCCL -------------------------------------------------------------


def _issue(ops_with_buffers) -> None:
    from parallel.collectives import tp_all_gather_last_dim, tp_all_reduce, tp_broadcast

    for op, buf in ops_with_buffers:
        if op == "all_reduce":
            tp_all_reduce(buf)
        elif op == "broadcast":
            tp_broadcast(buf, 0)
        else:
            tp_all_gather_last_dim(buf)


def _time_ops(ops: list, device: torch.device, reps: int) -> tuple[float, str]:
    """ms per run of `ops` (zeros, so sums stay finite), in a CUDA graph where capture works."""
    buffers = {}
    work = []
    for op, shape, dtype in ops:
        key = (op, shape, dtype)
        if key not in buffers:
            buffers[key] = torch.zeros(shape, dtype=dtype, device=device)
        work.append((op, buffers[key]))
    _issue(work)  # the first call of each collective outside any capture
    torch.cuda.synchronize(device)
    run, how = (lambda: _issue(work)), "eager"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _issue(work)
        run, how = graph.replay, "CUDA graph"
    except RuntimeError as e:
        print(f"capture failed, timing eagerly: {e}", flush=True)
    for _ in range(3):
        run()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        run()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / reps, how


def _collectives_rank(
    rank: int, world: int, address: str, batches: tuple, reps: int, results
) -> None:
    from parallel.distributed import destroy_distributed, init_distributed

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    init_distributed(rank, world, world, 1, address, device, 600)
    config = shard_config(tiny=False)
    rows, how = {}, set()
    for b in batches:
        decode = step_collectives(config, b)
        row = {}
        row["decode_ms"], h = _time_ops(decode, device, reps)
        how.add(h)
        for kind in ("all_reduce", "broadcast", "all_gather"):
            row[f"{kind}_ms"], h = _time_ops([o for o in decode if o[0] == kind], device, reps)
            how.add(h)
        row[f"mtp_k{MTP_K}_ms"], h = _time_ops(step_collectives(config, b, MTP_K), device, reps)
        how.add(h)
        rows[str(b)] = row
        print(f"[rank {rank}] batch {b}: decode collectives {row['decode_ms']:.3f} ms", flush=True)
    torch.cuda.synchronize(device)
    if rank == 0:
        results.put({"rows": rows, "how": " and ".join(sorted(how))})
    destroy_distributed()


def measure_collectives(world: int, batches: tuple = BATCHES, reps: int = 20) -> dict:
    """The collectives of one decode step (and one MTP round) of the real model per rank, over
    `world` GPUs (one process each, NCCL), at TP=8's per-rank message sizes."""
    from benchmarks.bench_decode import spawn_ranks

    measured = spawn_ranks(_collectives_rank, world, batches, reps)
    config = shard_config(tiny=False)
    return {
        "world_size": world,
        "device": torch.cuda.get_device_name(0),
        "how": measured["how"],
        "per_step": {str(b): summarize_collectives(step_collectives(config, b)) for b in batches},
        "rows": measured["rows"],
    }


def print_collectives(measured: dict, emit) -> None:
    world = measured["world_size"]
    emit(
        f"\ncollectives per rank over {world} GPUs ({measured['device']}, NCCL, timed as "
        f"{measured['how']}), TP=8's per-rank message sizes"
        + (
            f"; a lower bound for 8 ranks (an all-reduce or all-gather over 8 takes more steps "
            f"than over {world})"
            if world < TP_SIZE
            else ""
        )
    )
    for b, what in measured["per_step"].items():
        emit(f"  decode step at b={b}: {what}")
    emit(
        f"\n| batch | decode step ms | of it all-reduce | broadcast | all-gather "
        f"| MTP round (k={MTP_K}) ms |"
    )
    emit("|---|---|---|---|---|---|")
    for b, row in measured["rows"].items():
        emit(
            f"| {b} | {row['decode_ms']:.3f} | {row['all_reduce_ms']:.3f} | "
            f"{row['broadcast_ms']:.3f} | {row['all_gather_ms']:.3f} | "
            f"{row[f'mtp_k{MTP_K}_ms']:.3f} |"
        )


# --- the runs -------------------------------------------------------------------------------------


def run_cpu_tiny(emit) -> dict:
    """The tiny config's shard on the CPU: its bytes against the plan's, and the collectives
    its decode step and MTP round make against `step_collectives`. Returns what it checked."""
    config = shard_config(tiny=True)
    device = torch.device("cpu")
    with simulated_rank() as state:
        model = build_shard(config, device, progress=emit)
        ours, plan = bytes_by_dtype(model), plan_bytes_by_dtype(tiny=True)
        worst = compare_with_plan(ours, plan, emit)
        from workers.kv_cache import allocate_kv_caches

        model.bind_caches(*allocate_kv_caches(config, 2, 64, BF16, device, with_mtp=True))
        checked = {}
        for batch, k in ((2, 0), (3, MTP_K)):
            recorded = recorded_collectives(model, state, batch, k)
            expected = step_collectives(config, batch, k)
            checked[(batch, k)] = (recorded, expected)
            what = "decode step" if k == 0 else f"MTP round k={k}"
            emit(
                f"{what}, b={batch}: recorded {summarize_collectives(recorded)}; "
                f"{'equals' if recorded == expected else 'DIFFERS FROM'} step_collectives"
            )
        floor = floor_bytes(model, 2, 64)
        weights, kv = floor["weights"], floor["kv"]
        emit(f"HBM floor at b=2, context 64: {weights:.0f} B of weights, {kv:.0f} B of KV")
    return {"bytes": ours, "plan": plan, "worst_gap": worst, "collectives": checked}


def run_gpu(args, emit) -> None:
    from benchmarks.bench_decode import BLOCK, DecodeBench
    from benchmarks.bench_kernels import copy_bandwidth_gbs
    from workers.kv_cache import cache_bytes_per_block
    from workers.mtp_proposer import MtpProposer

    cuda = torch.device("cuda")
    measured = None
    if args.collectives_json:
        with open(args.collectives_json) as f:
            measured = json.load(f)
    elif torch.cuda.device_count() >= 2:
        measured = measure_collectives(min(torch.cuda.device_count(), TP_SIZE), args.batches)
    if measured:
        print_collectives(measured, emit)
    bw = copy_bandwidth_gbs()
    torch.cuda.empty_cache()
    emit(f"\ncopy bandwidth {bw:.0f} GB/s")

    config = shard_config(tiny=False)
    started = time.perf_counter()
    emit(f"building rank {RANK} of TP={TP_SIZE}/EP={EP_SIZE} (61 layers + MTP, FP8) on the GPU:")
    with simulated_rank() as state, torch.no_grad():
        model = build_shard(config, cuda, progress=emit)
        emit(f"built in {time.perf_counter() - started:.0f} s")
        compare_with_plan(bytes_by_dtype(model), plan_bytes_by_dtype(tiny=False), emit)

        max_batch = max(args.batches)
        blocks = max_batch * (args.context // BLOCK + 2) + 1  # DecodeBench's cache size
        kv_need = blocks * cache_bytes_per_block(config, BLOCK, BF16, with_mtp=True)
        free = torch.cuda.mem_get_info()[0]
        emit(
            f"KV caches for {max_batch} sequences of {args.context} tokens: {kv_need / 1e9:.1f} "
            f"GB (latent and indexer keys in bf16, 61 layers + MTP); free {free / 1e9:.1f} GB"
        )
        if kv_need + args.headroom_gb * 1e9 > free:
            raise SystemExit(f"not enough memory: lower --context (now {args.context})")
        bench = DecodeBench(model, max_batch, args.context)
        for k in (0, MTP_K):  # one eager run of what the graphs capture, at b=1
            recorded, expected = (
                recorded_collectives(model, state, 1, k),
                step_collectives(config, 1, k),
            )
            emit(
                f"collectives of the shard's {'decode step' if k == 0 else f'MTP round k={k}'} "
                f"at b=1: {summarize_collectives(recorded)}; "
                f"{'equals' if recorded == expected else 'DIFFERS FROM'} what --collectives times"
            )
        if args.profile:
            from benchmarks.bench_decode import profile_step

            profile_step(bench, args.profile_batch, args.context)
            return
        graphs = bench.graphs(True, max_batch)
        emit(f"weights + caches: {torch.cuda.memory_allocated() / 1e9:.1f} GB allocated")

        steps, floors = {}, {}
        for b in args.batches:
            steps[b] = bench.graph_ms(graphs, b, args.context, 1)
            fb = floor_bytes(model, b, args.context)
            floors[b] = (fb["weights"] + fb["kv"]) / (bw * 1e6)
            emit(
                f"  b={b}: step {steps[b]:.2f} ms (graph replay), HBM floor {floors[b]:.2f} ms "
                f"(weights {fb['weights'] / 1e9:.2f} GB + KV {fb['kv'] / 1e9:.2f} GB), "
                f"{time.perf_counter() - started:.0f} s"
            )
        rounds, runner_steps = {}, {}
        if not args.skip_mtp:
            bench.runner.graphs = graphs
            bench.runner.proposer = MtpProposer(model, BLOCK, graphs)
            for b in args.batches:
                runner_steps[b] = bench.round_ms(b, args.context, 0, False)
                rounds[b] = bench.round_ms(b, args.context, MTP_K, False)
                emit(
                    f"  b={b}: runner step {runner_steps[b]:.2f} ms, MTP round k={MTP_K} "
                    f"{rounds[b]:.2f} ms (wall clock, host work and sampling included)"
                )
        emit(
            f"peak GPU memory {torch.cuda.max_memory_allocated() / 1e9:.1f} GB allocated, "
            f"{torch.cuda.max_memory_reserved() / 1e9:.1f} GB reserved; "
            f"{time.perf_counter() - started:.0f} s"
        )
    report(config, steps, floors, rounds, runner_steps, measured, args.context, emit)


def report(config, steps, floors, rounds, runner_steps, measured, context, emit) -> None:
    rows = measured["rows"] if measured else {}
    emit(
        f"\nexperts touched per rank (uniform group-limited routing, {config.n_routed_experts} "
        f"experts top-{config.num_experts_per_tok}, 32 a rank = one group): the floor assumes "
        "the mean; each MoE all-reduce waits for the busiest rank"
    )
    for b in steps:
        mean, busiest = experts_touched(config, b)
        emit(f"  b={b}: mean {mean:.1f}, busiest rank {busiest:.1f}")
    emit(
        f"\nprojection at context {context}: projected step = shard step + collectives (no "
        f"overlap assumed); the 8 GPUs serve b sequences a step, so tokens/s per GPU = "
        f"b / (8 x step s)"
    )
    emit(
        "\n| batch | shard step ms | HBM floor ms | x floor | collectives ms | projected step ms "
        "| tok/s per GPU | tok/s per instance |"
    )
    emit("|---|---|---|---|---|---|---|---|")
    for b, ms in steps.items():
        coll = rows.get(str(b), {}).get("decode_ms")
        if coll is None:
            emit(f"| {b} | {ms:.2f} | {floors[b]:.2f} | {ms / floors[b]:.2f} | - | - | - | - |")
            continue
        step = ms + coll
        emit(
            f"| {b} | {ms:.2f} | {floors[b]:.2f} | {ms / floors[b]:.2f} | {coll:.2f} | "
            f"{step:.2f} | {b / (TP_SIZE * step) * 1e3:.0f} | {b / step * 1e3:.0f} |"
        )
    if not rounds:
        return
    emit(
        f"\nMTP k={MTP_K}: a round yields 1 + a tokens a sequence (a: the draft's acceptance), "
        f"so tokens/s per GPU = b (1 + a) / (8 x round s); runner rounds are wall clock"
    )
    emit(
        "\n| batch | runner step ms (k=0) | round ms | collectives ms | projected round ms "
        "| tok/s per GPU, a=0 | a=1 |"
    )
    emit("|---|---|---|---|---|---|---|")
    for b, ms in rounds.items():
        coll = rows.get(str(b), {}).get(f"mtp_k{MTP_K}_ms")
        if coll is None:
            emit(f"| {b} | {runner_steps[b]:.2f} | {ms:.2f} | - | - | - | - |")
            continue
        total = ms + coll
        per_gpu = b / (TP_SIZE * total) * 1e3
        emit(
            f"| {b} | {runner_steps[b]:.2f} | {ms:.2f} | {coll:.2f} | {total:.2f} | "
            f"{per_gpu:.0f} | {2 * per_gpu:.0f} |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="the tiny config (the CPU smoke check)")
    ap.add_argument("--context", type=int, default=CONTEXT)
    ap.add_argument(
        "--batches",
        type=lambda v: tuple(int(b) for b in v.split(",")),
        default=BATCHES,
        help="sequences a step, comma-separated (default %(default)s)",
    )
    ap.add_argument("--collectives", action="store_true", help="only time the collectives")
    ap.add_argument("--world", type=int, default=None, help="GPUs for --collectives (all)")
    ap.add_argument("--json", default=None, help="--collectives: write the timings here")
    ap.add_argument("--collectives-json", default=None, help="timings from a --collectives run")
    ap.add_argument("--skip-mtp", action="store_true", help="no MTP rounds")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="print the kernels of one eager decode step (PDL off) and its graph replay, and exit",
    )
    ap.add_argument(
        "--profile-batch", type=int, default=1, help="with --profile: the decode step's batch"
    )
    ap.add_argument("--headroom-gb", type=float, default=4.0, help="left free beside the caches")
    ap.add_argument("--out", default=None, help="also write the output here")
    args = ap.parse_args(argv)
    lines = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    if args.device == "cpu" or args.tiny:
        if args.device != "cpu" or not args.tiny:
            ap.error("the tiny config runs on the CPU only: --device cpu --tiny")
        run_cpu_tiny(emit)
    else:
        commit = (
            os.environ.get("GIT_COMMIT")
            or subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            or "?"
        )
        emit(
            f"device {torch.cuda.get_device_name()}, "
            f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
            f"commit {commit}, torch {torch.__version__}"
        )
        if args.collectives:
            world = args.world or min(torch.cuda.device_count(), TP_SIZE)
            if world < 2:
                raise SystemExit("--collectives needs 2 or more GPUs")
            measured = measure_collectives(world, args.batches)
            print_collectives(measured, emit)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(measured, f, indent=1)
        else:
            run_gpu(args, emit)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
