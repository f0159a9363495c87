"""y = x @ W^T with W in DeepSeek's block-scaled FP8, dequantized in registers.

The weights stay FP8 in HBM (half the bytes of bf16: a decode step reads every weight once, so
this halves the step's floor); activations stay in their dtype. The twins are in kernels/fp8.py:
`fp8_linear_reference` (exact dequantization, then the matmul) is this kernel's spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

from kernels.fp8 import FP8_BLOCK, FP8_DTYPE, scale_grid
from kernels.launch import FLOAT_DTYPES, check_tensor, dot_in_fp32, launch
from kernels.platform import tl, triton

# --- Triton ---------------------------------------------------------------------------------------
#
# One program per (BLOCK_M rows, BLOCK_N output features, split of K). Each K step is one 128-wide
# scale block: the FP8 tile is converted to fp32, multiplied by its rows' scales for that block,
# rounded to the activations' dtype (as the twin rounds the dequantized weight) and fed to
# tl.dot. Decode has few rows and, for a narrow projection, few output tiles (q_a: 1536 outputs
# = 24 tiles of 64 for 132 SMs), so K is split across programs; each split writes its fp32
# partial sums and a second kernel adds the splits in a fixed order (deterministic, unlike
# atomics: graph replays and PDL on/off give identical bits).


@dataclass(frozen=True)
class Fp8TileConfig:
    """A launch config of both FP8 GEMMs (this w8a16 one and kernels/fp8_gemm.py's w8a8)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Programs to aim for: K is split (in 128-wide blocks, summed in a fixed order by a second
    # kernel) until tiles x splits reaches this; 1 never splits.
    split_target: int = 264


# The first configs (tests use them as a decode-sized and a prefill-sized tile): decode (M <= 16)
# spreads K over enough programs to fill the H200's 132 SMs twice; prefill uses tensor-core-sized
# tiles. W8A16_CONFIGS below is what the launcher picks from.
DECODE_CONFIG = Fp8TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=4)
PREFILL_CONFIG = Fp8TileConfig(block_m=64, block_n=128, num_warps=8, num_stages=3)
# By rows: the first entry whose key is >= M, the last for any larger M (`config_for_rows`).
# Tuned on the H200 (2026-11-30): `benchmarks/bench_fp8_linear.py --sweep`, the config nearest
# every DeepSeek-V3.2 projection's best per row count.
W8A16_CONFIGS: dict[int, Fp8TileConfig] = {
    1: Fp8TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=3, split_target=264),
    16: Fp8TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=4, split_target=132),
    32: Fp8TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, split_target=132),
    64: Fp8TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, split_target=132),
    128: Fp8TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, split_target=132),
    256: Fp8TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, split_target=132),
    2048: Fp8TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, split_target=132),
}

Config = TypeVar("Config")


def config_for_rows(num_rows: int, configs: dict[int, Config]) -> Config:
    """The config of the smallest key >= num_rows; the largest key's beyond them all."""
    for max_rows in sorted(configs):
        if num_rows <= max_rows:
            return configs[max_rows]
    return configs[max(configs)]


@triton.jit
def _fp8_linear_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    partial_ptr,
    num_rows,
    out_features,
    in_features,
    x_row_stride,
    w_row_stride,
    scale_row_stride,
    partial_split_stride,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    split = tl.program_id(2)
    kk = tl.arange(0, BLOCK_K)
    row_mask = rows < num_rows
    col_mask = cols < out_features
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * w_row_stride
    scale_rows = scale_ptr + (cols // BLOCK_K) * scale_row_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    for k0 in range(k_start, k_end, BLOCK_K):
        k_mask = (k0 + kk) < k_end
        a = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * x_row_stride + k0 + kk[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_rows + k0 + kk[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        scale = tl.load(scale_rows + k0 // BLOCK_K, mask=col_mask, other=0.0)  # [BLOCK_N]
        w = w.to(tl.float32) * scale[:, None]  # [BLOCK_N, BLOCK_K], exactly dequantized
        if UPCAST_DOT:
            acc = tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(
        partial_ptr
        + split * partial_split_stride
        + rows[:, None].to(tl.int64) * out_features
        + cols[None, :],
        acc,
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _sum_splits_kernel(
    partial_ptr,
    out_ptr,
    num_elements,
    partial_split_stride,
    NUM_SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_elements
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(NUM_SPLITS):  # a fixed order
        total += tl.load(partial_ptr + s * partial_split_stride + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def split_k(num_tiles: int, in_features: int, split_target: int) -> tuple[int, int]:
    """(splits, K per split, a multiple of 128) so that num_tiles x splits is about
    split_target programs; every split has at least one 128-wide block."""
    k_blocks = -(-in_features // FP8_BLOCK)
    num_splits = max(1, min(k_blocks, -(-split_target // num_tiles)))
    k_per_split = -(-k_blocks // num_splits) * FP8_BLOCK
    return -(-in_features // k_per_split), k_per_split


def fp8_linear_triton(
    x: torch.Tensor,  # [T, in_features]
    weight: torch.Tensor,  # [out_features, in_features] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(out/128), ceil(in/128)] float32
    config: Fp8TileConfig | None = None,
) -> torch.Tensor:
    """Triton twin of `kernels.fp8.fp8_linear_reference`: [T, out_features] in x's dtype."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    device = x.device
    check_tensor("weight", weight, ndim=2, dtypes=(FP8_DTYPE,), device=device)
    check_tensor("scale_inv", scale_inv, ndim=2, dtypes=(torch.float32,), device=device)
    num_rows, in_features = x.shape
    out_features = weight.shape[0]
    if weight.shape[1] != in_features:
        raise ValueError(f"weight {tuple(weight.shape)} does not take {in_features} features")
    if tuple(scale_inv.shape) != scale_grid(out_features, in_features):
        raise ValueError(
            f"scale_inv {tuple(scale_inv.shape)}, expected "
            f"{scale_grid(out_features, in_features)} for a {tuple(weight.shape)} weight"
        )
    out = torch.empty(num_rows, out_features, dtype=x.dtype, device=device)
    if num_rows == 0:
        return out
    if config is None:
        config = config_for_rows(num_rows, W8A16_CONFIGS)
    tiles_m = triton.cdiv(num_rows, config.block_m)
    tiles_n = triton.cdiv(out_features, config.block_n)
    num_splits, k_per_split = split_k(tiles_m * tiles_n, in_features, config.split_target)
    partial = torch.empty(num_splits, num_rows, out_features, dtype=torch.float32, device=device)
    launch(
        _fp8_linear_kernel,
        (tiles_m, tiles_n, num_splits),
        x,
        x,
        weight,
        scale_inv,
        partial,
        num_rows,
        out_features,
        in_features,
        x.stride(0),
        weight.stride(0),
        scale_inv.stride(0),
        partial.stride(0),
        k_per_split,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=FP8_BLOCK,
        UPCAST_DOT=dot_in_fp32(x.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    num_elements = num_rows * out_features
    launch(
        _sum_splits_kernel,
        (triton.cdiv(num_elements, 1024),),
        x,
        partial,
        out,
        num_elements,
        partial.stride(0),
        NUM_SPLITS=num_splits,
        BLOCK=1024,
        num_warps=4,
    )
    return out
