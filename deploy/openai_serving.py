"""Translation between OpenAI request/response bodies and engine requests/outputs.

No HTTP and no Ray here: the ingress calls these functions, and they are plain enough to test
directly. `n` > 1 and batched completion prompts become one engine request per choice; choice
`i` of a seeded request gets seed `seed + i` (wrapped into int64: `choice_seed`) so choices
differ yet reproduce.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from cluster.sampling_params import InvalidRequestError, SamplingParams, choice_seed
from deploy.chat_dsv32 import encode_messages
from deploy.dsml_parser import DSMLParser, merged_tool_calls
from deploy.messages import GenerateChunk
from deploy.openai_protocol import (
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatDelta,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    PromptTokensDetails,
    ToolCall,
    TopLogprob,
    UsageInfo,
)


@dataclasses.dataclass
class ChoicePlan:
    """One engine request: output choice `index`, generated from prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool = True  # False: the model server sends the completion as one chunk


@dataclasses.dataclass
class ChoiceResult:
    """What one choice has produced so far: the chunks' deltas, joined."""

    index: int
    text: str = ""
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    completion_token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None

    def update(self, chunk: GenerateChunk) -> None:
        self.text += chunk.new_text
        self.num_cached_tokens = chunk.num_cached_tokens
        self.completion_token_ids.extend(chunk.new_token_ids)
        if chunk.new_logprobs:
            self.logprobs.extend(chunk.new_logprobs)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason


def completion_prompt_token_ids(request: CompletionRequest, tokenizer) -> list[list[int]]:
    """`prompt` may be a string, a list of strings, a token list, or a list of token lists."""
    prompt = request.prompt
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]


def thinking_requested(request) -> bool:
    """Thinking mode: `chat_template_kwargs` {"thinking": true} (vLLM's and SGLang's key for
    DeepSeek; "enable_thinking" is accepted too). Off by default."""
    kwargs = request.chat_template_kwargs or {}
    return bool(kwargs.get("thinking", kwargs.get("enable_thinking", False)))


def prompt_tools(request) -> list[dict[str, Any]] | None:
    """The tools the prompt shows the model: none when `tool_choice` is "none" (the model is
    not told about tools it must not call); "required" and named choices are refused until
    constrained decoding exists."""
    choice = request.tool_choice
    if choice is not None and choice not in ("none", "auto"):
        raise InvalidRequestError(
            f'tool_choice {choice!r} is not supported: only "auto" and "none" (forcing a call '
            "needs constrained decoding)",
            "tool_choice",
        )
    if not request.tools or choice == "none":
        return None
    # The client's own dicts, keys in the order sent (DeepSeek's prompt shows each as JSON).
    return [tool.as_sent() for tool in request.tools]


def message_dicts(request) -> list[dict[str, Any]]:
    """The history as plain dicts; tool calls, tool call ids and reasoning are kept."""
    messages = []
    for m in request.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        if m.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in m.tool_calls]
        messages.append(message)
    return messages


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """How one checkpoint's chats are rendered and its answers read.

    A checkpoint's own chat template wins; a DeepSeek-V3.2 checkpoint without one is rendered
    by the built-in encoder (`deploy.chat_dsv32`). A DeepSeek-V3.2 model's answers are parsed
    (`deploy.dsml_parser`) for reasoning in thinking mode and for DSML tool calls when the
    prompt offered tools.
    """

    builtin_dsv32: bool = False
    dsv32_output: bool = False

    @classmethod
    def for_checkpoint(cls, model_dir: str, tokenizer) -> ChatFormat:
        try:
            with open(os.path.join(model_dir, "config.json")) as f:
                model_type = json.load(f).get("model_type")
        except OSError:
            model_type = None
        is_dsv32 = model_type == "deepseek_v32"
        return cls(
            builtin_dsv32=is_dsv32 and not getattr(tokenizer, "chat_template", None),
            dsv32_output=is_dsv32,
        )

    def prompt_text(self, request, tokenizer) -> str:
        """`request` has messages, tools, tool_choice, chat_template_kwargs and
        add_generation_prompt (a chat completion or a /tokenize request). The built-in encoder
        always ends with the assistant's opener, so add_generation_prompt does not apply."""
        tools = prompt_tools(request)
        messages = message_dicts(request)
        if self.builtin_dsv32:
            return encode_messages(messages, thinking=thinking_requested(request), tools=tools)
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            **(request.chat_template_kwargs or {}),
        )

    def answer(self, request) -> ChatAnswer:
        thinking = self.dsv32_output and thinking_requested(request)
        tools = prompt_tools(request) if self.dsv32_output else None
        if not thinking and not tools:
            return ChatAnswer(None)
        return ChatAnswer(DSMLParser(thinking, parse_tools=bool(tools), tools=tools))


