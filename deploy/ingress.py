"""The OpenAI-compatible HTTP ingress deployment (FastAPI on Ray Serve).

It validates bodies, tokenizes (chat template included), fans a request out into one engine
request per choice on the model-server deployment (streaming `DeploymentHandle` calls), and
merges the streams back into OpenAI responses or server-sent events.

The status is decided before the first byte: the ingress waits for every choice's first item, so
an engine error (bad parameters, prompt longer than the context, queue full) becomes a 4xx/503
with an OpenAI error body instead of a broken stream. When the HTTP client disconnects, Serve
cancels this request and, through `_merge`'s `finally`, each engine call, and the model server
aborts the engine requests (their KV blocks are freed).
"""

# No `from __future__ import annotations` here: Serve's class-based views rebuild the route
# signatures, and FastAPI then sees string annotations it cannot resolve (bodies become queries).

import asyncio
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoTokenizer

from cluster.sampling_params import InvalidRequestError
from deploy import openai_serving as serving
from deploy.messages import GenerateChunk, GenerateFailure, GenerateRequest, ModelInfo
from deploy.openai_protocol import (
    ChatChunkChoice,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    random_id,
)

app = FastAPI(title="mtpserve", docs_url=None, redoc_url=None)

_END = object()  # marks the end of one choice's stream inside `_merge`


def error_response(
    status_code: int,
    message: str,
    error_type: str,
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = ErrorResponse(error=ErrorBody(message=message, type=error_type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status_code)


def failure_body(failure: GenerateFailure) -> ErrorResponse:
    error = ErrorBody(
        message=failure.message,
        type=failure.error_type,
        param=failure.param,
        code=failure.error_type,
    )
    return ErrorResponse(error=error)


def failure_response(failure: GenerateFailure) -> JSONResponse:
    return JSONResponse(failure_body(failure).model_dump(), status_code=failure.status_code)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return error_response(
            400,
            f"malformed JSON body: {first.get('ctx', {}).get('error', '')}".strip(),
            "invalid_request_error",
            code="json_invalid",
        )
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    return error_response(
        400,
        f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg")),
        "invalid_request_error",
        param=param,
        code="invalid_value",
    )


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), "invalid_request_error")


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def _failure_event(failure: GenerateFailure) -> str:
    """A failure after the stream started: an OpenAI error body as the last SSE event."""
    return _sse(failure_body(failure).model_dump_json())


def _failure_from_handle_error(exc: BaseException) -> GenerateFailure:
    """A call that failed in Serve itself (replica died, cancelled): not the client's fault."""
    return GenerateFailure(503, "service_unavailable", f"model server failed: {exc}")


