"""GPU: the FP8 linears at DeepSeek-V3.2's projection shapes against the bf16 GEMM, cuBLASLt's FP8
GEMM (torch._scaled_mm, per-tensor scales) and the HBM floor of reading the FP8 weights once.

Default: one markdown table, the shipped tile configs: w8a16 (kernels/fp8_linear.py, weights
dequantized in registers) and w8a8 (kernels/fp8_gemm.py, activations quantized per token and 128,
then FP8 x FP8 tensor cores; the time includes the quantization).

--sweep: for each projection and M in SWEEP_TOKENS, a small grid of tile configs of both kernels;
prints the best per (projection, M), then dict literals to paste into kernels/fp8_linear.py
(W8A16_CONFIGS) and kernels/fp8_gemm.py (W8A8_CONFIGS, W8A8_MIN_TOKENS): per M the config with the
smallest geometric mean over the projections of its time / that projection's best time.
Every time is a CUDA graph of back-to-back calls replayed (launch overhead excluded).
"""

from __future__ import annotations

import argparse
import itertools
import math
from functools import partial

import torch

from benchmarks.bench_kernels import copy_bandwidth_gbs
from kernels.fp8 import quantize_fp8_reference
from kernels.fp8_gemm import fp8_linear_w8a8_triton
from kernels.fp8_linear import Fp8TileConfig, fp8_linear_triton

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


def graph_us(fn, reps: int | None = None) -> float:
    """Mean time of `fn` replayed from a CUDA graph of back-to-back calls. Without `reps`, as
    many calls as make about 2 ms (3 to 50), so a sweep's slow configs cost little."""
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
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def w8a16_candidates(num_tokens: int) -> list[Fp8TileConfig]:
    block_m = 16 if num_tokens <= 16 else 64
    splits = (132, 264, 528) if num_tokens <= 128 else (1, 132)
    return [
        Fp8TileConfig(block_m, block_n, warps, stages, split)
        for block_n, (warps, stages), split in itertools.product(
            (32, 64, 128), W8A16_WARPS_STAGES, splits
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


def floor_us(n: int, k: int, t: int, bw: float) -> float:
    return (n * k + t * k * 2 + t * n * 2) / bw * 1e6


def table(shapes: dict, tokens: list[int], bw: float) -> None:
    print(
        "| projection | tokens | w8a16 us | w8a8 us | floor us | bf16 cuBLAS us "
        "| fp8 _scaled_mm us |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda") * k**-0.5
        weight, scale = quantize_fp8_reference(w)
        w_bf16 = w.bfloat16()
        for t in tokens:
            x = torch.randn(t, k, dtype=torch.bfloat16, device="cuda")
            w8a16 = graph_us(partial(fp8_linear_triton, x, weight, scale), reps=50)
            w8a8 = graph_us(partial(fp8_linear_w8a8_triton, x, weight, scale), reps=50)
            bf16, scaled = peers_us(x, w_bf16, weight)
            print(
                f"| {name} | {t} | {w8a16:.1f} | {w8a8:.1f} | {floor_us(n, k, t, bw):.1f} "
                f"| {bf16:.1f} | {scaled:.1f} |"
            )


def _geomean_best(results: dict, kernel: str, t: int, shapes: dict):
    """The config whose time / best time, geometric mean over the shapes, is smallest."""
    scores: dict = {}
    for name in shapes:
        timings = results[(name, t)][kernel]
        best = min(timings.values())
        for config, us in timings.items():
            scores.setdefault(config, []).append(math.log(us / best))
    complete = {c: s for c, s in scores.items() if len(s) == len(shapes)}
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
        w_bf16 = w.bfloat16()
        for t in tokens:
            x = torch.randn(t, k, dtype=torch.bfloat16, device="cuda")
            row: dict = {"w8a16": {}, "w8a8": {}}
            for kernel, fn, candidates in (
                ("w8a16", fp8_linear_triton, w8a16_candidates(t)),
                ("w8a8", fp8_linear_w8a8_triton, w8a8_candidates(t)),
            ):
                for config in candidates:
                    try:
                        fn_config = partial(fn, x, weight, scale, config=config)
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
        del w, weight, scale, w_bf16
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
    if min_tokens is None:
        print("# W8A8_MIN_TOKENS: w8a8 never stayed ahead of w8a16 up to the largest M swept")
    else:
        print(f"W8A8_MIN_TOKENS = {min_tokens}  # from here on w8a8's sum stays below w8a16's")


def _short(config) -> str:
    return (
        f"m{config.block_m} n{config.block_n} w{config.num_warps} s{config.num_stages} "
        f"split{config.split_target}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--sweep", action="store_true", help="tile configs per (projection, M)")
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
    if args.sweep:
        sweep(shapes, args.tokens or list(SWEEP_TOKENS), bw)
    else:
        table(shapes, args.tokens or [1, 8, 64, 2048], bw)


if __name__ == "__main__":
    main()
