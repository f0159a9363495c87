"""Per-request sampling parameters and the error raised for bad user input.

`SamplingParams` is plain data: the scheduler reads the stop conditions (`max_tokens`, `stop`,
`stop_token_ids`, `ignore_eos`, `min_tokens`), the model runner reads the sampling knobs
(`temperature`, `top_p`, `top_k`, `seed`, `logprobs`) and the logits processors
(`logit_bias`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `min_tokens`).
`validate()` is the one place user input is checked, to what the engine can really run;
`deploy/` maps the `InvalidRequestError` it raises to an OpenAI-shaped 400.

Seed policy: a seed is any integer in the signed 64-bit range (OpenAI's schema for `seed`);
anything else is refused. Choice `i` of a seeded request uses `choice_seed(seed, i)`, which
wraps inside that range, so every choice seed is valid; the worker seeds its generator with the
seed modulo 2**64 (`workers.sampler.generator_seed`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Below this temperature sampling is argmax. Matches vLLM's _SAMPLING_EPS: dividing logits by a
# smaller temperature overflows fp16/bf16 logits without changing the argmax.
GREEDY_TEMPERATURE_EPS = 1e-5

# OpenAI's `top_logprobs` accepts 0..20; we keep the same bound so clients see the same limits.
MAX_LOGPROBS = 20

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# OpenAI's ranges: penalties in [-2, 2], a logit bias in [-100, 100].
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024  # each one is a scatter per sampled row
MAX_REPETITION_PENALTY = 10.0


def choice_seed(seed: int, choice_index: int) -> int:
    """The seed of choice `choice_index` of a request seeded with `seed`: `seed + i`, wrapped
    into [SEED_MIN, SEED_MAX] (two's complement), so `seed = 2**63 - 1` with `n = 2` is valid."""
    return (seed + choice_index - SEED_MIN) % 2**64 + SEED_MIN


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
    `top_k` is -1, 0 (both off) or >= 1; `seed` in [SEED_MIN, SEED_MAX] when set; every stop
    string is non-empty; every stop token id, logit-bias token id and `top_k` lie inside the
    vocabulary when its size is known; `0 <= logprobs <= MAX_LOGPROBS` when set; `n >= 1`;
    penalties finite, `|presence|, |frequency| <= 2`, `0 < repetition <= 10`;
    `0 <= min_tokens <= max_tokens`; logit biases finite in [-100, 100].
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
    # Logits processors (workers.logits_processors): OpenAI's, then vLLM's extensions.
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # CTRL's: divides positive, multiplies negative logits
    min_tokens: int = 0  # EOS and stop tokens are masked, stop strings unchecked, before this

    def __post_init__(self) -> None:
        # OpenAI accepts `stop` as one string or a list; normalise once so readers see a list.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.logit_bias is None:
            self.logit_bias = {}

    @property
    def has_logits_processors(self) -> bool:
        """True when the sampled distribution is not the model's alone."""
        from workers.batch import uses_logits_processors

        return uses_logits_processors(self)

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
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError(
                f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}", "seed"
            )
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
        self._validate_logits_processors(vocab_size)

    def _validate_logits_processors(self, vocab_size: int | None) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise InvalidRequestError(
                    f"{name} must be a number in [-2, 2], got {value!r}", name
                )
        r = self.repetition_penalty
        if not _is_number(r) or not 0.0 < r <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {r!r}",
                "repetition_penalty",
            )
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}",
                "min_tokens",
            )
        bias = self.logit_bias
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(
                f"logit_bias must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to numbers",
                "logit_bias",
            )
        for token_id, value in bias.items():
            if (
                not _is_int(token_id)
                or token_id < 0
                or (vocab_size is not None and token_id >= vocab_size)
            ):
                raise InvalidRequestError(
                    f"logit_bias: token id {token_id!r} is not in the vocabulary"
                    + (f" (size {vocab_size})" if vocab_size is not None else ""),
                    "logit_bias",
                )
            if not _is_number(value) or not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias: the bias of token {token_id} must be a number in [-100, 100], "
                    f"got {value!r}",
                    "logit_bias",
                )
