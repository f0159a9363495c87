"""Random sampling at TP=2 with MTP: every rank drafts from rank 0's sampled tokens.

Ranks draw from their own RNG streams, so without agreement the MTP layer's collectives would mix
different tokens (or different row counts). Here rank 1's sampler is replaced by one that always
disagrees; the output must still be TP=1's output for the same seeds.
"""

from __future__ import annotations

import sys

import pytest

from tests.parallel.conftest import STEP_TIMEOUT_S

pytestmark = pytest.mark.timeout(240)


def _sabotage_sampler(actor) -> None:
    import workers.model_runner as runner_module

    def disagree(logits, drafts, specs, *more):
        return [([7], 0)] * len(specs)

    runner_module.verify_and_sample_batch = disagree


def _seeded(i: int):
    from cluster.sampling_params import SamplingParams

    return SamplingParams(max_tokens=12, temperature=0.8, top_k=50, seed=100 + i, ignore_eos=True)


def test_sampling_uses_rank0_tokens_on_every_rank(ray_local, tiny_model_dir, prompts):
    from cluster.config import EngineConfig
    from cluster.engine import LLMEngine

    ray = ray_local
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    def run(config: EngineConfig, before=None) -> list[list[int]]:
        engine = LLMEngine(config)
        try:
            if before is not None:
                before(engine)
            ids = [engine.add_request(p, _seeded(i)) for i, p in enumerate(prompts)]
            final = {}
            while engine.has_unfinished:
                final.update({o.request_id: o for o in engine.step() if o.finished})
            return [final[i].token_ids for i in ids]
        finally:
            engine.shutdown()

    base = EngineConfig(model=tiny_model_dir, num_draft_tokens=2, dtype="float32")
    expected = run(base)

    def sabotage_rank1(engine):
        ray.get(engine.executor.workers[1].run.remote(_sabotage_sampler), timeout=30)

    tp2 = base.replace(tp_size=2, actor_num_cpus=0.5, step_timeout_s=STEP_TIMEOUT_S)
    assert run(tp2, sabotage_rank1) == expected
