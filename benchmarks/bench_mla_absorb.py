"""GPU: MLA's absorbed products on an FP8 kv_b_proj (kernels/fp8_mla_absorb.py) against the bf16
bmm on the dequantized weight that the model ran before, at DeepSeek-V3.2's shapes (nope 128,
v 128, kv_lora 512; 128 heads at TP=1, 16 at TP=8), with the HBM floor of reading the FP8 weight
part once.

Every time is a CUDA graph of back-to-back calls replayed, the median of five replays; the calls
walk over enough copies of the weight to exceed the L2 cache, as a decode step's layers do (one
weight timed over and over would be served from L2). "out" includes the model's reshape to
o_proj's [T, H * v] input (a copy after the bmm, none after the kernel).

--sweep: tile configs per (heads, rows, product), the best against the shipped one.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.bench_fp8_linear import graph_us
from benchmarks.bench_kernels import copy_bandwidth_gbs
from kernels.fp8 import dequantize_fp8_reference, quantize_fp8_reference
from kernels.fp8_mla_absorb import (
    AbsorbConfig,
    absorb_out_triton,
    absorb_q_triton,
    config_for,
)

NOPE, V, KV_LORA = 128, 128, 512
L2_BYTES = 50 << 20
DEVICE = torch.device("cuda")


def weights(heads: int, pow2: bool = True):
    """(FP8 weights, their scales, the bf16 dequantized copies): enough copies that one pass over
    them is at least twice the L2 cache in FP8."""
    w = torch.randn(heads * (NOPE + V), KV_LORA, device=DEVICE) * KV_LORA**-0.5
    weight, scale = quantize_fp8_reference(w, pow2)
    copies = max(2, -(-2 * L2_BYTES // weight.numel()))
    fp8 = [(weight.clone(), scale.clone()) for _ in range(copies)]
    bf16 = [
        dequantize_fp8_reference(wq, s).to(torch.bfloat16).view(heads, NOPE + V, KV_LORA)
        for wq, s in fp8
    ]
    return fp8, bf16


def products(num_rows: int, heads: int, fp8, bf16, config_q=None, config_out=None):
    """{(product, path): a callable that runs one call, the next weight copy each time}."""
    q = torch.randn(num_rows, heads, NOPE + 64, device=DEVICE, dtype=torch.bfloat16)
    q_nope = q[..., :NOPE]
    o_latent = torch.randn(num_rows, heads, KV_LORA, device=DEVICE, dtype=torch.bfloat16)
    turn = itertools.count()

    def nxt(items):
        return items[next(turn) % len(items)]

    def q_fp8():
        weight, scale = nxt(fp8)
        return absorb_q_triton(q_nope, weight, scale, V, True, config_q)

    def q_bf16():
        w_uk = nxt(bf16)[:, :NOPE]
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def out_fp8():
        weight, scale = nxt(fp8)
        return absorb_out_triton(o_latent, weight, scale, NOPE, True, config_out).reshape(
            num_rows, -1
        )

    def out_bf16():
        w_uv = nxt(bf16)[:, NOPE:]
        out = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2))
        return out.transpose(0, 1).reshape(num_rows, -1)

    return {
        ("q", "fp8"): q_fp8,
        ("q", "bf16"): q_bf16,
        ("out", "fp8"): out_fp8,
        ("out", "bf16"): out_bf16,
    }


def floor_us(num_rows: int, heads: int, product: str, bw: float) -> float:
    weight = heads * NOPE * KV_LORA  # either part: 128 rows x 512 per head, one byte each
    k, n = (NOPE, KV_LORA) if product == "q" else (KV_LORA, V)
    activations = num_rows * heads * (k + n) * 2
    return (weight + activations) / bw * 1e6


def table(rows: list[int], heads_list: list[int], bw: float) -> None:
    print(
        "| heads | rows | product | FP8 kernel us | bf16 bmm us | x | floor us | kernel x floor |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for heads in heads_list:
        fp8, bf16 = weights(heads)
        for num_rows in rows:
            calls = products(num_rows, heads, fp8, bf16)
            for product in ("q", "out"):
                ours = graph_us(calls[(product, "fp8")], reps=len(fp8) * 4)
                theirs = graph_us(calls[(product, "bf16")], reps=len(fp8) * 4)
                floor = floor_us(num_rows, heads, product, bw)
                print(
                    f"| {heads} | {num_rows} | {product} | {ours:.1f} | {theirs:.1f} | "
                    f"{theirs / ours:.2f} | {floor:.1f} | {ours / floor:.2f} |"
                )


def candidates(num_rows: int) -> list[AbsorbConfig]:
    if num_rows == 1:
        return [
            AbsorbConfig(1, n, w, 1, k)
            for n, w, k in itertools.product((32, 64, 128), (2, 4, 8), (128, 512))
        ]
    if num_rows <= 16:
        return [
            AbsorbConfig(16, n, w, s)
            for n, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3))
        ]
    return [
        AbsorbConfig(m, n, w, 2) for m, n, w in itertools.product((16, 32, 64), (64, 128), (4, 8))
    ]


def sweep(rows: list[int], heads_list: list[int]) -> None:
    print("| heads | rows | product | shipped | us | best | us |")
    print("|---|---|---|---|---|---|---|")
    for heads in heads_list:
        fp8, bf16 = weights(heads)
        for num_rows in rows:
            for product in ("q", "out"):
                n_out, k_in = (KV_LORA, NOPE) if product == "q" else (V, KV_LORA)
                shipped = config_for(num_rows, heads, n_out, k_in)
                results = {}
                for config in {*candidates(num_rows), shipped}:
                    kw = {"config_q": config} if product == "q" else {"config_out": config}
                    call = products(num_rows, heads, fp8, bf16, **kw)[(product, "fp8")]
                    results[config] = graph_us(call, reps=len(fp8) * 4)
                best = min(results, key=results.get)
                print(
                    f"| {heads} | {num_rows} | {product} | {_short(shipped)} | "
                    f"{results[shipped]:.1f} | {_short(best)} | "
                    f"{results[best]:.1f} |"
                )


def _short(config: AbsorbConfig) -> str:
    return (
        f"m{config.block_m} n{config.block_n} k{config.block_k} w{config.num_warps} "
        f"s{config.num_stages}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16, 32, 128, 2048])
    ap.add_argument("--heads", type=int, nargs="+", default=[128, 16])
    ap.add_argument("--sweep", action="store_true", help="tile configs per (heads, rows)")
    args = ap.parse_args()
    bw = copy_bandwidth_gbs() * 1e9
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bw / 1e9:.0f} GB/s\n")
    if args.sweep:
        sweep(args.rows, args.heads)
    else:
        table(args.rows, args.heads, bw)


if __name__ == "__main__":
    main()
