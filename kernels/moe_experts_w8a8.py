"""FP8 routed experts with FP8 activations (w8a8), for prefill-sized steps: the grouped MoE of
kernels/moe_experts.py with both GEMMs on the FP8 tensor cores.

The twin is `kernels.moe_experts.grouped_moe_w8a8_reference` (DeepSeek's reference inference).
Four launches: the input quantized per token in 1x128 groups (kernels/fp8_act_quant.py, once per
token, not per routed pair); gate/up as FP8 x FP8 with SiLU-and-mul and the intermediate's own
per-token 1x128 quantization fused into the epilogue (each program holds whole 128-column groups
of its rows: BLOCK_N is a multiple of 128); down as FP8 x FP8 times the routing weight into one
fp32 row per pair; the pair sum of kernels/moe_experts.py. Same contiguous grouped layout.

Each K step is one 128-wide scale block, as in kernels/fp8_gemm.py: the FP8 tile product (fp32
out) is multiplied by a_scale[row, kb] * w_scale[n // 128, kb] and added to an fp32 accumulator,
so the tensor cores never accumulate more than 128 products (DeepSeek's promotion every 128).
Under Triton's interpreter (no FP8 tl.dot) the FP8 tiles are converted to fp32 first: the same
products (e4m3 x e4m3 is exact in fp32), the same scaling.
"""

from __future__ import annotations

import torch

from kernels.fp8 import FP8_BLOCK, FP8_DTYPE, FP8_MAX
from kernels.fp8_act_quant import quantize_activations_triton, quantize_groups
from kernels.fp8_gemm import scaled_fp8_dot
from kernels.launch import check_tensor, launch
from kernels.moe_experts import (
    GroupedGemmConfig,
    check_fp8_scales,
    check_moe_args,
    grouped_layout_triton,
    launch_pair_sum,
)
from kernels.platform import tl, triton, triton_interpreter

# block_k is the scale block (one promotion per 128 of K); block_n a multiple of it, so the
# gate/up epilogue quantizes whole groups. The H200 sweep (`benchmarks/bench_fp8_linear.py --moe
# --sweep`, BENCHMARKS.md, session 11) found this the fastest of 24 tiles at 512, 2048 and 8192
# tokens; four stages instead of three: 5-8% at 512 and 2048 tokens.
W8A8_CONFIG = GroupedGemmConfig(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=4)
# The down GEMM's own tile (its block_m is the layout's, so W8A8_CONFIG's): its K is the
# intermediate (16 steps at DeepSeek-V3.2's 2048) and its N the hidden size, where gate/up has
# 56 K steps over 16 N tiles of both halves. `bench_fp8_linear.py --moe --sweep-down` on an H100
# (BENCHMARKS.md, session 42): a whole MoE layer at 512 / 2048 / 8192 tokens 4.38 / 5.79 /
# 15.52 ms with W8A8_CONFIG's tile, 4.22 / 5.32 / 14.06 ms with this one (the same bits).
W8A8_DOWN_CONFIG = GroupedGemmConfig(
    block_m=64, block_n=256, block_k=128, num_warps=8, num_stages=4
)

_FP8_MAX = tl.constexpr(FP8_MAX)


def _tl_dtype(dtype: torch.dtype):
    """Triton's dtype for a torch one, looked up at launch: where Triton is not installed this
    module must still import (the ops run the twins)."""
    by_torch = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    return by_torch[dtype]


