"""GPU: the FP8 linear (weights FP8 in HBM, dequantized in registers) against the bf16 GEMM and
cuBLASLt's FP8 GEMM (torch._scaled_mm, per-tensor scales) at DeepSeek-V3.2's projection shapes,
and against the HBM floor of reading the FP8 weights once. Prints a markdown table."""

from __future__ import annotations

import argparse
from functools import partial

import torch

from benchmarks.bench_kernels import copy_bandwidth_gbs
from kernels.fp8 import quantize_fp8_reference
from kernels.fp8_linear import fp8_linear_triton

SHAPES = {
    "q_a 1536x7168": (1536, 7168),
    "kv_a 576x7168": (576, 7168),
    "q_b 24576x1536": (24576, 1536),
    "o_proj 7168x16384": (7168, 16384),
    "mlp gate+up 36864x7168": (36864, 7168),
    "mlp down 7168x18432": (7168, 18432),
}


def graph_us(fn, reps: int = 50) -> float:
    """Mean time of `fn` replayed from a CUDA graph of `reps` calls (launch overhead excluded)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    args = ap.parse_args()
    bw = copy_bandwidth_gbs() * 1e9  # bytes/s, the same measure as bench_decode's floor
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s\n")
    print("| projection | tokens | fp8 (ours) us | x floor | bf16 cuBLAS us | fp8 _scaled_mm us |")
    print("|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda") * k**-0.5
        weight, scale = quantize_fp8_reference(w)
        w_bf16 = w.bfloat16()
        one = torch.ones((), device="cuda")
        for t in args.tokens:
            x = torch.randn(t, k, dtype=torch.bfloat16, device="cuda")
            ours = graph_us(partial(fp8_linear_triton, x, weight, scale))
            bf16 = graph_us(partial(torch.matmul, x, w_bf16.t()))
            pad = max(16, t)  # _scaled_mm needs rows in multiples of 16
            x8 = torch.zeros(pad, k, device="cuda").to(torch.float8_e4m3fn)
            scaled = graph_us(
                partial(torch._scaled_mm, x8, weight.t(), one, one, out_dtype=torch.bfloat16)
            )
            floor_us = (n * k + t * k * 2 + t * n * 2) / bw * 1e6
            print(
                f"| {name} | {t} | {ours:.1f} | {ours / floor_us:.2f} | {bf16:.1f} | {scaled:.1f} |"
            )


if __name__ == "__main__":
    main()
