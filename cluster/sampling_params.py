"""Per-request sampling parameters and the error raised for bad user input.

`SamplingParams` is plain data: the scheduler reads the stop conditions (`max_tokens`, `stop`,
`stop_token_ids`, `ignore_eos`), the model runner reads the sampling knobs (`temperature`,
`top_p`, `top_k`, `seed`, `logprobs`). `validate()` is the one place user input is checked;
`deploy/` maps the `InvalidRequestError` it raises to an OpenAI-shaped 400.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this temperature sampling is argmax. Matches vLLM's _SAMPLING_EPS: dividing logits by a
# smaller temperature overflows fp16/bf16 logits without changing the argmax.
GREEDY_TEMPERATURE_EPS = 1e-5

# OpenAI's `top_logprobs` accepts 0..20; we keep the same bound so clients see the same limits.
MAX_LOGPROBS = 20


class InvalidRequestError(ValueError):
    """Bad user input; `param` names the offending field.

    deploy/ maps it to an OpenAI-shaped 400 whose `param` is this field.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def _is_int(value: object) -> bool:
    # bool is a subclass of int; `max_tokens=True` is a client bug, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """How to sample one completion and when to stop it.

    Invariants after `validate()`: `max_tokens >= 1`; `temperature >= 0`; `0 < top_p <= 1`;
    `top_k` is -1, 0 (both off) or >= 1; every stop string is non-empty; every stop token id and
    `top_k` lie inside the vocabulary when its size is known; `0 <= logprobs <= MAX_LOGPROBS`
    when set; `n >= 1`.
    """

    max_tokens: int = 16
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 => off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token; None = none
    n: int = 1
    skip_special_tokens: bool = True  # passed to the detokenizer

    def __post_init__(self) -> None:
        # OpenAI accepts `stop` as one string or a list; normalise once so readers see a list.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax: temperature (near) 0, or top_k == 1."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `InvalidRequestError(param=<field>)` on the first invalid field."""
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens"
            )
        if (
            not _is_number(self.temperature)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}",
                "temperature",
            )
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}", "top_p")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}", "top_k"
            )
        if vocab_size is not None and self.top_k > vocab_size:
            raise InvalidRequestError(
                f"top_k {self.top_k} exceeds the vocabulary size {vocab_size}", "top_k"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", "seed")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop must be a non-empty string or a list of them", "stop")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise InvalidRequestError(
                "stop_token_ids must be a list of non-negative integers", "stop_token_ids"
            )
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"stop_token_ids {bad} are outside the vocabulary (size {vocab_size})",
                    "stop_token_ids",
                )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos must be a boolean", "ignore_eos")
        if self.logprobs is not None:
            if not _is_int(self.logprobs) or not (0 <= self.logprobs <= MAX_LOGPROBS):
                raise InvalidRequestError(
                    f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
                    "logprobs",
                )
        if not _is_int(self.n) or self.n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {self.n!r}", "n")
