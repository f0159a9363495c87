"""TP=2 and TP=2/EP=2 with MTP, over gloo among Ray actors, give TP=1's greedy tokens.

Also checks where the top-k comes from: with the broadcast on, rank 1 never runs an indexer (its
indexer-key caches stay zero); off, every rank runs its own.
"""

from __future__ import annotations

import sys

import pytest

from cluster.sampling_params import SamplingParams
from tests.parallel.conftest import STEP_TIMEOUT_S, greedy_params

pytestmark = pytest.mark.timeout(240)

LAYOUTS = [
    # tp, ep, num_draft_tokens, share_topk, topk_broadcast (None: on at TP > 1)
    pytest.param(2, 1, 2, False, None, id="tp2-mtp2"),
    pytest.param(2, 1, 2, True, None, id="tp2-mtp2-share"),
    pytest.param(2, 2, 2, True, None, id="tp2-ep2-mtp2-share"),
    pytest.param(2, 2, 2, False, False, id="tp2-ep2-mtp2-every-rank-indexer"),
]


def _indexer_cache_abs_sum(actor) -> float:
    return float(sum(c.abs().sum() for c in actor.worker.model.index_caches))


def _niceness(actor) -> int:
    import os

    return os.nice(0)


def _frozen_objects(actor) -> int:
    import gc

    return gc.get_freeze_count()


def _tp_llm(ray, model_dir: str, **options):
    """An LLM on Ray ranks of this test's shape (fp32, half a CPU each); the helpers that run
    on the ranks travel by value."""
    from cluster.llm import LLM

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return LLM(
        model_dir, dtype="float32", actor_num_cpus=0.5, step_timeout_s=STEP_TIMEOUT_S, **options
    )


@pytest.mark.parametrize("tp, ep, k, share_topk, topk_broadcast", LAYOUTS)
def test_tp_greedy_matches_tp1(
    ray_local, tiny_model_dir, prompts, tp1_tokens, tp, ep, k, share_topk, topk_broadcast
):
    ray = ray_local
    llm = _tp_llm(
        ray,
        tiny_model_dir,
        tp_size=tp,
        ep_size=ep,
        num_draft_tokens=k,
        share_topk=share_topk,
        topk_broadcast=topk_broadcast,
    )
    try:
        outs = llm.generate(prompts, greedy_params())
        assert [o.token_ids for o in outs] == tp1_tokens
        assert all(o.spec.num_rounds > 0 for o in outs)
        stats = llm.stats()
        assert stats.num_free_blocks == stats.num_total_blocks

        workers = llm.engine.executor.workers
        cache_sums = ray.get([w.run.remote(_indexer_cache_abs_sum) for w in workers], timeout=60)
        assert cache_sums[0] > 0
        if topk_broadcast is False:
            assert cache_sums[1] > 0
        else:
            assert cache_sums[1] == 0  # rank 1 skipped every indexer: no key was ever written
    finally:
        llm.engine.shutdown()


def _rows_reused(actor) -> tuple[int, int]:
    runner = actor.worker.runner
    return runner.num_rows_ahead, runner.num_rows_reused


def test_tp2_steps_overlap(ray_local, tiny_model_dir, prompts, tp1_tokens):
    """Every rank launches the next step's decodes ahead and takes the same rows (their
    collectives meet): TP=1's greedy tokens, and both ranks took every row the other took;
    with sampling requests beside greedy ones too (only the greedy rows go ahead)."""
    ray = ray_local
    llm = _tp_llm(ray, tiny_model_dir, tp_size=2, num_draft_tokens=0, overlap_steps="on")
    try:
        outs = llm.generate(prompts, greedy_params())
        assert [o.token_ids for o in outs] == tp1_tokens
        assert llm.engine.executor.overlaps_steps
        workers = llm.engine.executor.workers
        counts = ray.get([w.run.remote(_rows_reused) for w in workers], timeout=60)
        assert counts[0] == counts[1] and counts[0][1] > 0
        engine = llm.engine
        sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
        ids = [
            engine.add_request(p, greedy_params() if i % 2 else sampled)
            for i, p in enumerate(prompts)
        ]
        final = {}
        while engine.has_unfinished:
            final.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        greedy = [final[rid] for i, rid in enumerate(ids) if i % 2]
        assert greedy == [t for i, t in enumerate(tp1_tokens) if i % 2]
        after = ray.get([w.run.remote(_rows_reused) for w in workers], timeout=60)
        assert after[0] == after[1]
        # every greedy decode went ahead, no draw did
        assert after[0][1] - counts[0][1] == sum(len(t) - 1 for t in greedy)
    finally:
        llm.engine.shutdown()


@pytest.mark.no_triton
def test_auto_executor_picks_ray_for_tp2(ray_local, tiny_model_dir, prompts, tp1_tokens):
    from cluster.llm import LLM
    from cluster.ray_executor import RayExecutor

    llm = LLM(
        tiny_model_dir,
        num_draft_tokens=0,
        tp_size=2,
        dtype="float32",
        actor_num_cpus=0.5,
        step_timeout_s=STEP_TIMEOUT_S,
    )
    try:
        assert isinstance(llm.engine.executor, RayExecutor)
        outs = llm.generate(prompts[:2], greedy_params())
        assert [o.token_ids for o in outs] == tp1_tokens[:2]
        # The ranks run at the normal priority, not at Ray's worker niceness (15).
        ray_local.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        workers = llm.engine.executor.workers
        assert ray_local.get([w.run.remote(_niceness) for w in workers], timeout=60) == [0, 0]
        # Each rank froze what it built once warm (workers/long_lived.py): a full collection of
        # it would stall every step of the engine.
        frozen = ray_local.get([w.run.remote(_frozen_objects) for w in workers], timeout=60)
        assert min(frozen) > 10_000, frozen
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(
    "seed, ep",
    [
        pytest.param(16, 2, id="family16-tp2-ep2"),  # 2 heads, 12 experts in 4 groups, YaRN
        pytest.param(4, 1, id="family4-tp2"),  # 4 heads, no dense layer, index_topk 4
    ],
)
def test_tp_greedy_on_the_config_family(ray_local, tmp_path_factory, prompts, seed, ep):
    """Configs unlike the fixture at TP=2 with MTP (k = 2, top-k sharing): TP=1's greedy."""
    from cluster.llm import LLM
    from workers.tiny_model import make_tiny_model, random_config

    ray_local.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    model_dir = make_tiny_model(
        str(tmp_path_factory.mktemp(f"family-{seed}")), seed, mtp_echo=0.1, **random_config(seed)
    )
    want = [
        o.token_ids
        for o in LLM(model_dir, num_draft_tokens=0, dtype="float32").generate(
            prompts, greedy_params()
        )
    ]
    llm = LLM(
        model_dir,
        tp_size=2,
        ep_size=ep,
        num_draft_tokens=2,
        share_topk=True,
        dtype="float32",
        actor_num_cpus=0.5,
        step_timeout_s=STEP_TIMEOUT_S,
    )
    try:
        assert [o.token_ids for o in llm.generate(prompts, greedy_params())] == want
    finally:
        llm.engine.shutdown()
