"""MLA's absorbed products on DeepSeek's block-scaled FP8 kv_b_proj, dequantized in registers.

MLA never multiplies by kv_b_proj as a linear: attention runs in the latent space, so q's nope
part is taken into it per head (`absorb_q`: q_latent[t, h] = q_nope[t, h] @ W_UK[h]) and the
attention's latent output back out of it (`absorb_out`: out[t, h] = o_latent[t, h] @ W_UV[h]^T).
kv_b_proj's weight is [H * (nope + v), kv_lora]: per head, nope rows of W_UK then v rows of W_UV.
Where each head's nope and v parts are whole 128-row scale blocks (DeepSeek-V3.2: 128 and 128),
the weight stays FP8 with its scales: a decode step reads half the bytes of the bf16 bmm (8.4 MB
instead of 16.8 per product and layer at 128 heads). That is for steps of up to
ABSORB_FP8_MAX_ROWS rows; larger ones read a bf16 copy that the model keeps beside the FP8
weight (workers.model.AbsorbedKvB), where cuBLAS's bmm wins.

The twins (`absorb_q_reference`, `absorb_out_reference`) dequantize the weight to x's dtype and
run torch.bmm: what the model did before, on a weight dequantized at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.fp8 import FP8_BLOCK, FP8_DTYPE, dequantize_fp8_reference, scale_grid
from kernels.launch import FLOAT_DTYPES, check_tensor, dot_in_fp32, launch
from kernels.platform import tl, triton


def fp8_absorbable(nope_dim: int, v_dim: int) -> bool:
    """Whether an FP8 kv_b_proj of these head dims is read FP8 (each head's parts whole blocks)."""
    return nope_dim % FP8_BLOCK == 0 and v_dim % FP8_BLOCK == 0


def _heads(weight: torch.Tensor, nope_dim: int, v_dim: int) -> int:
    rows = weight.shape[0]
    if rows % (nope_dim + v_dim):
        raise ValueError(f"kv_b weight of {rows} rows is not heads x ({nope_dim} + {v_dim})")
    return rows // (nope_dim + v_dim)


def absorb_q_dense(q_nope: torch.Tensor, w_kv_b: torch.Tensor, v_dim: int) -> torch.Tensor:
    """q_nope [T, H, nope] times each head's W_UK of a kv_b_proj weight in q_nope's dtype
    ([H * (nope + v), kv_lora]) -> [T, H, kv_lora]: one torch.bmm over the heads (what
    einsum("thd,hdl->thl") runs, without its per-call parsing, a visible share of an eager
    step's host time on the H200)."""
    nope_dim = q_nope.shape[-1]
    w_uk = w_kv_b.view(q_nope.shape[1], nope_dim + v_dim, -1)[:, :nope_dim]
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def absorb_out_dense(o_latent: torch.Tensor, w_kv_b: torch.Tensor, nope_dim: int) -> torch.Tensor:
    """o_latent [T, H, kv_lora] times each head's W_UV^T of a kv_b_proj weight in o_latent's
    dtype -> [T, H, v]."""
    w_kv_b = w_kv_b.view(o_latent.shape[1], -1, w_kv_b.shape[-1])
    w_uv = w_kv_b[:, nope_dim:]
    return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def absorb_q_reference(
    q_nope: torch.Tensor,  # [T, H, nope]
    weight: torch.Tensor,  # [H * (nope + v), kv_lora] FP8
    scale_inv: torch.Tensor,  # its 128x128 blocks' scales
    v_dim: int,
    pow2_scales: bool = False,
) -> torch.Tensor:
    """q_nope taken into the latent space: [T, H, kv_lora] in q_nope's dtype, the weight
    dequantized and rounded to that dtype first. (`pow2_scales`, the kernel's hint, changes
    nothing here.)"""
    _heads(weight, q_nope.shape[-1], v_dim)
    w_kv_b = dequantize_fp8_reference(weight, scale_inv).to(q_nope.dtype)
    return absorb_q_dense(q_nope, w_kv_b, v_dim)


def absorb_out_reference(
    o_latent: torch.Tensor,  # [T, H, kv_lora]
    weight: torch.Tensor,  # [H * (nope + v), kv_lora] FP8
    scale_inv: torch.Tensor,
    nope_dim: int,
    pow2_scales: bool = False,
) -> torch.Tensor:
    """The attention's latent output taken back out: [T, H, v] in o_latent's dtype, the weight
    dequantized and rounded to that dtype first. (`pow2_scales`, the kernel's hint, changes
    nothing here.)"""
    w_kv_b = dequantize_fp8_reference(weight, scale_inv).to(o_latent.dtype)
    return absorb_out_dense(o_latent, w_kv_b, nope_dim)


# --- Triton ---------------------------------------------------------------------------------------
#
# One kernel for both products: per head, out[t, n] = sum_k x[t, k] * w[n, k] * s[n // 128,
# k // 128], where w and s are addressed through strides, so W_UK is read transposed (n = latent
# column, k = nope row: n contiguous, N_CONTIGUOUS) and W_UV as stored (n = v row, k = latent
# column), neither copied; each tile is loaded with its contiguous axis last. One program per
# (head, BLOCK_N outputs, BLOCK_M rows); K (128 nope rows or kv_lora latent columns) is walked
# BLOCK_K at a time, a multiple of the 128-wide scale blocks.
# - One row: on CUDA cores, the FP8 tile times the row, summed per scale block, each block's sum
#   times its scale (as the one-row linear, kernels/fp8_linear.py: no 16-row padding for the
#   tensor cores, and K in one wide load).
# - More rows: tl.dot with the dequantized tile (BLOCK_K = 128), rounded to x's dtype as the twin
#   rounds its weight; with power-of-two scales the FP8 tile goes to the dot as it is (exact in
#   bf16) and the scale multiplies the block's product instead (exact).


@dataclass(frozen=True)
class AbsorbConfig:
    block_m: int  # 1: the CUDA-core product, one row a program
    block_n: int
    num_warps: int
    num_stages: int
    block_k: int = FP8_BLOCK  # one row only: up to the whole K in one load


# By rows (`config_for`); block_n halves until heads x output tiles reaches min_programs (fewer
# heads per rank under TP narrow it further). `benchmarks/bench_mla_absorb.py --sweep` on the H200
# (2026-12-04, BENCHMARKS.md session 25), weights past L2: one row at 128 heads, absorb_q 5.6 us
# at n64 with 2 warps (the best of 18 tiles 5.2, within the run's spread), absorb_out 4.0 at n32
# with K whole (best 3.8); at 16 heads 2.3 / 1.9 (best 2.2 / 1.8). A few rows: n64 for both.
ONE_ROW = AbsorbConfig(block_m=1, block_n=64, num_warps=4, num_stages=1, block_k=512)
FEW_ROWS = AbsorbConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)
MANY_ROWS = AbsorbConfig(block_m=32, block_n=128, num_warps=8, num_stages=2)
_MIN_PROGRAMS = {1: 512, 16: 256, 32: 256}  # by block_m
_MIN_BLOCK_N = 32
# One row: a tile of at most this many weights (absorb_q's K is 128 nope rows) takes 2 warps.
_SMALL_ONE_ROW_TILE = 128 * 64
# Steps of up to this many rows read the FP8 weight; larger ones a bf16 copy with torch.bmm
# (cuBLAS). The same runs, 128 heads, FP8 kernel against the bf16 bmm (q + out, us): 1 row
# 5.3 + 4.0 against 6.4 + 6.4; 4 rows 7.3 + 6.1 against 6.4 + 8.6; 32 rows (best tiles) 10.2 + 8.1
# against 7.1 + 9.2; 2048 rows 4.4x and 2.6x slower (the tensor-core tile converts each weight
# again for every row tile).
ABSORB_FP8_MAX_ROWS = 16


