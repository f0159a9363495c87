"""The twins' helpers for reading a step's tokens (kernels/paged.py)."""

from __future__ import annotations

import torch

from kernels import paged
from kernels.paged import row_chunks, sequence_runs


def test_runs_of_one_sequence_and_the_other_tokens() -> None:
    seq_idx = torch.tensor([0] * 8 + [1] + [2] * 3 + [3] * 9 + [4] * 7)
    runs, rest = sequence_runs(seq_idx, 8)
    assert runs == [slice(0, 8), slice(12, 21)]
    assert rest.tolist() == [8, 9, 10, 11, *range(21, 28)]


def test_a_step_without_runs_is_one_slice() -> None:
    """A decode or verify step: no run, every token in one slice (views, no index)."""
    assert sequence_runs(torch.tensor([0, 1, 1, 1, 2, 3]), 8) == ([], slice(0, 6))
    assert sequence_runs(torch.tensor([5] * 7), 8) == ([], slice(0, 7))
    assert sequence_runs(torch.zeros(0, dtype=torch.long), 8) == ([], slice(0, 0))


def test_row_chunks_cover_their_rows_in_order_within_the_budget(monkeypatch) -> None:
    monkeypatch.setattr(paged, "GATHER_BUDGET_ELEMENTS", 30)
    assert row_chunks(slice(5, 12), 10) == [slice(5, 8), slice(8, 11), slice(11, 12)]
    parts = row_chunks(torch.tensor([1, 4, 6, 9, 10]), 15)
    assert [p.tolist() for p in parts] == [[1, 4], [6, 9], [10]]
    assert row_chunks(torch.zeros(0, dtype=torch.long), 15) == []
