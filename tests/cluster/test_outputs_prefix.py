"""An output's cumulative token ids and logprobs are what they were when it was made, though
the engine no longer copies them per output (`cluster.outputs.Prefix`)."""

from __future__ import annotations

import json
import pickle

import pytest

from cluster.llm import LLM
from cluster.outputs import CumulativeOutput, Prefix, make_request_delta
from cluster.request import Request, RequestStatus
from cluster.sampling_params import SamplingParams


def test_prefix_reads_as_the_list_it_was():
    items = [4, 5, 6]
    prefix = Prefix(items)
    items += [7, 8]  # the source grows after the prefix was taken
    assert len(prefix) == 3
    assert prefix == [4, 5, 6] and prefix == (4, 5, 6) and prefix != [4, 5, 6, 7]
    assert list(prefix) == [4, 5, 6]
    assert prefix[-1] == 6 and prefix[1:] == [5, 6] and prefix[::-1] == [6, 5, 4]
    with pytest.raises(IndexError):
        prefix[3]
    with pytest.raises(IndexError):
        prefix[-4]
    assert 7 not in prefix and 5 in prefix
    assert repr(prefix) == "[4, 5, 6]"
    assert [1] + prefix == [1, 4, 5, 6] and prefix + [9] == [4, 5, 6, 9]
    assert type([1] + prefix) is list and prefix + prefix == [4, 5, 6, 4, 5, 6]
    assert Prefix(items) == items
    unpickled = pickle.loads(pickle.dumps(prefix))
    assert type(unpickled) is list and unpickled == [4, 5, 6]
    with pytest.raises(TypeError):
        hash(prefix)


def test_offline_outputs_keep_their_step_tokens(tiny_model_dir):
    """Every streamed output of the offline engine holds the tokens up to its own step, and the
    last one all of them."""
    llm = LLM(tiny_model_dir, num_draft_tokens=2, dtype="float32")
    engine = llm.engine
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    request_id = engine.add_request([5, 9, 13, 17], params)
    outputs = []
    while engine.has_unfinished:
        outputs.extend(engine.step())
    seen: list[int] = []
    for out in outputs:
        seen += out.new_token_ids
        assert out.token_ids == seen
        assert len(out.logprobs) == len(seen)
    last = outputs[-1]
    assert last.request_id == request_id and last.finished and len(seen) == 24
    # What a caller keeps is a plain list: it serializes and extends as one.
    assert type(last.token_ids) is list and type(last.logprobs) is list
    assert json.loads(json.dumps(last.token_ids)) == seen


def test_cumulative_outputs_from_deltas_keep_their_step_tokens():
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=10))
    request.status = RequestStatus.RUNNING
    cumulative = CumulativeOutput(request.prompt_token_ids)
    outputs = []
    for step_tokens in ([7], [8, 9], [10]):
        request.output_token_ids.extend(step_tokens)
        outputs.append(cumulative.complete(make_request_delta(request)))
    request.status = RequestStatus.FINISHED_LENGTH
    outputs.append(cumulative.complete(make_request_delta(request)))
    want = [[7], [7, 8, 9], [7, 8, 9, 10], [7, 8, 9, 10]]
    assert [out.token_ids for out in outputs] == want
    assert type(outputs[-1].token_ids) is list
