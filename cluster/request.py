"""One request's state as the scheduler sees it. Plain Python: no torch.

Lifecycle: WAITING -> RUNNING <-> PREEMPTED (recompute) -> FINISHED_*.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cluster.outputs import SpecDecodeStats
from cluster.sampling_params import SamplingParams
from workers.batch import SamplingSpec

if TYPE_CHECKING:
    from cluster.detokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()  # client cancelled
    FINISHED_ERROR = enum.auto()  # the engine failed this request (never used for bad input)

    # Members are singletons compared by identity: hash them by identity too, in C, instead of
    # Enum's `hash(self._name_)` in Python (looked up per request per step: `is_finished`).
    __hash__ = object.__hash__

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-shaped reason: "stop" | "length" | "abort" | "error"; None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    """A prompt, its completion so far, and where its KV lives.

    Invariants:
    - `num_computed_tokens <= num_tokens`: the KV of `all_token_ids[:num_computed_tokens]` is in
      the cache (positions 0..num_computed_tokens-1), in slots of `block_ids`.
    - Past its prefill a running request has `num_computed_tokens == num_tokens - 1`: the last
      sampled token's KV is written by the next (verify) step.
    - `draft_token_ids` are MTP proposals to follow `all_token_ids[-1]`; they are not part of
      `output_token_ids` until verified. `[]` when none (MTP off, or dropped on preemption).
    - `num_prefill_tokens`: the prefill (or, after preemption, the recompute) is complete once
      `num_computed_tokens >= num_prefill_tokens`.
    - Prefix caching: `block_keys[b]` names full block b's content (see
      `cluster.block_manager.block_key`; tokens only grow, so a key never changes once known);
      the first `num_final_blocks` of `block_ids` hold final rows in every cache and were
      offered to the cache; `num_cached_tokens` is how many prompt tokens the first admission
      took from the cache (what `usage.prompt_tokens_details.cached_tokens` reports).
    - `output_text` never contains EOS / stop-token text or a stop string or anything after it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: set[int] = field(default_factory=set)
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # The first entries of `block_ids` the workers hold as they are now: sent with an earlier
    # step and not dropped since (`BlockManager.truncate`). A step sends only the rest.
    num_blocks_sent: int = 0
    output_text: str = ""
    stop_reason: str | int | None = None  # the stop string or stop/EOS token id that matched
    num_preemptions: int = 0
    error: str | None = None
    output_logprobs: list[Any] = field(default_factory=list)
    spec_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    detokenizer: IncrementalDetokenizer | None = None
    block_keys: list[bytes] = field(default_factory=list)
    num_final_blocks: int = 0
    num_cached_tokens: int = 0
    # What the device needs of sampling_params (built once when the engine admits the request).
    sampling_spec: SamplingSpec = field(default_factory=SamplingSpec)
    num_prefill_tokens: int = -1  # set to len(prompt) in __post_init__, num_tokens on preemption
    # Streaming markers, advanced by `cluster.outputs.make_request_output`.
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    # What `cluster.outputs.EngineCounters` has counted of this request.
    num_counted_tokens: int = 0
    finish_counted: bool = False

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.eos_token_ids = set(self.eos_token_ids)
        if self.num_prefill_tokens < 0:
            self.num_prefill_tokens = len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_prefilling(self) -> bool:
        """True until the prompt (or the recompute after a preemption) is fully in the cache."""
        return self.num_computed_tokens < self.num_prefill_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def token_slice(self, start: int, end: int) -> list[int]:
        """`all_token_ids[start:end]` without copying the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]
