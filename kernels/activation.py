"""SiLU-and-mul: the gated activation of every DeepSeek MLP and expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.launch import FLOAT_DTYPES, check_tensor, launch
from kernels.platform import tl, triton


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] = [gate | up] -> silu(gate) * up [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- Triton -------------------------------------------------------------------------------

# 1024 columns per program: at decode shapes (I = 2048 per expert) a row is two programs, enough
# to fill the GPU from batch ~32 up (bandwidth table in BENCHMARKS.md).
_SILU_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
    width,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * x_row_stride + width + cols, mask=mask, other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    # The twin computes silu in x's dtype (torch upcasts internally and rounds), then multiplies.
    g32 = gate.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype).to(tl.float32)
    out = (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row_stride + cols, out, mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton twin of `silu_and_mul_reference`: x [..., 2 * I] -> [..., I]."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} is not even ([gate | up])")
    width = x.shape[-1] // 2
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.shape[0] > 1 and x2d.stride(1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty(x2d.shape[0], width, dtype=x.dtype, device=x.device)
    if x2d.shape[0] > 0 and width > 0:
        grid = (x2d.shape[0], triton.cdiv(width, _SILU_BLOCK))
        launch(
            _silu_and_mul_kernel,
            grid,
            x,
            x2d,
            out,
            x2d.stride(0),
            out.stride(0),
            width,
            BLOCK=min(_SILU_BLOCK, triton.next_power_of_2(width)),
            num_warps=4,
        )
    return out.view(*x.shape[:-1], width)
