from __future__ import annotations

import pytest
import torch

from kernels.moe_routing import moe_route_reference, moe_route_triton
from tests.kernels.conftest import DEVICE, DTYPES, needs_triton

pytestmark = needs_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,num_experts,num_groups,topk_groups,top_k,norm",
    [
        (1, 8, 1, 1, 1, True),
        (7, 24, 4, 2, 5, True),
        (131, 64, 8, 4, 8, False),
    ],
)
def test_moe_route_matches_twin(
    dtype: torch.dtype,
    num_tokens: int,
    num_experts: int,
    num_groups: int,
    topk_groups: int,
    top_k: int,
    norm: bool,
) -> None:
    torch.manual_seed(num_tokens)
    logits = torch.randn(num_tokens, num_experts, dtype=dtype, device=DEVICE) * 2
    bias = torch.randn(num_experts, device=DEVICE) * 0.1
    args = (logits, bias, num_groups, topk_groups, top_k, norm, 2.5)
    weights_ref, ids_ref = moe_route_reference(*args)
    weights, ids = moe_route_triton(*args)
    # The twin's top-k is unsorted: compare (id, weight) pairs sorted by id.
    ids_ref_sorted, order_ref = ids_ref.sort(-1)
    ids_sorted, order = ids.sort(-1)
    assert torch.equal(ids_sorted, ids_ref_sorted)
    torch.testing.assert_close(
        weights.gather(1, order), weights_ref.gather(1, order_ref), atol=1e-6, rtol=1e-5
    )
