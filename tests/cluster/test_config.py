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