# The row count and row strides vary by step: not specialized on, so a layer's variants are only
# its constexprs' (`config_for`: one row, up to 16, more), all met by the warm-up's steps.
@triton.jit(do_not_specialize=["num_rows", "x_row_stride", "out_row_stride"])
def _fp8_head_matmul_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    out_ptr,
    num_rows,
    n_out,
    k_in,
    x_row_stride,
    x_head_stride,
    out_row_stride,
    out_head_stride,
    w_head_stride,
    w_n_stride,
    w_k_stride,
    s_head_stride,
    s_n_stride,
    s_k_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
    N_CONTIGUOUS: tl.constexpr,
    ONE_ROW: tl.constexpr,
    POW2_SCALES: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    KB: tl.constexpr = BLOCK_K // SCALE_BLOCK  # scale blocks per K step
    head = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # outputs
    col_mask = cols < n_out
    w_head = w_ptr + head.to(tl.int64) * w_head_stride
    s_cols = scale_ptr + head * s_head_stride + (cols // SCALE_BLOCK) * s_n_stride  # [BLOCK_N]
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    x_rows = x_ptr + rows[:, None].to(tl.int64) * x_row_stride + head * x_head_stride
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    if ONE_ROW:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < k_in
        blocks = k0 // SCALE_BLOCK + tl.arange(0, KB)
        scale = tl.load(
            s_cols[:, None] + blocks[None, :] * s_k_stride,
            mask=col_mask[:, None] & (blocks * SCALE_BLOCK < k_in)[None, :],
            other=0.0,
        )  # [BLOCK_N, KB]
        x = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if N_CONTIGUOUS:
            w = tl.load(
                w_head + kk[:, None] * w_k_stride + cols[None, :],
                mask=k_mask[:, None] & col_mask[None, :],
                other=0.0,
            )  # [BLOCK_K, BLOCK_N]
        else:
            w = tl.trans(
                tl.load(
                    w_head + cols[:, None] * w_n_stride + kk[None, :],
                    mask=col_mask[:, None] & k_mask[None, :],
                    other=0.0,
                )
            )  # [BLOCK_K, BLOCK_N]
        if ONE_ROW:
            w3 = tl.reshape(w.to(tl.float32), [KB, SCALE_BLOCK, BLOCK_N])
            x3 = tl.reshape(x.to(tl.float32), [KB, SCALE_BLOCK, 1])
            scale_t = tl.trans(scale)  # [KB, BLOCK_N]
            if POW2_SCALES:
                acc += tl.sum(tl.sum(w3 * x3, axis=1) * scale_t, axis=0)
            else:
                w3 = (w3 * scale_t[:, None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
                acc += tl.sum(tl.sum(w3 * x3, axis=1), axis=0)
        else:
            scale_n = tl.reshape(scale, [BLOCK_N])  # KB == 1
            if POW2_SCALES:
                w = w.to(x_ptr.dtype.element_ty)  # e4m3 is exact in bf16 / fp16 / fp32
            else:
                w = (w.to(tl.float32) * scale_n[None, :]).to(x_ptr.dtype.element_ty)
            if UPCAST_DOT:
                part = tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(x, w)
            if POW2_SCALES:
                acc += part * scale_n[None, :]
            else:
                acc += part
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if ONE_ROW:
        out = out_ptr + head * out_head_stride + cols
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=col_mask)
    else:
        out = out_ptr + rows[:, None].to(tl.int64) * out_row_stride + head * out_head_stride
        tl.store(
            out + cols[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & col_mask[None, :],
        )


def config_for(num_rows: int, heads: int, n_out: int, k_in: int) -> AbsorbConfig:
    """The tile for a launch: by rows, block_n narrowed until the launch has min_programs (not
    counting row tiles, so a layer's variants do not follow the row count)."""
    base = ONE_ROW if num_rows == 1 else FEW_ROWS if num_rows <= 16 else MANY_ROWS
    block_n = min(base.block_n, max(16, triton.next_power_of_2(n_out)))
    min_programs = _MIN_PROGRAMS[base.block_m]
    while block_n > _MIN_BLOCK_N and heads * triton.cdiv(n_out, block_n) < min_programs:
        block_n //= 2
    num_warps = base.num_warps
    if num_rows == 1 and block_n * min(base.block_k, k_in) <= _SMALL_ONE_ROW_TILE:
        num_warps = 2
    return AbsorbConfig(base.block_m, block_n, num_warps, base.num_stages, base.block_k)


def _check(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, nope_dim: int, v_dim: int
) -> int:
    check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=2, dtypes=(FP8_DTYPE,), contiguous=True, device=x.device)
    check_tensor("scale_inv", scale_inv, ndim=2, dtypes=(torch.float32,), device=x.device)
    if not fp8_absorbable(nope_dim, v_dim):
        raise ValueError(
            f"nope {nope_dim} and v {v_dim} must be whole {FP8_BLOCK}-row scale blocks per head"
        )
    if tuple(scale_inv.shape) != scale_grid(*weight.shape):
        raise ValueError(
            f"scale_inv {tuple(scale_inv.shape)}, expected {scale_grid(*weight.shape)} for a "
            f"{tuple(weight.shape)} weight"
        )
    heads = _heads(weight, nope_dim, v_dim)
    if x.shape[1] != heads:
        raise ValueError(f"x has {x.shape[1]} heads, the weight {heads}")
    return heads


@dataclass(frozen=True)
class _HeadPart:
    """One part of every head's kv_b_proj rows as the kernel reads it, [H, N, K] through strides
    (nothing copied): W_UK transposed (n: a latent column, k: a nope row) or W_UV as stored
    (n: a v row, k: a latent column)."""

    weight: torch.Tensor  # from the part's first row
    scale_inv: torch.Tensor  # from the part's first scale row
    strides: tuple[int, int, int]  # head, n, k
    scale_strides: tuple[int, int, int]

    @classmethod
    def w_uk(cls, weight: torch.Tensor, scale_inv: torch.Tensor, nope_dim: int, v_dim: int):
        head_rows = nope_dim + v_dim
        return cls(
            weight,
            scale_inv,
            (head_rows * weight.stride(0), 1, weight.stride(0)),
            (head_rows // FP8_BLOCK * scale_inv.stride(0), 1, scale_inv.stride(0)),
        )

    @classmethod
    def w_uv(cls, weight: torch.Tensor, scale_inv: torch.Tensor, nope_dim: int, v_dim: int):
        head_rows = nope_dim + v_dim
        return cls(
            weight[nope_dim:],
            scale_inv[nope_dim // FP8_BLOCK :],
            (head_rows * weight.stride(0), weight.stride(0), 1),
            (head_rows // FP8_BLOCK * scale_inv.stride(0), scale_inv.stride(0), 1),
        )


def _head_matmul(
    x: torch.Tensor,  # [T, H, K]
    part: _HeadPart,
    out: torch.Tensor,  # [T, H, N]
    pow2_scales: bool,
    config: AbsorbConfig | None,
) -> torch.Tensor:
    num_rows, heads, k_in = x.shape
    n_out = out.shape[2]
    if num_rows == 0:
        return out
    config = config or config_for(num_rows, heads, n_out, k_in)
    one_row = config.block_m == 1
    if one_row and num_rows != 1:
        raise ValueError(f"the one-row tile takes 1 row, not {num_rows}")
    if config.block_k % FP8_BLOCK or (not one_row and config.block_k != FP8_BLOCK):
        raise ValueError(
            f"block_k {config.block_k}: a multiple of {FP8_BLOCK}, {FP8_BLOCK} with rows"
        )
    block_k = min(config.block_k, triton.next_power_of_2(triton.cdiv(k_in, FP8_BLOCK)) * FP8_BLOCK)
    grid = (heads, triton.cdiv(n_out, config.block_n), triton.cdiv(num_rows, config.block_m))
    launch(
        _fp8_head_matmul_kernel,
        grid,
        x,
        x,
        part.weight,
        part.scale_inv,
        out,
        num_rows,
        n_out,
        k_in,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        *part.strides,
        *part.scale_strides,
        BLOCK_M=config.block_m,  # 1: x is [1, BLOCK_K]
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        SCALE_BLOCK=FP8_BLOCK,
        N_CONTIGUOUS=part.strides[1] == 1,
        ONE_ROW=one_row,
        POW2_SCALES=pow2_scales,
        UPCAST_DOT=dot_in_fp32(x.dtype),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def absorb_q_triton(
    q_nope: torch.Tensor,  # [T, H, nope], last dim contiguous
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    v_dim: int,
    pow2_scales: bool = False,
    config: AbsorbConfig | None = None,
) -> torch.Tensor:
    """Triton twin of `absorb_q_reference`: [T, H, kv_lora] contiguous. `pow2_scales`: the
    caller's promise that every scale is a power of two (then products are scaled, not
    weights: the same numbers up to the fp32 summation order)."""
    nope_dim = q_nope.shape[-1]
    heads = _check(q_nope, weight, scale_inv, nope_dim, v_dim)
    kv_lora = weight.shape[1]
    out = torch.empty(q_nope.shape[0], heads, kv_lora, dtype=q_nope.dtype, device=q_nope.device)
    part = _HeadPart.w_uk(weight, scale_inv, nope_dim, v_dim)
    return _head_matmul(q_nope, part, out, pow2_scales, config)


def absorb_out_triton(
    o_latent: torch.Tensor,  # [T, H, kv_lora], last dim contiguous
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    nope_dim: int,
    pow2_scales: bool = False,
    config: AbsorbConfig | None = None,
) -> torch.Tensor:
    """Triton twin of `absorb_out_reference`: [T, H, v] contiguous (o_proj's input as
    [T, H * v] without a copy)."""
    heads = o_latent.shape[1]
    v_dim = weight.shape[0] // heads - nope_dim
    _check(o_latent, weight, scale_inv, nope_dim, v_dim)
    if o_latent.shape[2] != weight.shape[1]:
        raise ValueError(f"o_latent has {o_latent.shape[2]} columns, the weight {weight.shape[1]}")
    out = torch.empty(o_latent.shape[0], heads, v_dim, dtype=o_latent.dtype, device=o_latent.device)
    part = _HeadPart.w_uv(weight, scale_inv, nope_dim, v_dim)
    return _head_matmul(o_latent, part, out, pow2_scales, config)
