"""cuBLASLt's block-scaled FP8 GEMM for large row counts: the w8a8 product of
kernels/fp8_gemm.py (activations in FP8 with one scale per token and 128 columns, weights in FP8
with one per 128x128 block), run by `torch._scaled_mm` with its 1x128 x 128x128 block-wise
scaling (PyTorch built against CUDA 12.9 or later, compute capability 9.0: the scales are applied
per 128-deep block of K and accumulated in fp32, DeepSeek's promotion).

The same twin as the Triton kernel (`kernels.fp8.fp8_gemm_reference`): only the order of the
fp32 additions differs. Whether this PyTorch and device take it is probed once per device on a
small GEMM checked against the twin (`cublaslt_block_scaled`), and a shape takes it only where
cuBLASLt's layout rules hold (`cublaslt_shape_ok`); everything else stays on the Triton kernel.
"""

from __future__ import annotations

import logging

import torch

from kernels.fp8 import (
    FP8_BLOCK,
    fp8_gemm_reference,
    quantize_activations_reference,
    quantize_fp8_reference,
)

logger = logging.getLogger(__name__)

# Rows from which kernels.ops.fp8_linear takes cuBLASLt's block-scaled GEMM over the Triton w8a8
# kernel (where `cublaslt_block_scaled` holds). Measured on the H200 with
# `benchmarks/bench_fp8_linear.py --tokens ...` (BENCHMARKS.md, issue 17, session 10).
CUBLASLT_MIN_ROWS = 256


def cublaslt_shape_ok(out_features: int, in_features: int) -> bool:
    """cuBLASLt's block-scaled FP8 layouts for a weight: whole 128-blocks of output features, K
    in whole blocks with a multiple of 4 of them (the weight scales' row stride). The
    activations' rows come in multiples of 16 (`quantize_activations_triton`'s
    rows_multiple)."""
    return out_features % FP8_BLOCK == 0 and in_features % (4 * FP8_BLOCK) == 0


def fp8_gemm_cublaslt(
    a: torch.Tensor,  # [M, K] float8_e4m3fn, contiguous, M a multiple of 16
    a_scale: torch.Tensor,  # [M, K/128] float32, strides (1, M) (token-major)
    weight: torch.Tensor,  # [N, K] float8_e4m3fn, contiguous
    scale_inv: torch.Tensor,  # [N/128, K/128] float32, contiguous
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """`kernels.fp8.fp8_gemm_reference` on cuBLASLt: [M, N] in out_dtype. The caller checks
    `cublaslt_shape_ok`; a and a_scale come from
    `quantize_activations_triton(x, scales_token_major=True, rows_multiple=16)`."""
    return torch._scaled_mm(
        a,
        weight.t(),  # [K, N], column-major as cuBLASLt takes B
        scale_a=a_scale,
        scale_b=scale_inv.t(),  # [K/128, N/128]; its transpose is the weight's row-major grid
        out_dtype=out_dtype,
    )


def cublaslt_block_scaled(device: torch.device) -> bool:
    """Whether torch._scaled_mm runs the 1x128 x 128x128 block-scaled FP8 GEMM on this device
    (CUDA, compute capability 9.0: where it was measured) and gives the twin's product. Probed
    once per device, never inside a CUDA graph capture (the probe synchronizes): a capture
    before the first probe keeps the Triton kernel."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PROBED and torch.cuda.get_device_capability(index) != (9, 0):
        _PROBED[index] = False  # asked once per device, as the probe is
    if index not in _PROBED:
        if torch.cuda.is_current_stream_capturing():
            return False
        _PROBED[index] = _probe(index)
    return _PROBED[index]


_PROBED: dict[int, bool] = {}  # device index -> the probe's answer


def _probe(device_index: int) -> bool:
    """A small GEMM with scales that differ per block (a PyTorch that ignored or transposed
    them fails the check) against the twin."""
    device = torch.device("cuda", device_index)
    generator = torch.Generator(device="cpu").manual_seed(0)
    rows, out_features, in_features = 64, 256, 512
    x = torch.randn(rows, in_features, generator=generator)
    x *= torch.linspace(0.1, 10.0, in_features // FP8_BLOCK).repeat_interleave(FP8_BLOCK)
    w = torch.randn(out_features, in_features, generator=generator) * in_features**-0.5
    w *= torch.linspace(0.5, 4.0, out_features)[:, None]
    weight, scale_inv = (t.to(device) for t in quantize_fp8_reference(w))
    a, a_scale = (t.to(device) for t in quantize_activations_reference(x))
    a_scale = a_scale.t().contiguous().t()  # token-major, as cuBLASLt reads it
    try:
        got = fp8_gemm_cublaslt(a, a_scale, weight, scale_inv).float()
    except (RuntimeError, NotImplementedError) as error:
        logger.info("cuBLASLt block-scaled FP8 GEMM not available here: %s", error)
        return False
    want = fp8_gemm_reference(a, a_scale, weight, scale_inv, torch.float32)
    err = ((got - want).abs().max() / want.abs().max()).item()
    if err > 1e-2:  # bf16 output rounding is 2^-9; a wrong scale layout is off by O(1)
        logger.warning(
            "cuBLASLt block-scaled FP8 GEMM differs from its twin (max error %.2e of the "
            "largest output): not used",
            err,
        )
        return False
    return True
