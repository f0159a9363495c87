"""The Ray executor's one-message-per-step transports, the compiled graph (shared-memory channels)
and the socket (a Unix socket to each rank): TP=1's greedy tokens with MTP, health probes while
the ranks' loops run, a hung or killed rank is a WorkerError within the step timeout (after which
shutdown returns promptly), and a request that fails a step fails alone."""

from __future__ import annotations

import sys
import time

import pytest

from benchmarks.bench_step_transport import echo_ranks
from tests.parallel.conftest import all_dead, greedy_params

pytestmark = pytest.mark.timeout(240)

STEP_TIMEOUT_S = 20.0


@pytest.fixture(params=["graph", "socket"])
def transport(request):
    return request.param


def _config(tiny_model_dir, transport, **changes):
    from cluster.config import EngineConfig

    config = EngineConfig(
        model=tiny_model_dir,
        tp_size=2,
        ep_size=2,
        num_draft_tokens=2,
        dtype="float32",
        actor_num_cpus=0.5,
        step_timeout_s=STEP_TIMEOUT_S,
        step_transport=transport,
    )
    return config.replace(**changes)


def _hang_forever(actor) -> None:
    actor.worker.execute = lambda step: time.sleep(3600)


def test_resolve_step_transport():
    from cluster.ray_executor import resolve_step_transport

    for device in ("cuda", "cpu"):
        assert resolve_step_transport("auto", device, ranks_on_this_node=True) == "socket"
        assert resolve_step_transport("calls", device, ranks_on_this_node=True) == "calls"
        assert resolve_step_transport("graph", device, ranks_on_this_node=False) == "graph"
    assert resolve_step_transport("auto", "cuda", ranks_on_this_node=False) == "graph"
    assert resolve_step_transport("auto", "cpu", ranks_on_this_node=False) == "calls"
    with pytest.raises(ValueError, match="every rank on the coordinator's node"):
        resolve_step_transport("socket", "cuda", ranks_on_this_node=False)
    with pytest.raises(ValueError):
        resolve_step_transport("ray.put", "cpu", ranks_on_this_node=True)


def test_transport_gives_tp1_tokens_and_answers_probes(
    ray_local, tiny_model_dir, prompts, tp1_tokens, transport
):
    from cluster.llm import LLM
    from workers.batch import StepInput, StepOutput

    llm = LLM(**_config(tiny_model_dir, transport).__dict__)
    executor = llm.engine.executor
    try:
        assert executor.transport == transport
        outs = llm.generate(prompts, greedy_params())
        assert [o.token_ids for o in outs] == tp1_tokens
        assert all(o.spec.num_rounds > 0 for o in outs)
        executor.check_health()  # plain calls beside the ranks' step loops
        assert executor.execute(StepInput([])) == StepOutput([])
    finally:
        started = time.monotonic()
        llm.engine.shutdown()
        assert time.monotonic() - started < 30


def test_transport_hung_rank_is_an_error_within_the_timeout(
    ray_local, tiny_model_dir, prompts, transport
):
    from cluster.engine import LLMEngine
    from cluster.executor import WorkerError

    ray = ray_local
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engine = LLMEngine(_config(tiny_model_dir, transport, step_timeout_s=5.0))
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


def test_transport_killed_rank_is_an_error(ray_local, tiny_model_dir, prompts, transport):
    from cluster.engine import LLMEngine
    from cluster.executor import WorkerError

    ray = ray_local
    engine = LLMEngine(_config(tiny_model_dir, transport))
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


def test_transport_isolates_a_failing_request(
    ray_local, tiny_model_dir, prompts, tp1_tokens, transport
):
    """Every rank answers the failed step with a StepFailure: the engine re-runs the step
    without the failing request, which alone ends in an error, and the transport serves on."""
    from cluster.engine import LLMEngine

    ray = ray_local
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    engine = LLMEngine(_config(tiny_model_dir, transport, num_draft_tokens=0, ep_size=1))
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


def _killed_rank_fails(ray, rank, call) -> None:
    """Kill `rank`: `call` (a step or a health check), repeated since the kill lands within one
    or two, is a WorkerError saying a rank died within 10 s, not after the step timeout."""
    from cluster.executor import WorkerError

    ray.kill(rank)
    started = time.monotonic()
    with pytest.raises(WorkerError, match="died"):
        for _ in range(100):
            call()
            time.sleep(0.05)
    assert time.monotonic() - started < 10


