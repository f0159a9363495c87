"""RMSNorm (DeepSeek's, computed in fp32)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import FLOAT_DTYPES, check_tensor, launch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)` over the last dim; statistics in fp32, output in x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


# --- Triton -------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
    width,
    eps,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / width + eps)
    # The twin rounds the normalized row to x's dtype before the weight multiply.
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(
        out_ptr + row * out_row_stride + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask
    )


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton twin of `rms_norm_reference`: one program per row."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    width = x.shape[-1]
    if weight.shape[0] != width:
        raise ValueError(f"weight has {weight.shape[0]} entries, x rows have {width}")
    x2d = x.reshape(-1, width)  # [rows, width]; a view when x's rows are evenly strided
    if x2d.shape[0] > 1 and x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty(x2d.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2d.shape[0] > 0:
        launch(
            _rms_norm_kernel,
            (x2d.shape[0],),
            x,
            x2d,
            weight,
            out,
            x2d.stride(0),
            out.stride(0),
            width,
            eps,
            BLOCK=triton.next_power_of_2(width),
            num_warps=4 if width <= 2048 else 8,
        )
    return out.view(x.shape)
