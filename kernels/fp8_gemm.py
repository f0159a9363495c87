"""y = A @ W^T with both in DeepSeek's block-scaled FP8 (w8a8): the FP8 tiles go to the tensor
cores as they are.

A is FP8 with one float32 scale per token and 128 columns ([M, ceil(K/128)], from
kernels/fp8_act_quant.py); W is FP8 with one per 128x128 block ([ceil(N/128), ceil(K/128)]).
Each K step is one 128-wide scale block: the FP8 x FP8 product of the tiles (fp32 out) is
multiplied by a_scale[m, kb] * w_scale[n // 128, kb] and added to an fp32 accumulator, so the
tensor cores' own accumulation never runs longer than 128 products (DeepSeek's promotion to
fp32 every 128). The twin is `kernels.fp8.fp8_gemm_reference` (both operands dequantized
exactly, the product in fp32); `fp8_linear_w8a8_triton` quantizes bf16 activations first and
is the twin `fp8_linear_act_quant_reference`. K is split at small M as in kernels/fp8_linear.py
(`split_k`; a tile's last split sums the splits' partials in a fixed order, `store_split_k`).

Under Triton's interpreter (no FP8 tl.dot there) UPCAST_DOT converts the FP8 tiles to fp32
before the dot: the same products (an e4m3 x e4m3 product is exact in fp32), the same scaling.
"""

from __future__ import annotations

import torch

from kernels.fp8 import FP8_BLOCK, FP8_DTYPE, scale_grid
from kernels.fp8_act_quant import quantize_activations_triton
from kernels.fp8_cublaslt import (
    CUBLASLT_MIN_ROWS,
    cublaslt_block_scaled,
    cublaslt_shape_ok,
    fp8_gemm_cublaslt,
)
from kernels.fp8_linear import (
    Fp8TileConfig,
    config_for_rows,
    split_k,
    split_k_workspace,
    store_split_k,
)
from kernels.launch import check_tensor, launch
from kernels.platform import tl, triton, triton_interpreter

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# Tile configs by rows: the first entry whose key is >= M, the last for any larger M. Tuned on the
# H200 (2026-11-30) with `benchmarks/bench_fp8_linear.py --sweep`: per row count, the config
# nearest every DeepSeek-V3.2 projection's best.
W8A8_CONFIGS: dict[int, Fp8TileConfig] = {
    1: Fp8TileConfig(block_m=16, block_n=128, num_warps=4, num_stages=3, split_target=264),
    16: Fp8TileConfig(block_m=16, block_n=128, num_warps=4, num_stages=3, split_target=264),
    32: Fp8TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=4, split_target=264),
    64: Fp8TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, split_target=264),
    128: Fp8TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, split_target=264),
    256: Fp8TileConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, split_target=132),
    2048: Fp8TileConfig(block_m=128, block_n=64, num_warps=4, num_stages=3, split_target=1),
}
# Rows (tokens) from which kernels.ops.fp8_linear takes this path for bf16 / fp16 activations
# where kernels.ops.use_fp8_w8a8 allows it (below it: the w8a16 kernel); kernels.ops.grouped_moe
# takes the w8a8 experts (kernels/moe_experts_w8a8.py) from the same step size. The sweep above
# has w8a8 faster from one row on (the projections' sum 191.6 against 228.8 us at M = 1), but
# rounding activations to FP8 is a step function: a last-bit difference upstream can move a value
# to the next FP8 step. On the H200 greedy MTP left plain greedy within 20 tokens in the FP8
# engine test (tests/workers/test_gpu_engine.py) with w8a8 in every step from 1 row and from 64
# rows (a step's size, and so its kernel, differs between the two runs: a verify of k + 1 rows
# a sequence against a decode of one), and kept it with w8a8 off. So by default only steps of
# prompt tokens only take it (MTPSERVE_FP8_W8A8=prefill): every decode and verify keeps the
# w8a16 kernels, and a prompt that is alone in its steps (one request, or all arriving together)
# is prefilled by the same kernels with MTP and without. fp32 activations never take w8a8.
W8A8_MIN_TOKENS = 64
# Consecutive tile rows that walk the output columns together, so their weight tiles are read
# from L2 rather than HBM when M spans several tiles.
GROUP_M = 8


