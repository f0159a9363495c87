"""A step's bytes on the socket transport: each request's SamplingSpec sent once, not every step.

A request's spec never changes while it runs, and pickling it is half of a decode step's
StepInput (13 fields by name, per request per step: BENCHMARKS.md, session 32). The coordinator's
`StepEncoder` sends a request's spec with its first step and after that the SeqWork without it;
each rank's `StepDecoder` keeps the specs it was sent by request id and puts them back. Both
forget a request when a step names it finished. The two stay in step because every rank decodes
every step the encoder wrote, in order, before it runs it; a rank that cannot is gone (its
socket closes) and the engine is rebuilt with new ranks and a new encoder. A rank's answer goes
back with each SeqResult by position (`encode_answer`), which plain pickle.loads reads.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass

from workers.batch import SamplingSpec, SeqResult, SeqWork, StepInput

PROTOCOL = pickle.HIGHEST_PROTOCOL


@dataclass(frozen=True)
class RankCall:
    """A call of a rank's method between two steps, on the same socket as the steps (its warm-up
    and health check, when the process that steps the ranks is not the one that holds their Ray
    handles: cluster/step_sockets.py). Pickled as it is; the decoder passes it through."""

    name: str
    args: tuple = ()

    def encode(self) -> bytes:
        return pickle.dumps(self, protocol=PROTOCOL)


def _seq_without_spec(
    request_id, token_ids, start_position, block_ids, num_draft_tokens, samples, table_start
) -> SeqWork:
    return SeqWork(
        request_id,
        token_ids,
        start_position,
        block_ids,
        num_draft_tokens,
        samples,
        None,  # the decoder puts the request's spec back
        table_start,
    )


class _Pickler(pickle.Pickler):
    def __init__(self, file, sent: dict[str, SamplingSpec]):
        super().__init__(file, protocol=PROTOCOL)
        self.sent = sent

    def reducer_override(self, obj):
        if type(obj) is not SeqWork:
            return NotImplemented
        if self.sent.get(obj.request_id) is not obj.sampling:
            self.sent[obj.request_id] = obj.sampling
            return NotImplemented  # the whole SeqWork, its spec included
        return _seq_without_spec, (
            obj.request_id,
            obj.token_ids,
            obj.start_position,
            obj.block_ids,
            obj.num_draft_tokens,
            obj.samples,
            obj.block_table_start,
        )


class StepEncoder:
    """The coordinator's side: the specs its ranks hold, by request id."""

    def __init__(self):
        self.sent: dict[str, SamplingSpec] = {}

    def encode(self, step: StepInput) -> bytes:
        out = io.BytesIO()
        _Pickler(out, self.sent).dump(step)
        for request_id in step.finished_request_ids:
            self.sent.pop(request_id, None)
        return out.getvalue()


class StepDecoder:
    """A rank's side: the specs it was sent, by request id."""

    def __init__(self):
        self.specs: dict[str, SamplingSpec] = {}

    def decode(self, data: bytes) -> StepInput | RankCall:
        step = pickle.loads(data)
        if isinstance(step, RankCall):
            return step
        for seq in step.seqs:
            if seq.sampling is None:
                seq.sampling = self.specs[seq.request_id]
            else:
                self.specs[seq.request_id] = seq.sampling
        for request_id in step.finished_request_ids:
            self.specs.pop(request_id, None)
        return step


class _AnswerPickler(pickle.Pickler):
    def reducer_override(self, obj):
        if type(obj) is not SeqResult:
            return NotImplemented
        return SeqResult, (  # its fields in their order: SeqResult(*args) rebuilds it
            obj.request_id,
            obj.sampled_token_ids,
            obj.num_accepted_drafts,
            obj.next_draft_token_ids,
            obj.logprobs,
        )


def encode_answer(answer) -> bytes:
    """A rank's answer to a step (its StepOutput, None or a StepFailure) for the socket: each
    SeqResult by position, not as a dataclass's fields by name (pickle.loads reads it back;
    ~40% less time both ways at 128 requests)."""
    out = io.BytesIO()
    _AnswerPickler(out, protocol=PROTOCOL).dump(answer)
    return out.getvalue()
