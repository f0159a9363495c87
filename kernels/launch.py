"""The one way our Triton kernels are launched: the PDL gate decides both halves of PDL.

Every kernel takes `USE_PDL: tl.constexpr`. `launch` sets it from `pdl_enabled(device)` and adds
the `launch_pdl=True` keyword only when the gate is on, so on ROCm, XPU, pre-Hopper CUDA and
Triton's interpreter no PDL variant is ever compiled or launched (no `launch_pdl` keyword at all).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels.platform import pdl_enabled, triton_interpreter
from kernels.settings import settings

Grid = tuple[int, ...] | Callable[[dict[str, Any]], tuple[int, ...]]


def kernel_device(tensor: torch.Tensor) -> torch.device:
    """The device whose PDL gate applies to a launch (a seam tests use to fake a CUDA device)."""
    return tensor.device


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether a kernel's tl.dot must run on fp32 operands (UPCAST_DOT, with ieee precision).

    fp32 inputs always (tf32 would lose the twin's precision). Under the interpreter also bf16 and
    fp16: Triton 3.9's interpreter returns garbage (errors ~1e10 on a 16x16 randn product) for
    tl.dot on bf16 operands, and is exact on fp32 copies.
    """
    return dtype == torch.float32 or triton_interpreter()


def launch(kernel: Any, grid: Grid, device_tensor: torch.Tensor, *args: Any, **meta: Any) -> None:
    """Launch `kernel[grid](*args, **meta)` with USE_PDL (and launch_pdl) set by the gate, less
    the kernels MTPSERVE_PDL_OFF_KERNELS names."""
    use_pdl = pdl_enabled(kernel_device(device_tensor)) and (
        kernel.fn.__name__ not in settings().pdl_off_kernels
    )
    if use_pdl:
        kernel[grid](*args, USE_PDL=True, launch_pdl=True, **meta)
    else:
        kernel[grid](*args, USE_PDL=False, **meta)


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    last_dim_contiguous: bool = True,
    contiguous: bool = False,
    device: torch.device | None = None,
) -> None:
    """Shape/dtype/stride checks shared by the launchers; errors name the argument."""
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(tensor.shape)}")
    if dtypes is not None and tensor.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {tensor.dtype} not in {dtypes}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, strides {tensor.stride()}")
    if last_dim_contiguous and tensor.dim() > 0 and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name}: last dim must have stride 1, strides {tensor.stride()}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: on {tensor.device}, expected {device}")


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
