from __future__ import annotations

import pytest
import torch

from kernels.argmax import argmax_reference, argmax_triton
from tests.kernels.conftest import DEVICE, DTYPES, needs_triton

pytestmark = needs_triton


def _equal(x: torch.Tensor) -> None:
    got, want = argmax_triton(x), argmax_reference(x)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 2048), (5, 2049), (2, 3, 5000), (1, 129280)])
def test_argmax_matches_torch(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    _equal(torch.randn(shape, device=DEVICE).to(dtype))


@pytest.mark.parametrize("width", [9, 4100, 129280])
def test_ties_go_to_the_first_index_across_chunks(width: int) -> None:
    """Values drawn from a handful, so the largest repeats inside a chunk and in later ones."""
    torch.manual_seed(1)
    x = torch.randint(0, 4, (6, width), device=DEVICE).float()
    x[1] = 0.0  # one value everywhere: index 0
    x[2, -1] = 9.0  # the largest in the last element only
    x[3, width // 2 :] = 5.0  # the largest from the middle on: its first index
    _equal(x)


def test_nan_and_infinities_follow_torch() -> None:
    width = 6000  # three chunks
    x = torch.randn(7, width, device=DEVICE)
    x[0, 4500] = float("nan")  # a NaN beats everything
    x[0, 10] = float("inf")
    x[1, 5000] = float("nan")  # two NaNs in different chunks: the first
    x[1, 2100] = float("nan")
    x[2, 3000:3002] = float("inf")  # +inf twice: the first
    x[3] = float("-inf")  # all -inf: index 0
    x[4] = float("nan")  # all NaN: index 0
    x[5, :4096] = float("-inf")
    x[5, 4096:] = float("nan")
    x[6, 2047] = float("inf")
    x[6, 2048] = float("nan")
    _equal(x)


def test_strided_rows_and_bf16_logits() -> None:
    """Rows of a wider buffer (the graph's logits view), and bf16 ties that fp32 would keep."""
    torch.manual_seed(2)
    wide = torch.randn(4, 3000, device=DEVICE)
    _equal(wide[:, :2500])
    x = (torch.randn(3, 4096, device=DEVICE) * 0.01 + 1).to(torch.bfloat16)
    _equal(x)


def test_empty() -> None:
    assert argmax_triton(torch.zeros(0, 5, device=DEVICE)).shape == (0,)
    with pytest.raises(ValueError, match="empty row"):
        argmax_triton(torch.zeros(3, 0, device=DEVICE))
