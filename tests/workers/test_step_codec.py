"""The socket transport's step encoding: every decoded step equals the step encoded, with each
request's SamplingSpec sent only with its first step, through finishes, re-runs of part of a
step and a request id used again."""

from __future__ import annotations

import io
import pickle

from workers.batch import SamplingSpec, SeqWork, StepInput
from workers.step_codec import StepDecoder, StepEncoder


def _seq(request_id: str, spec: SamplingSpec, token: int) -> SeqWork:
    return SeqWork(request_id, [token], 100 + token, [], 0, True, spec, 2)


def _spec(n: int) -> SamplingSpec:
    return SamplingSpec(
        temperature=0.5 * n, seed=n, num_prompt_tokens=10 + n, logit_bias=((n, 1.0),)
    )


def test_decoded_steps_equal_the_encoded_with_each_spec_sent_once():
    encoder, decoder = StepEncoder(), StepDecoder()
    a, b, c = _spec(1), _spec(2), _spec(3)
    steps = [
        StepInput([_seq("a", a, 1), _seq("b", b, 2)]),
        StepInput([_seq("a", a, 3), _seq("b", b, 4)]),
        StepInput([_seq("b", b, 5), _seq("c", c, 6)], finished_request_ids=["a"]),
        # a re-run of part of a step, as the engine's isolation does: nothing sent again
        StepInput([_seq("c", c, 6)]),
        StepInput([_seq("c", c, 7)], finished_request_ids=["b"]),
        # "a" again, a new request with another spec
        StepInput([_seq("a", _spec(4), 8), _seq("c", c, 9)]),
    ]
    sizes = []
    for step in steps:
        data = encoder.encode(step)
        sizes.append(len(data))
        decoded = decoder.decode(data)
        assert decoded == step
        assert [s.sampling for s in decoded.seqs] == [s.sampling for s in step.seqs]
    plain = [len(pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL)) for s in steps]
    assert sizes[0] >= plain[0] - 16  # first steps carry their specs
    assert sizes[1] < plain[1] / 2  # both specs left out
    assert sizes[1] < sizes[0] / 2
    assert sizes[3] < sizes[2]  # c's spec went with step 2
    assert sizes[5] > sizes[4] * 1.5  # the new "a" carries its spec
    assert set(encoder.sent) == set(decoder.specs) == {"a", "c"}


def test_a_finished_request_is_forgotten_on_both_sides():
    encoder, decoder = StepEncoder(), StepDecoder()
    spec = _spec(5)
    decoder.decode(encoder.encode(StepInput([_seq("x", spec, 1)])))
    assert encoder.sent == decoder.specs == {"x": spec}
    decoder.decode(encoder.encode(StepInput([], finished_request_ids=["x"])))
    assert encoder.sent == decoder.specs == {}


def test_answers_read_back_equal_what_the_rank_answered():
    """A rank's answer by position (`encode_answer`) reads back with plain pickle.loads as the
    same StepOutput (every field, logprobs included), None, or StepFailure."""
    from workers.batch import SeqResult, StepFailure, StepOutput
    from workers.step_codec import encode_answer

    logprobs = [{"token_id": 7, "logprob": -0.25, "top": [(7, -0.25), (9, -1.5)]}]
    output = StepOutput(
        [
            SeqResult("a", [7], 0, [3, 4, 5], logprobs),
            SeqResult("b", [1, 2, 3], 2, []),
            SeqResult("c", []),
        ]
    )
    for answer in (output, StepOutput([]), None, StepFailure("RuntimeError: x")):
        assert pickle.loads(encode_answer(answer)) == answer
    # The codec lists SeqResult's fields by hand (a tuple of attributes is the fastest form
    # on this per-step path): it must name every one of them, in the dataclass's order.
    from dataclasses import fields

    from workers.step_codec import _AnswerPickler

    result = output.results[0]
    reduced = _AnswerPickler(io.BytesIO()).reducer_override(result)
    assert reduced == (SeqResult, tuple(getattr(result, f.name) for f in fields(SeqResult)))
    # Smaller than the dataclasses pickled by field name.
    assert len(encode_answer(output)) < len(pickle.dumps(output, pickle.HIGHEST_PROTOCOL))
