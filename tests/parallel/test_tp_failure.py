"""A rank that dies or hangs mid-generation is an error to the caller within the step timeout, and
a rebuilt engine serves the next request with the right tokens."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

from tests.parallel.conftest import all_dead, greedy_params

pytestmark = pytest.mark.timeout(240)

STEP_TIMEOUT_S = 20.0


def _config(tiny_model_dir):
    from cluster.config import EngineConfig

    return EngineConfig(
        model=tiny_model_dir,
        tp_size=2,
        ep_size=2,
        num_draft_tokens=2,
        dtype="float32",
        actor_num_cpus=0.5,
        step_timeout_s=STEP_TIMEOUT_S,
    )


def _hang_forever(actor) -> None:
    actor.worker.execute = lambda step: time.sleep(3600)


@pytest.mark.parametrize(
    "own_process, killed",
    [(False, "rank"), (True, "rank"), (True, "engine process")],
    ids=["thread-rank", "process-rank", "process-engine"],
)
def test_killed_rank_fails_requests_then_restart_serves(
    ray_local, tiny_model_dir, prompts, tp1_tokens, own_process, killed
):
    """On a thread of this process, or (as a Serve replica runs it) in an engine process that
    steps the ranks this process started over their sockets; there, the engine process may be
    what dies (its ranks then outlive it until the rebuild replaces them)."""
    import signal

    from cluster.async_engine import AsyncEngine, EngineDeadError
    from cluster.sampling_params import SamplingParams

    ray = ray_local
    engine = AsyncEngine(_config(tiny_model_dir), own_process=own_process)
    assert engine.own_process == own_process
    assert (engine.pid != os.getpid()) == own_process
    ranks = engine.rank_actors
    assert len(ranks) == 2

    async def kill_mid_generation() -> float:
        params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
        stream = engine.generate(prompts[1], params)
        first = await stream.__anext__()
        assert not first.finished
        if killed == "rank":
            ray.kill(ranks[1])
        else:
            os.kill(engine.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(EngineDeadError):
            async for out in stream:
                assert not out.finished or out.finish_reason == "error"
        return time.monotonic() - killed_at

    async def generate(prompt) -> list[int]:
        async for out in engine.generate(prompt, greedy_params()):  # noqa: B007
            pass
        return out.token_ids

    try:
        assert asyncio.run(generate(prompts[2])) == tp1_tokens[2]
        seconds_to_error = asyncio.run(kill_mid_generation())
        assert seconds_to_error < STEP_TIMEOUT_S
        assert engine.is_dead
        with pytest.raises(EngineDeadError):
            asyncio.run(engine.check_health())
        with pytest.raises(EngineDeadError):  # no new work until rebuilt
            asyncio.run(generate(prompts[0]))

        engine.restart()
        assert not set(engine.rank_actors) & set(ranks)  # new ranks
        assert all_dead(ray, ranks)  # the old ones are gone, rank 0 too
        assert asyncio.run(generate(prompts[0])) == tp1_tokens[0]
        assert asyncio.run(generate(prompts[1])) == tp1_tokens[1]
        ranks = engine.rank_actors
    finally:
        asyncio.run(engine.shutdown())
    assert all_dead(ray, ranks)


def test_hung_rank_is_an_error_within_the_timeout(ray_local, tiny_model_dir, prompts):
    from cluster.engine import LLMEngine
    from cluster.executor import WorkerError

    ray = ray_local
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engine = LLMEngine(_config(tiny_model_dir).replace(step_timeout_s=5.0))
    try:
        engine.add_request(prompts[0], greedy_params())
        assert engine.step()  # healthy: the prefill returns rank 0's token
        ray.get(engine.executor.workers[1].run.remote(_hang_forever), timeout=30)
        started = time.monotonic()
        with pytest.raises(WorkerError):
            while engine.has_unfinished:
                engine.step()
        # Rank 0's collective timeout or the step timeout, whichever fires first (+ scheduling).
        assert time.monotonic() - started < 5.0 + 5.0
    finally:
        engine.shutdown()


BAD_SEED = 666


def _fail_seed(actor, seed: int) -> None:
    """On this rank, sampling raises for requests seeded `seed` (every rank alike)."""
    import workers.model_runner as runner_module

    real = runner_module.verify_and_sample_batch

    def faulty(logits, drafts, specs, *more):
        if any(spec.seed == seed for spec in specs):
            raise RuntimeError("injected failure")
        return real(logits, drafts, specs, *more)

    runner_module.verify_and_sample_batch = faulty


def test_request_failing_on_every_rank_fails_alone(ray_local, tiny_model_dir, prompts):
    """TP=2 over Ray: a step whose code raises on the ranks (all finish it) is re-run without
    the failing request; the others get the tokens they get without it; the engine lives."""
    from cluster.engine import LLMEngine
    from cluster.sampling_params import SamplingParams

    ray = ray_local
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engine = LLMEngine(_config(tiny_model_dir))

    def run(requests):
        ids = [engine.add_request(p, params) for p, params in requests]
        final = {}
        while engine.has_unfinished:
            final.update({o.request_id: o for o in engine.step() if o.finished})
        return [final[i] for i in ids]

    try:
        good = [(p, greedy_params()) for p in prompts[:2]]
        reference = [o.token_ids for o in run(good)]
        ray.get([w.run.remote(_fail_seed, BAD_SEED) for w in engine.executor.workers])
        bad = SamplingParams(max_tokens=8, temperature=1.0, seed=BAD_SEED, ignore_eos=True)
        outs = run(good[:1] + [(prompts[2], bad)] + good[1:])
        assert outs[1].finish_reason == "error"
        assert [outs[0].token_ids, outs[2].token_ids] == reference
        assert [o.token_ids for o in run(good)] == reference  # still serving
    finally:
        engine.shutdown()
