from __future__ import annotations

import pytest
import torch

from kernels import indexer as indexer_module
from kernels.indexer import (
    HIST_WIDTH,
    indexer_logits_triton,
    indexer_topk_reference,
    indexer_topk_triton,
    key_histogram,
    topk_select_triton,
)
from tests.kernels.conftest import DEVICE, DTYPES, needs_triton, overlap

pytestmark = needs_triton


def gather_positions(cache: torch.Tensor, table_row: torch.Tensor, num: int) -> torch.Tensor:
    """Cache rows of positions 0..num-1 of one sequence: [num, width] (written apart from
    kernels.paged, which the twin uses, so the closed form below checks the kernel alone)."""
    positions = torch.arange(num, device=cache.device)
    return cache[table_row[positions // cache.shape[1]].long(), positions % cache.shape[1]]


def _problem(dtype: torch.dtype, num_heads: int, head_dim: int, seed: int = 0):
    """Two sequences of 131 and 192 positions over shuffled blocks of 64; seven query tokens."""
    torch.manual_seed(seed)
    k_cache = torch.randn(6, 64, head_dim, dtype=dtype, device=DEVICE)
    block_tables = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32, device=DEVICE)
    seq_idx = torch.tensor([0, 0, 1, 1, 1, 0, 1], dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([130, 0, 5, 190, 100, 64, 191], dtype=torch.int32, device=DEVICE)
    # Large q and positive weights make ties (several all-negative heads -> logit 0) rare.
    q = torch.randn(7, num_heads, head_dim, dtype=dtype, device=DEVICE) * 4
    weights = torch.rand(7, num_heads, dtype=dtype, device=DEVICE) + 0.5
    return q, weights, k_cache, block_tables, seq_idx, positions


@pytest.mark.parametrize("dtype", DTYPES)
def test_indexer_logits_match_closed_form(dtype: torch.dtype) -> None:
    q, weights, k_cache, block_tables, seq_idx, positions = _problem(dtype, 5, 24)
    scale = 24**-0.5
    logits = indexer_logits_triton(q, weights, k_cache, block_tables, seq_idx, positions, scale)
    for t in range(q.shape[0]):
        num_keys = int(positions[t]) + 1
        keys = gather_positions(k_cache, block_tables[seq_idx[t]], num_keys).float()
        scores = (q[t].float() @ keys.t() * scale).relu()  # [H, S]
        expected = weights[t].float() @ scores
        torch.testing.assert_close(logits[t, :num_keys], expected, atol=1e-4, rtol=1e-5)
        block = indexer_module._INDEXER_BLOCK_S  # the rest of the last key block is -inf
        block_end = -(-num_keys // block) * block
        assert torch.isneginf(logits[t, num_keys:block_end]).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("topk", [1, 7, 131, 300])
def test_indexer_topk_matches_twin(dtype: torch.dtype, topk: int) -> None:
    args = _problem(dtype, 3, 37, seed=topk)
    expected = indexer_topk_reference(*args[:6], topk, 37**-0.5)
    actual = indexer_topk_triton(*args[:6], topk, 37**-0.5)
    assert actual.dtype == torch.int32 and actual.shape == expected.shape
    # -1 padding in the same places: k = min(topk, position + 1) picks per token.
    assert torch.equal(actual < 0, expected < 0)
    # Same sets (near-ties may swap order; fp32 logits from the same inputs rarely differ).
    assert overlap(actual, expected).min() >= 0.99


def _select_oracle(logits: torch.Tensor, positions: torch.Tensor, topk: int) -> torch.Tensor:
    """Per row: the positions of the topk largest logits of 0..p, ties to the earlier position,
    in position order, then -1."""
    out = torch.full((logits.shape[0], topk), -1, dtype=torch.int32)
    for t, p in enumerate(positions.tolist()):
        values = logits[t, : p + 1].tolist()
        best = sorted(range(p + 1), key=lambda i: (-values[i], i))[:topk]
        out[t, : len(best)] = torch.tensor(sorted(best), dtype=torch.int32)
    return out


def _as_sets(rows: torch.Tensor) -> torch.Tensor:
    """Rows as sets: each one's valid positions ascending, then its -1s."""
    last = torch.iinfo(torch.int32).max
    ordered = torch.where(rows < 0, last, rows).sort(dim=-1).values
    return torch.where(ordered == last, -1, ordered)


def _ordered_keys(logits: torch.Tensor) -> torch.Tensor:
    """The kernels' order-preserving integer keys, as int64 in 0..2**32-1."""
    bits = logits.view(torch.int32).long()
    return torch.where(bits < 0, ~bits & 0xFFFFFFFF, bits + 2**31)


@pytest.mark.parametrize("capacity", [None, 40, 0])
@pytest.mark.parametrize("quantize", [False, True])
def test_topk_select_is_exact(monkeypatch, quantize: bool, capacity: int | None) -> None:
    """The radix select against sorting, across block boundaries (5000 > 2 x 2048 logits), with
    rows shorter than topk, negative and zero logits, and (quantized) many exact ties. A smaller
    candidate list makes big threshold buckets narrow over the whole row first; with none the
    select never leaves the row."""
    if capacity is not None:
        monkeypatch.setattr(indexer_module, "_CANDIDATES", capacity)
    torch.manual_seed(quantize)
    topk = 300
    positions = torch.tensor([4999, 0, 299, 300, 2047, 3000], dtype=torch.int32)
    logits = torch.randn(positions.shape[0], 5120) * 3
    if quantize:  # a handful of distinct values: the threshold key is shared by many positions
        logits = (logits * 2).round() / 2
    logits[:, 7] = -0.0
    logits[:, 8] = 0.0
    got = topk_select_triton(logits.to(DEVICE), positions.to(DEVICE), topk).cpu()
    assert torch.equal(_as_sets(got), _select_oracle(logits, positions, topk))


def test_topk_select_within_one_bucket() -> None:
    """Keys that share their top 12 bits (one histogram bucket, 1 <= x < 1.0005): the lower bits
    decide, over the candidate list."""
    torch.manual_seed(3)
    positions = torch.tensor([2999, 1500], dtype=torch.int32)
    logits = 1 + torch.rand(2, 3072) * 5e-4
    got = topk_select_triton(logits.to(DEVICE), positions.to(DEVICE), 1000).cpu()
    assert torch.equal(_as_sets(got), _select_oracle(logits, positions, 1000))


def test_key_histogram_counts_top_bits() -> None:
    positions = torch.tensor([2500, 99, 100, 0], dtype=torch.int32)
    logits = torch.randn(4, 3000) * torch.tensor([[1.0], [1e-3], [1e3], [1.0]])
    hist = key_histogram(logits.to(DEVICE), positions.to(DEVICE), 100).cpu()
    assert hist.shape == (4, HIST_WIDTH.value)
    for t, p in enumerate(positions.tolist()):
        want = torch.zeros(HIST_WIDTH.value, dtype=torch.int32)  # the second level stays zero
        if p >= 100:  # rows of at most topk keys are selected without one
            want[:4096] = torch.bincount(_ordered_keys(logits[t, : p + 1]) >> 20, minlength=4096)
        assert torch.equal(hist[t], want), t


def test_indexer_logits_count_the_histogram() -> None:
    """The logits kernel's fused histogram is key_histogram of the logits it wrote."""
    q, weights, k_cache, block_tables, seq_idx, positions = _problem(torch.float32, 3, 37)
    hist = torch.zeros(q.shape[0], HIST_WIDTH.value, dtype=torch.int32, device=DEVICE)
    logits = indexer_logits_triton(
        q, weights, k_cache, block_tables, seq_idx, positions, 0.1, hist, 64
    )
    assert hist.sum() > 0
    assert torch.equal(hist, key_histogram(logits, positions, 64))


def test_topk_select_ignores_logits_past_the_position() -> None:
    """Entries past a token's position are never read (the logits kernel leaves them unset)."""
    positions = torch.tensor([2500, 10], dtype=torch.int32)
    logits = torch.randn(2, 4096)
    poisoned = logits.clone()
    poisoned[0, 2501:] = float("inf")
    poisoned[1, 11:] = float("nan")
    want = _select_oracle(logits, positions, 64)
    got = topk_select_triton(poisoned.to(DEVICE), positions.to(DEVICE), 64).cpu()
    assert torch.equal(_as_sets(got), want)


def test_topk_select_can_reuse_a_histogram() -> None:
    """The select adds its second level into the histogram it is given and resets it first, so
    a histogram passed twice (as a benchmark replays one call) selects the same set twice."""
    torch.manual_seed(5)
    positions = torch.tensor([4999, 3000], dtype=torch.int32)
    logits = torch.randn(2, 5120)
    want = _select_oracle(logits, positions, 300)
    hist = key_histogram(logits.to(DEVICE), positions.to(DEVICE), 300)
    for _ in range(2):
        got = topk_select_triton(logits.to(DEVICE), positions.to(DEVICE), 300, hist).cpu()
        assert torch.equal(_as_sets(got), want)
