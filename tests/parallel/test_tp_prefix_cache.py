"""Prefix caching at TP=2 with MTP over gloo among Ray actors: every rank reuses the same cached
blocks (one block table from the coordinator), and multi-turn greedy output with hits is TP=1's
without the cache."""

from __future__ import annotations

import pytest

from tests.cluster.test_engine_prefix_cache import BLOCK, _converse, _llm, _user_turns
from tests.parallel.conftest import STEP_TIMEOUT_S

pytestmark = pytest.mark.timeout(240)


def test_tp2_mtp_greedy_identical_with_cache_hits(ray_local, tiny_model_dir):
    turns = _user_turns(512, seed=4)
    reference = _converse(_llm(tiny_model_dir, enable_prefix_caching=False), *turns)
    llm = _llm(
        tiny_model_dir,
        tp_size=2,
        num_draft_tokens=2,
        actor_num_cpus=0.5,
        step_timeout_s=STEP_TIMEOUT_S,
    )
    try:
        assert _converse(llm, *turns) == reference
        assert llm.stats().prefix_cache_hit_tokens >= 8 * 2 * BLOCK
    finally:
        llm.engine.shutdown()
