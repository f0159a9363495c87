"""MTP acceptance counters (`SpecDecodeStats`), the engine's cumulative counters
(`EngineCounters`) and what the engine yields to callers (`RequestOutput`). What one step
returns per request is the worker's `workers.batch.SeqResult`, which the scheduler consumes as
it crosses the actor boundary, with no copy into a type of ours.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from cluster.detokenizer import num_stop_holdback_chars

if TYPE_CHECKING:
    from cluster.request import Request


class Prefix(Sequence):
    """The first `len(items)` items (at the time it is made) of a list that only ever grows:
    an output's cumulative token ids or logprobs as they were at that output, without copying
    them all at every step (a copy per output made each request's host work grow with its
    length: quadratic over a long completion). Read-only; equal to a list or tuple of the same
    items, added to a list it gives a list (`prompt + out.token_ids`); pickles as a plain list;
    `list(prefix)` where a real list is needed (json)."""

    __slots__ = ("_items", "_length")

    def __init__(self, items: list) -> None:
        self._items = items
        self._length = len(items)

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._items[: self._length][index]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError("Prefix index out of range")
        return self._items[index]

    def __iter__(self):
        return itertools.islice(self._items, self._length)

    def __eq__(self, other) -> bool:
        if isinstance(other, (Prefix, list, tuple)):
            return len(other) == self._length and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # like the list it stands for

    def __add__(self, other):
        if isinstance(other, (Prefix, list)):
            return list(self) + list(other)
        return NotImplemented

    def __radd__(self, other):
        if isinstance(other, list):
            return other + list(self)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self):
        return list, (list(self),)


@dataclass
class SpecDecodeStats:
    """MTP acceptance counters for one request (or, after `merge`, many).

    A round is one verify step of a request past its prefill (with or without drafts). Draft
    position i counts as accepted in a round iff the first i+1 drafts all matched, so
    `num_accepted_per_position` is non-increasing. A *draft* (vLLM's `num_drafts`) is a round
    that verified at least one draft token: `num_proposed_per_position[0]`.
    """

    num_rounds: int = 0
    num_draft_tokens: int = 0  # drafts proposed (verified), all rounds
    num_accepted_drafts: int = 0
    num_proposed_per_position: list[int] = field(default_factory=list)
    num_accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_drafts: int) -> None:
        """Record one verify round that checked `num_draft_tokens` drafts.

        Proposed counts are raised before accepted ones, and `snapshot` reads them the other
        way round, so a snapshot taken from another thread mid-round still has accepted <=
        proposed everywhere."""
        if not 0 <= num_accepted_drafts <= num_draft_tokens:
            raise ValueError(f"accepted {num_accepted_drafts} of {num_draft_tokens} drafts")
        self.num_rounds += 1
        grow = num_draft_tokens - len(self.num_proposed_per_position)
        if grow > 0:
            self.num_proposed_per_position.extend([0] * grow)
            self.num_accepted_per_position.extend([0] * grow)
        self.num_draft_tokens += num_draft_tokens
        for i in range(num_draft_tokens):
            self.num_proposed_per_position[i] += 1
        self.num_accepted_drafts += num_accepted_drafts
        for i in range(num_accepted_drafts):
            self.num_accepted_per_position[i] += 1

    def snapshot(self) -> SpecDecodeStats:
        """A copy that may be taken while another thread observes (see `observe`)."""
        num_accepted_per_position = list(self.num_accepted_per_position)
        num_accepted_drafts = self.num_accepted_drafts
        num_proposed_per_position = list(self.num_proposed_per_position)
        num_draft_tokens = self.num_draft_tokens
        num_rounds = self.num_rounds
        # A list may have grown between the two copies: pad the accepted one.
        num_accepted_per_position += [0] * (
            len(num_proposed_per_position) - len(num_accepted_per_position)
        )
        return SpecDecodeStats(
            num_rounds,
            num_draft_tokens,
            num_accepted_drafts,
            num_proposed_per_position,
            num_accepted_per_position[: len(num_proposed_per_position)],
        )

    @property
    def num_drafts(self) -> int:
        """Rounds that verified at least one draft token."""
        return self.num_proposed_per_position[0] if self.num_proposed_per_position else 0

    def merge(self, other: SpecDecodeStats) -> None:
        """Add `other`'s counters into these (engine-wide totals)."""
        self.num_rounds += other.num_rounds
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_drafts += other.num_accepted_drafts
        grow = len(other.num_proposed_per_position) - len(self.num_proposed_per_position)
        if grow > 0:
            self.num_proposed_per_position.extend([0] * grow)
            self.num_accepted_per_position.extend([0] * grow)
        for i, (p, a) in enumerate(
            zip(other.num_proposed_per_position, other.num_accepted_per_position)
        ):
            self.num_proposed_per_position[i] += p
            self.num_accepted_per_position[i] += a

    @property
    def mean_tokens_per_round(self) -> float:
        """Tokens gained per round (accepted drafts + 1), averaged; 1.0 with MTP off or no
        rounds."""
        if self.num_rounds == 0:
            return 1.0
        return (self.num_accepted_drafts + self.num_rounds) / self.num_rounds

    @property
    def acceptance_per_position(self) -> list[float]:
        """Fraction of rounds proposing a draft at position i in which it was accepted."""
        return [
            a / p if p else 0.0
            for p, a in zip(self.num_proposed_per_position, self.num_accepted_per_position)
        ]


@dataclass
class EngineCounters:
    """What the engine did since it started, counted as it happens (every request a step
    changes and every output the engine builds passes through `observe`, which counts from the
    request's own state, so a request whose output waits is counted all the same), so aborted
    and failed requests count too. MTP rounds are
    counted by the scheduler at each step (`Scheduler.spec_stats`)."""

    num_prompt_tokens: int = 0  # of requests that produced their first token
    num_generation_tokens: int = 0  # output tokens, every request's
    num_finished: dict[str, int] = field(default_factory=dict)  # requests by finish_reason
    num_steps: int = 0  # steps that ran
    num_prefill_steps: int = 0  # of them, steps that carried a prompt (a chunk of one)
    step_time_s: float = 0.0  # wall time inside those steps: schedule, execute, outputs
    prefill_step_time_s: float = 0.0  # of it, inside the steps that carried a prompt

    def observe(self, request: Request) -> None:
        """Count what `request` gained since it was last observed (its tokens, its prompt's
        once its first token came, its finish once). Called for every request a step changes
        and every output built, whether or not an output goes with it."""
        num_new = len(request.output_token_ids) - request.num_counted_tokens
        if num_new > 0:
            if request.num_counted_tokens == 0:
                self.num_prompt_tokens += len(request.prompt_token_ids)  # prefill done
            self.num_generation_tokens += num_new
            request.num_counted_tokens += num_new
        if request.status.is_finished and not request.finish_counted:
            request.finish_counted = True
            reason = request.finish_reason or "unknown"
            self.num_finished[reason] = self.num_finished.get(reason, 0) + 1


@dataclass
class RequestOutput:
    """One update for a caller. `token_ids`, `text` and `logprobs` are cumulative over the
    completion; `new_token_ids`, `new_text` and `new_logprobs` are the deltas since the previous
    output for the same request. `finish_reason` is "stop" | "length" | "abort" | "error" once
    `finished`, else None.
    """

    request_id: str
    prompt_token_ids: list[int]
    # A list in a finished output; before that the engine's `Prefix` of the request's tokens
    # (a read-only sequence: one copy per request, not one per step).
    token_ids: Sequence[int]
    new_token_ids: list[int]
    text: str
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: Sequence[Any] | None = None  # as token_ids
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    spec: SpecDecodeStats | None = None
    error: str | None = None
    new_logprobs: list[Any] | None = None


def _advance(request: Request) -> tuple[str, int, list[int], list[Any] | None]:
    """The text and tokens not yet sent, and advance the request's sent-markers: -> (the text
    sendable now, new_text, new_token_ids, new_logprobs).

    While the request runs, trailing text that could be the start of a stop string is held
    back (it may yet be cut); once finished, everything left is released. Each token id and each
    character therefore appears in exactly one `new_*` delta.
    """
    text = request.output_text
    if request.status.is_finished:
        num_stable_chars = len(text)
    else:
        holdback = num_stop_holdback_chars(text, request.sampling_params.stop)
        num_stable_chars = len(text) - holdback
    # Never move the marker backwards (a cut at a stop string only shortens unsent text).
    num_stable_chars = max(num_stable_chars, request.num_sent_chars)
    new_text = text[request.num_sent_chars : num_stable_chars]
    new_token_ids = request.output_token_ids[request.num_sent_tokens :]
    new_logprobs = None
    if request.sampling_params.logprobs is not None:
        new_logprobs = request.output_logprobs[request.num_sent_tokens :]
    request.num_sent_chars = num_stable_chars
    request.num_sent_tokens = len(request.output_token_ids)
    return text[:num_stable_chars], new_text, new_token_ids, new_logprobs


def _cumulative(items: list | None, finished: bool) -> Sequence | None:
    """An output's cumulative list: a `Prefix` of it while the request runs, a copy once it
    has finished (what callers keep, serialize and extend)."""
    if items is None:
        return None
    return list(items) if finished else Prefix(items)


def make_request_output(request: Request) -> RequestOutput:
    """Build the next streaming update for `request` and advance its sent-markers (`_advance`
    says what is held back)."""
    text, new_text, new_token_ids, new_logprobs = _advance(request)
    logprobs = request.output_logprobs if new_logprobs is not None else None
    finished = request.status.is_finished
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=_cumulative(request.output_token_ids, finished),
        new_token_ids=new_token_ids,
        text=text,
        new_text=new_text,
        finished=request.status.is_finished,
        finish_reason=request.finish_reason,
        stop_reason=request.stop_reason,
        logprobs=_cumulative(logprobs, finished),
        num_prompt_tokens=len(request.prompt_token_ids),
        num_cached_tokens=request.num_cached_tokens,
        spec=request.spec_stats,
        error=request.error,
        new_logprobs=new_logprobs,
    )


