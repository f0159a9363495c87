"""The per-token 1x128 activation quantizer against its twin: scales and FP8 bytes identical."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import FP8_DTYPE, quantize_activations_reference
from kernels.fp8_act_quant import quantize_activations_triton
from tests.kernels.conftest import DEVICE, needs_triton


def _activations(num_tokens: int, num_cols: int, dtype: torch.dtype, seed: int = 0):
    """Rows of very different magnitudes, an all-zero group, a row with a lone nonzero value,
    and tiny values that land on e4m3's subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_cols, generator=g)
    x *= torch.logspace(-3, 3, num_tokens)[:, None]
    if num_tokens > 2:
        x[1, : min(128, num_cols)] = 0.0  # an all-zero group: scale 1
        x[2] = 0.0
        x[2, num_cols // 2] = -3.0
    if num_tokens > 3:
        x[3, ::7] *= 1e-4  # far below the group's amax: e4m3 subnormals and zeros, signs kept
    return x.to(dtype)


def _assert_identical(x: torch.Tensor) -> None:
    want_q, want_scale = quantize_activations_reference(x)
    got_q, got_scale = quantize_activations_triton(x.to(DEVICE))
    assert got_q.dtype == FP8_DTYPE and got_scale.dtype == torch.float32
    assert got_scale.shape == want_scale.shape and got_q.shape == want_q.shape
    assert torch.equal(got_scale.cpu(), want_scale)
    assert torch.equal(got_q.cpu().view(torch.uint8), want_q.view(torch.uint8))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens, num_cols", [(1, 128), (5, 300), (7, 1000), (3, 1)])
def test_act_quant_matches_twin_exactly(dtype, num_tokens, num_cols) -> None:
    _assert_identical(_activations(num_tokens, num_cols, dtype))


@needs_triton
def test_act_quant_strided_rows_and_wide_groups() -> None:
    """A row stride wider than the row (a slice of a wider tensor), and more groups than one
    program takes."""
    x = _activations(4, 2100, torch.bfloat16, seed=1)
    wide = torch.zeros(4, 2200, dtype=torch.bfloat16)
    wide[:, 50:2150] = x
    _assert_identical(wide[:, 50:2150])


def test_act_quant_twin_on_a_closed_form() -> None:
    """Every e4m3 value / 8 in one group (amax 448 / 8, so scale 1/8) comes back exactly."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    codes = codes[codes.isfinite()][:128]  # 0 .. 448 and -0 .. -448: 126 finite, 2 extra
    x = torch.zeros(2, 200)
    x[0, : codes.numel()] = codes / 8
    q, scale = quantize_activations_reference(x)
    assert scale.tolist() == [[0.125, 1.0], [1.0, 1.0]]
    assert torch.equal(q.float()[0, : codes.numel()] * 0.125, x[0, : codes.numel()])
    assert (q.float()[1] == 0).all()


@needs_triton
@pytest.mark.parametrize("num_tokens", [1, 16, 21])
def test_act_quant_token_major_scales_and_padded_rows(num_tokens) -> None:
    """The layout cuBLASLt's block-scaled GEMM reads: scales stored column by column, rows
    rounded up to 16 with the extra rows zero (scale 1); the real rows are the twin's."""
    x = _activations(num_tokens, 700, torch.bfloat16, seed=2)
    want_q, want_scale = quantize_activations_reference(x)
    got_q, got_scale = quantize_activations_triton(
        x.to(DEVICE), scales_token_major=True, rows_multiple=16
    )
    rows = -(-num_tokens // 16) * 16
    assert got_q.shape == (rows, 700) and got_scale.shape == (rows, 6)
    assert got_scale.stride() == (1, rows)
    assert torch.equal(got_scale[:num_tokens].cpu(), want_scale)
    assert torch.equal(got_q[:num_tokens].cpu().view(torch.uint8), want_q.view(torch.uint8))
    assert (got_q[num_tokens:].cpu().float() == 0).all()
    assert (got_scale[num_tokens:].cpu() == 1).all()
