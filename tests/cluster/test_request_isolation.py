"""A request that fails inside a step fails alone: the engine re-runs the step without it, the
other requests' outputs (seeded sampling included) are exactly what they are without the failing
request, and the engine keeps serving. A worker that is gone still fails the whole engine."""

from __future__ import annotations

import pytest

import workers.model_runner
from cluster.engine import LLMEngine, WorkerError
from cluster.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48], [9, 10], [300, 301, 302]]
BAD_SEED = 666


def _params(seed: int | None) -> SamplingParams:
    if seed is None:
        return SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return SamplingParams(max_tokens=12, temperature=0.9, seed=seed, ignore_eos=True)


def _run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> dict:
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    final = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return {i: final[i] for i in ids}


@pytest.fixture(scope="module", params=[2, 0], ids=["mtp", "overlap"])
def engine(tiny_model_dir, request):
    """MTP k = 2; or MTP off with steps overlapping (the greedy request's next decodes launched
    ahead, dropped when a step fails)."""
    from cluster.config import EngineConfig

    k = request.param
    return LLMEngine(
        EngineConfig(
            tiny_model_dir,
            device="cpu",
            dtype="float32",
            num_draft_tokens=k,
            overlap_steps="on" if k == 0 else "auto",
        )
    )


GOOD = [(PROMPTS[0], _params(1)), (PROMPTS[1], _params(None)), (PROMPTS[2], _params(2))]


@pytest.mark.parametrize("fail_after_calls", [0, 3])
def test_failing_request_fails_alone_and_others_are_unchanged(
    engine, monkeypatch, fail_after_calls
):
    reference = [out.token_ids for out in _run(engine, GOOD).values()]

    real = workers.model_runner.verify_and_sample_batch
    calls = {"bad": 0}

    def faulty(logits, drafts, specs, *more):
        # The seeded requests drawn with the bad one take their draws first: a step that
        # failed after them would change their streams unless the worker put them back.
        drawn = real(logits, drafts, specs, *more)
        if any(spec.seed == BAD_SEED for spec in specs):
            calls["bad"] += 1
            if calls["bad"] > fail_after_calls:
                raise RuntimeError("injected failure")
        return drawn

    monkeypatch.setattr(workers.model_runner, "verify_and_sample_batch", faulty)
    requests = GOOD[:1] + [(PROMPTS[3], _params(BAD_SEED))] + GOOD[1:]
    outs = list(_run(engine, requests).values())
    bad = outs.pop(1)
    assert bad.finished and bad.finish_reason == "error"
    assert "failed inside an engine step" in bad.error and "injected" not in bad.error
    assert len(bad.token_ids) == fail_after_calls  # what it produced before failing
    assert [out.token_ids for out in outs] == reference
    assert all(out.finish_reason == "length" for out in outs)

    monkeypatch.setattr(workers.model_runner, "verify_and_sample_batch", real)
    assert [out.token_ids for out in _run(engine, GOOD).values()] == reference
    assert engine.scheduler.block_manager.num_free_blocks == (
        engine.scheduler.block_manager.num_usable_blocks
    )


@pytest.mark.parametrize("error", ["a worker actor died", "1 rank(s) did not answer within 5s"])
def test_a_dead_or_hung_worker_still_fails_the_engine(engine, monkeypatch, error):
    """Only a step whose code raised while every rank finished it is re-run; a rank that died
    or hangs (the step may still be running there) fails the engine, whatever the probe says."""
    calls = []

    def failing(step):
        calls.append(step)
        raise WorkerError(error)

    monkeypatch.setattr(engine.executor, "execute", failing)
    for prompt in PROMPTS[:2]:
        engine.add_request(prompt, _params(None))
    with pytest.raises(WorkerError, match=error.split()[-1]):
        engine.step()
    assert len(calls) == 1  # not re-run
    engine.fail_all("test cleanup")