class Delta:
    """Where each field sits in a delta: a RequestOutput's deltas as a plain tuple
    (`make_request_delta`), what the engine in its own process sends (cluster/engine_process.py).
    It leaves out what repeats everything before (the prompt, every token so far, the text so
    far): the receiver keeps those (`CumulativeOutput`). A plain tuple because it pickles fastest:
    128 of them in 17 us against 171 as RequestOutputs and 85 as a NamedTuple
    (`benchmarks/bench_engine_loop.py`, the 2-core box, BENCHMARKS.md)."""

    REQUEST_ID = 0
    NEW_TOKEN_IDS = 1
    NEW_TEXT = 2
    FINISHED = 3
    FINISH_REASON = 4
    STOP_REASON = 5
    NEW_LOGPROBS = 6
    NUM_PROMPT_TOKENS = 7
    NUM_CACHED_TOKENS = 8
    SPEC = 9
    ERROR = 10
    IS_FIRST = 11  # the request's first tokens are in this delta (its prefill is done)


def failure_delta(request_id: str, error: str) -> tuple:
    """The last delta of a request whose engine is gone (nothing more came from it)."""
    return (request_id, [], "", True, "error", None, None, 0, 0, None, error, False)


def make_request_delta(request: Request) -> tuple:
    """`make_request_output`'s deltas only, as a tuple laid out as `Delta` says."""
    _, new_text, new_token_ids, new_logprobs = _advance(request)
    return (
        request.request_id,
        new_token_ids,
        new_text,
        request.status.is_finished,
        request.finish_reason,
        request.stop_reason,
        new_logprobs,
        len(request.prompt_token_ids),
        request.num_cached_tokens,
        request.spec_stats,
        request.error,
        bool(new_token_ids) and len(new_token_ids) == len(request.output_token_ids),
    )


