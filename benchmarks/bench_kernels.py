"""Kernel benchmark at DeepSeek-V3.2 decode shapes on one GPU; prints a Markdown table.

    PYTHONPATH=$PWD python benchmarks/bench_kernels.py [--out results.md]

Times come from CUDA-graph replays (a graph of REPEATS calls, replayed, timed by CUDA events), so
launch overhead is what a captured decode step pays. Bytes are the HBM bytes the op must move at
least (inputs read once, outputs written once), so GB/s is a lower bound on achieved bandwidth,
compared with a device-to-device copy measured in the same run. Each kernel is timed with PDL on
(the gate's choice on Hopper) and off (MTPSERVE_DISABLE_PDL=1). Last, a chain of a few layers'
kernels as a decode step: graph with PDL, graph without, and the twins eagerly.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import itertools
import os
import subprocess
import sys
from collections.abc import Callable

import torch

from kernels import ops
from kernels.activation import silu_and_mul_triton
from kernels.cache_write import indexer_k_cache_write_triton, mla_kv_cache_write_triton
from kernels.indexer import indexer_logits_triton, indexer_topk_triton
from kernels.moe_experts import grouped_moe_triton
from kernels.moe_routing import moe_route_triton
from kernels.rmsnorm import rms_norm_triton
from kernels.rope import rope_cos_sin
from kernels.settings import reload_settings
from kernels.sparse_mla import sparse_mla_attention_triton

HIDDEN, NUM_HEADS, KV_LORA, ROPE = 7168, 128, 512, 64
INDEX_HEADS, INDEX_DIM, INDEX_TOPK = 64, 128, 2048
NUM_EXPERTS, TOP_K, NUM_GROUPS, TOPK_GROUPS, MOE_INTER = 256, 8, 8, 4, 2048
BLOCK = 64
BF16 = torch.bfloat16
CUDA = torch.device("cuda")
REPEATS = 20  # calls captured per graph
BATCHES = (1, 8, 32)
CONTEXTS = (1024, 8192)


def graph_time_us(fn: Callable[[], object], repeats: int = REPEATS, replays: int = 10) -> float:
    """Mean time per call of `fn` replayed inside a CUDA graph of `repeats` calls."""
    fn()  # compile
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * repeats)


def with_pdl(enabled: bool) -> None:
    if enabled:
        os.environ.pop("MTPSERVE_DISABLE_PDL", None)
    else:
        os.environ["MTPSERVE_DISABLE_PDL"] = "1"
    reload_settings()


def mma_tflops() -> float:
    a = torch.randn(8192, 8192, dtype=BF16, device=CUDA)
    return 2 * 8192**3 / eager_time_us(lambda: a @ a, iters=10) / 1e6


def copy_bandwidth_gbs() -> float:
    src = torch.randn(512 * 1024**2, dtype=torch.float32, device=CUDA)  # 2 GiB
    dst = torch.empty_like(src)
    # Eager, not in a graph: captured, a D2D copy_ becomes a memcpy node on the copy engines,
    # which ran at only ~2.7 TB/s here (commit 754cbe5), below what our kernels reach.
    us = eager_time_us(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() * 4 / us / 1e3  # read + write


def paged(num_seqs: int, context: int, width: int):
    blocks = context // BLOCK
    cache = torch.randn(num_seqs * blocks, BLOCK, width, dtype=BF16, device=CUDA)
    tables = torch.randperm(num_seqs * blocks, device=CUDA).to(torch.int32).view(num_seqs, blocks)
    return cache, tables


def cos_sin(positions):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, ROPE, 2, device=CUDA).float() / ROPE))
    return rope_cos_sin(positions, inv_freq)


def kernel_cases(batch: int, context: int, experts):
    """(name, fn, bytes) for each kernel at one decode shape (one token per sequence)."""
    w13, w2 = experts
    seq_idx = torch.arange(batch, device=CUDA, dtype=torch.int32)
    positions = torch.full((batch,), context - 1, device=CUDA, dtype=torch.int32)
    cos, sin = cos_sin(positions)
    slots = torch.arange(batch, device=CUDA) * context + context - 1
    cases = []
    x = torch.randn(batch, HIDDEN, dtype=BF16, device=CUDA)
    w = torch.randn(HIDDEN, dtype=BF16, device=CUDA)
    cases.append(
        ("rms_norm [B, 7168]", lambda: rms_norm_triton(x, w, 1e-6), 2 * (2 * x.numel() + HIDDEN))
    )
    gu = torch.randn(batch * TOP_K, 2 * MOE_INTER, dtype=BF16, device=CUDA)
    cases.append(
        ("silu_and_mul [8B, 2x2048]", lambda: silu_and_mul_triton(gu), 2 * gu.numel() * 3 // 2)
    )
    kv_cache, tables = paged(batch, context, KV_LORA + ROPE)
    kv_a = torch.randn(batch, KV_LORA + ROPE, dtype=BF16, device=CUDA)
    kv_w = torch.randn(KV_LORA, dtype=BF16, device=CUDA)
    cases.append(
        (
            "mla_kv_cache_write",
            lambda: mla_kv_cache_write_triton(kv_a, kv_w, 1e-6, cos, sin, kv_cache, slots),
            2 * 3 * kv_a.numel(),
        )
    )
    k_cache, _ = paged(batch, context, INDEX_DIM)
    k = torch.randn(batch, INDEX_DIM, dtype=BF16, device=CUDA)
    ln_w, ln_b = (
        torch.ones(INDEX_DIM, dtype=BF16, device=CUDA),
        torch.zeros(INDEX_DIM, dtype=BF16, device=CUDA),
    )
    cases.append(
        (
            "indexer_k_cache_write",
            lambda: indexer_k_cache_write_triton(k, ln_w, ln_b, 1e-6, cos, sin, k_cache, slots),
            2 * 3 * k.numel(),
        )
    )
    qi = torch.randn(batch, INDEX_HEADS, INDEX_DIM, dtype=BF16, device=CUDA)
    wi = torch.rand(batch, INDEX_HEADS, dtype=BF16, device=CUDA)
    idx_bytes = batch * (context * INDEX_DIM * 2 + qi[0].numel() * 2 + context * 4)
    cases.append(
        (
            "indexer logits",
            lambda: indexer_logits_triton(
                qi, wi, k_cache, tables, seq_idx, positions, INDEX_DIM**-0.5
            ),
            idx_bytes,
        )
    )
    cases.append(
        (
            "indexer_topk (logits + radix select)",
            lambda: indexer_topk_triton(
                qi, wi, k_cache, tables, seq_idx, positions, INDEX_TOPK, INDEX_DIM**-0.5
            ),
            idx_bytes,
        )
    )
    q = torch.randn(batch, NUM_HEADS, KV_LORA + ROPE, dtype=BF16, device=CUDA)
    topk = torch.stack(
        [torch.randperm(context, device=CUDA)[:INDEX_TOPK] for _ in range(batch)]
    ).to(torch.int32)
    num_keys = min(INDEX_TOPK, context)
    mla_bytes = batch * (
        num_keys * (KV_LORA + ROPE) * 2
        + q[0].numel() * 2
        + NUM_HEADS * KV_LORA * 2
        + INDEX_TOPK * 4
    )
    mla_gflop = batch * NUM_HEADS * num_keys * ((KV_LORA + ROPE) + KV_LORA) * 2 / 1e9
    cases.append(
        (
            f"sparse_mla_attention (top-2048, {mla_gflop:.1f} GFLOP)",
            lambda: sparse_mla_attention_triton(
                q, kv_cache, tables, seq_idx, topk, 192**-0.5, KV_LORA
            ),
            mla_bytes,
        )
    )
    logits = torch.randn(batch, NUM_EXPERTS, device=CUDA)
    bias = torch.randn(NUM_EXPERTS, device=CUDA) * 0.1
    cases.append(
        (
            "moe_route (256 -> 8)",
            lambda: moe_route_triton(logits, bias, NUM_GROUPS, TOPK_GROUPS, TOP_K, True, 2.5),
            logits.numel() * 4 + batch * TOP_K * 8,
        )
    )
    weights, ids = moe_route_triton(logits, bias, NUM_GROUPS, TOPK_GROUPS, TOP_K, True, 2.5)
    num_active = int(ids.unique().numel())
    moe_bytes = num_active * 3 * MOE_INTER * HIDDEN * 2 + 2 * x.numel() * 2
    cases.append(
        (
            f"grouped_moe ({num_active} experts)",
            lambda: grouped_moe_triton(x, w13, w2, weights, ids),
            moe_bytes,
        )
    )
    return cases


def decode_chain(num_layers: int, batch: int, context: int, experts):
    """One decode step's kernels for `num_layers` layers (each its own caches, shared experts)."""
    w13, w2 = experts
    seq_idx = torch.arange(batch, device=CUDA, dtype=torch.int32)
    positions = torch.full((batch,), context - 1, device=CUDA, dtype=torch.int32)
    cos, sin = cos_sin(positions)
    layers = []
    for _ in range(num_layers):
        kv_cache, tables = paged(batch, context, KV_LORA + ROPE)
        k_cache, _ = paged(batch, context, INDEX_DIM)
        layers.append((kv_cache, k_cache, tables))
    hidden = torch.randn(batch, HIDDEN, dtype=BF16, device=CUDA)
    norm_w = torch.randn(HIDDEN, dtype=BF16, device=CUDA)
    kv_a = torch.randn(batch, KV_LORA + ROPE, dtype=BF16, device=CUDA)
    kv_w = torch.randn(KV_LORA, dtype=BF16, device=CUDA)
    k = torch.randn(batch, INDEX_DIM, dtype=BF16, device=CUDA)
    ln_w, ln_b = (
        torch.ones(INDEX_DIM, dtype=BF16, device=CUDA),
        torch.zeros(INDEX_DIM, dtype=BF16, device=CUDA),
    )
    qi = torch.randn(batch, INDEX_HEADS, INDEX_DIM, dtype=BF16, device=CUDA)
    wi = torch.rand(batch, INDEX_HEADS, dtype=BF16, device=CUDA)
    q = torch.randn(batch, NUM_HEADS, KV_LORA + ROPE, dtype=BF16, device=CUDA)
    router = torch.randn(batch, NUM_EXPERTS, device=CUDA)
    bias = torch.randn(NUM_EXPERTS, device=CUDA) * 0.1

    gate_up = torch.randn(batch, 2 * 18432 // 8, dtype=BF16, device=CUDA)  # a dense MLP's, TP=8

    def step():
        for kv_cache, k_cache, tables in layers:
            slots = tables[:, -1].long() * BLOCK + BLOCK - 1
            normed = ops.rms_norm(hidden, norm_w, 1e-6)
            ops.mla_kv_cache_write(kv_a, kv_w, 1e-6, cos, sin, kv_cache, slots)
            ops.indexer_k_cache_write(k, ln_w, ln_b, 1e-6, cos, sin, k_cache, slots)
            topk = ops.indexer_topk(
                qi, wi, k_cache, tables, seq_idx, positions, INDEX_TOPK, INDEX_DIM**-0.5
            )
            ops.sparse_mla_attention(q, kv_cache, tables, seq_idx, topk, 192**-0.5, KV_LORA)
            ops.rms_norm(hidden, norm_w, 1e-6)
            weights, ids = ops.moe_route(router, bias, NUM_GROUPS, TOPK_GROUPS, TOP_K, True, 2.5)
            ops.grouped_moe(normed, w13, w2, weights, ids)
            ops.silu_and_mul(gate_up)

    return step


@contextlib.contextmanager
def _sparse_mla_tiles(names: tuple[str, ...], values: tuple):
    """kernels.sparse_mla's tile constants `names` set to `values` inside, put back after."""
    from kernels import sparse_mla

    saved = tuple(getattr(sparse_mla, n) for n in names)
    for name, value in zip(names, values, strict=True):
        setattr(sparse_mla, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved, strict=True):
            setattr(sparse_mla, name, value)


def sweep_sparse_mla(emit) -> None:
    """Decode tiles of the split kernel at batch 32, as the engine calls it (positions, rows of
    the picks then -1): context 8192 (every top-2048 entry used) and 1024 (half of them)."""
    names = ("_MLA_BLOCK_H", "_MLA_BLOCK_K", "_MLA_NUM_WARPS", "_MLA_NUM_STAGES", "_MLA_PREFETCH")
    cases = []
    for context in (8192, 1024):
        args, positions = sparse_mla_rows(False, 32, context)
        cases.append(functools.partial(sparse_mla_attention_triton, *args, positions))
    emit()
    with_pdl(True)
    emit("sparse-MLA tiles, batch 32 (graph replays, PDL on), us; prefetch: the next tile's")
    emit("indices loaded while a tile's keys load")
    emit("| BLOCK_H | BLOCK_K | warps | stages | prefetch | context 8192 | context 1024 |")
    emit("|---|---|---|---|---|---|---|")
    tiles = ((64, 32, 8), (32, 64, 8), (32, 32, 4))
    for (block_h, block_k, warps), stages, prefetch in itertools.product(tiles, (2, 3), (0, 1, 2)):
        config = (block_h, block_k, warps, stages, prefetch)
        try:
            with _sparse_mla_tiles(names, config):
                times = [f"{graph_time_us(fn):.1f}" for fn in cases]
        except Exception as error:  # OutOfResources and friends: not this config
            times = [f"failed ({type(error).__name__})"] * 2
        emit(f"| {' | '.join(map(str, config))} | {times[0]} | {times[1]} |")


def sweep_sparse_mla_prefill(emit) -> None:
    """Tiles of the split kernel for a 2048-token prefill chunk (one split: its programs write
    the output, with _MLA_DIRECT_BLOCK_K keys a step), as the engine calls it (positions, rows
    of min(2048, p + 1) picks then -1), at context 0, 8192 and 30000. Each config's output
    against the shipped config's: the same bits, or the largest difference."""
    names = ("_MLA_BLOCK_H", "_MLA_DIRECT_BLOCK_K", "_MLA_NUM_WARPS", "_MLA_NUM_STAGES")
    contexts = (0, 8192, 30000)
    cases = []
    for context in contexts:
        args, positions = sparse_mla_rows(True, 2048, context)
        cases.append(functools.partial(sparse_mla_attention_triton, *args, positions))
    shipped = [fn() for fn in cases]
    emit()
    with_pdl(True)
    emit("sparse-MLA tiles, one 2048-token prefill chunk (graph replays, PDL on), us per call;")
    emit("last column: against the shipped config's output (bits, or the largest difference)")
    head = " | ".join(f"context {c}" for c in contexts)
    emit(f"| BLOCK_H | BLOCK_K | warps | stages | {head} | output |")
    emit("|---|---|---|---|" + "---|" * len(contexts) + "---|")
    tiles = ((64, 64, 8), (64, 32, 8), (64, 64, 16), (128, 32, 16), (32, 128, 8), (32, 64, 4))
    for (block_h, block_k, warps), stages in itertools.product(tiles, (1, 2, 3)):
        config = (block_h, block_k, warps, stages)
        try:
            with _sparse_mla_tiles(names, config):
                times = [f"{graph_time_us(fn, repeats=4, replays=3):.0f}" for fn in cases]
                diffs = [
                    (fn().float() - want.float()).abs().max().item()
                    for fn, want in zip(cases, shipped, strict=True)
                ]
            output = "same bits" if max(diffs) == 0 else f"max diff {max(diffs):.2e}"
        except Exception as error:  # OutOfResources and friends: not this config
            times = [f"failed ({type(error).__name__})"] * len(contexts)
            output = ""
        emit(f"| {' | '.join(map(str, config))} | {' | '.join(times)} | {output} |")


def sparse_mla_rows(prefill: bool, tokens: int, context: int):
    """-> (sparse_mla_attention_triton's arguments without positions, positions): `tokens`
    rows as the indexer makes them (a token at p has min(2048, p + 1) picks, then -1) of a
    prefill chunk of one sequence after `context` cached tokens, or of `tokens` decoding
    sequences at `context`."""
    num_seqs = 1 if prefill else tokens
    length = context + tokens if prefill else context
    kv_cache, tables = paged(num_seqs, max(BLOCK, -(-length // BLOCK) * BLOCK), KV_LORA + ROPE)
    if prefill:
        seq_idx = torch.zeros(tokens, device=CUDA, dtype=torch.int32)
        positions = torch.arange(context, context + tokens, device=CUDA)
    else:
        seq_idx = torch.arange(tokens, device=CUDA, dtype=torch.int32)
        positions = torch.full((tokens,), context - 1, device=CUDA)
    ranks = torch.arange(INDEX_TOPK, device=CUDA)[None, :]
    picks = torch.randint(0, 2**30, (tokens, INDEX_TOPK), device=CUDA) % (positions[:, None] + 1)
    topk = torch.where(ranks <= positions[:, None], picks, -1).to(torch.int32)
    q = torch.randn(tokens, NUM_HEADS, KV_LORA, dtype=BF16, device=CUDA)
    q_rope = torch.randn(tokens, NUM_HEADS, ROPE, dtype=BF16, device=CUDA)
    return (q, kv_cache, tables, seq_idx, topk, 192**-0.5, KV_LORA, q_rope), positions


def mla_used_entries_table(emit) -> None:
    """Sparse MLA with and without each token's position: rows as the indexer makes them (a
    token at p has min(2048, p + 1) picks, then -1); given positions the kernel reads only the
    picks. A 2048-token prefill chunk at context 0 and 8192, and decode rows (batch 1 and 32)
    at context 1024 and 8192."""
    emit(
        "\nSparse MLA, rows of min(2048, p + 1) picks (graph replays, PDL on; us per call, "
        "best of three alternated):"
    )
    emit("| case | tokens | context | every entry | the picks only (positions) | x |")
    emit("|---|---|---|---|---|---|")
    with_pdl(True)
    cases = [("prefill chunk", 2048, 0), ("prefill chunk", 2048, 8192)]
    cases += [("decode", batch, context) for context in (1024, 8192) for batch in (1, 32)]
    for name, tokens, context in cases:
        args, positions = sparse_mla_rows(name.startswith("prefill"), tokens, context)
        calls = (
            functools.partial(sparse_mla_attention_triton, *args),
            functools.partial(sparse_mla_attention_triton, *args, positions),
        )
        times: list[list[float]] = [[], []]
        for _ in range(3):  # alternated, the best of each: the GPU's clock drifts over a run
            for i, call in enumerate(calls):
                times[i].append(graph_time_us(call, 4))
        every, used = min(times[0]), min(times[1])
        emit(f"| {name} | {tokens} | {context} | {every:.1f} | {used:.1f} | {every / used:.2f} |")


def select_times_us(batch: int, context: int) -> list[float]:
    """One row of `select_table`: each token at the last position of its own sequence."""
    from kernels.indexer import key_histogram, topk_select_reference, topk_select_triton

    k_cache, tables = paged(batch, context, INDEX_DIM)
    seq_idx = torch.arange(batch, device=CUDA, dtype=torch.int32)
    positions = torch.full((batch,), context - 1, device=CUDA, dtype=torch.int32)
    qi = torch.randn(batch, INDEX_HEADS, INDEX_DIM, dtype=BF16, device=CUDA)
    wi = torch.rand(batch, INDEX_HEADS, dtype=BF16, device=CUDA) * INDEX_HEADS**-0.5
    args = (qi, wi, k_cache, tables, seq_idx, positions)
    logits = indexer_logits_triton(*args, INDEX_DIM**-0.5)
    hist = key_histogram(logits, positions, INDEX_TOPK)
    # The logits kernel as the op runs it, counting a histogram (its counts pile up over the
    # replays; an atomic add costs the same whatever the count).
    scratch = torch.zeros_like(hist)
    return [
        graph_time_us(lambda: indexer_topk_triton(*args, INDEX_TOPK, INDEX_DIM**-0.5)),
        graph_time_us(lambda: indexer_logits_triton(*args, INDEX_DIM**-0.5, scratch, INDEX_TOPK)),
        graph_time_us(lambda: topk_select_triton(logits, positions, INDEX_TOPK, hist)),
        graph_time_us(lambda: topk_select_reference(logits, positions, INDEX_TOPK)),
    ]


def select_table(emit) -> None:
    """The indexer's top-k at long contexts: the whole op (logits kernel with its histogram, then
    the select), the logits kernel alone (with its histogram), the select alone (histogram given)
    and the twin's masked torch.topk over the same logits, PDL on."""
    emit("\nIndexer top-2048 at long context (graph replays, PDL on; us per call):")
    emit("| batch | context | logits + select | logits alone | select alone | torch.topk (twin) |")
    emit("|---|---|---|---|---|---|")
    for context in (1024, 4096, 8192, 32768, 131072):
        for batch in (1, 8):
            times = select_times_us(batch, context)
            emit(f"| {batch} | {context} | " + " | ".join(f"{t:.1f}" for t in times) + " |")


def eager_time_us(fn, iters: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None, help="also write the Markdown here")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--commit", default=None, help="git commit (the device copy has no .git)")
    parser.add_argument(
        "--sweep-mla", action="store_true", help="only a sweep of sparse-MLA decode tile configs"
    )
    parser.add_argument(
        "--sweep-mla-prefill",
        action="store_true",
        help="only a sweep of sparse-MLA tile configs for a 2048-token prefill chunk",
    )
    parser.add_argument("--select", action="store_true", help="only the long-context top-k table")
    parser.add_argument(
        "--mla-used",
        action="store_true",
        help="only sparse MLA with and without positions (the picks only)",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    lines = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    commit = (
        args.commit
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        or "unknown"
    )
    import triton

    emit(
        f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
        f"{triton.__version__}; date {datetime.date.today()}; commit {commit}"
    )
    emit(f"command: PYTHONPATH=$PWD python {' '.join(sys.argv)}")
    copy = copy_bandwidth_gbs()
    emit(f"measured copy bandwidth (2 GiB D2D, read + write): {copy:.0f} GB/s")
    if args.select:
        select_table(emit)
    elif args.mla_used:
        mla_used_entries_table(emit)
    elif args.sweep_mla:
        sweep_sparse_mla(emit)
    elif args.sweep_mla_prefill:
        sweep_sparse_mla_prefill(emit)
    else:
        kernel_tables(args, emit, copy)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


def kernel_tables(args, emit, copy: float) -> None:
    emit()
    w13 = torch.randn(NUM_EXPERTS, 2 * MOE_INTER, HIDDEN, dtype=BF16, device=CUDA) * 0.02
    w2 = torch.randn(NUM_EXPERTS, HIDDEN, MOE_INTER, dtype=BF16, device=CUDA) * 0.02
    emit("bf16 MMA rate for compute-bound rows: 8192^3 matmul " + f"{mma_tflops():.0f} TFLOP/s")
    emit()
    emit(
        "| kernel | batch | context | MB moved | us (PDL off) | us (PDL on) | GB/s (on) "
        "| % of copy |"
    )
    emit("|---|---|---|---|---|---|---|---|")
    for context in CONTEXTS:
        for batch in BATCHES:
            for name, fn, nbytes in kernel_cases(batch, context, (w13, w2)):
                if context != CONTEXTS[-1] and not name.startswith(
                    ("indexer logits", "indexer_topk", "sparse")
                ):
                    continue  # context-independent: report once
                times = {}
                try:
                    for pdl in (False, True):
                        with_pdl(pdl)
                        times[pdl] = graph_time_us(fn)
                except Exception as error:  # keep the rest of the table
                    emit(
                        f"| {name} | {batch} | {context} | failed: {type(error).__name__}: "
                        f"{str(error)[:120]} |"
                    )
                    continue
                gbs = nbytes / times[True] / 1e3
                emit(
                    f"| {name} | {batch} | {context} | {nbytes / 1e6:.2f} | {times[False]:.1f} "
                    f"| {times[True]:.1f} | {gbs:.0f} | {100 * gbs / copy:.0f}% |"
                )
    emit()
    emit(f"Decode-step chain, {args.layers} layers of these kernels (8 launches+ per layer):")
    emit(
        "| batch | context | twins eager (us) | graph, PDL off (us) | graph, PDL on (us) "
        "| PDL saves |"
    )
    emit("|---|---|---|---|---|---|")
    for batch, context in ((1, 8192), (8, 8192), (32, 8192)):
        step = decode_chain(args.layers, batch, context, (w13, w2))
        os.environ["MTPSERVE_FORCE_REFERENCE"] = "1"
        reload_settings()
        twins = eager_time_us(step, iters=2)
        del os.environ["MTPSERVE_FORCE_REFERENCE"]
        reload_settings()
        times = {}
        for pdl in (False, True):
            with_pdl(pdl)
            times[pdl] = graph_time_us(step, repeats=2, replays=10)
        emit(
            f"| {batch} | {context} | {twins:.0f} | {times[False]:.0f} | {times[True]:.0f} | "
            f"{100 * (1 - times[True] / times[False]):.1f}% |"
        )
    with_pdl(True)


if __name__ == "__main__":
    main()
