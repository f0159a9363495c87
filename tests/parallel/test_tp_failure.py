"""A rank that dies or hangs mid-generation is an error to the caller within the step timeout, and
a rebuilt engine serves the next request with the right tokens."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from tests.parallel.conftest import greedy_params

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


def test_killed_rank_fails_requests_then_restart_serves(
    ray_local, tiny_model_dir, prompts, tp1_tokens
):
    from cluster.async_engine import AsyncEngine, EngineDeadError
    from cluster.executor import WorkerError
    from cluster.sampling_params import SamplingParams

    ray = ray_local
    engine = AsyncEngine(_config(tiny_model_dir))

    async def kill_mid_generation() -> float:
        params = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
        stream = engine.generate(prompts[1], params)
        first = await stream.__anext__()
        assert not first.finished
        ray.kill(engine.engine.executor.workers[1])
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
        seconds_to_error = asyncio.run(kill_mid_generation())
        assert seconds_to_error < STEP_TIMEOUT_S
        assert engine.is_dead
        with pytest.raises(WorkerError):
            engine.engine.check_health()
        with pytest.raises(EngineDeadError):  # no new work until rebuilt
            asyncio.run(generate(prompts[0]))

        engine.restart()
        assert asyncio.run(generate(prompts[0])) == tp1_tokens[0]
        assert asyncio.run(generate(prompts[1])) == tp1_tokens[1]
    finally:
        asyncio.run(engine.shutdown())


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
