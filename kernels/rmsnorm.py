"""RMSNorm (DeepSeek's, computed in fp32), alone and fused with the residual add before it."""

from __future__ import annotations

import torch

from kernels.launch import FLOAT_DTYPES, check_tensor, launch
from kernels.platform import tl, triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)` over the last dim; statistics in fp32, output in x's dtype."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): a decoder layer's residual add and the norm after
    it."""
    h = residual + x
    return rms_norm_reference(h, weight, eps), h


# --- Triton -------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    residual_out_ptr,
    weight_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
    width,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # the residual add first, rounded to x's dtype as the twin's add rounds
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * x_row_stride + cols, mask=mask)).to(
            x.dtype
        )
        tl.store(residual_out_ptr + row * width + cols, x, mask=mask)
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


def _rms_norm_launch(x, residual, weight, eps):
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    width = x.shape[-1]
    if weight.shape[0] != width:
        raise ValueError(f"weight has {weight.shape[0]} entries, x rows have {width}")
    x2d = x.reshape(-1, width)  # [rows, width]; a view when x's rows are evenly strided
    if x2d.shape[0] > 1 and x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    residual_out = None
    if residual is not None:
        check_tensor("residual", residual, dtypes=(x.dtype,), device=x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} vs x {tuple(x.shape)}")
        x2d = x2d.contiguous()
        residual = residual.reshape(-1, width).contiguous()
        residual_out = torch.empty_like(x2d)
    out = torch.empty(x2d.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x2d.shape[0] > 0:
        launch(
            _rms_norm_kernel,
            (x2d.shape[0],),
            x,
            x2d,
            x2d if residual is None else residual,
            x2d if residual_out is None else residual_out,
            weight,
            out,
            x2d.stride(0),
            out.stride(0),
            width,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(width),
            num_warps=4 if width <= 2048 else 8,
        )
    return out.view(x.shape), residual_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton twin of `rms_norm_reference`: one program per row."""
    return _rms_norm_launch(x, None, weight, eps)[0]


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `add_rms_norm_reference`: the add and the norm in one pass over the row."""
    out, residual_out = _rms_norm_launch(x, residual, weight, eps)
    return out, residual_out.view(x.shape)
