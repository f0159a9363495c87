"""AsyncEngine: streaming, aborts, overload, and recovery after a failed step (TP=1); with the
step loop on a thread and in a process of its own (tests/cluster/test_engine_process.py has
what only the latter does)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from cluster.config import EngineConfig
from cluster.executor import WorkerError
from cluster.llm import LLM
from cluster.sampling_params import InvalidRequestError, SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 11]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


MODES = pytest.mark.parametrize("own_process", [False, True], ids=["thread", "process"])


@pytest.fixture(
    params=[(False, "auto"), (True, "auto"), (False, "on"), (True, "on")],
    ids=["thread", "process", "thread-overlap", "process-overlap"],
)
def engine(tiny_model_dir, request):
    """The step loop on a thread or in a process; with steps overlapping ("on") as on a GPU,
    where "auto" turns it on (on CPU it is off)."""
    own_process, overlap = request.param
    engine = AsyncEngine(
        EngineConfig(
            model=tiny_model_dir,
            num_draft_tokens=0,
            dtype="float32",
            max_queued_requests=2,
            overlap_steps=overlap,
        ),
        own_process=own_process,
    )
    assert engine.own_process == own_process
    yield engine
    asyncio.run(engine.shutdown())


async def _collect(engine, prompt, params, request_id=None):
    outs = [o async for o in engine.generate(prompt, params, request_id)]
    return outs


def test_stream_deltas_add_up_to_the_offline_result(engine, tiny_model_dir):
    outs = asyncio.run(_collect(engine, PROMPT, _greedy(12)))
    expected = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32").generate(
        [PROMPT], _greedy(12)
    )[0]
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert [t for o in outs for t in o.new_token_ids] == expected.token_ids
    assert "".join(o.new_text for o in outs) == expected.text


class _Timings:
    def __init__(self):
        self.first: list[tuple[int, float]] = []
        self.later: list[tuple[int, float]] = []

    def first_tokens(self, num_tokens, ttft_s):
        self.first.append((num_tokens, ttft_s))

    def later_tokens(self, num_tokens, since_previous_s):
        self.later.append((num_tokens, since_previous_s))


def test_a_request_not_streamed_gets_one_output_and_every_tokens_time(engine, tiny_model_dir):
    timings = _Timings()

    async def run():
        return [
            o async for o in engine.generate(PROMPT, _greedy(12), stream=False, timings=timings)
        ]

    outs = asyncio.run(run())
    expected = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32").generate(
        [PROMPT], _greedy(12)
    )[0]
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].new_token_ids == expected.token_ids and outs[0].new_text == expected.text
    # The step loop stamped each step's tokens: one first, eleven later (one per step, MTP off).
    assert [n for n, _ in timings.first] == [1] and timings.first[0][1] > 0
    assert [n for n, _ in timings.later] == [1] * 11
    assert all(dt >= 0 for _, dt in timings.later)


@MODES
def test_a_paced_stream_joins_steps_and_keeps_the_text(tiny_model_dir, own_process):
    # 1 stream output per second: the first text at once, the rest of 40 tokens (well under a
    # second on the CPU tiny model) in the final output.
    engine = AsyncEngine(
        EngineConfig(model=tiny_model_dir, num_draft_tokens=0, dtype="float32"),
        stream_chunks_per_s=1.0,
        own_process=own_process,
    )
    try:
        outs = asyncio.run(_collect(engine, PROMPT, _greedy(40)))
    finally:
        asyncio.run(engine.shutdown())
    expected = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32").generate(
        [PROMPT], _greedy(40)
    )[0]
    assert 2 <= len(outs) < 40
    assert [t for o in outs for t in o.new_token_ids] == expected.token_ids
    assert "".join(o.new_text for o in outs) == expected.text


def test_abort_mid_stream_frees_every_block(engine):
    async def run():
        stream = engine.generate(PROMPT, _greedy(200), "victim")
        first = await stream.__anext__()
        assert not first.finished
        await engine.abort("victim")
        rest = [o async for o in stream]
        return rest

    rest = asyncio.run(run())
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_caller_that_stops_at_the_last_output_aborts_nothing(engine, monkeypatch, stream):
    # The model server reads up to the finished output and closes the generator there. The
    # engine has ended that request: an abort would be a wasted command whose round trip to the
    # step loop (a step or more) held up every completed response.
    posted = []
    post = engine._post

    def recording(command):
        posted.append(type(command).__name__)
        post(command)

    monkeypatch.setattr(engine, "_post", recording)

    async def run():
        outputs = engine.generate(PROMPT, _greedy(6), stream=stream)
        async for out in outputs:
            if out.finished:
                break
        await outputs.aclose()
        return out

    last = asyncio.run(run())
    assert last.finished and last.finish_reason == "length"
    assert posted == ["Add"]
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_bad_input_is_an_invalid_request(engine):
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(_collect(engine, PROMPT, SamplingParams(max_tokens=-1)))
    assert err.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError):
        asyncio.run(_collect(engine, [10**7], _greedy(2)))  # token id outside the vocabulary


@MODES
def test_queue_past_max_queued_requests_is_overload(tiny_model_dir, own_process):
    # One running sequence at a time and at most 2 waiting: of 4 long requests one is refused.
    config = EngineConfig(
        model=tiny_model_dir,
        num_draft_tokens=0,
        dtype="float32",
        max_queued_requests=2,
        max_num_seqs=1,
    )
    engine = AsyncEngine(config, own_process=own_process)

    async def run():
        streams = [engine.generate(PROMPT, _greedy(300), f"q{i}") for i in range(4)]
        # All four are submitted before the engine can finish any (300 steps each).
        firsts = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # a caller going away aborts its request
        return firsts

    try:
        results = asyncio.run(run())
    finally:
        stats = engine.stats()
        asyncio.run(engine.shutdown())
    # q0 and q1 always fit (2 may wait). q2 fits only if the loop had already started q0 when
    # it arrived, and then q3 finds q1 and q2 waiting; if q2 came first, q3 fits only if the loop
    # started q0 between the two (the commands reached it in two turns). Never both.
    refused = [isinstance(r, EngineOverloadedError) for r in results]
    assert refused in (
        [False, False, True, True],
        [False, False, False, True],
        [False, False, True, False],
    )
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.fixture
def thread_engine(tiny_model_dir):
    """The step loop on a thread, whose executor a test can reach (an engine process's
    failure: test_engine_process.py kills it)."""
    engine = AsyncEngine(EngineConfig(model=tiny_model_dir, num_draft_tokens=0, dtype="float32"))
    yield engine
    asyncio.run(engine.shutdown())


def test_failed_step_errors_every_request_then_restart_serves(thread_engine, monkeypatch):
    engine = thread_engine
    real = engine.engine.executor.execute

    def broken(step):
        raise WorkerError("rank 0 died")

    def unreachable():
        raise WorkerError("rank 0 does not answer")

    # A dead rank fails the step and the health probe (a step failing while every rank answers
    # fails only its request: tests/cluster/test_request_isolation.py).
    monkeypatch.setattr(engine.engine.executor, "execute", broken)
    monkeypatch.setattr(engine.engine.executor, "check_health", unreachable)
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(engine, PROMPT, _greedy(4)))
    with pytest.raises(EngineDeadError):  # dead until restarted
        asyncio.run(_collect(engine, PROMPT, _greedy(4)))
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.check_health())
    monkeypatch.setattr(engine.engine.executor, "execute", real)
    engine.restart()
    outs = asyncio.run(_collect(engine, PROMPT, _greedy(4)))
    assert outs[-1].finished and len(outs[-1].token_ids) == 4
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