class ChatAnswer:
    """One choice's answer, read as it streams (or whole): reasoning, content, tool calls."""

    def __init__(self, parser: DSMLParser | None):
        self._parser = parser

    def _finish_reason(self, reason: str | None) -> str | None:
        called = self._parser is not None and self._parser.num_tool_calls > 0
        return "tool_calls" if called and reason == "stop" else reason

    def delta(self, new_text: str, finish_reason: str | None) -> tuple[ChatDelta, str | None]:
        """The stream delta for `new_text` (all of the rest when `finish_reason` is set)."""
        if self._parser is None:
            return ChatDelta(content=new_text or None), finish_reason
        parsed = self._parser.feed(new_text)
        if finish_reason is not None:
            parsed.extend(self._parser.finish())
        tool_calls = [
            DeltaToolCall(
                index=piece.index,
                id=piece.id,
                type="function" if piece.id else None,
                function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments),
            )
            for piece in parsed.tool_calls
        ]
        delta = ChatDelta(
            content=parsed.content or None,
            reasoning_content=parsed.reasoning or None,
            tool_calls=tool_calls or None,
        )
        return delta, self._finish_reason(finish_reason)

    def message(
        self, text: str, finish_reason: str | None
    ) -> tuple[ChatResponseMessage, str | None]:
        """The whole answer as a message; content is null when only tools were called."""
        if self._parser is None:
            return ChatResponseMessage(content=text), finish_reason
        parsed = self._parser.feed(text)
        parsed.extend(self._parser.finish())
        calls = [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in merged_tool_calls(parsed.tool_calls)
        ]
        message = ChatResponseMessage(
            content=parsed.content or (None if calls else ""),
            reasoning_content=parsed.reasoning or None,
            tool_calls=calls or None,
        )
        return message, self._finish_reason(finish_reason)


def chat_prompt_token_ids(
    request: ChatCompletionRequest, tokenizer, chat_format: ChatFormat | None = None
) -> list[int]:
    prompt_text = (chat_format or ChatFormat()).prompt_text(request, tokenizer)
    # Render to text, then encode: the template already places BOS where the model expects it.
    return tokenizer.encode(prompt_text, add_special_tokens=False)


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int,
    num_logprobs: int | None,
    choice_index: int,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """Engine parameters for choice `choice_index`. Unset fields take `defaults` (the
    checkpoint's generation_config.json), then the engine's; values the request sets win. The
    engine validates values and raises `InvalidRequestError` (-> 400)."""
    kwargs: dict[str, Any] = {**(defaults or {}), "max_tokens": max_tokens}
    if request.temperature is not None:
        kwargs["temperature"] = request.temperature
    if request.top_p is not None:
        kwargs["top_p"] = request.top_p
    if request.top_k is not None:
        kwargs["top_k"] = request.top_k
    if request.seed is not None:
        kwargs["seed"] = choice_seed(request.seed, choice_index)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        if (value := getattr(request, name)) is not None:
            kwargs[name] = value
    if request.logit_bias:
        kwargs["logit_bias"] = request.token_logit_bias()
    if request.min_tokens:
        kwargs["min_tokens"] = request.min_tokens
    if request.stop:
        kwargs["stop"] = request.stop_list()
    if request.stop_token_ids:
        kwargs["stop_token_ids"] = list(request.stop_token_ids)
    if request.ignore_eos:
        kwargs["ignore_eos"] = True
    if num_logprobs is not None:
        kwargs["logprobs"] = num_logprobs
    params = SamplingParams(**kwargs)
    params.validate()  # the engine validates again, knowing the vocabulary size
    return params


