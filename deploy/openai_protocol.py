"""OpenAI-shaped request and response bodies (the subset mtpserve serves).

Every field of OpenAI's completions and chat-completions request schemas is either honored or
refused with a 400 naming it; unknown fields are refused, as OpenAI's API does. Honored beyond
sampling: `user`, `prompt_cache_key` and `safety_identifier` (identifiers that do not change
the output), `tools` with `tool_choice` "auto" or "none" and `parallel_tool_calls`, assistant
`tool_calls` / tool messages / `reasoning_content` in the history, `store: false`,
`service_tier` "auto"/"default", `best_of` equal to `n`, an empty `suffix`, `response_format`
{"type": "text"}, `modalities` ["text"], `function_call` "none". Everything else of OpenAI's
that a model without images, audio or structured output cannot do is refused when set
(`UNSUPPORTED`; `tool_choice` "required" or a named function, which need constrained decoding,
are refused where the prompt is built). Documented extensions (vLLM's names): `top_k`,
`ignore_eos`, `stop_token_ids`, `repetition_penalty`, `min_tokens`, and for chat
`add_generation_prompt` and `chat_template_kwargs`.

Types are strict: `max_tokens: "10"` or `true` is a 400, not 10 or 1; a number field takes
integers and floats, never booleans or strings. Every string anywhere in a body must be
encodable as UTF-8 (no lone surrogates such as "\ud800"), or the request is a 400 naming
where. Error bodies follow OpenAI: `{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError

from cluster.sampling_params import SEED_MAX, SEED_MIN

# Strict scalars: no coercion from strings or booleans.
Int = Annotated[int, Field(strict=True)]
Float = Annotated[float, Field(strict=True)]  # integers are accepted, as in JSON
Bool = Annotated[bool, Field(strict=True)]
Str = Annotated[str, Field(strict=True)]

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 1024


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def first_unencodable(value: Any, path: str = "") -> tuple[str, int] | None:
    """(where, character index) of the first string in a decoded JSON value that UTF-8 cannot
    encode (a lone surrogate), keys included; None if every string encodes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return path, exc.start
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = first_unencodable(key, path) or first_unencodable(
                item, f"{path}.{key}" if path else str(key)
            )
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if found := first_unencodable(item, f"{path}.{i}" if path else str(i)):
                return found
    return None


def refuse(param: str, message: str) -> PydanticCustomError:
    """A validation error whose OpenAI `param` is `param` (the ingress reads ctx["param"])."""
    return PydanticCustomError("unsupported_value", "{param}: " + message, {"param": param})


# ---------------------------------------------------------------------------------------------
# Errors


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


# ---------------------------------------------------------------------------------------------
# Requests


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: Bool = False
    include_obfuscation: Bool | None = None  # OpenAI's; there is no obfuscation to turn off


# Fields of OpenAI's request schemas that this server cannot honor, and the values that ask
# for nothing (accepted). Anything else is a 400 naming the field.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "audio": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "metadata": (None, {}),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "response_format": (None, {"type": "text"}),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "verbosity": (None,),
    "web_search_options": (None,),
    "suffix": (None, ""),
}


class _Text(_Strict):
    """A body whose every string must be encodable (no lone surrogates)."""

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        found = first_unencodable(data)
        if found is not None:
            where, index = found
            raise PydanticCustomError(
                "unencodable_text",
                "{param}: the text is not valid Unicode (a lone surrogate at index {index})",
                {"param": where or "body", "index": index},
            )
        return data


