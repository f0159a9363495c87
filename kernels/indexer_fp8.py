"""The indexer's deployed numerics: a Hadamard rotation, then FP8 (e4m3) with one scale per
128-wide block of each row, applied to the indexer's queries and keys.

DeepSeek-V3.2's deployments score the indexer in FP8 after rotating q and k by a Hadamard
matrix (orthogonal, so exact scores are unchanged; the rotation spreads outliers across the
block before quantization). `transformers` computes the scores exactly; mtpserve offers both,
exact by default. The queries and keys are quantized as DeepSeek-V3.2's `act_quant` does under
its `scale_fmt: "ue8m0"` (kernels/fp8_cache.py: power-of-two scales per 128 values), the keys
into an FP8 cache (144 bytes a 128-wide key, padding included); this twin rounds a row as FP8
would and keeps it in the model's dtype (exactly: power-of-two scales).
"""

from __future__ import annotations

import functools
import math

import torch

from kernels.fp8_cache import fp8_round_rows_reference

FP8_E4M3_MAX = 448.0
FP8_BLOCK = 128


@functools.cache
def _hadamard(dim: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    if dim & (dim - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two width, got {dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(dim)).to(device=device, dtype=dtype)


def hadamard_rotate_reference(x: torch.Tensor) -> torch.Tensor:
    """x [..., d] @ H_d / sqrt(d), computed in fp32."""
    h = _hadamard(x.shape[-1], str(x.device), torch.float32)
    return (x.float() @ h).to(x.dtype)


def fp8_round_reference(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Quantize to e4m3 with a scale of amax / 448 per `block` values of the last dim, and back
    (plain float scales; the indexer uses DeepSeek's power-of-two ones, see above)."""
    shape = x.shape
    width = shape[-1]
    pad = (-width) % block
    x32 = torch.nn.functional.pad(x.float(), (0, pad)).view(
        *shape[:-1], (width + pad) // block, block
    )
    scale = x32.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_E4M3_MAX
    q = (x32 / scale).to(torch.float8_e4m3fn).float() * scale
    return q.view(*shape[:-1], width + pad)[..., :width].to(x.dtype)


def indexer_fp8_reference(x: torch.Tensor) -> torch.Tensor:
    """What the deployed indexer scores with: FP8-rounded Hadamard-rotated rows (DeepSeek's
    power-of-two scales, as the FP8 key cache stores them)."""
    return fp8_round_rows_reference(hadamard_rotate_reference(x))
