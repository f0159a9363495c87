"""Activations to FP8 per token in 1x128 groups, for the w8a8 GEMM (kernels/fp8_gemm.py).

Per token and per 128 columns: scale = amax / 448 (1 for an all-zero group), q = x / scale in
float8_e4m3fn. The twin is `kernels.fp8.quantize_activations_reference` (DeepSeek's `act_quant`
without the power-of-two rounding of its "ue8m0" scale format); this kernel gives its scales and
FP8 bytes exactly: both divisions are IEEE (`div_rn`: Triton's plain fp32 `/` is not correctly
rounded on NVIDIA), and the e4m3 rounding is done in fp32 bits first (`_round_to_e4m3`), so
the conversion after it is exact under the interpreter too.
"""

from __future__ import annotations

import torch

from kernels.fp8 import FP8_BLOCK, FP8_DTYPE, FP8_MAX
from kernels.fp8_cache import _round_to_e4m3
from kernels.launch import FLOAT_DTYPES, check_tensor, launch
from kernels.platform import tl, triton

# Groups (of 128 columns) one program quantizes: a 7168-wide hidden state is 56 groups, so a
# token takes 7 programs (decode: few tokens, so enough programs to cover the SMs' load units).
GROUPS_PER_PROGRAM = 8


@triton.jit
def quantize_groups(x, FP8_MAX_VALUE: tl.constexpr):
    """x [R, 128] fp32, one group per row -> (q [R, 128] fp32 on the e4m3 grid, scale [R]): the
    act_quant math, shared by this file's kernel and the epilogues that quantize their output
    (kernels/moe_experts_w8a8.py)."""
    amax = tl.max(tl.abs(x), axis=1)  # [R]
    fp8_max = tl.full(amax.shape, FP8_MAX_VALUE, tl.float32)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, fp8_max), 1.0)  # [R]
    return _round_to_e4m3(tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))), scale


@triton.jit
def _act_quant_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    num_cols,
    num_groups,
    x_row_stride,
    q_row_stride,
    scale_token_stride,
    scale_group_stride,
    GROUPS: tl.constexpr,
    GROUP: tl.constexpr,
    FP8_MAX_VALUE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)  # [GROUPS]
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GROUPS, GROUP]
    mask = cols < num_cols
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + token * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    q, scale = quantize_groups(x, FP8_MAX_VALUE)
    tl.store(q_ptr + token * q_row_stride + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(
        scale_ptr + token * scale_token_stride + groups * scale_group_stride,
        scale,
        mask=groups < num_groups,
    )


def quantize_activations_triton(
    x: torch.Tensor, scales_token_major: bool = False, rows_multiple: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `kernels.fp8.quantize_activations_reference`: x [T, C] ->
    (q [T, C] float8_e4m3fn, contiguous; scales [T, ceil(C/128)] float32, contiguous).

    For cuBLASLt's block-scaled GEMM (kernels/fp8_cublaslt.py): `scales_token_major` stores the
    scales column by column (strides (1, rows)), and `rows_multiple` rounds the rows up to a
    multiple of it, the extra rows zero (scale 1)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, num_cols = x.shape
    num_groups = triton.cdiv(num_cols, FP8_BLOCK)
    rows = -(-num_tokens // rows_multiple) * rows_multiple
    q = torch.empty(rows, num_cols, dtype=FP8_DTYPE, device=x.device)
    scale_strides = (1, rows) if scales_token_major else (num_groups, 1)
    scale = torch.empty_strided(
        (rows, num_groups), scale_strides, dtype=torch.float32, device=x.device
    )
    if rows > num_tokens:
        q[num_tokens:].zero_()
        scale[num_tokens:].fill_(1.0)
    if num_tokens == 0 or num_cols == 0:
        return q, scale
    groups_per_program = min(GROUPS_PER_PROGRAM, triton.next_power_of_2(num_groups))
    launch(
        _act_quant_kernel,
        (num_tokens, triton.cdiv(num_groups, groups_per_program)),
        x,
        x,
        q,
        scale,
        num_cols,
        num_groups,
        x.stride(0),
        q.stride(0),
        scale.stride(0),
        scale.stride(1),
        GROUPS=groups_per_program,
        GROUP=FP8_BLOCK,
        FP8_MAX_VALUE=FP8_MAX,
        num_warps=4,
    )
    return q, scale