class _SamplingFields(_Text):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Str
    n: Int = Field(1, ge=1, le=128)
    stream: Bool = False
    stream_options: StreamOptions | None = None
    stop: Str | list[Str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    seed: Int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    temperature: Float | None = Field(None, ge=0.0, le=2.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[Str, Float] | None = None  # token id (decimal string) -> [-100, 100]
    user: Str | None = None
    prompt_cache_key: Str | None = None
    safety_identifier: Str | None = None
    # Extensions that OpenAI does not define but vLLM-style clients send.
    top_k: Int | None = None
    ignore_eos: Bool = False
    stop_token_ids: list[Int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    repetition_penalty: Float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: Int = Field(0, ge=0)

    @model_validator(mode="after")
    def _honored(self):
        for name, accepted in UNSUPPORTED.items():
            if name in type(self).model_fields and getattr(self, name) not in accepted:
                raise refuse(name, "not supported by this server")
        if self.logit_bias:
            for key, bias in self.logit_bias.items():
                if not key.isascii() or not key.isdigit():
                    raise refuse("logit_bias", f"keys must be token ids, got {key!r}")
                if not -100.0 <= bias <= 100.0:
                    raise refuse("logit_bias", f"biases must be in [-100, 100], got {bias}")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def token_logit_bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}


class CompletionRequest(_SamplingFields):
    prompt: Str | list[Int] | list[Str] | list[list[Int]]
    max_tokens: Int | None = Field(None, ge=1)  # unset or null: OpenAI's default of 16
    logprobs: Int | None = Field(None, ge=0, le=20)
    echo: Bool = False
    best_of: Int | None = Field(None, ge=1)
    suffix: Any = None

    @model_validator(mode="after")
    def _prompt_and_best_of(self):
        if isinstance(self.prompt, list) and not self.prompt:
            raise refuse("prompt", "an empty list is no prompt")
        if self.best_of is not None and self.best_of != self.n:
            raise refuse("best_of", f"only best_of = n ({self.n}) is supported")
        return self

    @property
    def prompt_texts(self) -> list[str]:
        """The prompt's strings (empty for token-id prompts)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        return [p for p in self.prompt if isinstance(p, str)]


class FunctionCall(_Strict):
    name: Str
    arguments: Str  # a JSON object, as text


class ToolCall(_Strict):
    id: Str | None = None  # always set in responses
    type: Literal["function"] = "function"
    function: FunctionCall


class _KeepsKeyOrder(_Strict):
    """Remembers the order of the keys the client sent: DeepSeek-V3.2's prompt shows each tool
    as the client's JSON (`json.dumps` of its dict), so a reordered dump is a different prompt
    from the one the model was trained to read (pydantic dumps in field-definition order)."""

    _sent_keys: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _remember_key_order(cls, data, handler):
        model = handler(data)
        if isinstance(data, dict):
            model._sent_keys = tuple(data)
        return model

    def as_sent(self) -> dict[str, Any]:
        """The fields the client set, in its order (nested tools' functions too)."""
        fields = {
            key: value.as_sent() if isinstance(value, _KeepsKeyOrder) else value
            for key, value in ((k, getattr(self, k)) for k in self.model_fields_set)
        }
        order = [k for k in self._sent_keys if k in fields]
        order += [k for k in fields if k not in order]
        return {key: fields[key] for key in order}


class FunctionDefinition(_KeepsKeyOrder):
    name: Str
    description: Str | None = None
    parameters: dict[Str, Any] | None = None
    strict: Bool | None = None


class ToolDefinition(_KeepsKeyOrder):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatMessage(_Strict):
    """A text message, or an assistant's tool calls and a tool's answer to one. `developer` is
    the newer name of `system` and is rendered as one; the null fields that clients echo back
    from an assistant reply are accepted."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[dict[Str, Any]] | None = None
    name: None = None
    refusal: None = None
    audio: None = None
    function_call: None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, kept in the history
    tool_call_id: Str | None = None  # a tool message's answer to that call
    reasoning_content: Str | None = None  # an assistant's reasoning (thinking mode)
    annotations: list | None = Field(None, max_length=0)

    @model_validator(mode="after")
    def _text_only(self):
        if self.role == "developer":
            self.role = "system"
        if self.tool_calls and self.role != "assistant":
            raise refuse("tool_calls", "only an assistant message makes tool calls")
        for i, part in enumerate(self.content if isinstance(self.content, list) else []):
            kind = part.get("type")
            if kind != "text":
                raise refuse(
                    f"content.{i}.type", f"only text content parts are served, got {kind!r}"
                )
            if not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
                raise refuse(f"content.{i}", 'a text part is {"type": "text", "text": "..."}')
        return self

    def text(self) -> str:
        """The message's text; content parts of type "text" are concatenated."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p["text"] for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=20)
    add_generation_prompt: Bool = True
    # Tools: "auto" (the default with tools) and "none"; the others wait for constrained decoding.
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[Str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    # Keyword arguments of the chat template; {"thinking": true} turns on thinking mode.
    chat_template_kwargs: dict[Str, Any] | None = None
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    metadata: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    response_format: Any = None
    service_tier: Any = None
    store: Any = None
    verbosity: Any = None
    web_search_options: Any = None


class TokenizeRequest(_Text):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered as /v1/chat/completions does."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---------------------------------------------------------------------------------------------
# Responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mtpserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class _Response(BaseModel):
    """What every completion response and stream chunk carries (subclasses fix `object` and the
    choice type; pydantic keeps this field order)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list
    usage: UsageInfo | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of tool call `index`: id, type and name in its first piece, then arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChunk(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
