from __future__ import annotations

import pytest
import torch

from kernels.linear_fp32 import MAX_TOKENS, linear_fp32_reference, linear_fp32_triton
from tests.kernels.conftest import DEVICE, DTYPES, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 16, MAX_TOKENS, MAX_TOKENS + 1])
def test_linear_fp32_matches_twin(dtype: torch.dtype, num_tokens: int) -> None:
    """bf16 or fp32 rows against an fp32 weight whose rows (67) and width (300) are not multiples
    of the tiles; the scale applied once; beyond MAX_TOKENS the twin itself."""
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, 300, device=DEVICE).to(dtype)
    weight = torch.randn(67, 300, device=DEVICE)
    want = linear_fp32_reference(x, weight, 0.125)
    got = linear_fp32_triton(x, weight, 0.125)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
