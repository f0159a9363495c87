"""Rotary position embedding in the two layouts DeepSeek-V3.2 uses.

MLA rotates *interleaved* pairs (x0, x1), (x2, x3), ... of the last `qk_rope_head_dim` dims; the
indexer rotates *half-split* (NeoX) pairs (x_i, x_{i+d/2}) of its first `qk_rope_head_dim` dims.
Both write the result de-interleaved, [real parts | imaginary parts], as `transformers` does, so
q and k stay consistent and cached keys compare bit-for-bit with the oracle's.
"""

from __future__ import annotations

import torch

from kernels.launch import FLOAT_DTYPES, check_tensor, launch
from kernels.platform import libdevice, tl, triton, triton_interpreter


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin per position and frequency: [num_tokens, rope_dim // 2], fp32."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


# Tokens per program: a decode step's few tokens are one program; a 2k prefill chunk 128.
_COS_SIN_TOKENS = 16


# The token count is not specialized on, nor the positions' offset in the step's packed inputs:
# a new batch shape must not compile a variant mid-serving.
@triton.jit(do_not_specialize=["num_tokens"], do_not_specialize_on_alignment=["positions_ptr"])
def _rope_cos_sin_kernel(
    positions_ptr,
    inv_freq_ptr,
    cos_ptr,
    sin_ptr,
    num_tokens,
    half,
    attention_scaling,
    BLOCK_T: tl.constexpr,
    BLOCK_F: tl.constexpr,
    LIBDEVICE: tl.constexpr,  # False under the interpreter, which runs no libdevice function
    USE_PDL: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    freqs = tl.arange(0, BLOCK_F)
    token_mask = tokens < num_tokens
    freq_mask = freqs < half
    # The model's inv_freq buffer is no kernel's output: read before the PDL wait.
    inv_freq = tl.load(inv_freq_ptr + freqs, mask=freq_mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    positions = tl.load(positions_ptr + tokens, mask=token_mask, other=0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # The twin's ops one by one, each rounded to fp32: the product, then the device math
    # library's cos / sin (torch's on CUDA; tl.cos may lower to an approximate instruction),
    # then the scaling.
    angle = positions.to(tl.float32)[:, None] * inv_freq[None, :]
    if LIBDEVICE:
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    else:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    at = tokens[:, None] * half + freqs[None, :]
    mask = token_mask[:, None] & freq_mask[None, :]
    tl.store(cos_ptr + at, cos * attention_scaling, mask=mask)
    tl.store(sin_ptr + at, sin * attention_scaling, mask=mask)


def rope_cos_sin_triton(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `rope_cos_sin`: one launch where the twin makes six."""
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64))
    check_tensor("inv_freq", inv_freq, ndim=1, dtypes=(torch.float32,), device=positions.device)
    num_tokens, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(num_tokens, half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if num_tokens and half:
        launch(
            _rope_cos_sin_kernel,
            (triton.cdiv(num_tokens, _COS_SIN_TOKENS),),
            positions,
            positions,
            inv_freq,
            cos,
            sin,
            num_tokens,
            half,
            float(attention_scaling),
            BLOCK_T=_COS_SIN_TOKENS,
            BLOCK_F=triton.next_power_of_2(half),
            LIBDEVICE=not triton_interpreter(),
            num_warps=1,
        )
    return cos, sin


def rope_reference(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    rope_dims: int | None = None,
) -> torch.Tensor:
    """Rotate x [num_tokens, ..., width] by cos/sin [num_tokens, rope_dims // 2]: the first
    `rope_dims` (default: all) of the last dim; the rest pass through."""
    if rope_dims is not None and rope_dims < x.shape[-1]:
        return torch.cat(
            [rope_reference(x[..., :rope_dims], cos, sin, interleaved), x[..., rope_dims:]], -1
        )
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos = cos.reshape(shape).to(x.dtype)
    sin = sin.reshape(shape).to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# --- Triton ---------------------------------------------------------------------------------------


@triton.jit
def rope_pair(x1, x2, cos, sin, ROUND_DTYPE: tl.constexpr):
    """(x1 cos - x2 sin, x2 cos + x1 sin) for fp32 x1, x2, cos, sin, rounding to ROUND_DTYPE
    where the twin's torch ops round (the GPU may still contract a product into an FMA: within
    a rounding of the twin). Shared by the queries' kernel and the keys' cache writes."""
    cos = cos.to(ROUND_DTYPE).to(tl.float32)
    sin = sin.to(ROUND_DTYPE).to(tl.float32)
    a = (x1 * cos).to(ROUND_DTYPE).to(tl.float32)
    b = (x2 * sin).to(ROUND_DTYPE).to(tl.float32)
    c = (x2 * cos).to(ROUND_DTYPE).to(tl.float32)
    d = (x1 * sin).to(ROUND_DTYPE).to(tl.float32)
    return (a - b).to(ROUND_DTYPE), (c + d).to(ROUND_DTYPE)


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    x_token_stride,
    x_head_stride,
    cos_stride,
    num_heads,
    width,
    INTERLEAVED: tl.constexpr,
    HALF: tl.constexpr,  # rope_dims // 2
    BLOCK_H: tl.constexpr,
    BLOCK_REST: tl.constexpr,  # next power of 2 of width - rope_dims (0: none)
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, HALF)
    head_mask = heads < num_heads
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    row = x_ptr + token * x_token_stride + heads[:, None].to(tl.int64) * x_head_stride
    if INTERLEAVED:
        x1 = tl.load(row + 2 * j[None, :], mask=head_mask[:, None], other=0.0)
        x2 = tl.load(row + 2 * j[None, :] + 1, mask=head_mask[:, None], other=0.0)
    else:
        x1 = tl.load(row + j[None, :], mask=head_mask[:, None], other=0.0)
        x2 = tl.load(row + HALF + j[None, :], mask=head_mask[:, None], other=0.0)
    c = tl.load(cos_ptr + token * cos_stride + j)[None, :]
    s = tl.load(sin_ptr + token * cos_stride + j)[None, :]
    real, imag = rope_pair(x1.to(tl.float32), x2.to(tl.float32), c, s, x1.dtype)
    out_row = out_ptr + (token * num_heads + heads[:, None].to(tl.int64)) * width
    tl.store(out_row + j[None, :], real, mask=head_mask[:, None])
    tl.store(out_row + HALF + j[None, :], imag, mask=head_mask[:, None])
    if BLOCK_REST > 0:
        rest = 2 * HALF + tl.arange(0, BLOCK_REST)
        mask = head_mask[:, None] & (rest[None, :] < width)
        tl.store(out_row + rest[None, :], tl.load(row + rest[None, :], mask=mask), mask=mask)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def rope_triton(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    rope_dims: int | None = None,
) -> torch.Tensor:
    """Triton twin of `rope_reference` for x [T, H, width] (any token/head strides): one launch
    instead of the twin's dozen elementwise ops, the pass-through dims copied in the same pass."""
    check_tensor("x", x, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("cos", cos, ndim=2, dtypes=(torch.float32,), device=x.device)
    check_tensor("sin", sin, ndim=2, dtypes=(torch.float32,), device=x.device)
    num_tokens, num_heads, width = x.shape
    rope_dims = width if rope_dims is None else rope_dims
    half = rope_dims // 2
    if rope_dims % 2 or rope_dims > width or half & (half - 1):
        raise ValueError(f"rope_dims={rope_dims}: an even power of 2 of at most {width}")
    if cos.shape != (num_tokens, half) or sin.shape != cos.shape or cos.stride() != sin.stride():
        raise ValueError(f"cos/sin {tuple(cos.shape)}, expected {(num_tokens, half)}")
    out = torch.empty(num_tokens, num_heads, width, dtype=x.dtype, device=x.device)
    if num_tokens > 0:
        block_h = min(16, triton.next_power_of_2(num_heads))
        rest = width - rope_dims
        launch(
            _rope_kernel,
            (num_tokens, triton.cdiv(num_heads, block_h)),
            x,
            x,
            cos,
            sin,
            out,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            num_heads,
            width,
            INTERLEAVED=interleaved,
            HALF=half,
            BLOCK_H=block_h,
            BLOCK_REST=triton.next_power_of_2(rest) if rest else 0,
            num_warps=4,
        )
    return out