def check_room(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """OpenAI's rule for an explicit max_tokens (None: unset): prompt plus completion must fit
    the context (400 otherwise, not a silently shorter answer). A prompt that leaves no room at
    all is the engine's error to give."""
    room = max_model_len - num_prompt_tokens
    if max_tokens is not None and 1 <= room < max_tokens:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{num_prompt_tokens}, so max_tokens can be at most {room}, got {max_tokens}",
            "max_tokens",
        )


def plan_completion(
    request: CompletionRequest,
    prompts: list[list[int]],
    max_model_len: int,
    sampling_defaults: dict[str, Any] | None = None,
) -> list[ChoicePlan]:
    max_tokens = request.max_tokens if request.max_tokens is not None else 16
    plans = []
    for prompt_index, prompt_ids in enumerate(prompts):
        check_room(len(prompt_ids), request.max_tokens, max_model_len)
        for i in range(request.n):
            params = sampling_params(
                request,
                max_tokens=max_tokens,
                num_logprobs=request.logprobs,
                choice_index=i,
                defaults=sampling_defaults,
            )
            plans.append(
                ChoicePlan(len(plans), prompt_index, prompt_ids, params, bool(request.stream))
            )
    return plans


def plan_chat(
    request: ChatCompletionRequest,
    prompt_ids: list[int],
    max_model_len: int,
    sampling_defaults: dict[str, Any] | None = None,
) -> list[ChoicePlan]:
    max_tokens = request.max_completion_tokens or request.max_tokens
    check_room(len(prompt_ids), max_tokens, max_model_len)
    if max_tokens is None:
        # OpenAI's default: whatever the context has left (at least 1, so an over-long prompt
        # reaches the engine and gets its context-length error).
        max_tokens = max(1, max_model_len - len(prompt_ids))
    num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return [
        ChoicePlan(
            i,
            0,
            prompt_ids,
            sampling_params(
                request,
                max_tokens=max_tokens,
                num_logprobs=num_logprobs,
                choice_index=i,
                defaults=sampling_defaults,
            ),
            bool(request.stream),
        )
        for i in range(request.n)
    ]


def usage(results: list[ChoiceResult], plans: list[ChoicePlan]) -> UsageInfo:
    """Prompt tokens count once per distinct prompt, completion tokens once per choice. A
    prompt's cached tokens are the fewest any of its choices took from the prefix cache (its
    choices run side by side, so later ones may hit what the first computed)."""
    prompt_tokens: dict[int, int] = {}
    cached_tokens: dict[int, int] = {}
    for plan, result in zip(plans, results):
        prompt_tokens[plan.prompt_index] = len(plan.prompt_token_ids)
        cached = min(result.num_cached_tokens, cached_tokens.get(plan.prompt_index, 1 << 62))
        cached_tokens[plan.prompt_index] = cached
    completion_tokens = sum(len(r.completion_token_ids) for r in results)
    total_prompt = sum(prompt_tokens.values())
    return UsageInfo(
        prompt_tokens=total_prompt,
        completion_tokens=completion_tokens,
        total_tokens=total_prompt + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached_tokens.values())),
    )


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(
    entries: list[dict[str, Any]], tokenizer, text_offset: int = 0
) -> CompletionLogprobs:
    result = CompletionLogprobs()
    for entry in entries:
        token = _token_text(tokenizer, entry["token_id"])
        result.tokens.append(token)
        result.token_logprobs.append(float(entry["logprob"]))
        top_by_text: dict[str, float] = {}
        for tid, lp in entry.get("top") or []:
            # Keyed by text, two tokens can collide (e.g. partial UTF-8 bytes both decode to
            # U+FFFD); keep the likelier one, as the list is not guaranteed to be sorted.
            text = _token_text(tokenizer, tid)
            top_by_text[text] = max(float(lp), top_by_text.get(text, float("-inf")))
        result.top_logprobs.append(top_by_text or None)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(entries: list[dict[str, Any]], tokenizer, num_top: int) -> ChatChoiceLogprobs:
    content = []
    for entry in entries:
        token = _token_text(tokenizer, entry["token_id"])
        top = [
            TopLogprob(
                token=(t := _token_text(tokenizer, tid)), logprob=float(lp), bytes=list(t.encode())
            )
            for tid, lp in (entry.get("top") or [])[:num_top]
        ]
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=float(entry["logprob"]),
                bytes=list(token.encode()),
                top_logprobs=top,
            )
        )
    return ChatChoiceLogprobs(content=content)
