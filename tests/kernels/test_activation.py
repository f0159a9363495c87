from __future__ import annotations

import pytest
import torch

from kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2), (7, 262), (131, 14), (2, 3, 2600)])
def test_silu_and_mul_matches_twin(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, device=DEVICE) * 4
    assert_close(silu_and_mul_triton(x), silu_and_mul_reference(x))


def test_silu_and_mul_rejects_odd_width() -> None:
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_triton(torch.randn(3, 7, device=DEVICE))