@serve.ingress(app)  # here, at import: the replica must see the class-based routes it rewrites
class OpenAIIngress:
    """Serve deployment class; `deploy.app.build_app` makes it a deployment."""

    def __init__(self, model_server: DeploymentHandle):
        self._model_server = model_server
        self._stream_server = model_server.options(stream=True)
        self._info: ModelInfo | None = None
        self._tokenizer = None
        self._chat_format = serving.ChatFormat()
        self._ready_lock: asyncio.Lock | None = None

    async def _ready(self) -> tuple[ModelInfo, object]:
        """The served model's name, context length and tokenizer, fetched once."""
        if self._info is None:
            if self._ready_lock is None:
                self._ready_lock = asyncio.Lock()
            async with self._ready_lock:
                if self._info is None:
                    info: ModelInfo = await self._model_server.model_info.remote()
                    self._tokenizer = await asyncio.to_thread(
                        AutoTokenizer.from_pretrained, info.model_dir
                    )
                    self._chat_format = serving.ChatFormat.for_checkpoint(
                        info.model_dir, self._tokenizer
                    )
                    self._info = info
        return self._info, self._tokenizer

    def _check_model(self, requested: str, info: ModelInfo) -> JSONResponse | None:
        if requested in (info.model_name, info.model_dir):
            return None
        return error_response(
            404,
            f"The model `{requested}` does not exist; this server serves `{info.model_name}`.",
            "invalid_request_error",
            param="model",
            code="model_not_found",
        )

    # -- routes -----------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models(self) -> ModelList:
        info, _ = await self._ready()
        return ModelList(data=[ModelCard(id=info.model_name, max_model_len=info.max_model_len)])

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str):
        info, _ = await self._ready()
        if (not_found := self._check_model(model_id, info)) is not None:
            return not_found
        return ModelCard(id=info.model_name, max_model_len=info.max_model_len)

    @app.post("/tokenize")
    async def tokenize(self, request: TokenizeRequest):
        """vLLM's shape: a prompt, or messages rendered exactly as for a chat completion."""
        info, tokenizer = await self._ready()
        not_found = self._check_model(request.model, info) if request.model else None
        if not_found is not None:
            return not_found
        if request.messages is not None:
            try:
                text = self._chat_format.prompt_text(request, tokenizer)
            except InvalidRequestError as exc:
                return error_response(400, exc.message, "invalid_request_error", exc.param)
            except Exception as exc:  # noqa: BLE001 - a template error is the messages' fault
                return error_response(
                    400, f"chat template failed: {exc}", "invalid_request_error", "messages"
                )
            add_special_tokens = bool(request.add_special_tokens)
        else:
            text = request.prompt
            add_special_tokens = request.add_special_tokens is not False
        tokens = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        token_strs = tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(tokens),
            max_model_len=info.max_model_len,
            tokens=tokens,
            token_strs=token_strs,
        )

    @app.post("/detokenize")
    async def detokenize(self, request: DetokenizeRequest):
        info, tokenizer = await self._ready()
        not_found = self._check_model(request.model, info) if request.model else None
        if not_found is not None:
            return not_found
        if any(not 0 <= t < len(tokenizer) for t in request.tokens):
            message = f"token ids must be in [0, {len(tokenizer)})"
            return error_response(400, message, "invalid_request_error", "tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))

    @app.get("/health")
    async def health(self) -> JSONResponse:
        try:
            stats = await self._model_server.probe.remote()
        except Exception as exc:  # noqa: BLE001 - any failure means unhealthy
            return error_response(503, f"unhealthy: {exc}", "service_unavailable")
        return JSONResponse({"status": "ok", "engine": stats})

    @app.post("/v1/completions")
    async def completions(self, request: CompletionRequest):
        info, tokenizer = await self._ready()
        if (not_found := self._check_model(request.model, info)) is not None:
            return not_found
        prompts = serving.completion_prompt_token_ids(request, tokenizer)
        started = await self._start("cmpl", serving.plan_completion, request, prompts, info)
        if isinstance(started, JSONResponse):
            return started
        request_id, plans, merged = started
        if request.stream:
            return StreamingResponse(
                self._completion_events(request, request_id, info, plans, merged, tokenizer),
                media_type="text/event-stream",
            )
        results = await self._collect(plans, merged)
        if isinstance(results, JSONResponse):
            return results
        choices = []
        for result in results:
            prefix = ""
            if request.echo:
                prefix = tokenizer.decode(plans[result.index].prompt_token_ids)
            logprobs = None
            if request.logprobs is not None:
                logprobs = serving.completion_logprobs(result.logprobs, tokenizer, len(prefix))
            choices.append(
                CompletionChoice(
                    index=result.index,
                    text=prefix + result.text,
                    logprobs=logprobs,
                    finish_reason=result.finish_reason,
                )
            )
        return CompletionResponse(
            id=request_id,
            model=info.model_name,
            choices=choices,
            usage=serving.usage(results, plans),
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: ChatCompletionRequest):
        info, tokenizer = await self._ready()
        if (not_found := self._check_model(request.model, info)) is not None:
            return not_found
        try:
            prompt_ids = serving.chat_prompt_token_ids(request, tokenizer, self._chat_format)
        except InvalidRequestError as exc:
            return error_response(400, exc.message, "invalid_request_error", exc.param)
        except Exception as exc:  # noqa: BLE001 - a template error is the messages' fault
            return error_response(
                400, f"chat template failed: {exc}", "invalid_request_error", param="messages"
            )
        started = await self._start("chatcmpl", serving.plan_chat, request, prompt_ids, info)
        if isinstance(started, JSONResponse):
            return started
        request_id, plans, merged = started
        num_top = request.top_logprobs or 0
        if request.stream:
            return StreamingResponse(
                self._chat_events(request, request_id, info, plans, merged, tokenizer, num_top),
                media_type="text/event-stream",
            )
        results = await self._collect(plans, merged)
        if isinstance(results, JSONResponse):
            return results
        choices = []
        for r in results:
            message, finish_reason = self._chat_format.answer(request).message(
                r.text, r.finish_reason
            )
            choices.append(
                ChatCompletionChoice(
                    index=r.index,
                    message=message,
                    logprobs=(
                        serving.chat_logprobs(r.logprobs, tokenizer, num_top)
                        if request.logprobs
                        else None
                    ),
                    finish_reason=finish_reason,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=info.model_name,
            choices=choices,
            usage=serving.usage(results, plans),
        )

    # -- engine calls -------------------------------------------------------------------------

    async def _start(self, id_prefix: str, plan_fn, request, prompts, info):
        """Plan the choices, start them on the engine and merge their streams:
        (request id, plans, merged stream), or the error response to send instead."""
        try:
            plans = plan_fn(request, prompts, info.max_model_len)
        except ValueError as exc:  # InvalidRequestError is one
            return error_response(
                400,
                getattr(exc, "message", None) or str(exc),
                "invalid_request_error",
                getattr(exc, "param", None),
            )
        request_id = random_id(id_prefix)
        opened = await self._open(request_id, plans, bool(request.stream))
        if isinstance(opened, JSONResponse):
            return opened
        return request_id, plans, self._merge(*opened)

    async def _open(self, request_id: str, plans: list[serving.ChoicePlan], stream: bool):
        """Start one engine request per choice and wait for each one's first item."""
        streams = [
            self._stream_server.generate.remote(
                GenerateRequest(
                    f"{request_id}-{plan.index}", plan.prompt_token_ids, plan.params, stream
                )
            )
            for plan in plans
        ]

        async def first_item(stream):
            try:
                return await stream.__anext__()
            except StopAsyncIteration:
                return GenerateFailure(500, "internal_error", "engine stream ended without output")
            except Exception as exc:  # noqa: BLE001
                return _failure_from_handle_error(exc)

        try:
            firsts = await asyncio.gather(*(first_item(s) for s in streams))
        except BaseException:
            for stream in streams:
                stream.cancel()
            raise
        failures = [item for item in firsts if isinstance(item, GenerateFailure)]
        if failures:
            for stream in streams:
                stream.cancel()
            return failure_response(min(failures, key=lambda f: f.status_code))
        return streams, firsts

    async def _merge(
        self, streams, firsts
    ) -> AsyncIterator[tuple[int, GenerateChunk | GenerateFailure]]:
        """Interleave the choices' streams as items arrive: yields (choice index, item)."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream, first) -> None:
            try:
                await queue.put((index, first))
                if not (isinstance(first, GenerateChunk) and first.finished):
                    async for item in stream:
                        await queue.put((index, item))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                await queue.put((index, _failure_from_handle_error(exc)))
            finally:
                queue.put_nowait((index, _END))

        tasks = [
            asyncio.create_task(pump(i, stream, first))
            for i, (stream, first) in enumerate(zip(streams, firsts))
        ]
        remaining = len(tasks)
        try:
            while remaining:
                index, item = await queue.get()
                if item is _END:
                    remaining -= 1
                    continue
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            for stream in streams:
                stream.cancel()

    async def _collect(self, plans, merged):
        results = [serving.ChoiceResult(index=plan.index) for plan in plans]
        async for index, item in merged:
            if isinstance(item, GenerateFailure):
                await merged.aclose()
                return failure_response(item)
            results[index].update(item)
        return results

    # -- server-sent events -------------------------------------------------------------------

    async def _completion_events(self, request, request_id, info, plans, merged, tokenizer):
        results = [serving.ChoiceResult(index=plan.index) for plan in plans]
        text_offsets = [0] * len(plans)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        try:
            if request.echo:
                for plan in plans:
                    prompt_text = tokenizer.decode(plan.prompt_token_ids)
                    text_offsets[plan.index] = len(prompt_text)
                    yield _sse(
                        CompletionChunk(
                            id=request_id,
                            model=info.model_name,
                            choices=[CompletionChoice(index=plan.index, text=prompt_text)],
                        ).model_dump_json()
                    )
            async for index, item in merged:
                if isinstance(item, GenerateFailure):
                    yield _failure_event(item)
                    break
                results[index].update(item)
                if not item.new_text and not item.finished:
                    continue
                logprobs = None
                if request.logprobs is not None:
                    logprobs = serving.completion_logprobs(
                        item.new_logprobs or [], tokenizer, text_offsets[index]
                    )
                text_offsets[index] += len(item.new_text)
                chunk = CompletionChunk(
                    id=request_id,
                    model=info.model_name,
                    choices=[
                        CompletionChoice(
                            index=index,
                            text=item.new_text,
                            logprobs=logprobs,
                            finish_reason=item.finish_reason if item.finished else None,
                        )
                    ],
                )
                yield _sse(chunk.model_dump_json())
            else:
                if include_usage:
                    yield _sse(
                        CompletionChunk(
                            id=request_id,
                            model=info.model_name,
                            choices=[],
                            usage=serving.usage(results, plans),
                        ).model_dump_json()
                    )
            yield _sse("[DONE]")
        finally:
            await merged.aclose()

    async def _chat_events(self, request, request_id, info, plans, merged, tokenizer, num_top):
        results = [serving.ChoiceResult(index=plan.index) for plan in plans]
        answers = [self._chat_format.answer(request) for _ in plans]
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        def chunk(choices, usage=None) -> str:
            return _sse(
                ChatCompletionChunk(
                    id=request_id,
                    model=info.model_name,
                    choices=choices,
                    usage=usage,
                ).model_dump_json()
            )

        try:
            for plan in plans:
                yield chunk(
                    [
                        ChatChunkChoice(
                            index=plan.index, delta=ChatDelta(role="assistant", content="")
                        )
                    ]
                )
            async for index, item in merged:
                if isinstance(item, GenerateFailure):
                    yield _failure_event(item)
                    break
                results[index].update(item)
                if not item.new_text and not item.finished:
                    continue
                delta, finish_reason = answers[index].delta(
                    item.new_text, item.finish_reason if item.finished else None
                )
                logprobs = None
                if request.logprobs:
                    logprobs = serving.chat_logprobs(item.new_logprobs or [], tokenizer, num_top)
                elif delta == ChatDelta() and finish_reason is None:
                    continue  # text held back by the parser (a marker may be starting)
                yield chunk(
                    [
                        ChatChunkChoice(
                            index=index,
                            delta=delta,
                            logprobs=logprobs,
                            finish_reason=finish_reason,
                        )
                    ]
                )
            else:
                if include_usage:
                    yield chunk([], usage=serving.usage(results, plans))
            yield _sse("[DONE]")
        finally:
            await merged.aclose()
