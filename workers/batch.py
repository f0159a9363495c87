"""The worker's step contract: what the coordinator sends each rank, and what rank 0 returns.

Plain dataclasses of Python lists (no tensors), so they cross Ray actor boundaries cheaply and
every rank builds identical device tensors from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property


def uses_logits_processors(sampling) -> bool:
    """Whether `sampling` (SamplingSpec here, or the request's SamplingParams) asks for any
    logits processor, so that the sampled distribution is not the model's alone."""
    return bool(
        sampling.logit_bias
        or sampling.presence_penalty
        or sampling.frequency_penalty
        or sampling.repetition_penalty != 1.0
        or sampling.min_tokens
    )


@dataclass(frozen=True)
class SamplingSpec:
    """The part of a request's sampling parameters the device needs."""

    temperature: float = 0.0  # 0 => greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 => off
    seed: int | None = None
    num_logprobs: int | None = None  # None => no logprobs
    # Logits processors (workers.logits_processors), applied before temperature/top-k/top-p.
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # over prompt and output tokens; 1 => off
    min_tokens: int = 0  # `min_tokens_masked_ids` are masked until the output is this long
    min_tokens_masked_ids: tuple[int, ...] = ()  # EOS (unless ignored) and stop token ids
    num_prompt_tokens: int = 0  # where the output starts (penalties count output tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @cached_property  # read per request per step; the spec never changes
    def has_logits_processors(self) -> bool:
        return uses_logits_processors(self)

    @property
    def decided_by_argmax(self) -> bool:
        """Greedy with no logits processors: its token is the argmax of the model's logits."""
        return self.greedy and not self.has_logits_processors


@dataclass
class SeqWork:
    """One request's share of a step."""

    request_id: str
    token_ids: list[int]  # tokens whose KV this step computes, in order
    start_position: int  # position of token_ids[0]
    # The request's block table from entry `block_table_start` on. The entries before it are
    # the ones the runner already holds from this request's earlier steps (a decode step sends
    # the blocks allocated since the last, most often none); 0 sends the whole table.
    block_ids: list[int]
    num_draft_tokens: int  # drafts at the end of token_ids (a verify); 0 for prefill
    samples: bool  # this step emits tokens (decode, or the prompt's last chunk)
    sampling: SamplingSpec = field(default_factory=SamplingSpec)
    block_table_start: int = 0


def verify_rows(seqs: list[SeqWork]) -> int | None:
    """q when every sequence samples all of its q tokens' logits (its last token and q - 1
    drafts: a step of decodes, or of verifies of equal length), else None."""
    q = len(seqs[0].token_ids)
    if all(s.samples and len(s.token_ids) == q == 1 + s.num_draft_tokens for s in seqs):
        return q
    return None


def carries_only_prompts(seqs: list[SeqWork]) -> bool:
    """Every sequence of the step computes prompt tokens (prefill chunks, or a preempted
    request's recompute), none a decode or a verify: no drafts, and each either samples nothing
    (a chunk before the last) or computes more than the one token a decode does. A last chunk
    of one token reads as a decode: such a step counts as not prompt-only, which errs towards
    the decode kernels."""
    return all(s.num_draft_tokens == 0 and (not s.samples or len(s.token_ids) > 1) for s in seqs)


@dataclass
class StepInput:
    seqs: list[SeqWork]
    num_draft_tokens: int = 0  # k: drafts the MTP layer proposes for the next round
    share_topk: bool = False  # draft steps 1..k-1 reuse draft step 0's top-k row
    finished_request_ids: list[str] = field(default_factory=list)  # drop per-request state
    # Preempted this step: a pending MTP hidden state of theirs belongs to a computation that
    # was thrown away (and, after a prefix-cache hit, its pair's row lies in a shared block).
    preempted_request_ids: list[str] = field(default_factory=list)


@dataclass
class SeqResult:
    """Rank 0's answer for one scheduled request after one step.

    Invariants: when the step `samples`, `sampled_token_ids` holds the accepted drafts followed
    by the target's own token, so `len(sampled_token_ids) == num_accepted_drafts + 1`; for a
    non-final prefill chunk it is `[]` and `num_accepted_drafts == 0`. `next_draft_token_ids`
    holds the MTP layer's proposal for the next round (`[]` when MTP is off). `logprobs`, when
    requested, has one entry per sampled token:
    {"token_id", "logprob", "top": [(token_id, logprob), ...]}.
    """

    request_id: str
    sampled_token_ids: list[int] = field(default_factory=list)
    num_accepted_drafts: int = 0
    next_draft_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None


@dataclass
class StepOutput:
    results: list[SeqResult]


@dataclass
class StepFailure:
    """A rank's answer to a step whose code raised there, where raising is not an option: in a
    Ray Compiled Graph a raise reaches the driver before the other ranks have finished the step
    (cluster/ray_executor.py)."""

    error: str  # "ExceptionType: message"
