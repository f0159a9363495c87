"""GPU: the FP8 linears at DeepSeek-V3.2's projection shapes against the bf16 GEMM, cuBLASLt's FP8
GEMM (torch._scaled_mm, per-tensor scales) and the HBM floor of reading the FP8 weights once.

Default: one markdown table, the shipped tile configs: w8a16 (kernels/fp8_linear.py, weights
dequantized in registers) and w8a8 (kernels/fp8_gemm.py, activations quantized per token and 128,
then FP8 x FP8 tensor cores; the time includes the quantization), and the same w8a8 product on
cuBLASLt's block-scaled GEMM (kernels/fp8_cublaslt.py) with its error against the twin.

--sweep: for each projection and M in SWEEP_TOKENS, a small grid of tile configs of both kernels
(w8a16 on UE8M0 scales, as DeepSeek-V3.2 ships them); prints the best per (projection, M), then
dict literals to paste into kernels/fp8_linear.py (W8A16_CONFIGS) and kernels/fp8_gemm.py
(W8A8_CONFIGS, W8A8_MIN_TOKENS): per M the config with the smallest geometric mean over the
projections of its time / that projection's best time.
Every time is a CUDA graph of back-to-back calls replayed, the median of five replays (launch
overhead excluded).

Both tables add w8a16 on the same weights with UE8M0 scales (each a power of two, as
DeepSeek-V3.1 and later ship them), where the kernels scale each k step's product instead of
every weight element (`pow2_scales`); one row with them takes the CUDA-core kernel (the table
shows the tensor-core kernel's time beside it in brackets; the sweep tunes W8A16_GEMV_CONFIG).

--moe: the routed experts of one DeepSeek-V3.2 MoE layer (256 FP8 experts, hidden 7168,
intermediate 2048, top-8 of random router logits) at 512 / 2048 / 8192 tokens: w8a16
(kernels/moe_experts.py) against w8a8 (kernels/moe_experts_w8a8.py, its act_quant included), with
the layer's floor: the FP8 bytes of the experts hit plus x and the output at the copy bandwidth,
and its FLOPs at the FP8 and bf16 dense GEMM rates measured here (torch._scaled_mm, matmul).
--moe --sweep: tile configs of the w8a8 grouped kernels per token count (the gate/up tile and the
layout's block_m; the down GEMM keeps W8A8_DOWN_CONFIG's N tile, warps and stages), then the one
nearest every count's best (geometric mean), as a literal for W8A8_CONFIG.
--moe --sweep-down: the down GEMM's own tile (W8A8_DOWN_CONFIG: block_n, warps, stages; block_m
is the layout's) with the gate/up tile as shipped, per token count, with each layer's time
against its HBM floor; then the nearest every count's best, as a literal for W8A8_DOWN_CONFIG.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from functools import partial

import torch

from benchmarks.bench_kernels import copy_bandwidth_gbs
from kernels.fp8 import (
    FP8_DTYPE,
    fp8_linear_act_quant_reference,
    quantize_fp8_reference,
    scale_grid,
    to_fp8,
)
from kernels.fp8_act_quant import quantize_activations_triton
from kernels.fp8_cublaslt import cublaslt_block_scaled, cublaslt_shape_ok, fp8_gemm_cublaslt
from kernels.fp8_gemm import fp8_linear_w8a8_triton
from kernels.fp8_linear import (
    W8A16_CONFIGS,
    Fp8GemvConfig,
    Fp8TileConfig,
    config_for_rows,
    fp8_linear_triton,
)
from kernels.moe_experts import GroupedGemmConfig, grouped_moe_triton
from kernels.moe_experts_w8a8 import W8A8_CONFIG, W8A8_DOWN_CONFIG, grouped_moe_w8a8_triton
from kernels.moe_routing import moe_route_triton

SHAPES = {
    "q_a 1536x7168": (1536, 7168),
    "kv_a 576x7168": (576, 7168),
    "q_a+kv_a 2112x7168": (2112, 7168),
    "q_b 24576x1536": (24576, 1536),
    "o_proj 7168x16384": (7168, 16384),
    "mlp gate+up 36864x7168": (36864, 7168),
    "mlp down 7168x18432": (7168, 18432),
}
SWEEP_TOKENS = (1, 16, 32, 64, 128, 256, 2048)
# (num_warps, num_stages) pairs tried for every tile shape. The grid is small on purpose: every
# tile shape x pair is one compile, and a fresh Triton cache pays them all (the whole sweep is
# meant to take a few minutes).
W8A16_WARPS_STAGES = ((4, 3), (4, 4), (4, 5), (8, 4))
W8A8_WARPS_STAGES = ((4, 3), (4, 4), (8, 3), (8, 4))


def graph_us(fn, reps: int | None = None, replays: int = 5) -> float:
    """Time of one call of `fn`: a CUDA graph of `reps` back-to-back calls replayed `replays`
    times, the median replay's mean. Without `reps`, as many calls as make about 2 ms (3 to
    50), so a sweep's slow configs cost little."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if reps is None:
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        reps = max(3, min(50, int(2.0 / max(start.elapsed_time(end), 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):  # the median replay: one slow replay does not move it
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]


def w8a16_candidates(num_tokens: int) -> list[Fp8TileConfig]:
    block_ns = (32, 64, 128)
    if num_tokens <= 16:
        block_ms, splits = (16,), (132, 264, 528, 1056)
    elif num_tokens <= 32:  # MTP verify rows and b=32 decode: a 32-row tile pads nothing
        # 32-row tiles (64-row ones lost on every projection: BENCHMARKS.md, session 20), the
        # UE8M0 scale on each k step's product or on each weight element.
        # A tile re-reads the rows' activations from L2: at 32 bf16 rows as many bytes per k
        # step as 64 FP8 weight columns, so wider tiles read fewer of them.
        return [
            Fp8TileConfig(32, block_n, warps, stages, split, scale_products)
            for block_n, (warps, stages), split, scale_products in itertools.product(
                (32, 64, 128, 256), W8A16_WARPS_STAGES, (264, 528, 1056), (False, True)
            )
        ]
    else:
        block_ms, splits = (64,), (132, 264, 528) if num_tokens <= 128 else (1, 132)
    return [
        Fp8TileConfig(block_m, block_n, warps, stages, split)
        for block_m, block_n, (warps, stages), split in itertools.product(
            block_ms, block_ns, W8A16_WARPS_STAGES, splits
        )
    ]


GEMV_CANDIDATES = [
    Fp8GemvConfig(block_n, block_k, warps, split)
    for block_n, block_k, warps, split in itertools.product(
        (16, 32, 64), (256, 512), (4, 8), (264, 528, 1056)
    )
]


def w8a8_candidates(num_tokens: int) -> list[Fp8TileConfig]:
    if num_tokens <= 16:
        block_ms, splits = (16,), (132, 264, 528)
    elif num_tokens <= 128:
        block_ms, splits = (64,), (132, 264)
    else:
        block_ms, splits = (64, 128), (1, 132)
    return [
        Fp8TileConfig(block_m, block_n, warps, stages, split)
        for block_m, block_n, (warps, stages), split in itertools.product(
            block_ms, (64, 128), W8A8_WARPS_STAGES, splits
        )
    ]


def peers_us(x: torch.Tensor, w_bf16: torch.Tensor, weight: torch.Tensor) -> tuple[float, float]:
    """(bf16 cuBLAS, cuBLASLt FP8 with per-tensor scales) for these activations and weight."""
    one = torch.ones((), device="cuda")
    bf16 = graph_us(partial(torch.matmul, x, w_bf16.t()))
    pad = -(-max(16, x.shape[0]) // 16) * 16  # _scaled_mm needs rows in multiples of 16
    x8 = torch.zeros(pad, x.shape[1], device="cuda").to(torch.float8_e4m3fn)
    scaled = graph_us(partial(torch._scaled_mm, x8, weight.t(), one, one, out_dtype=torch.bfloat16))
    return bf16, scaled


def cublaslt_us(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> str:
    """cuBLASLt's block-scaled w8a8 (kernels/fp8_cublaslt.py, the activations' quantization
    included) and its largest error against the twin, relative to the largest output; "n/a"
    where this PyTorch / device or the shape does not take it."""
    if not (cublaslt_block_scaled(x.device) and cublaslt_shape_ok(*weight.shape)):
        return "n/a"

    def run():
        q, q_scale = quantize_activations_triton(x, scales_token_major=True, rows_multiple=16)
        return fp8_gemm_cublaslt(q, q_scale, weight, scale, x.dtype)[: x.shape[0]]

    want = fp8_linear_act_quant_reference(x.float(), weight, scale)
    err = ((run().float() - want).abs().max() / want.abs().max()).item()
    return f"{graph_us(run, reps=50):.1f} ({err:.0e})"


def floor_us(n: int, k: int, t: int, bw: float) -> float:
    return (n * k + t * k * 2 + t * n * 2) / bw * 1e6


def table(shapes: dict, tokens: list[int], bw: float) -> None:
    print(
        "| projection | tokens | w8a16 us | w8a16 UE8M0 us | w8a8 us | floor us | bf16 cuBLAS us "
        "| fp8 _scaled_mm us | w8a8 cuBLASLt block-scaled us (error) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda") * k**-0.5
        weight, scale = quantize_fp8_reference(w)
        # UE8M0 scales (powers of two, as DeepSeek-V3.1 and later ship them): the w8a16
        # kernel's POW2_SCALES path.
        weight_ue8m0, scale_ue8m0 = quantize_fp8_reference(w, pow2_scales=True)
        w_bf16 = w.bfloat16()
        for t in tokens:
            x = torch.randn(t, k, dtype=torch.bfloat16, device="cuda")
            w8a16 = graph_us(partial(fp8_linear_triton, x, weight, scale), reps=50)
            ue8m0_fn = partial(fp8_linear_triton, x, weight_ue8m0, scale_ue8m0, pow2_scales=True)
            ue8m0 = f"{graph_us(ue8m0_fn, reps=50):.1f}"
            if t == 1:  # the one-row kernel; in brackets the tensor-core kernel it replaces
                tiles = partial(ue8m0_fn, config=config_for_rows(1, W8A16_CONFIGS))
                ue8m0 += f" ({graph_us(tiles, reps=50):.1f})"
            w8a8 = graph_us(partial(fp8_linear_w8a8_triton, x, weight, scale), reps=50)
            bf16, scaled = peers_us(x, w_bf16, weight)
            print(
                f"| {name} | {t} | {w8a16:.1f} | {ue8m0} | {w8a8:.1f} "
                f"| {floor_us(n, k, t, bw):.1f} | {bf16:.1f} | {scaled:.1f} "
                f"| {cublaslt_us(x, weight, scale)} |",
                flush=True,
            )


def _geomean_best(results: dict, kernel: str, t: int, shapes: dict):
    """The config whose time / best time, geometric mean over the shapes, is smallest."""
    return _nearest_every_best([results[(name, t)][kernel] for name in shapes])


def _nearest_every_best(runs: list[dict]):
    """Over runs of {config: time}: the config whose time / that run's best time, geometric
    mean over the runs it completed all of, is smallest."""
    scores: dict = {}
    for timings in runs:
        best = min(timings.values())
        for config, us in timings.items():
            scores.setdefault(config, []).append(math.log(us / best))
    complete = {c: s for c, s in scores.items() if len(s) == len(runs)}
    return min(complete, key=lambda c: sum(complete[c]))


def sweep(shapes: dict, tokens: list[int], bw: float) -> None:
    results: dict = {}  # (shape, t) -> {"w8a16": {config: us}, "w8a8": {...}, "peers": (..)}
    print(
        "| projection | tokens | best w8a16 us | config | best w8a8 us | config | floor us "
        "| bf16 cuBLAS us | fp8 _scaled_mm us |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda") * k**-0.5
        weight, scale = quantize_fp8_reference(w)
        # w8a16 is tuned on UE8M0 scales where its kernel takes them (decode tiles), the scales
        # DeepSeek-V3.1 and later ship; elsewhere the kernel is the same for both.
        weight_ue8m0, scale_ue8m0 = quantize_fp8_reference(w, pow2_scales=True)
        w8a16_ue8m0 = partial(fp8_linear_triton, pow2_scales=True)
        w_bf16 = w.bfloat16()
        for t in tokens:
            x = torch.randn(t, k, dtype=torch.bfloat16, device="cuda")
            row: dict = {"w8a16": {}, "w8a8": {}}
            kernels = [
                ("w8a16", w8a16_ue8m0, (weight_ue8m0, scale_ue8m0), w8a16_candidates(t)),
                ("w8a8", fp8_linear_w8a8_triton, (weight, scale), w8a8_candidates(t)),
            ]
            if t == 1:  # the one-row CUDA-core kernel (UE8M0 scales only)
                row["one-row"] = {}
                kernels.append(
                    ("one-row", w8a16_ue8m0, (weight_ue8m0, scale_ue8m0), GEMV_CANDIDATES)
                )
            for kernel, fn, (wt, sc), candidates in kernels:
                for config in candidates:
                    try:
                        fn_config = partial(fn, x, wt, sc, config=config)
                        row[kernel][config] = graph_us(fn_config)
                    except Exception as error:  # OutOfResources and friends: not this config
                        print(f"  skipped {kernel} {config}: {type(error).__name__}")
            results[(name, t)] = row
            bf16, scaled = peers_us(x, w_bf16, weight)
            best = {kernel: min(row[kernel].items(), key=lambda kv: kv[1]) for kernel in row}
            print(
                f"| {name} | {t} | {best['w8a16'][1]:.1f} | {_short(best['w8a16'][0])} "
                f"| {best['w8a8'][1]:.1f} | {_short(best['w8a8'][0])} "
                f"| {floor_us(n, k, t, bw):.1f} | {bf16:.1f} | {scaled:.1f} |",
                flush=True,
            )
            if "one-row" in best:
                print(f"|  | one-row | {best['one-row'][1]:.1f} | {best['one-row'][0]} |")
        del w, weight, scale, weight_ue8m0, scale_ue8m0, w_bf16
        torch.cuda.empty_cache()

    # One config per M over all the shapes, and where w8a8 starts to win.
    print("\nPer M, the config nearest every projection's best (geometric mean), and the sum of")
    print("the projections' times with it:\n")
    print("| tokens | w8a16 sum us | w8a8 sum us |")
    print("|---|---|---|")
    picks: dict = {"w8a16": {}, "w8a8": {}}
    sums: dict = {}
    for t in tokens:
        for kernel in picks:
            picks[kernel][t] = _geomean_best(results, kernel, t, shapes)
        sums[t] = {
            kernel: sum(results[(name, t)][kernel][picks[kernel][t]] for name in shapes)
            for kernel in picks
        }
        print(f"| {t} | {sums[t]['w8a16']:.1f} | {sums[t]['w8a8']:.1f} |")
    print("\nPer M, the w8a16 configs of the smallest sum over the projections (a step's time):\n")
    for t in tokens:
        runs = [results[(name, t)]["w8a16"] for name in shapes]
        common = set.intersection(*(set(r) for r in runs))
        by_sum = sorted(common, key=lambda c: sum(r[c] for r in runs))
        for config in by_sum[:5]:
            print(f"  {t}: {sum(r[config] for r in runs):.1f} us  {_short(config)}")
    wins = [sums[t]["w8a8"] < sums[t]["w8a16"] for t in tokens]
    min_tokens = next((t for i, t in enumerate(tokens) if all(wins[i:])), None)
    print("\n# kernels/fp8_linear.py")
    print("W8A16_CONFIGS: dict[int, Fp8TileConfig] = {")
    for t, c in picks["w8a16"].items():
        print(f"    {t}: {c!r},")
    print("}")
    print("# kernels/fp8_gemm.py")
    print("W8A8_CONFIGS: dict[int, Fp8TileConfig] = {")
    for t, c in picks["w8a8"].items():
        print(f"    {t}: {c!r},")
    print("}")
    if 1 in tokens:
        pick = _nearest_every_best([results[(name, 1)]["one-row"] for name in shapes])
        total = sum(results[(name, 1)]["one-row"][pick] for name in shapes)
        print(f"W8A16_GEMV_CONFIG = {pick!r}  # one row: {total:.1f} us over the projections")
    if min_tokens is None:
        print("# W8A8_MIN_TOKENS: w8a8 never stayed ahead of w8a16 up to the largest M swept")
    else:
        print(f"W8A8_MIN_TOKENS = {min_tokens}  # from here on w8a8's sum stays below w8a16's")


# DeepSeek-V3.2's routed experts: hidden, intermediate, experts, top-k, groups, groups kept.
MOE_HIDDEN, MOE_INTER, MOE_EXPERTS, MOE_TOP_K, MOE_GROUPS, MOE_TOPK_GROUPS = (
    7168,
    2048,
    256,
    8,
    8,
    4,
)
MOE_TOKENS = (512, 2048, 8192)


def moe_experts(num_experts: int = MOE_EXPERTS) -> tuple[torch.Tensor, ...]:
    """Random FP8 experts (w13, w2, w13_scale, w2_scale), an expert at a time (11.3 GB)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter = MOE_HIDDEN, MOE_INTER
    w13 = torch.empty(num_experts, 2 * inter, hidden, dtype=FP8_DTYPE, device="cuda")
    w2 = torch.empty(num_experts, hidden, inter, dtype=FP8_DTYPE, device="cuda")
    for e in range(num_experts):
        w13[e] = to_fp8(torch.randn(w13.shape[1:], generator=gen, device="cuda") * 64)
        w2[e] = to_fp8(torch.randn(w2.shape[1:], generator=gen, device="cuda") * 64)
    grid_13, grid_2 = scale_grid(inter, hidden), scale_grid(hidden, inter)
    w13_scale = torch.rand(num_experts, 2, *grid_13, generator=gen, device="cuda") * 3e-4 + 1e-4
    w2_scale = torch.rand(num_experts, *grid_2, generator=gen, device="cuda") * 3e-4 + 1e-4
    return w13, w2, w13_scale, w2_scale


def moe_step(num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [T, hidden] bf16, topk_weights, topk_ids) of a step routed by random logits."""
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, MOE_HIDDEN, generator=gen, device="cuda").bfloat16()
    logits = torch.randn(num_tokens, MOE_EXPERTS, generator=gen, device="cuda")
    bias = torch.zeros(MOE_EXPERTS, device="cuda")
    weights, ids = moe_route_triton(logits, bias, MOE_GROUPS, MOE_TOPK_GROUPS, MOE_TOP_K, True, 2.5)
    return x, weights, ids


def dense_tflops() -> tuple[float, float]:
    """(FP8, bf16) dense GEMM rates measured here on 8192^3: torch._scaled_mm (per-tensor
    scales, bf16 out) and torch.matmul."""
    n = 8192
    a = torch.randn(n, n, device="cuda")
    a8, b8 = a.to(torch.float8_e4m3fn), a.t().contiguous().to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    fp8_us = graph_us(
        partial(torch._scaled_mm, a8, b8, one, one, out_dtype=torch.bfloat16), reps=20
    )
    bf16_us = graph_us(partial(torch.matmul, a.bfloat16(), a.bfloat16()), reps=20)
    flops = 2 * n**3
    return flops / fp8_us / 1e6, flops / bf16_us / 1e6


def moe_table(tokens: list[int], bw: float) -> None:
    """w8a16 vs w8a8 for one MoE layer's routed experts, and the layer's floors."""
    fp8_tflops, bf16_tflops = dense_tflops()
    print(f"dense GEMM 8192^3: FP8 {fp8_tflops:.0f} TFLOP/s, bf16 {bf16_tflops:.0f} TFLOP/s\n")
    w13, w2, w13_scale, w2_scale = moe_experts()
    expert_bytes = 3 * MOE_INTER * MOE_HIDDEN + (w13_scale[0].numel() + w2_scale[0].numel()) * 4
    # The same experts with UE8M0 scales (each rounded to a power of two, as DeepSeek-V3.1 and
    # later ship them): the w8a16 kernels' POW2_SCALES path.
    pow2 = [torch.exp2(torch.round(torch.log2(s))) for s in (w13_scale, w2_scale)]
    print(
        "| tokens | experts hit | w8a16 ms | w8a16 UE8M0 ms | w8a8 ms | w8a8 speed-up "
        "| HBM floor ms | FP8 FLOP floor ms | bf16 FLOP floor ms | w8a16 UE8M0 x floor "
        "| w8a8 x floor |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for t in tokens:
        x, weights, ids = moe_step(t)
        args = (x, w13, w2, weights, ids, 0, w13_scale, w2_scale)
        w8a16 = graph_us(partial(grouped_moe_triton, *args)) / 1e3
        fast = graph_us(partial(grouped_moe_triton, *args[:6], *pow2, pow2_scales=True)) / 1e3
        w8a8 = graph_us(partial(grouped_moe_w8a8_triton, *args)) / 1e3
        hit = int(ids.unique().numel())
        hbm = (hit * expert_bytes + 2 * x.numel() * 2) / bw * 1e3
        flops = ids.numel() * 3 * MOE_INTER * MOE_HIDDEN * 2
        fp8_floor, bf16_floor = flops / fp8_tflops / 1e9, flops / bf16_tflops / 1e9
        print(
            f"| {t} | {hit} | {w8a16:.3f} | {fast:.3f} | {w8a8:.3f} | {w8a16 / w8a8:.2f}x "
            f"| {hbm:.3f} | {fp8_floor:.3f} | {bf16_floor:.3f} "
            f"| {fast / max(hbm, bf16_floor):.2f} | {w8a8 / max(hbm, fp8_floor):.2f} |",
            flush=True,
        )


def moe_w8a8_candidates() -> list[GroupedGemmConfig]:
    return [
        GroupedGemmConfig(block_m, block_n, 128, warps, stages)
        for block_m, block_n, (warps, stages) in itertools.product(
            (32, 64, 128), (128, 256), ((4, 3), (4, 4), (8, 3), (8, 4))
        )
    ]


def moe_sweep(tokens: list[int]) -> None:
    """The w8a8 grouped kernels over `moe_w8a8_candidates` at each token count. Every config's
    output is also compared with the shipped config's: the largest difference over the
    output's largest magnitude, across every config, is the last column (tiles change no
    rounding but the order of the atomic adds across a token's experts: ~1e-3 is bf16's)."""
    w13, w2, w13_scale, w2_scale = moe_experts()
    runs: list[dict] = []  # per token count {config: us}
    print(
        "| tokens | w8a16 ms (shipped) | best w8a8 ms | config | shipped w8a8 ms "
        "| every config vs shipped, max diff / max |"
    )
    print("|---|---|---|---|---|---|")
    for t in tokens:
        x, weights, ids = moe_step(t)
        args = (x, w13, w2, weights, ids, 0, w13_scale, w2_scale)
        # the down GEMM in its own shipped N tile, on each candidate's layout (block_m)
        timings, worst = _time_tiles(
            args,
            {
                config: (config, dataclasses.replace(W8A8_DOWN_CONFIG, block_m=config.block_m))
                for config in moe_w8a8_candidates()
            },
        )
        runs.append(timings)
        best = min(timings, key=timings.get)
        w8a16 = graph_us(partial(grouped_moe_triton, *args))
        shipped = graph_us(partial(grouped_moe_w8a8_triton, *args))
        print(
            f"| {t} | {w8a16 / 1e3:.3f} | {timings[best] / 1e3:.3f} | {_short_grouped(best)} "
            f"| {shipped / 1e3:.3f} | {worst:.1e} |",
            flush=True,
        )
        _print_fastest(timings)
    pick = _nearest_every_best(runs)
    print("\n# kernels/moe_experts_w8a8.py: nearest every token count's best (geometric mean)")
    print(f"W8A8_CONFIG = {pick!r}")


def moe_down_candidates() -> list[GroupedGemmConfig]:
    return [
        GroupedGemmConfig(W8A8_CONFIG.block_m, block_n, 128, warps, stages)
        for block_n, (warps, stages) in itertools.product(
            (64, 128, 256), ((4, 3), (4, 4), (8, 3), (8, 4), (8, 5))
        )
    ]


def moe_down_sweep(tokens: list[int], bw: float) -> None:
    """The down GEMM's tile over `moe_down_candidates`, gate/up as shipped; every config's output
    against the shipped one's (the down tile changes no product's rounding: 0 expected)."""
    w13, w2, w13_scale, w2_scale = moe_experts()
    expert_bytes = 3 * MOE_INTER * MOE_HIDDEN
    runs: list[dict] = []
    print(
        "| tokens | shipped ms | x floor | best ms | x floor | down config "
        "| every config vs shipped, max diff / max |"
    )
    print("|---|---|---|---|---|---|---|")
    for t in tokens:
        x, weights, ids = moe_step(t)
        args = (x, w13, w2, weights, ids, 0, w13_scale, w2_scale)
        floor_us = ids.unique().numel() * expert_bytes / bw * 1e6
        timings, worst = _time_tiles(
            args, {down: (W8A8_CONFIG, down) for down in moe_down_candidates()}
        )
        runs.append(timings)
        best = min(timings, key=timings.get)
        shipped = graph_us(partial(grouped_moe_w8a8_triton, *args))
        print(
            f"| {t} | {shipped / 1e3:.3f} | {shipped / floor_us:.2f} | {timings[best] / 1e3:.3f} "
            f"| {timings[best] / floor_us:.2f} | {_short_grouped(best)} | {worst:.1e} |",
            flush=True,
        )
        _print_fastest(timings)
    pick = _nearest_every_best(runs)
    print(f"\n# kernels/moe_experts_w8a8.py (shipped {W8A8_DOWN_CONFIG!r}):")
    print(f"W8A8_DOWN_CONFIG = {pick!r}")


def _time_tiles(args: tuple, tiles: dict) -> tuple[dict, float]:
    """The w8a8 grouped experts on `args` with each {key: (gate/up tile, down tile)}: {key: us}
    and the largest difference from the shipped tiles' output over its largest magnitude. A tile
    that does not run here (OutOfResources and friends) is reported and left out."""
    reference = grouped_moe_w8a8_triton(*args).float()
    scale = reference.abs().max().item()
    timings: dict = {}
    worst = 0.0
    for key, (config, down) in tiles.items():
        try:
            run = partial(grouped_moe_w8a8_triton, *args, config=config, down_config=down)
            worst = max(worst, (run().float() - reference).abs().max().item() / scale)
            timings[key] = graph_us(run)
        except Exception as error:  # noqa: BLE001 - not this tile
            print(f"  skipped {_short_grouped(key)}: {type(error).__name__}")
    return timings, worst


def _print_fastest(timings: dict) -> None:
    ranked = sorted(timings, key=timings.get)[:5]
    print("  fastest: " + ", ".join(f"{_short_grouped(c)} {timings[c]:.0f} us" for c in ranked))


def _short_grouped(config: GroupedGemmConfig) -> str:
    return f"m{config.block_m} n{config.block_n} w{config.num_warps} s{config.num_stages}"


def _short(config) -> str:
    return (
        f"m{config.block_m} n{config.block_n} w{config.num_warps} s{config.num_stages} "
        f"split{config.split_target}"
        + {None: "", True: " scaled products", False: " scaled weights"}[config.scale_products]
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--sweep", action="store_true", help="tile configs per (projection, M)")
    ap.add_argument("--moe", action="store_true", help="one MoE layer's FP8 experts instead")
    ap.add_argument(
        "--sweep-down", action="store_true", help="with --moe: the down GEMM's tile alone"
    )
    ap.add_argument(
        "--shapes", nargs="+", default=None, help="projection name prefixes, e.g. q_a o_proj"
    )
    args = ap.parse_args()
    shapes = {
        name: shape
        for name, shape in SHAPES.items()
        if not args.shapes or any(name.startswith(prefix) for prefix in args.shapes)
    }
    bw = copy_bandwidth_gbs() * 1e9  # bytes/s, the same measure as bench_decode's floor
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s\n")
    if args.moe and args.sweep_down:
        moe_down_sweep(args.tokens or list(MOE_TOKENS), bw)
    elif args.moe and args.sweep:
        moe_sweep(args.tokens or list(MOE_TOKENS))
    elif args.moe:
        moe_table(args.tokens or list(MOE_TOKENS), bw)
    elif args.sweep:
        sweep(shapes, args.tokens or list(SWEEP_TOKENS), bw)
    else:
        table(shapes, args.tokens or [1, 8, 64, 2048], bw)


if __name__ == "__main__":
    main()
