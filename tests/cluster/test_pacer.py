"""The step loop's pacing of outputs (`cluster.engine_loop.Pacer`): when a request's outputs
cross to its caller."""

from __future__ import annotations

from cluster.engine_loop import Pacer
from cluster.outputs import Delta


def _delta(request_id: str, token: int, text: str, finished: bool = False, first: bool = False):
    """A `make_request_delta` tuple of one step's token."""
    return (request_id, [token], text, finished, None, None, None, 4, 0, None, None, first)


def test_a_stream_gets_its_first_text_at_once_then_one_output_per_interval():
    """Tokens that render no text yet (part of a character's bytes, text held for a stop
    string) join the next output instead of going alone; the first output with text goes at
    once, then the stream is paced (1 output per second here: nothing else until it ends)."""
    pacer = Pacer(chunks_per_s=1.0, deltas=True)
    pacer.add("s", stream=True)
    assert pacer.pace([_delta("s", 7, "", first=True)]) == []  # no text yet: joins
    [(request_id, joined, stamps)] = pacer.pace([_delta("s", 8, "é")])
    assert request_id == "s" and joined[Delta.NEW_TOKEN_IDS] == [7, 8]
    assert joined[Delta.NEW_TEXT] == "é" and joined[Delta.IS_FIRST]
    assert [n for n, _ in stamps] == [1, 1]  # each step's tokens keep their own time
    assert pacer.pace([_delta("s", 9, "a")]) == []  # paced now
    assert pacer.pace([_delta("s", 10, "b")]) == []
    [(_, last, _)] = pacer.pace([_delta("s", 11, "c", finished=True)])
    assert last[Delta.NEW_TOKEN_IDS] == [9, 10, 11] and last[Delta.NEW_TEXT] == "abc"


def test_a_stream_whose_first_token_has_text_goes_at_once():
    pacer = Pacer(chunks_per_s=1.0, deltas=True)
    pacer.add("s", stream=True)
    [(_, first, _)] = pacer.pace([_delta("s", 7, "x", first=True)])
    assert first[Delta.NEW_TEXT] == "x"
    assert pacer.pace([_delta("s", 8, "y")]) == []


def test_a_stream_without_text_is_sent_when_it_ends():
    pacer = Pacer(chunks_per_s=0.0, deltas=True)  # unpaced: one output per step once text came
    pacer.add("s", stream=True)
    assert pacer.pace([_delta("s", 7, "", first=True)]) == []
    [(_, last, _)] = pacer.pace([_delta("s", 8, "", finished=True)])
    assert last[Delta.NEW_TOKEN_IDS] == [7, 8] and last[Delta.FINISHED]


def test_unpaced_streams_get_every_step_after_the_first_text():
    pacer = Pacer(chunks_per_s=0.0, deltas=True)
    pacer.add("s", stream=True)
    assert len(pacer.pace([_delta("s", 7, "x", first=True)])) == 1
    assert len(pacer.pace([_delta("s", 8, "")])) == 1  # text came: every step goes
    assert len(pacer.pace([_delta("s", 9, "y")])) == 1


def test_a_request_not_streamed_gets_one_output():
    pacer = Pacer(chunks_per_s=1.0, deltas=True)
    pacer.add("w", stream=False)
    assert pacer.pace([_delta("w", 7, "x", first=True)]) == []
    [(_, whole, _)] = pacer.pace([_delta("w", 8, "y", finished=True)])
    assert whole[Delta.NEW_TEXT] == "xy"


def _offline(tiny_model_dir, prompt, params):
    from cluster.llm import LLM

    return LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32").generate([prompt], params)[0]


