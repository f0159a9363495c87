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
