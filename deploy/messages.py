"""Typed messages between the ingress and the model-server deployment.

An engine error is sent back as a `GenerateFailure` item in the stream rather than a raised
exception: Serve wraps raised exceptions in `RayTaskError`, and the ingress needs the HTTP status
before it sends the first byte, so the mapping from engine error to status lives in one place
(`model_server.failure_from_exception`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cluster.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # False: the caller wants the whole completion only, and the model server sends it as one
    # chunk (or one failure) when the request finishes.
    stream: bool = True


@dataclasses.dataclass(frozen=True)
class GenerateChunk:
    """What one engine request produced since the previous chunk: deltas only, so a message
    stays small however long the prompt or the completion (a `RequestOutput` carries the prompt
    and everything generated so far). Each token, character and logprob is in exactly one chunk;
    the last chunk has `finished`."""

    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    new_logprobs: list[dict[str, Any]] | None = None  # one entry per new token, when asked
    num_cached_tokens: int = 0  # the request's prompt tokens served from the prefix cache


@dataclasses.dataclass(frozen=True)
class GenerateFailure:
    """An engine error, already classified for HTTP."""

    status_code: int  # 400 invalid request, 503 overloaded or engine dead, 500 otherwise
    error_type: str  # OpenAI error "type"
    message: str
    param: str | None = None


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    model_name: str
    max_model_len: int
    model_dir: str
    # SamplingParams fields for requests that omit them: the checkpoint's generation_config.json
    sampling_defaults: dict = dataclasses.field(default_factory=dict)
