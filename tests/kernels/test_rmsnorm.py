from __future__ import annotations

import pytest
import torch

from kernels.rmsnorm import (
    add_rms_norm_reference,
    add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (7, 131), (3, 5, 64), (2, 1100)])
def test_rms_norm_matches_twin(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, device=DEVICE) * 3
    weight = torch.randn(shape[-1], dtype=dtype, device=DEVICE)
    assert_close(rms_norm_triton(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))


def test_rms_norm_strided_rows_and_fp32_weight() -> None:
    torch.manual_seed(1)
    x = torch.randn(7, 262, dtype=torch.bfloat16, device=DEVICE)[:, :131]  # row stride 262
    weight = torch.randn(131, dtype=torch.float32, device=DEVICE)
    expected = rms_norm_reference(x, weight, 1e-5)
    assert expected.dtype == torch.float32
    # fp32 out, but the normalized row is rounded to bf16 first: bf16 precision.
    torch.testing.assert_close(rms_norm_triton(x, weight, 1e-5), expected, atol=3e-2, rtol=1e-2)


def test_rms_norm_rejects_mismatched_weight() -> None:
    x = torch.randn(3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(7, device=DEVICE), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_twin(dtype: torch.dtype) -> None:
    """The fused residual add + norm: both outputs, on rows of an odd width."""
    torch.manual_seed(1)
    x = torch.randn(5, 3, 300, dtype=dtype, device=DEVICE)
    residual = torch.randn(5, 3, 300, dtype=dtype, device=DEVICE) * 4
    weight = torch.rand(300, dtype=dtype, device=DEVICE) + 0.5
    want_out, want_residual = add_rms_norm_reference(x, residual, weight, 1e-6)
    got_out, got_residual = add_rms_norm_triton(x, residual, weight, 1e-6)
    if dtype == torch.float32:  # one rounded add on both sides
        assert torch.equal(got_residual, want_residual)
    assert_close(got_residual, want_residual)
    assert_close(got_out, want_out)
