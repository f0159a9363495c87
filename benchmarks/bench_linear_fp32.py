"""GPU: the fp32-weight projections of a decode step (kernels/linear_fp32.py) at DeepSeek-V3.2's
shapes, the MoE router (256 x 7168) and the indexer's head weights (64 x 7168), against the twin
(F.linear in fp32, cuBLAS) and the HBM floor of reading the fp32 weight once.

Default: the shipped LINEAR_FP32_CONFIGS. --sweep: a grid of configs on CUDA cores and on tensor
cores, the best per (shape, tokens), and per token count the config of the smallest summed time
over the shapes, as literals for LINEAR_FP32_CONFIGS. Times are CUDA graphs of back-to-back
calls (bench_fp8_linear.graph_us).

    python benchmarks/bench_linear_fp32.py [--sweep] [--tokens 1 4 16 32]
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial

import torch

from benchmarks.bench_fp8_linear import graph_us
from benchmarks.bench_kernels import copy_bandwidth_gbs
from kernels.fp8_linear import config_for_rows
from kernels.linear_fp32 import (
    LINEAR_FP32_CONFIGS,
    LinearFp32Config,
    linear_fp32_reference,
    linear_fp32_triton,
)

SHAPES = {"router 256x7168": (256, 7168), "indexer weights 64x7168": (64, 7168)}


def candidates(num_tokens: int) -> list[LinearFp32Config]:
    cuda_cores = [
        LinearFp32Config(block_n, block_k, 0, warps, 1, use_dot=False)
        for block_n, block_k, warps in itertools.product((1, 2, 4), (1024, 2048, 4096), (4, 8))
        if num_tokens <= 8
    ]
    tensor_cores = [
        LinearFp32Config(block_n, block_k, split, warps, stages)
        for block_n, block_k, split, (warps, stages) in itertools.product(
            (16, 32, 64), (64, 128), (256, 512), ((4, 3), (8, 3))
        )
    ]
    return cuda_cores + tensor_cores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    bw = copy_bandwidth_gbs()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw:.0f} GB/s\n")
    shipped = {t: config_for_rows(t, LINEAR_FP32_CONFIGS) for t in args.tokens}
    totals: dict[int, dict[LinearFp32Config, list[float]]] = {t: {} for t in args.tokens}
    print(
        "| shape | tokens | shipped us | best us | best config | twin (cuBLAS fp32) us | floor us |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda")
        for t in args.tokens:
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            times = {}
            for config in {shipped[t], *(candidates(t) if args.sweep else [])}:
                try:
                    times[config] = graph_us(partial(linear_fp32_triton, x, weight, 1.0, config))
                except Exception as error:  # OutOfResources and friends: not this config
                    print(f"  skipped {config}: {type(error).__name__}")
            for config, us in times.items():
                totals[t].setdefault(config, []).append(us)
            best = min(times, key=times.get)
            twin = graph_us(partial(linear_fp32_reference, x, weight))
            floor = n * k * 4 / bw / 1e3
            print(
                f"| {name} | {t} | {times[shipped[t]]:.1f} | {times[best]:.1f} | "
                f"{best} | {twin:.1f} | {floor:.1f} |",
                flush=True,
            )
    if args.sweep:
        print("\nPer token count, summed over the shapes, the smallest (the shipped one's sum):")
        for t in args.tokens:
            complete = {c: sum(us) for c, us in totals[t].items() if len(us) == len(SHAPES)}
            ranked = sorted(complete, key=complete.get)
            print(f"  {t}: shipped {complete[shipped[t]]:.1f} us")
            for config in ranked[:3]:
                print(f"  {t}: {complete[config]:.1f} us  {config}")


if __name__ == "__main__":
    main()
