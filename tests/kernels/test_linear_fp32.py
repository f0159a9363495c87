from __future__ import annotations

import pytest
import torch

from kernels.linear_fp32 import (
    LINEAR_FP32_CONFIGS,
    MAX_TOKENS,
    linear_fp32_reference,
    linear_fp32_triton,
)
from tests.kernels.conftest import DEVICE, DTYPES, needs_triton

pytestmark = needs_triton
K_PER_SPLIT = max(c.k_per_split for c in LINEAR_FP32_CONFIGS.values())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 3, 8, 16, 17, MAX_TOKENS, MAX_TOKENS + 1])
@pytest.mark.parametrize("width", [300, 2 * K_PER_SPLIT + 76])
def test_linear_fp32_matches_twin(dtype: torch.dtype, num_tokens: int, width: int) -> None:
    """bf16 or fp32 rows against an fp32 weight whose rows (67) and width are not multiples of
    the tiles, K in one piece or split in three (the last one short, where the config splits);
    token counts on CUDA cores and on tensor cores (under, at and over the 16-row tile); the
    scale applied once; beyond MAX_TOKENS the twin itself."""
    torch.manual_seed(num_tokens * width)
    x = torch.randn(num_tokens, width, device=DEVICE).to(dtype)
    weight = torch.randn(67, width, device=DEVICE)
    want = linear_fp32_reference(x, weight, 0.125)
    got = linear_fp32_triton(x, weight, 0.125)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)


def test_linear_fp32_split_k_repeats_exactly() -> None:
    """The split pieces are summed in a fixed order by whichever program ends last: the same
    bits on every call, and the tile counters left at zero for the next launch."""
    torch.manual_seed(0)
    x = torch.randn(20, 3 * K_PER_SPLIT, device=DEVICE)
    weight = torch.randn(40, 3 * K_PER_SPLIT, device=DEVICE)
    first = linear_fp32_triton(x, weight)
    for _ in range(3):
        assert torch.equal(linear_fp32_triton(x, weight), first)