def join_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """Consecutive outputs of one request as one: the last one's cumulative fields, every
    delta concatenated in order (what a stream that fell behind the engine sends)."""
    last = outputs[-1]
    if len(outputs) == 1:
        return last
    new_logprobs = None
    if last.new_logprobs is not None:
        new_logprobs = [entry for out in outputs for entry in (out.new_logprobs or [])]
    return replace(
        last,
        new_token_ids=[t for out in outputs for t in out.new_token_ids],
        new_text="".join(out.new_text for out in outputs),
        new_logprobs=new_logprobs,
    )


class _Join:
    """A request's deltas as they come, taken as one: each `add` costs its deltas only.
    (Keeping the outputs to join later would keep each one's copy of the cumulative token ids
    and text: quadratic in the completion's length for a request held until it finishes.)"""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._last = None
        self._token_ids: list[int] = []
        self._text_parts: list[str] = []
        self._logprobs: list[Any] = []

    def __bool__(self) -> bool:
        return self._last is not None

    def _add(self, last, new_token_ids: list[int], new_text: str, new_logprobs) -> None:
        self._last = last
        self._token_ids.extend(new_token_ids)
        self._text_parts.append(new_text)
        self._logprobs.extend(new_logprobs or [])


class JoinedOutputs(_Join):
    """`join_outputs` of a request's RequestOutputs as they come."""

    def add(self, out: RequestOutput) -> None:
        self._add(out, out.new_token_ids, out.new_text, out.new_logprobs)

    def take(self) -> RequestOutput:
        """The join of every output added since the last `take` (at least one)."""
        last = self._last
        joined = replace(
            last,
            new_token_ids=self._token_ids,
            new_text="".join(self._text_parts),
            new_logprobs=self._logprobs if last.new_logprobs is not None else None,
        )
        self._reset()
        return joined