def test_step_sockets_answer_in_rank_order_and_a_dead_rank_is_an_error_at_once(ray_local):
    """The socket transport alone (real actors, no model): every rank's answer comes back in rank
    order, step after step; a rank killed between steps is a WorkerError as soon as the next
    step is sent, not after the step timeout; closing lets the live ranks' loops return."""
    from cluster.step_sockets import StepSockets
    from workers.batch import SamplingSpec, SeqResult, SeqWork, StepInput, StepOutput

    ray = ray_local
    ranks = echo_ranks(ray, 3)
    sockets = StepSockets.connect(ranks, timeout_s=60)
    try:
        specs = {"a": SamplingSpec(num_prompt_tokens=7), "b": SamplingSpec(num_prompt_tokens=9)}
        for n, ids in ((1, "a"), (5, "ab"), (2, "b"), (3, "ab")):  # specs sent once each
            step = StepInput([SeqWork(i, list(range(n)), 0, [], 0, True, specs[i]) for i in ids])
            expected = StepOutput([SeqResult(i, [n], 0, [specs[i].num_prompt_tokens]) for i in ids])
            assert sockets.execute(step, timeout_s=30) == [expected, None, None]
        assert ray.get([r.ping.remote() for r in ranks], timeout=30)  # beside the loops
        _killed_rank_fails(ray, ranks[2], lambda: sockets.execute(StepInput([]), STEP_TIMEOUT_S))
    finally:
        sockets.close()
        for r in ranks:
            ray.kill(r)


def test_socket_executor_steps_calls_and_checks_ranks_it_was_handed(ray_local):
    """What an engine process does with the ranks a replica hands it: the sockets, detached from
    the StepSockets that connected them, step the ranks, carry RankCalls (a rank's result, or
    its failure as a WorkerError that leaves the ranks serving), and a killed rank fails the
    health check within a moment."""
    from cluster.executor import WorkerError
    from cluster.step_sockets import LoadedRanks, SocketExecutor, StepSockets
    from workers.batch import SamplingSpec, SeqResult, SeqWork, StepFailure, StepInput, StepOutput

    ray = ray_local
    ranks = echo_ranks(ray, 2)
    pids = ray.get([r.ping.remote() for r in ranks], timeout=30)
    sockets = StepSockets.connect(ranks, timeout_s=60)
    try:
        assert sockets.call("ping", timeout_s=30) == pids
        refused = sockets.call("shutdown", timeout_s=30)  # not a call the socket carries
        assert all(isinstance(r, StepFailure) and "shutdown" in r.error for r in refused)
        loaded = LoadedRanks(tuple(sockets.detach()), 12, True, False)
    finally:
        sockets.close()
    executor = SocketExecutor(loaded, step_timeout_s=STEP_TIMEOUT_S)
    try:
        assert (executor.num_kv_blocks, executor.has_mtp, executor.overlaps_steps) == (
            12,
            True,
            False,
        )
        spec = SamplingSpec(num_prompt_tokens=5)
        step = StepInput([SeqWork("a", [1, 2, 3], 0, [], 0, True, spec)])
        assert executor.execute(step) == StepOutput([SeqResult("a", [3], 0, [5])])
        with pytest.raises(WorkerError, match="raised") as failed:
            executor.warm_up(2, False)  # an echo rank's worker has no warm-up
        assert failed.value.step_raised
        step = StepInput([SeqWork("a", [4, 5], 3, [], 0, True, spec)])  # its spec sent once
        assert executor.execute(step) == StepOutput([SeqResult("a", [2], 0, [5])])
        executor.check_health()
        _killed_rank_fails(ray, ranks[1], executor.check_health)
    finally:
        executor.shutdown()
        for r in ranks:
            ray.kill(r)


def test_step_sockets_a_rank_dead_before_connecting_is_an_error(ray_local):
    from cluster.executor import WorkerError
    from cluster.step_sockets import StepSockets

    ray = ray_local
    ranks = echo_ranks(ray, 2)
    ray.kill(ranks[1])
    assert all_dead(ray, [ranks[1]])  # before the sockets open: ray.kill returns first
    started = time.monotonic()
    try:
        with pytest.raises(WorkerError, match="failed to start"):
            StepSockets.connect(ranks, timeout_s=60)
        assert time.monotonic() - started < 20
    finally:
        for r in ranks:
            ray.kill(r)


def test_step_sockets_under_a_long_tmpdir(ray_local, tmp_path, monkeypatch):
    """A socket's path has ~107 bytes: under a TMPDIR longer than that the socket goes to /tmp."""
    import tempfile

    from cluster.step_sockets import StepSockets
    from workers.batch import SeqResult, SeqWork, StepInput, StepOutput

    ray = ray_local
    long_tmp = tmp_path / ("t" * 110)
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    ranks = echo_ranks(ray, 2)
    sockets = StepSockets.connect(ranks, timeout_s=60)
    try:
        step = StepInput([SeqWork("a", [1, 2, 3], 0, [], 0, True)])
        assert sockets.execute(step, timeout_s=30) == [
            StepOutput([SeqResult("a", [3], 0, [0])]),
            None,
        ]
    finally:
        sockets.close()
        for r in ranks:
            ray.kill(r)