@triton.jit
def scaled_fp8_dot(a, w, a_scale, w_scale, UPCAST_DOT: tl.constexpr):
    """One 128-wide K block of a block-scaled FP8 GEMM: a [M, 128] e4m3 times w [N, 128]
    e4m3 transposed, fp32 out of the FP8 tensor cores, times a_scale[m] * w_scale[n] (fp32):
    what the accumulator adds per block (DeepSeek's promotion every 128). UPCAST_DOT (Triton's
    interpreter): the tiles in fp32, the same products (e4m3 x e4m3 is exact in fp32)."""
    if UPCAST_DOT:
        part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    else:
        part = tl.dot(a, tl.trans(w))  # [BLOCK_M, BLOCK_N] fp32, FP8 tensor cores
    return part * (a_scale[:, None] * w_scale[None, :])


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    num_rows,
    out_features,
    in_features,
    a_row_stride,
    a_scale_row_stride,
    w_row_stride,
    w_scale_row_stride,
    partial_split_stride,
    k_blocks_per_split,
    num_splits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # Grouped tile order: GROUP_M tile rows share each column tile while it is in L2.
    tiles_m = tl.cdiv(num_rows, BLOCK_M)
    tiles_n = tl.cdiv(out_features, BLOCK_N)
    pid = tl.program_id(0)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows
    split = tl.program_id(1)

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output features
    kk = tl.arange(0, BLOCK_K)
    row_mask = rows < num_rows
    col_mask = cols < out_features
    a_rows = a_ptr + rows[:, None].to(tl.int64) * a_row_stride  # [BLOCK_M, 1]
    w_rows = w_ptr + cols[:, None].to(tl.int64) * w_row_stride  # [BLOCK_N, 1]
    a_scales = a_scale_ptr + rows.to(tl.int64) * a_scale_row_stride  # [BLOCK_M]
    w_scales = w_scale_ptr + (cols // BLOCK_K) * w_scale_row_stride  # [BLOCK_N]
    kb_start = split * k_blocks_per_split
    kb_end = tl.minimum(kb_start + k_blocks_per_split, tl.cdiv(in_features, BLOCK_K))
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    for kb in range(kb_start, kb_end):
        k = kb * BLOCK_K + kk
        if EVEN_K:
            a = tl.load(a_rows + k[None, :], mask=row_mask[:, None], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=col_mask[:, None], other=0.0)
        else:
            k_mask = k < in_features
            a = tl.load(a_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_rows + k[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        a_scale = tl.load(a_scales + kb, mask=row_mask, other=0.0)  # [BLOCK_M]
        w_scale = tl.load(w_scales + kb, mask=col_mask, other=0.0)  # [BLOCK_N]
        acc += scaled_fp8_dot(a, w, a_scale, w_scale, UPCAST_DOT)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    store_split_k(
        acc,
        out_ptr,
        partial_ptr,
        counter_ptr,
        rows[:, None].to(tl.int64) * out_features + cols[None, :],  # out and partials: [M, N]
        row_mask[:, None] & col_mask[None, :],
        pid,  # one program per output tile and split
        split,
        num_splits,
        partial_split_stride,
        SPLIT_K,
    )


def fp8_gemm_triton(
    a: torch.Tensor,  # [M, K] float8_e4m3fn
    a_scale: torch.Tensor,  # [M, ceil(K/128)] float32
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(N/128), ceil(K/128)] float32
    out_dtype: torch.dtype = torch.bfloat16,
    config: Fp8TileConfig | None = None,
) -> torch.Tensor:
    """Triton twin of `kernels.fp8.fp8_gemm_reference`: [M, N] in out_dtype."""
    check_tensor("a", a, ndim=2, dtypes=(FP8_DTYPE,))
    device = a.device
    check_tensor("a_scale", a_scale, ndim=2, dtypes=(torch.float32,), device=device)
    check_tensor("weight", weight, ndim=2, dtypes=(FP8_DTYPE,), device=device)
    check_tensor("scale_inv", scale_inv, ndim=2, dtypes=(torch.float32,), device=device)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype {out_dtype} not in {OUT_DTYPES}")
    num_rows, in_features = a.shape
    out_features = weight.shape[0]
    k_blocks = triton.cdiv(in_features, FP8_BLOCK)
    if weight.shape[1] != in_features:
        raise ValueError(f"weight {tuple(weight.shape)} does not take {in_features} features")
    if tuple(a_scale.shape) != (num_rows, k_blocks):
        raise ValueError(f"a_scale {tuple(a_scale.shape)}, expected {(num_rows, k_blocks)}")
    if tuple(scale_inv.shape) != scale_grid(out_features, in_features):
        raise ValueError(
            f"scale_inv {tuple(scale_inv.shape)}, expected "
            f"{scale_grid(out_features, in_features)} for a {tuple(weight.shape)} weight"
        )
    out = torch.empty(num_rows, out_features, dtype=out_dtype, device=device)
    if num_rows == 0:
        return out
    if config is None:
        config = config_for_rows(num_rows, W8A8_CONFIGS)
    num_tiles = triton.cdiv(num_rows, config.block_m) * triton.cdiv(out_features, config.block_n)
    num_splits, k_per_split = split_k(num_tiles, in_features, config.split_target)
    partial, counters = split_k_workspace(out, num_splits, num_tiles)
    launch(
        _fp8_gemm_kernel,
        (num_tiles, num_splits),
        a,
        a,
        a_scale,
        weight,
        scale_inv,
        out,
        partial,
        counters,
        num_rows,
        out_features,
        in_features,
        a.stride(0),
        a_scale.stride(0),
        weight.stride(0),
        scale_inv.stride(0),
        num_rows * out_features,
        k_per_split // FP8_BLOCK,
        num_splits,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=FP8_BLOCK,
        GROUP_M=GROUP_M,
        EVEN_K=in_features % FP8_BLOCK == 0,
        SPLIT_K=num_splits > 1,
        UPCAST_DOT=triton_interpreter(),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def fp8_linear_w8a8_triton(
    x: torch.Tensor,  # [T, in_features] bf16 / fp16 / fp32
    weight: torch.Tensor,  # [out_features, in_features] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(out/128), ceil(in/128)] float32
    config: Fp8TileConfig | None = None,
) -> torch.Tensor:
    """Triton twin of `kernels.fp8.fp8_linear_act_quant_reference`: x quantized per token and
    128 columns, then the w8a8 GEMM -> [T, out_features] in x's dtype."""
    q, q_scale = quantize_activations_triton(x)
    return fp8_gemm_triton(q, q_scale, weight, scale_inv, x.dtype, config)


def fp8_linear_w8a8(
    x: torch.Tensor,  # [T, in_features] bf16 / fp16
    weight: torch.Tensor,  # [out_features, in_features] float8_e4m3fn
    scale_inv: torch.Tensor,  # [ceil(out/128), ceil(in/128)] float32
) -> torch.Tensor:
    """The w8a8 linear (twin `fp8_linear_act_quant_reference`): from CUBLASLT_MIN_ROWS rows on,
    where this device's cuBLASLt takes DeepSeek's block scales and the shape its layouts,
    cuBLASLt's block-scaled FP8 GEMM (rows padded to 16); otherwise the Triton kernel."""
    num_rows = x.shape[0]
    if (
        num_rows >= CUBLASLT_MIN_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.is_contiguous()
        and cublaslt_shape_ok(*weight.shape)
        and cublaslt_block_scaled(x.device)
    ):
        q, q_scale = quantize_activations_triton(x, scales_token_major=True, rows_multiple=16)
        return fp8_gemm_cublaslt(q, q_scale, weight, scale_inv, x.dtype)[:num_rows]
    return fp8_linear_w8a8_triton(x, weight, scale_inv)