class JoinedDeltas(_Join):
    """A request's `make_request_delta` tuples as they come, taken as one delta (the last one's
    fields, every delta's new tokens, text and logprobs concatenated)."""

    def _reset(self) -> None:
        super()._reset()
        self._first = False

    def add(self, delta: tuple) -> None:
        self._add(
            delta, delta[Delta.NEW_TOKEN_IDS], delta[Delta.NEW_TEXT], delta[Delta.NEW_LOGPROBS]
        )
        self._first = self._first or delta[Delta.IS_FIRST]

    def take(self) -> tuple:
        joined = list(self._last)
        joined[Delta.NEW_TOKEN_IDS] = self._token_ids
        joined[Delta.NEW_TEXT] = "".join(self._text_parts)
        if joined[Delta.NEW_LOGPROBS] is not None:
            joined[Delta.NEW_LOGPROBS] = self._logprobs
        joined[Delta.IS_FIRST] = self._first
        self._reset()
        return tuple(joined)


class CumulativeOutput:
    """A request's cumulative fields (every token so far, the text so far, their logprobs),
    kept by the receiver of its deltas: each delta completed into a RequestOutput."""

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self._prompt_token_ids = prompt_token_ids
        self._token_ids: list[int] = []
        self._text = ""
        self._logprobs: list[Any] = []

    def complete(self, delta: tuple) -> RequestOutput:
        d = Delta
        new_token_ids, new_text = delta[d.NEW_TOKEN_IDS], delta[d.NEW_TEXT]
        new_logprobs = delta[d.NEW_LOGPROBS]
        self._token_ids.extend(new_token_ids)
        self._text += new_text
        if new_logprobs is not None:
            self._logprobs.extend(new_logprobs)
        finished = delta[d.FINISHED]
        return RequestOutput(
            request_id=delta[d.REQUEST_ID],
            prompt_token_ids=self._prompt_token_ids,
            token_ids=_cumulative(self._token_ids, finished),
            new_token_ids=new_token_ids,
            text=self._text,
            new_text=new_text,
            finished=delta[d.FINISHED],
            finish_reason=delta[d.FINISH_REASON],
            stop_reason=delta[d.STOP_REASON],
            logprobs=_cumulative(self._logprobs if new_logprobs is not None else None, finished),
            num_prompt_tokens=delta[d.NUM_PROMPT_TOKENS],
            num_cached_tokens=delta[d.NUM_CACHED_TOKENS],
            spec=delta[d.SPEC],
            error=delta[d.ERROR],
            new_logprobs=new_logprobs,
        )
