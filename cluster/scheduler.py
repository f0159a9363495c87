"""Continuous-batching scheduler with chunked prefill, MTP verify steps and preemption by
recompute. Plain Python: no torch.

One engine step is `schedule()` -> execute on the workers -> `update(results)`.

`schedule()` picks, under a per-step token budget and `max_num_seqs`:
1. running requests past their prefill (decodes), oldest first: each computes the KV of its last
   sampled token plus its drafts (`1 + k` tokens, the verify step);
2. running requests still prefilling (a chunk each), oldest first;
3. waiting requests (preempted ones at the front), in order, chunked to the remaining budget;
   each first takes the longest prefix of its tokens the block manager has cached (prefix
   caching), and its prefill starts after it.
A running request that cannot get its KV blocks preempts the most recently arrived running
request that is younger than it and not yet scheduled this step; when none is left a decode
preempts itself and a prefill chunk waits (keeping its blocks), and no new request is admitted
that step. Preemption is by recompute: blocks freed, `num_computed_tokens = 0`,
drafts dropped, back to the front of the waiting queue; it later prefills prompt + outputs.

A step that samples also owns `k - 1` lookahead slots past its last token: MTP draft steps
1..k-1 write the MTP layer's caches there. `update()` rolls them back with rejected drafts, so
between steps a request owns exactly the blocks of its computed KV. Without MTP, where steps
overlap (`EngineConfig.overlap_steps`), it owns one slot more, kept between steps: the next
decode's, which a rank launches before this step's token is read.

Progress guarantee: the config requires one request of `max_model_len` tokens (plus lookahead)
to fit in the pool and (without chunked prefill) in one step's budget, so the oldest running
request can always run once everything younger is preempted.

Requests that can never run (prompt longer than `max_model_len`, or empty) are rejected at
`add()` with `InvalidRequestError(param="prompt")`; FINISHED_ERROR is left for engine failures.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from cluster.block_manager import BlockManager
from cluster.config import EngineConfig, lookahead_slots
from cluster.detokenizer import IncrementalDetokenizer, find_stop_string, stop_search_start
from cluster.outputs import SpecDecodeStats
from cluster.request import Request, RequestStatus
from cluster.sampling_params import InvalidRequestError
from workers.batch import SeqResult


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Scheduling limits. Invariants (checked): `max_num_batched_tokens >= max_num_seqs` so every
    running decode gets at least its one token each step; `max_num_batched_tokens >= 1 + k`;
    without chunked prefill, `max_num_batched_tokens >= max_model_len` so any prompt fits a step.
    """

    num_blocks: int
    max_model_len: int
    max_num_seqs: int = EngineConfig.default("max_num_seqs")
    # per-step token budget
    max_num_batched_tokens: int = EngineConfig.default("max_num_batched_tokens")
    num_draft_tokens: int = 0  # k; 0 = MTP off
    block_size_tokens: int = EngineConfig.default("block_size_tokens")
    enable_chunked_prefill: bool = True
    # As the engine's (EngineConfig.overlap_steps): whether requests own the lookahead slot of
    # a decode launched ahead. Off here: a scheduler alone has no ranks.
    overlap_steps: str = "off"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.num_draft_tokens < 0:
            raise ValueError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens < max(self.max_num_seqs, 1 + self.num_draft_tokens):
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_num_seqs "
                f"({self.max_num_seqs}) and >= 1 + num_draft_tokens ({1 + self.num_draft_tokens})"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Invariants: `token_ids == all_token_ids[start_position : start_position + n] + drafts`
    where the last `num_draft_tokens` entries are drafts (verify; only when not prefill);
    `start_position == request.num_computed_tokens` at schedule time; the request owns slots
    for every position in `[0, start_position + len(token_ids))`.
    """

    request: Request
    token_ids: list[int]  # tokens whose KV this step computes, in order
    start_position: int  # position of token_ids[0]
    is_prefill: bool  # True while the prompt (or a recompute after preemption) is being filled
    samples: bool  # True when this step produces new tokens (decode, or the final prefill chunk)
    num_draft_tokens: int  # drafts included at the end of token_ids (verify); 0 for prefill

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class SchedulerOutput:
    """Invariant: `num_batched_tokens == sum(len(s.token_ids)) <= max_num_batched_tokens`."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes first, then prefills
    preempted_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting queue, the running set and (through the block manager) the KV blocks.

    `tokenizer`, when given, builds each request's `IncrementalDetokenizer` at `add()` (needed
    for stop strings and `output_text`); a request may instead arrive with its own.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager | None = None,
        tokenizer: object | None = None,
    ):
        self.config = config
        self.block_manager = block_manager or BlockManager(
            config.num_blocks, config.block_size_tokens
        )
        if self.block_manager.block_size_tokens != config.block_size_tokens:
            raise ValueError("block manager and config disagree on block_size_tokens")
        # The largest step of one request: a max_model_len prefill plus the lookahead.
        max_request_slots = config.max_model_len + lookahead_slots(
            config.num_draft_tokens, config.overlap_steps
        )
        if self.block_manager.capacity_tokens < max_request_slots:
            raise ValueError(
                f"the KV pool holds {self.block_manager.capacity_tokens} tokens, fewer than "
                f"max_model_len={config.max_model_len} + {max_request_slots - config.max_model_len}"
                " lookahead slots: a long request could never run"
            )
        self.tokenizer = tokenizer
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}  # unfinished only
        self._order: dict[str, int] = {}  # add order; breaks arrival_time ties
        self._next_order = itertools.count()
        # Every verify round of every request, counted here at the step (so an aborted
        # request's rounds count too); a request's own rounds are in `request.spec_stats`.
        self.spec_stats = SpecDecodeStats()

    # ---- queue state -----------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def _arrival_key(self, request: Request) -> tuple[float, int]:
        return (request.arrival_time, self._order[request.request_id])

    # ---- add / abort -----------------------------------------------------------------------

    def add(self, request: Request) -> None:
        """Queue a request. Raises InvalidRequestError for input that could never run."""
        if request.request_id in self._requests:
            raise InvalidRequestError(f"duplicate request id {request.request_id}", "request_id")
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if num_prompt > self.config.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {num_prompt} tokens, more than max_model_len="
                f"{self.config.max_model_len}",
                "prompt",
            )
        request.sampling_params.validate()
        if request.detokenizer is None and self.tokenizer is not None:
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                skip_special_tokens=request.sampling_params.skip_special_tokens,
            )
        if request.sampling_params.stop and request.detokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer on the server", "stop")
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self._order[request.request_id] = next(self._next_order)
        self.waiting.append(request)

    def abort(self, request_id: str) -> Request | None:
        """Cancel a request; frees its blocks. None if unknown or already finished."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.draft_token_ids = []
        self.block_manager.free(request)
        self._requests.pop(request.request_id, None)
        self._order.pop(request.request_id, None)

    # ---- schedule --------------------------------------------------------------------------

    def _max_new_tokens(self, request: Request) -> int:
        """Tokens the request may still gain before max_tokens / max_model_len stops it."""
        return min(
            request.sampling_params.max_tokens - request.num_output_tokens,
            self.config.max_model_len - request.num_tokens,
        )

    @property
    def _num_lookahead_slots(self) -> int:
        """Slots past the verified tokens that MTP draft steps 1..k-1 write (positions of the
        drafts they feed back), or that the next decode launched ahead writes (MTP off), so a
        step that samples owns them too (`cluster.config.lookahead_slots`)."""
        return lookahead_slots(self.config.num_draft_tokens, self.config.overlap_steps)

    @property
    def _num_kept_lookahead_slots(self) -> int:
        """Lookahead slots a request keeps between steps: the next decode's, which a rank may
        have launched before this step's tokens were read (MTP off, steps overlapping). MTP's
        are written within the step and rolled back with rejected drafts."""
        return self._num_lookahead_slots if self.config.num_draft_tokens == 0 else 0

    def _prefill_slots(
        self, request: Request, num_chunk_tokens: int, start: int | None = None
    ) -> int:
        end = (request.num_computed_tokens if start is None else start) + num_chunk_tokens
        return end + (self._num_lookahead_slots if end == request.num_tokens else 0)

    def _max_drafts(self, request: Request) -> int:
        # A verify with k drafts can gain k + 1 tokens; more drafts than that are wasted work.
        if self.config.num_draft_tokens == 0:  # MTP off: twice per request per step, so cheaply
            return 0
        return max(0, min(self.config.num_draft_tokens, self._max_new_tokens(request) - 1))

    def _preempt(self, request: Request, output: SchedulerOutput) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.draft_token_ids = []
        # Recompute everything known, and sample again only at the end of it.
        request.num_prefill_tokens = request.num_tokens
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        output.preempted_ids.append(request.request_id)

    def _make_room(
        self,
        request: Request,
        num_slots: int,
        scheduled_ids: set[str],
        output: SchedulerOutput,
    ) -> bool:
        """Preempt the youngest unscheduled running requests younger than `request` until it
        can hold `num_slots`. Returns False when no such request is left.

        Only younger ones: an older request keeps its progress, so the oldest running request
        can always advance and the system cannot livelock."""
        own_key = self._arrival_key(request)
        while not self.block_manager.can_allocate(request, num_slots):
            candidates = [
                r
                for r in self.running
                if r.request_id not in scheduled_ids and self._arrival_key(r) > own_key
            ]
            if not candidates:
                return False
            self._preempt(max(candidates, key=self._arrival_key), output)
        return True

    def _prefill_chunk(self, request: Request, budget_tokens: int, start: int | None = None) -> int:
        """Tokens of the prefill to compute this step from `start` (default: the computed
        ones); 0 if it must wait."""
        start = request.num_computed_tokens if start is None else start
        num_remaining = request.num_prefill_tokens - start
        if self.config.enable_chunked_prefill:
            return min(num_remaining, budget_tokens)
        return num_remaining if num_remaining <= budget_tokens else 0

    def _schedule_prefill(self, request: Request, num_chunk_tokens: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_chunk_tokens
        samples = end == request.num_tokens
        self.block_manager.allocate(request, self._prefill_slots(request, num_chunk_tokens))
        return ScheduledRequest(
            request=request,
            token_ids=request.token_slice(start, end),
            start_position=start,
            is_prefill=True,
            samples=samples,
            num_draft_tokens=0,
        )

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget_tokens = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        blocked_on_kv = False  # a running request lacked blocks: admit no one new this step

        self.running.sort(key=self._arrival_key)
        decodes = [r for r in self.running if not r.is_prefilling]
        prefills = [r for r in self.running if r.is_prefilling]

        # 1. Decodes (verify steps), oldest first.
        for index, request in enumerate(decodes):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted by an older request in this loop
            # Leave one token of budget for each younger decode; drafts take what remains.
            num_younger = len(decodes) - index - 1
            num_drafts = min(
                len(request.draft_token_ids),
                self._max_drafts(request),
                budget_tokens - 1 - num_younger,
            )
            num_drafts = max(0, num_drafts)
            if budget_tokens < 1:
                break
            start = request.num_computed_tokens
            num_slots = start + 1 + num_drafts + self._num_lookahead_slots
            # Most decode steps fit the blocks the request holds: nothing to make room for.
            if self.block_manager.num_new_blocks_needed(request, num_slots):
                if not self._make_room(request, num_slots, scheduled_ids, output):
                    self._preempt(request, output)
                    blocked_on_kv = True
                    continue
                self.block_manager.allocate(request, num_slots)
            token_ids = [request.last_token_id] + request.draft_token_ids[:num_drafts]
            output.scheduled.append(
                ScheduledRequest(
                    request=request,
                    token_ids=token_ids,
                    start_position=start,
                    is_prefill=False,
                    samples=True,
                    num_draft_tokens=num_drafts,
                )
            )
            scheduled_ids.add(request.request_id)
            budget_tokens -= len(token_ids)

        # 2. Running requests part-way through a chunked prefill, oldest first.
        for request in prefills:
            if request.status is not RequestStatus.RUNNING:
                continue
            num_chunk = self._prefill_chunk(request, budget_tokens)
            if num_chunk == 0:
                break
            num_slots = self._prefill_slots(request, num_chunk)
            if not self._make_room(request, num_slots, scheduled_ids, output):
                # Everyone younger is gone; older requests will finish and free blocks.
                blocked_on_kv = True
                continue
            output.scheduled.append(self._schedule_prefill(request, num_chunk))
            scheduled_ids.add(request.request_id)
            budget_tokens -= num_chunk

        # 3. Waiting and preempted requests, in queue order (FCFS: stop at the first misfit).
        while self.waiting and not blocked_on_kv and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.request_id in output.preempted_ids:
                break  # preempted this very step: its blocks went to someone else
            cached_block_ids = self.block_manager.lookup(request)
            num_cached = len(cached_block_ids) * self.config.block_size_tokens
            num_chunk = self._prefill_chunk(request, budget_tokens, num_cached)
            if num_chunk == 0:
                break
            num_slots = self._prefill_slots(request, num_chunk, num_cached)
            if not self.block_manager.can_acquire_and_allocate(
                request, cached_block_ids, num_slots
            ):
                break
            self.waiting.popleft()
            request.num_computed_tokens = self.block_manager.acquire(request, cached_block_ids)
            if request.num_preemptions == 0:
                request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            output.scheduled.append(self._schedule_prefill(request, num_chunk))
            scheduled_ids.add(request.request_id)
            budget_tokens -= num_chunk

        output.num_batched_tokens = self.config.max_num_batched_tokens - budget_tokens
        return output

    # ---- update ----------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, results: dict[str, SeqResult]) -> list[Request]:
        """Apply one step's results; returns the requests that gained tokens or finished.

        Requests aborted between `schedule()` and `update()` and requests without a result
        are skipped (a missing result leaves the request to be rescheduled as it was).
        """
        changed: list[Request] = []
        for scheduled in output.scheduled:
            request = scheduled.request
            result = results.get(request.request_id)
            if request.status is not RequestStatus.RUNNING or result is None:
                continue
            num_rejected = scheduled.num_draft_tokens - result.num_accepted_drafts
            if num_rejected < 0:
                raise ValueError(
                    f"{request.request_id}: {result.num_accepted_drafts} drafts accepted of "
                    f"{scheduled.num_draft_tokens} scheduled"
                )
            request.num_computed_tokens += len(scheduled.token_ids) - num_rejected
            # Slots of rejected drafts hold stale KV; give back blocks wholly past the prefix
            # (without MTP, past the slot of the next decode, which may already be running).
            self.block_manager.truncate(
                request, request.num_computed_tokens + self._num_kept_lookahead_slots
            )
            self.block_manager.cache_final_blocks(request)
            if not scheduled.samples:
                continue
            if not scheduled.is_prefill:
                request.spec_stats.observe(scheduled.num_draft_tokens, result.num_accepted_drafts)
                self.spec_stats.observe(scheduled.num_draft_tokens, result.num_accepted_drafts)
            if len(result.sampled_token_ids) != result.num_accepted_drafts + 1:
                raise ValueError(
                    f"{request.request_id}: {len(result.sampled_token_ids)} sampled tokens for "
                    f"{result.num_accepted_drafts} accepted drafts"
                )
            self._append_tokens(request, result)
            if request.is_finished:
                self.running.remove(request)
                self._finish(request, request.status)
            else:
                request.draft_token_ids = list(
                    result.next_draft_token_ids[: self._max_drafts(request)]
                )
            changed.append(request)
        return changed

    def _append_tokens(self, request: Request, result: SeqResult) -> None:
        """Append sampled tokens one at a time, stopping at the first stop condition; tokens
        after the stopping one are discarded. Sets `request.status` when it finishes.

        Order of checks per token: EOS (unless ignore_eos), stop_token_ids, max_tokens /
        max_model_len, stop strings (only past `min_tokens`; the worker masks EOS and stop
        token ids before it). EOS and stop-token ids are kept in `output_token_ids` but
        their text is not added to `output_text`.
        """
        params = request.sampling_params
        detokenizer = request.detokenizer
        for i, token_id in enumerate(result.sampled_token_ids):
            request.output_token_ids.append(token_id)
            if result.logprobs is not None and i < len(result.logprobs):
                request.output_logprobs.append(result.logprobs[i])
            if not params.ignore_eos and token_id in request.eos_token_ids:
                request.stop_reason = token_id
                request.status = RequestStatus.FINISHED_STOPPED
                return
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                request.status = RequestStatus.FINISHED_STOPPED
                return
            num_old_chars = len(request.output_text)
            if detokenizer is not None:
                detokenizer.append(token_id)
                request.output_text = detokenizer.text
            if (
                request.num_output_tokens >= params.max_tokens
                or request.num_tokens >= self.config.max_model_len
            ):
                request.status = RequestStatus.FINISHED_LENGTH
                return
            if (
                params.stop
                and len(request.output_text) > num_old_chars
                and request.num_output_tokens >= params.min_tokens
            ):
                match = find_stop_string(
                    request.output_text,
                    params.stop,
                    stop_search_start(num_old_chars, params.stop),
                )
                if match is not None:
                    index, stop = match
                    request.output_text = request.output_text[:index]
                    request.stop_reason = stop
                    request.status = RequestStatus.FINISHED_STOPPED
                    return
