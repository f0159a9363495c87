from __future__ import annotations

import pytest

from cluster.config import EngineConfig


@pytest.mark.parametrize(
    "options, message",
    [
        ({"tp_size": 4, "ep_size": 3}, "must divide"),
        ({"num_draft_tokens": -1}, "num_draft_tokens"),
        ({"num_draft_tokens": 18}, "num_draft_tokens"),  # past the caches' lookahead room
        ({"indexer_numerics": "fp4"}, "indexer numerics"),
    ],
)
def test_bad_options_fail_when_the_config_is_made(options: dict, message: str) -> None:
    """Before any worker starts or any weight loads."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="unused", **options)


def test_indexer_numerics_accepted() -> None:
    for numerics in ("exact", "fp8"):
        assert EngineConfig(model="unused", indexer_numerics=numerics).indexer_numerics == numerics


@pytest.mark.parametrize(
    "max_num_seqs, k, max_num_batched_tokens, eager, rows",
    [
        (64, 0, 2048, False, 256),  # room for 64 decodes and as many prompt tokens beside them
        (64, 3, 2048, False, 320),  # the default draft length: 64 verifies of 4 tokens, + 64
        (8, 0, 2048, False, 256),
        (200, 0, 2048, False, 400),
        (256, 0, 2048, False, 512),
        (256, 3, 2048, False, 1024),  # at most 1024
        (1500, 0, 2048, False, 1500),  # never below the decode batches
        (64, 0, 100, False, 100),  # a step never holds more tokens than its budget
        (64, 0, 2048, True, 0),  # enforce_eager: no graphs
    ],
)
def test_cuda_graph_max_rows(max_num_seqs, k, max_num_batched_tokens, eager, rows):
    config = EngineConfig(
        model="m",
        max_num_seqs=max_num_seqs,
        num_draft_tokens=k,
        max_num_batched_tokens=max_num_batched_tokens,
        enforce_eager=eager,
    )
    assert config.cuda_graph_max_rows == rows
