"""DeepSeek's block-scaled FP8, the twins: weights in float8_e4m3fn with one float32
`weight_scale_inv` per 128x128 block (edge blocks partial), and activations quantized per token
in 1x128 groups for FP8 GEMMs (scale = amax / 448), as DeepSeek's reference inference does.

These are the specs the FP8 kernels are tested against: the weight twin is exact dequantization
(weight x its block's scale) followed by the matmul; the activation twin also rounds the
activations to FP8 first.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128  # rows and columns of a weight's scale block, and the activations' group size
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """x in e4m3, saturated at +-448: a plain cast past the range gives 448 on CPU and NaN on
    CUDA (PyTorch 2.11)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor correctly rounded on every device (PyTorch's CUDA division by a Python
    scalar multiplies by its reciprocal, which can differ in the last bit)."""
    return x / torch.full_like(x, divisor)


def scale_grid(rows: int, cols: int) -> tuple[int, int]:
    """Shape of the scale tensor of a [rows, cols] FP8 weight."""
    return -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)


def dequantize_fp8_reference(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """weight [..., R, C] (FP8) * its block's scale [..., ceil(R/128), ceil(C/128)] -> fp32."""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, -2)[..., :rows, :]
    scale = scale.repeat_interleave(FP8_BLOCK, -1)[..., :cols]
    return weight.float() * scale


def quantize_fp8_reference(
    weight: torch.Tensor, pow2_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise quantization as DeepSeek ships its checkpoints: per 128x128 block,
    scale = amax / 448 (1 for an all-zero block) -> (FP8 weight, float32 scale_inv).
    `pow2_scales`: the scale rounded up to a power of two (UE8M0, DeepSeek-V3.1 and later)."""
    rows, cols = weight.shape
    grid_r, grid_c = scale_grid(rows, cols)
    padded = weight.new_zeros(grid_r * FP8_BLOCK, grid_c * FP8_BLOCK, dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(grid_r, FP8_BLOCK, grid_c, FP8_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))  # [grid_r, grid_c]
    scale = torch.where(amax > 0, _div(amax, FP8_MAX), torch.ones_like(amax))
    if pow2_scales:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(FP8_DTYPE)
    return q, scale


# The w8a16 kernels scale a k step's product instead of each weight element (pow2_scales) only
# with tiles of at most this many rows: on the H200 it is 6-17% faster at 1-8 rows and 6-15%
# slower with 64-row tiles (`benchmarks/bench_fp8_linear.py`, BENCHMARKS.md session 13).
POW2_SCALES_MAX_BLOCK_M = 16


def scales_are_powers_of_two(scale: torch.Tensor) -> bool:
    """Whether every scale is a positive, finite, normal power of two (its float32 mantissa
    bits all zero): DeepSeek-V3.1 and later ship their block scales so (UE8M0). Then a product
    times a scale is exact, and kernels may scale partial sums instead of weight elements."""
    bits = scale.detach().float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    return bool(((bits & 0x807FFFFF) == 0).all() and ((exponent > 0) & (exponent < 255)).all())


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, per 1x128 group of columns: scale = amax / 448 -> (x in FP8, scales
    [T, ceil(C/128)] float32). DeepSeek's `act_quant`."""
    tokens, cols = x.shape
    groups = -(-cols // FP8_BLOCK)
    padded = x.new_zeros(tokens, groups * FP8_BLOCK, dtype=torch.float32)
    padded[:, :cols] = x.float()
    grouped = padded.view(tokens, groups, FP8_BLOCK)
    amax = grouped.abs().amax(dim=-1)  # [T, groups]
    scale = torch.where(amax > 0, _div(amax, FP8_MAX), torch.ones_like(amax))
    q = (grouped / scale[..., None]).view_as(padded)[:, :cols].to(FP8_DTYPE)
    return q, scale


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, pow2_scales: bool = False
) -> torch.Tensor:
    """The weight twin: y = x @ dequant(weight)^T, the weights rounded to x's dtype as a
    bf16 GEMM sees them (exact in fp32). x [T, C], weight [R, C] FP8 -> [T, R] in x's dtype.
    `pow2_scales` (the kernels' hint, see `scales_are_powers_of_two`) changes nothing here."""
    w = dequantize_fp8_reference(weight, scale_inv).to(x.dtype)
    return x @ w.t()


def dequantize_activations_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [T, C] (FP8) * its token's group scale [T, ceil(C/128)] -> fp32."""
    return q.float() * scale.float().repeat_interleave(FP8_BLOCK, -1)[:, : q.shape[1]]


def fp8_gemm_reference(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The w8a8 GEMM's twin: FP8 activations with per-token 1x128 scales times an FP8 weight
    with 128x128 block scales, both dequantized exactly, multiplied in fp32 -> [T, R] out_dtype."""
    x = dequantize_activations_reference(q, q_scale)
    return (x @ dequantize_fp8_reference(weight, scale_inv).t()).to(out_dtype)


def fp8_linear_act_quant_reference(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor
) -> torch.Tensor:
    """The activation twin (DeepSeek's FP8 GEMM): activations quantized per 1x128 group too,
    products accumulated in fp32 -> [T, R] in x's dtype."""
    return fp8_gemm_reference(*quantize_activations_reference(x), weight, scale_inv, x.dtype)
