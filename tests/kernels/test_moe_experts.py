from __future__ import annotations

import pytest
import torch

from kernels.moe_experts import (
    DECODE_CONFIG,
    PREFILL_CONFIG,
    grouped_layout,
    grouped_layout_triton,
    grouped_moe_reference,
    grouped_moe_triton,
)
from tests.kernels.conftest import DEVICE, DTYPES, assert_close, needs_triton

pytestmark = needs_triton


def _problem(dtype, num_tokens, hidden, intermediate, num_local, num_total, top_k, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=DEVICE)
    w13 = torch.randn(num_local, 2 * intermediate, hidden, dtype=dtype, device=DEVICE) * 0.2
    w2 = torch.randn(num_local, hidden, intermediate, dtype=dtype, device=DEVICE) * 0.2
    ids = torch.stack([torch.randperm(num_total)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, device=DEVICE)
    return x, w13, w2, weights, ids.to(torch.int32).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [DECODE_CONFIG, PREFILL_CONFIG], ids=["decode", "prefill"])
@pytest.mark.parametrize(
    "num_tokens,hidden,intermediate,top_k",
    [
        (1, 7, 5, 1),
        (7, 37, 19, 3),
        (131, 16, 9, 2),
    ],
)
def test_grouped_moe_matches_twin(dtype, config, num_tokens, hidden, intermediate, top_k) -> None:
    # This rank holds experts 2..6 of 9 (expert parallelism): other routes contribute nothing.
    x, w13, w2, weights, ids = _problem(dtype, num_tokens, hidden, intermediate, 5, 9, top_k)
    expected = grouped_moe_reference(x, w13, w2, weights, ids, first_expert=2)
    actual = grouped_moe_triton(x, w13, w2, weights, ids, first_expert=2, config=config)
    assert_close(actual, expected)


def test_grouped_layout_sorts_pairs_by_expert_in_padded_runs() -> None:
    ids = torch.tensor([[3, 0], [0, 9], [3, 1]], dtype=torch.int32)  # 9 is not held here
    layout = grouped_layout(ids, num_local_experts=4, first_expert=0, block_m=2)
    # expert 0: pairs 1, 2; expert 1: pair 5 (+pad); expert 3: pairs 0, 4
    assert layout.block_expert[:3].tolist() == [0, 1, 3]
    assert (layout.block_expert[3:] == -1).all()
    assert layout.sorted_pairs[:6].tolist() == [1, 2, 5, -1, 0, 4]
    assert (layout.sorted_pairs[6:] == -1).all()


@pytest.mark.parametrize(
    "num_tokens,top_k,num_local,first_expert,block_m",
    [
        (1, 8, 256, 0, 16),
        (8, 8, 64, 64, 16),
        (32, 8, 256, 0, 16),
        (5, 3, 7, 2, 4),
        (1, 1, 1, 0, 16),
    ],
)
def test_grouped_layout_kernel_equals_torch_layout(
    num_tokens, top_k, num_local, first_expert, block_m
) -> None:
    """The one-program layout is the torch layout, pair for pair, with and without experts held
    elsewhere (expert parallelism), repeated experts, and 256 pairs."""
    torch.manual_seed(num_tokens * top_k)
    total = max(num_local + first_expert, 9)
    ids = torch.stack([torch.randperm(total)[:top_k] for _ in range(num_tokens)]).to(DEVICE)
    if num_tokens > 2:
        ids[1] = ids[0]  # two tokens routed alike: runs longer than one pair
    want = grouped_layout(ids, num_local, first_expert, block_m)
    got = grouped_layout_triton(ids, num_local, first_expert, block_m)
    assert torch.equal(got.sorted_pairs.cpu(), want.sorted_pairs.cpu())
    assert torch.equal(got.block_expert.cpu(), want.block_expert.cpu())


def test_grouped_moe_rejects_strided_topk_ids() -> None:
    """The pair sum reads ids by token * top_k + slot: a strided view must not be misread."""
    x = torch.randn(3, 6, device=DEVICE)
    w13, w2 = torch.randn(4, 10, 6, device=DEVICE), torch.randn(4, 6, 5, device=DEVICE)
    ids = torch.randint(0, 4, (3, 4), dtype=torch.int32, device=DEVICE)[:, :2]
    with pytest.raises(ValueError, match="topk_ids"):
        grouped_moe_triton(x, w13, w2, torch.rand(3, 2, device=DEVICE), ids)