def test_the_loop_builds_an_output_only_when_it_is_due(tiny_model_dir):
    """Held back (a request not streamed; a paced stream between its intervals), a request's
    output is not built at all: its sent-markers stay while its tokens grow, the engine's
    counters still count every token at every step, and the output it gets at last carries
    every token and character since the previous one, with a stop string cut as offline."""
    from cluster.config import EngineConfig
    from cluster.engine import LLMEngine
    from cluster.engine_loop import Add, EngineLoop
    from cluster.sampling_params import SamplingParams

    prompt = [5, 6, 7, 8, 9, 10, 11]
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = _offline(tiny_model_dir, prompt, free)
    # A stop string from the middle of the free-running text: the run must cut there.
    stop = expected.text[len(expected.text) // 2 :][:3]
    stopped = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    expected_stopped = _offline(tiny_model_dir, prompt, stopped)
    assert len(expected_stopped.text) < len(expected.text)

    engine = LLMEngine(
        EngineConfig(model=tiny_model_dir, num_draft_tokens=0, dtype="float32"),
        deltas_only=True,
    )
    loop = EngineLoop(engine, stream_chunks_per_s=1e-3)  # after its first text, 1 per 1000 s
    commands = [
        Add("whole", prompt, free, stream=False),
        Add("stream", prompt, free, stream=True),
        Add("stopped", prompt, stopped, stream=True),
    ]
    got: dict[str, list] = {"whole": [], "stream": [], "stopped": []}
    requests: dict = {}  # request id -> Request, kept past its end
    num_turns = 0
    while commands or loop.busy:
        due, _ = loop.turn(commands)
        commands = []
        num_turns += 1
        requests.update((r.request_id, r) for r in engine.scheduler.running)
        for request_id, delta, _ in due:
            got[request_id].append(delta)
        assert engine.counters.num_generation_tokens == sum(
            len(r.output_token_ids) for r in requests.values()
        )
        whole, stream = requests["whole"], requests["stream"]
        if not whole.is_finished:
            assert whole.output_token_ids and whole.num_sent_tokens == 0  # nothing built yet
        if not stream.is_finished:
            assert stream.num_sent_tokens == 1  # only its first output was built

    assert num_turns > 10
    assert len(got["whole"]) == 1 and len(got["stream"]) == 2
    for request_id, want in (("whole", expected), ("stream", expected)):
        assert [t for d in got[request_id] for t in d[Delta.NEW_TOKEN_IDS]] == want.token_ids
        assert "".join(d[Delta.NEW_TEXT] for d in got[request_id]) == want.text
    assert "".join(d[Delta.NEW_TEXT] for d in got["stopped"]) == expected_stopped.text
    assert [t for d in got["stopped"] for t in d[Delta.NEW_TOKEN_IDS]] == (
        expected_stopped.token_ids
    )


def test_streams_that_began_apart_are_due_at_the_same_tick(monkeypatch):
    """Each stream's interval ends on one grid of ticks, at least half an interval after its
    last output: streams whose first texts went at different times are then due together, so
    their outputs cross in one message; each stream still gets one output per interval."""
    import cluster.engine_loop as engine_loop

    clock = [100.013]
    monkeypatch.setattr(engine_loop.time, "perf_counter", lambda: clock[0])
    pacer = Pacer(chunks_per_s=20.0, deltas=True)  # two streams: an interval of 0.1 s
    pacer.add("a", stream=True)
    pacer.add("b", stream=True)
    assert len(pacer.pace([_delta("a", 1, "x", first=True)])) == 1  # at 100.013
    clock[0] = 100.071
    assert len(pacer.pace([_delta("b", 1, "x", first=True)])) == 1
    sent = {}
    for step in range(2, 40):  # a step every 10 ms
        clock[0] = round(100.071 + 0.01 * (step - 1), 6)
        for request_id, _, _ in pacer.pace([_delta("a", step, "y"), _delta("b", step, "y")]):
            sent.setdefault(clock[0], []).append(request_id)
    # a: at least 0.05 s after 100.013, the tick 100.1; b: the tick 100.2 (100.1 was too soon)
    assert sent == {100.101: ["a"], 100.201: ["a", "b"], 100.301: ["a", "b"], 100.401: ["a", "b"]}
    assert engine_loop.next_send_s(5.0, 0.0) == 5.0  # unpaced: at once
