"""The Ray executor's compiled-graph transport (one shared-memory message per step to every
rank): TP=1's greedy tokens with MTP, health probes while the graph runs, and a hung or killed
rank is a WorkerError within the step timeout, after which shutdown returns promptly."""

from __future__ import annotations

import sys
import time

import pytest

from tests.parallel.conftest import greedy_params

pytestmark = pytest.mark.timeout(240)

STEP_TIMEOUT_S = 20.0


def _config(tiny_model_dir, **changes):
    from cluster.config import EngineConfig

    config = EngineConfig(
        model=tiny_model_dir,
        tp_size=2,
        ep_size=2,
        num_draft_tokens=2,
        dtype="float32",
        actor_num_cpus=0.5,
        step_timeout_s=STEP_TIMEOUT_S,
        step_transport="graph",
    )
    return config.replace(**changes)


def _hang_forever(actor) -> None:
    actor.worker.execute = lambda step: time.sleep(3600)


def test_resolve_step_transport():
    from cluster.ray_executor import resolve_step_transport

    assert resolve_step_transport("auto", "cuda") == "graph"
    assert resolve_step_transport("auto", "cpu") == "calls"
    assert resolve_step_transport("calls", "cuda") == "calls"
    with pytest.raises(ValueError):
        resolve_step_transport("ray.put", "cpu")


def test_graph_transport_gives_tp1_tokens_and_answers_probes(
    ray_local, tiny_model_dir, prompts, tp1_tokens
):
    from cluster.llm import LLM
    from workers.batch import StepInput, StepOutput

    llm = LLM(**_config(tiny_model_dir).__dict__)
    executor = llm.engine.executor
    try:
        assert executor.transport == "graph"
        outs = llm.generate(prompts, greedy_params())
        assert [o.token_ids for o in outs] == tp1_tokens
        assert all(o.spec.num_rounds > 0 for o in outs)
        executor.check_health()  # plain calls beside the graph's loop
        assert executor.execute(StepInput([])) == StepOutput([])
    finally:
        started = time.monotonic()
        llm.engine.shutdown()
        assert time.monotonic() - started < 30


def test_graph_transport_hung_rank_is_an_error_within_the_timeout(
    ray_local, tiny_model_dir, prompts
):
    from cluster.engine import LLMEngine
    from cluster.executor import WorkerError

    ray = ray_local
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engine = LLMEngine(_config(tiny_model_dir, step_timeout_s=5.0))
    try:
        engine.add_request(prompts[0], greedy_params())
        assert engine.step()
        ray.get(engine.executor.workers[1].run.remote(_hang_forever), timeout=30)
        started = time.monotonic()
        with pytest.raises(WorkerError):
            while engine.has_unfinished:
                engine.step()
        assert time.monotonic() - started < 5.0 + 5.0
    finally:
        started = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - started < 30


def test_graph_transport_killed_rank_is_an_error(ray_local, tiny_model_dir, prompts):
    from cluster.engine import LLMEngine
    from cluster.executor import WorkerError

    ray = ray_local
    engine = LLMEngine(_config(tiny_model_dir))
    try:
        engine.add_request(prompts[1], greedy_params())
        assert engine.step()
        ray.kill(engine.executor.workers[1])
        started = time.monotonic()
        with pytest.raises(WorkerError):
            while engine.has_unfinished:
                engine.step()
        assert time.monotonic() - started < STEP_TIMEOUT_S + 5.0
    finally:
        engine.shutdown()


def _fail_requests_named_bad(actor) -> None:
    execute = actor.worker.execute

    def failing(step):
        if any(s.request_id.startswith("bad") for s in step.seqs):
            raise ValueError("this request breaks the step")
        return execute(step)

    actor.worker.execute = failing


def test_graph_transport_isolates_a_failing_request(ray_local, tiny_model_dir, prompts, tp1_tokens):
    """Every rank answers the failed step with a StepFailure: the engine re-runs the step
    without the failing request, which alone ends in an error, and the graph serves on."""
    from cluster.engine import LLMEngine

    ray = ray_local
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engine = LLMEngine(_config(tiny_model_dir, num_draft_tokens=0, ep_size=1))
    try:
        ray.get([w.run.remote(_fail_requests_named_bad) for w in engine.executor.workers])
        engine.add_request(prompts[0], greedy_params(), "good")
        engine.add_request(prompts[1], greedy_params(), "bad")
        final = {}
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        assert final["bad"].finish_reason == "error"
        assert final["good"].finish_reason == "length"
        assert final["good"].token_ids == tp1_tokens[0]
        engine.executor.check_health()
    finally:
        engine.shutdown()