@triton.jit
def _round_as(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE (nearest, ties to even), still in fp32. bf16 by its bits: the
    FP8 rounding after it turns a one-ulp bf16 difference into a whole e4m3 step, and Triton's
    interpreter truncates fp32 to bf16 (half of randn values came out one ulp off)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def _moe_gate_up_w8a8_kernel(
    xq_ptr,
    x_scale_ptr,
    w13_ptr,
    w13_scale_ptr,
    hq_ptr,
    h_scale_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    xq_row_stride,
    x_scale_row_stride,
    w13_expert_stride,
    w13_row_stride,
    scale_expert_stride,
    scale_part_stride,
    scale_row_stride,
    scale_col_stride,
    hq_row_stride,
    h_scale_row_stride,
    hidden,
    intermediate,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    block = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of intermediate
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    col_mask = cols < intermediate
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        pairs = tl.load(sorted_pairs_ptr + rows)
        valid = pairs >= 0
        tokens = tl.where(valid, pairs // TOP_K, 0).to(tl.int64)
        a_rows = xq_ptr + tokens[:, None] * xq_row_stride  # [BLOCK_M, 1]
        a_scales = x_scale_ptr + tokens * x_scale_row_stride  # [BLOCK_M]
        w_gate = w13_ptr + expert * w13_expert_stride + cols[:, None].to(tl.int64) * w13_row_stride
        w_up = w_gate + intermediate * w13_row_stride
        # [BLOCK_N] scale rows of the gate grid; the up grid is the next part.
        s_gate = w13_scale_ptr + expert * scale_expert_stride + (cols // BLOCK_K) * scale_row_stride
        s_up = s_gate + scale_part_stride
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(hidden, BLOCK_K)):
            k = kb * BLOCK_K + kk
            k_mask = k < hidden
            a = tl.load(a_rows + k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
            w_mask = col_mask[:, None] & k_mask[None, :]
            bg = tl.load(w_gate + k[None, :], mask=w_mask, other=0.0)  # [BLOCK_N, BLOCK_K]
            bu = tl.load(w_up + k[None, :], mask=w_mask, other=0.0)
            a_scale = tl.load(a_scales + kb, mask=valid, other=0.0)  # [BLOCK_M]
            sg = tl.load(s_gate + kb * scale_col_stride, mask=col_mask, other=0.0)  # [BLOCK_N]
            su = tl.load(s_up + kb * scale_col_stride, mask=col_mask, other=0.0)
            acc_gate += scaled_fp8_dot(a, bg, a_scale, sg, UPCAST_DOT)
            acc_up += scaled_fp8_dot(a, bu, a_scale, su, UPCAST_DOT)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        # Round where the twin rounds: the GEMM outputs, silu, the product; then its act_quant.
        gate = _round_as(acc_gate, ROUND_DTYPE)
        up = _round_as(acc_up, ROUND_DTYPE)
        silu = _round_as(gate / (1.0 + tl.exp(-gate)), ROUND_DTYPE)
        h = _round_as(silu * up, ROUND_DTYPE)  # columns past I are 0: no effect on amax
        # [BLOCK_M * BLOCK_N / 128, 128]: one row per (row, group), as act_quant groups them.
        q, scale = quantize_groups(
            tl.reshape(h, [BLOCK_M * (BLOCK_N // BLOCK_K), BLOCK_K]), _FP8_MAX
        )
        tl.store(
            hq_ptr + rows[:, None].to(tl.int64) * hq_row_stride + cols[None, :],
            tl.reshape(q, [BLOCK_M, BLOCK_N]).to(hq_ptr.dtype.element_ty),
            mask=valid[:, None] & col_mask[None, :],
        )
        groups = tl.program_id(1) * (BLOCK_N // BLOCK_K) + tl.arange(0, BLOCK_N // BLOCK_K)
        tl.store(
            h_scale_ptr + rows[:, None].to(tl.int64) * h_scale_row_stride + groups[None, :],
            tl.reshape(scale, [BLOCK_M, BLOCK_N // BLOCK_K]),
            mask=valid[:, None] & (groups * BLOCK_K < intermediate)[None, :],
        )


@triton.jit
def _moe_down_w8a8_kernel(
    hq_ptr,
    h_scale_ptr,
    w2_ptr,
    w2_scale_ptr,
    topk_weights_ptr,
    y_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    hq_row_stride,
    h_scale_row_stride,
    w2_expert_stride,
    w2_row_stride,
    scale_expert_stride,
    scale_row_stride,
    scale_col_stride,
    y_row_stride,
    hidden,
    intermediate,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUND_DTYPE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    block = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of hidden
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    col_mask = cols < hidden
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert >= 0:
        pairs = tl.load(sorted_pairs_ptr + rows)
        valid = pairs >= 0
        a_rows = hq_ptr + rows[:, None].to(tl.int64) * hq_row_stride  # [BLOCK_M, 1]
        a_scales = h_scale_ptr + rows.to(tl.int64) * h_scale_row_stride  # [BLOCK_M]
        w_rows = w2_ptr + expert * w2_expert_stride + cols[:, None].to(tl.int64) * w2_row_stride
        w_scales = (
            w2_scale_ptr + expert * scale_expert_stride + (cols // BLOCK_K) * scale_row_stride
        )
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(intermediate, BLOCK_K)):
            k = kb * BLOCK_K + kk
            k_mask = k < intermediate
            a = tl.load(a_rows + k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_rows + k[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
            a_scale = tl.load(a_scales + kb, mask=valid, other=0.0)  # [BLOCK_M]
            w_scale = tl.load(w_scales + kb * scale_col_stride, mask=col_mask, other=0.0)
            acc += scaled_fp8_dot(a, b, a_scale, w_scale, UPCAST_DOT)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
        weight = tl.load(topk_weights_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
        y = _round_as(acc, ROUND_DTYPE) * weight[:, None]
        tl.store(
            y_ptr + pairs[:, None].to(tl.int64) * y_row_stride + cols[None, :],
            y,
            mask=valid[:, None] & col_mask[None, :],
        )


def grouped_moe_w8a8_triton(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    config: GroupedGemmConfig | None = None,
    down_config: GroupedGemmConfig | None = None,
) -> torch.Tensor:
    """Triton twin of `kernels.moe_experts.grouped_moe_w8a8_reference`: x [T, hidden], FP8
    experts with their scales (`check_fp8_scales`) -> [T, hidden] in x's dtype. `config`: the
    gate/up tile (and the layout's block_m); `down_config`: the down GEMM's, with the same
    block_m (None: `config` where one is given, else W8A8_DOWN_CONFIG)."""
    device = x.device
    num_tokens, hidden, num_local_experts, intermediate, top_k = check_moe_args(
        x, w13, w2, topk_weights, topk_ids, (FP8_DTYPE,)
    )
    if not check_fp8_scales(w13, w2, w13_scale, w2_scale):
        raise ValueError("w8a8 experts need w13_scale and w2_scale")
    check_tensor("w13_scale", w13_scale, last_dim_contiguous=False, device=device)
    check_tensor("w2_scale", w2_scale, last_dim_contiguous=False, device=device)
    down_config = down_config or config or W8A8_DOWN_CONFIG
    config = config or W8A8_CONFIG
    if config.block_k != FP8_BLOCK or config.block_n % FP8_BLOCK:
        raise ValueError(
            f"w8a8 experts need block_k {FP8_BLOCK} and block_n a multiple of it, got {config}"
        )
    if down_config.block_k != FP8_BLOCK or down_config.block_m != config.block_m:
        raise ValueError(
            f"the down GEMM's tile needs block_k {FP8_BLOCK} and the layout's block_m "
            f"{config.block_m}, got {down_config}"
        )
    num_pairs = num_tokens * top_k
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=device)  # [T * top_k, hidden]
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=device)
    if num_pairs == 0:
        return out
    xq, x_scale = quantize_activations_triton(x)  # [T, H] e4m3, [T, ceil(H/128)] fp32
    layout = grouped_layout_triton(topk_ids, num_local_experts, first_expert, config.block_m)
    num_blocks = layout.block_expert.shape[0]
    num_rows = layout.sorted_pairs.shape[0]
    # [rows, I] e4m3 and [rows, ceil(I/128)] fp32, in the layout's row order; padding rows unset.
    hq = torch.empty(num_rows, intermediate, dtype=FP8_DTYPE, device=device)
    h_scale = torch.empty(
        num_rows, triton.cdiv(intermediate, FP8_BLOCK), dtype=torch.float32, device=device
    )

    def meta(tile: GroupedGemmConfig) -> dict:
        return dict(
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_K=FP8_BLOCK,
            ROUND_DTYPE=_tl_dtype(x.dtype),
            UPCAST_DOT=triton_interpreter(),
            num_warps=tile.num_warps,
            num_stages=tile.num_stages,
        )

    launch(
        _moe_gate_up_w8a8_kernel,
        (num_blocks, triton.cdiv(intermediate, config.block_n)),
        x,
        xq,
        x_scale,
        w13,
        w13_scale,
        hq,
        h_scale,
        layout.sorted_pairs,
        layout.block_expert,
        xq.stride(0),
        x_scale.stride(0),
        w13.stride(0),
        w13.stride(1),
        *w13_scale.stride(),
        hq.stride(0),
        h_scale.stride(0),
        hidden,
        intermediate,
        TOP_K=top_k,
        **meta(config),
    )
    launch(
        _moe_down_w8a8_kernel,
        (num_blocks, triton.cdiv(hidden, down_config.block_n)),
        x,
        hq,
        h_scale,
        w2,
        w2_scale,
        topk_weights,
        y,
        layout.sorted_pairs,
        layout.block_expert,
        hq.stride(0),
        h_scale.stride(0),
        w2.stride(0),
        w2.stride(1),
        *w2_scale.stride(),
        y.stride(0),
        hidden,
        intermediate,
        **meta(down_config),
    )
    launch_pair_sum(y, topk_ids, out, num_local_experts, first_expert)
    return out
