"""The OpenAI-compatible HTTP ingress deployment (FastAPI on Ray Serve).

It validates bodies, tokenizes (chat template included), fans a request out into one engine
request per choice on the model-server deployment (streaming `DeploymentHandle` calls), and
merges the streams back into OpenAI responses or server-sent events.

The status is decided before the first byte: the ingress waits for the first item of every
choice it starts, so an engine error (bad parameters, prompt longer than the context, queue full)
becomes a 4xx/503 with an OpenAI error body instead of a broken stream.

No request may hurt another (`IngressLimits`): a body past `max_request_body_bytes` is a 413
before it is read; tokenizing and chat templates come after a length check that needs no
tokenizer, and run on one worker thread, never on the event loop, unless the text is short
(`max_inline_tokenize_chars`, no tools: bounded work, cheaper than the thread's round trip,
done with a tokenizer of the loop's own, since tokenizers are not shared across threads); a
request may ask for at most
`max_sequences_per_request` choices (prompts x n; 400 beyond), and at most
`max_live_sequences_per_request` of them are in the engine at once, the next starting as one
finishes, so a huge fan-out shares the engine with everyone else instead of filling it.

The two completion endpoints skip FastAPI's request machinery (`DirectRoutes`): a well-formed
JSON body is parsed and validated here and handed to the route's own method, whose response is
sent as it is; anything else (a body that is not a JSON object, one that fails validation, another
content type) goes on to FastAPI's route, which words the error as for every other endpoint.
FastAPI's routing, dependency solving and response encoding run on the replica's one event loop,
which pays them for each request of a burst in turn (BENCHMARKS.md, session 11: the replica's CPU
per request fell by a fifth to a third without them).

When the HTTP client disconnects, Serve cancels this request and, through `_merge`'s `finally`,
each engine call, and the model server aborts the engine requests (their KV blocks are freed).
"""

# No `from __future__ import annotations` here: Serve's class-based views rebuild the route
# signatures, and FastAPI then sees string annotations it cannot resolve (bodies become queries).

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import AutoTokenizer

from cluster.sampling_params import InvalidRequestError
from deploy import openai_serving as serving
from deploy.auth import ApiKeyCheck, api_key_from, app_path
from deploy.limits import BodySizeLimit, IngressLimits, max_chars_per_token
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

logger = logging.getLogger("ray.serve")

app = FastAPI(title="mtpserve", docs_url=None, redoc_url=None)

METRICS_TIMEOUT_S = 5.0
_END = object()  # marks the end of one choice's stream inside `_merge`


class DirectRoutes:
    """ASGI middleware for POST /v1/completions and /v1/chat/completions (the module docstring
    says why). Runs after the API key and body size checks; the ingress replica puts itself in
    `app.state.ingress`."""

    ROUTES = {
        "/v1/completions": (CompletionRequest, "completions"),
        "/v1/chat/completions": (ChatCompletionRequest, "chat_completions"),
    }

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def __call__(self, scope, receive, send):
        route = self._route(scope)
        ingress = getattr(getattr(scope.get("app"), "state", None), "ingress", None)
        if route is None or ingress is None:
            return await self.app(scope, receive, send)
        model, method = route
        messages = []
        while True:  # the whole body (BodySizeLimit has bounded it)
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        request = _parse_body(model, b"".join(m.get("body", b"") for m in messages))
        if request is None:  # FastAPI answers it, with the error it words for every route

            async def replay():
                return messages.pop(0) if messages else await receive()

            return await self.app(scope, replay, send)
        response = await getattr(ingress, method)(request)
        if not isinstance(response, Response):  # a pydantic model, as FastAPI would encode it
            body = response.model_dump_json(by_alias=True)
            response = Response(body, media_type="application/json")
        await response(scope, receive, send)

    def _route(self, scope):
        if scope["type"] != "http" or scope.get("method") != "POST":
            return None
        route = self.ROUTES.get(app_path(scope))
        if route is None:
            return None
        content_type = dict(scope.get("headers") or []).get(b"content-type", b"")
        if content_type.split(b";", 1)[0].strip().lower() != b"application/json":
            return None  # FastAPI's content-type rules decide
        return route


def _parse_body(model, body: bytes):
    """`model` from a JSON object body as FastAPI reads it (json.loads, then the model's
    validation of the object); None when it is not one."""
    try:
        data = json.loads(body)
        if not isinstance(data, dict):
            return None
        return model.model_validate(data)
    except Exception:  # noqa: BLE001 - bad JSON, too deep, invalid: FastAPI's route says which
        return None


app.add_middleware(DirectRoutes)  # innermost: after the key and size checks
app.add_middleware(BodySizeLimit)
app.add_middleware(ApiKeyCheck)  # added last, so it runs first: no key, no body read

_UNION_TAGS = ("str", "int", "float", "bool", "list", "dict", "none")


def _param_of(error: dict) -> str | None:
    """An OpenAI `param` from a pydantic error: its location without "body" and without the
    union-member tags pydantic inserts ("list[int]", "str"), then the validator's own param."""
    location = [
        str(part)
        for part in error.get("loc", ())
        if part != "body" and not (isinstance(part, str) and (part in _UNION_TAGS or "[" in part))
    ]
    own = (error.get("ctx") or {}).get("param")
    if own and own != "body":
        location.append(own)
    return ".".join(location) or None


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
    param = _param_of(first)
    if first.get("type") == "extra_forbidden":
        message = (
            f"unknown field `{param}`: this server takes OpenAI's fields and the documented "
            "extensions (see the README)"
        )
        return error_response(400, message, "invalid_request_error", param, "unknown_field")
    message = str(first.get("msg", "invalid value"))
    if (first.get("ctx") or {}).get("param"):  # our validators' messages name the field already
        message = message.split(": ", 1)[-1]
    return error_response(
        400,
        f"{param}: {message}" if param else message,
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


def _is_number_or_numbers(value) -> bool:
    if isinstance(value, list):
        return all(_is_number_or_numbers(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _OneItem:
    """A plain call's response read like a stream of its one item (what `_merge` reads)."""

    def __init__(self, response):
        self._response = response
        self._read = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._read:
            raise StopAsyncIteration
        self._read = True
        return await self._response

    def cancel(self) -> None:
        self._response.cancel()


async def _first_item(stream):
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return GenerateFailure(500, "internal_error", "engine stream ended without output")
    except Exception as exc:  # noqa: BLE001
        return _failure_from_handle_error(exc)


def _failure_from_handle_error(exc: BaseException) -> GenerateFailure:
    """A call that failed in Serve itself (replica died, cancelled): not the client's fault.
    The exception (actor ids, node addresses) goes to the log, not to the client."""
    logger.warning("model server call failed: %s", exc)
    return GenerateFailure(503, "service_unavailable", "the model server is unavailable")


@serve.ingress(app)  # here, at import: the replica must see the class-based routes it rewrites
class OpenAIIngress:
    """Serve deployment class; `deploy.app.build_app` makes it a deployment."""

    async def __init__(
        self,
        model_server: DeploymentHandle,
        limits: IngressLimits | None = None,
        api_key: str | None = None,
        metrics_hub: DeploymentHandle | None = None,
    ):
        self._model_server = model_server
        self._metrics_hub = metrics_hub  # deploy.metrics.MetricsHub: every engine replica
        app.state.api_key = api_key_from(api_key)
        app.state.ingress = self  # DirectRoutes calls the completion routes' methods
        self._stream_server = model_server.options(stream=True)
        self._limits = limits or IngressLimits()
        app.state.max_body_bytes = self._limits.max_request_body_bytes
        self._info: ModelInfo | None = None
        self._tokenizer = None  # the event loop's
        self._thread_tokenizer = None  # the tokenizing thread's
        self._chat_format = serving.ChatFormat()
        self._max_prompt_chars = 0
        self._ready_lock: asyncio.Lock | None = None
        # One thread, with a tokenizer of its own: tokenizers are not safe to share across
        # threads, and the loop stays free of long texts.
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        # Warm before ready: the model server's info (the handle's first call sets up Serve's
        # router), the tokenizer's load and its thread's first use, and the chat format's first
        # rendering (a Jinja template compiles then) happen here, while the replica starts, not
        # in the first request after the app said it was ready.
        info, _ = await self._ready()
        warm_chat = ChatCompletionRequest(
            model=info.model_name, messages=[{"role": "user", "content": "warm up"}]
        )
        for num_chars in (0, self._limits.max_inline_tokenize_chars + 1):  # here, the thread
            await self._tokenize(num_chars, lambda tokenizer: tokenizer.encode("warm up"))
            try:
                await self._tokenize(
                    num_chars,
                    lambda tokenizer: serving.chat_prompt_token_ids(
                        warm_chat, tokenizer, self._chat_format
                    ),
                )
            except Exception:  # noqa: BLE001 - a checkpoint without a chat format: chat is 400
                logger.debug("chat format warm-up failed", exc_info=True)

    async def _ready(self) -> tuple[ModelInfo, object]:
        """The served model's name, context length and tokenizer, fetched once."""
        if self._info is None:
            if self._ready_lock is None:
                self._ready_lock = asyncio.Lock()
            async with self._ready_lock:
                if self._info is None:
                    info: ModelInfo = await self._model_server.model_info.remote()
                    self._tokenizer, self._thread_tokenizer = await asyncio.to_thread(
                        lambda: [AutoTokenizer.from_pretrained(info.model_dir) for _ in "ab"]
                    )
                    self._chat_format = serving.ChatFormat.for_checkpoint(
                        info.model_dir, self._tokenizer
                    )
                    self._max_prompt_chars = info.max_model_len * max_chars_per_token(
                        self._tokenizer
                    )
                    self._info = info
        return self._info, self._tokenizer

    async def _tokenize(self, num_chars: int, fn):
        """`fn(tokenizer)` for a request whose text has `num_chars` characters: here, with the
        loop's tokenizer, when that is at most `max_inline_tokenize_chars` (token-id prompts
        have none); else on the tokenizing thread, with its own."""
        if num_chars <= self._limits.max_inline_tokenize_chars:
            return fn(self._tokenizer)
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, fn, self._thread_tokenizer
        )

    def _num_chars(self, texts: list[str], tools) -> int:
        """A chat's weight for `_tokenize`: its messages' characters; with tools, past the
        inline bound (their schemas are rendered too, and are not counted here)."""
        if tools:
            return self._limits.max_inline_tokenize_chars + 1
        return sum(len(t) for t in texts)

    def _check_sizes(self, texts: list[str], num_sequences: int, info: ModelInfo, param: str):
        """400s that need no tokenizer: too many sequences, or text no context can hold."""
        if num_sequences > self._limits.max_sequences_per_request:
            return error_response(
                400,
                f"this request asks for {num_sequences} sequences (prompts x n); at most "
                f"{self._limits.max_sequences_per_request} per request",
                "invalid_request_error",
                param="n",
            )
        num_chars = sum(len(t) for t in texts)
        if num_chars > self._max_prompt_chars:
            return error_response(
                400,
                f"the prompt has {num_chars} characters, more than {self._max_prompt_chars}, "
                f"which cannot fit this model's context of {info.max_model_len} tokens",
                "invalid_request_error",
                param=param,
            )
        return None

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
        texts = [request.prompt or ""] + [m.text() for m in request.messages or []]
        refused = self._check_sizes(texts, 1, info, "prompt")
        if refused is not None:
            return refused
        if request.messages is not None:
            try:
                text = await self._tokenize(
                    self._num_chars(texts, request.tools),
                    lambda tokenizer: self._chat_format.prompt_text(request, tokenizer),
                )
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
        tokens = await self._tokenize(
            len(text),
            lambda tokenizer: tokenizer.encode(text, add_special_tokens=add_special_tokens),
        )
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
        vocab_size, tokens = len(tokenizer), request.tokens
        if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
            message = f"token ids must be in [0, {vocab_size})"
            return error_response(400, message, "invalid_request_error", "tokens")
        # A token is at least a character: a long list decodes on the tokenizing thread.
        text = await self._tokenize(len(tokens), lambda t: t.decode(tokens))
        return DetokenizeResponse(prompt=text)

    @app.get("/health")
    async def health(self) -> JSONResponse:
        """Status and engine numbers only: why it is unhealthy (actor ids, node addresses,
        tracebacks) goes to the log, never to whoever can reach the port."""
        try:
            stats = await self._model_server.probe.remote()
        except Exception:  # noqa: BLE001 - any failure means unhealthy
            logger.warning("health probe failed", exc_info=True)
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        numbers = {k: v for k, v in stats.items() if _is_number_or_numbers(v)}
        return JSONResponse({"status": "ok", "engine": numbers})

    @app.get("/metrics", include_in_schema=False)  # Prometheus text, not part of the API
    async def metrics(self) -> Response:
        """Prometheus text: every engine replica of this app (deploy/metrics.py)."""
        body = b""
        if self._metrics_hub is not None:
            try:
                # A hub being replaced must not hang the scraper (Prometheus waits 10 s).
                body = await asyncio.wait_for(self._metrics_hub.render.remote(), METRICS_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a scrape failing must say so, not crash
                logger.warning("metrics hub call failed", exc_info=True)
                return error_response(503, "metrics are unavailable", "service_unavailable")
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(self, request: CompletionRequest):
        info, tokenizer = await self._ready()
        if (not_found := self._check_model(request.model, info)) is not None:
            return not_found
        prompt = request.prompt
        num_prompts = 1 if isinstance(prompt, str) or isinstance(prompt[0], int) else len(prompt)
        refused = self._check_sizes(request.prompt_texts, num_prompts * request.n, info, "prompt")
        if refused is not None:
            return refused
        try:
            prompts = await self._tokenize(
                sum(len(t) for t in request.prompt_texts),  # token ids only: none
                lambda tokenizer: serving.completion_prompt_token_ids(request, tokenizer),
            )
        except Exception:  # noqa: BLE001 - what the tokenizer refuses is the prompt's fault
            logger.debug("tokenizing a prompt failed", exc_info=True)  # the client's 400
            return error_response(
                400, "the prompt cannot be tokenized", "invalid_request_error", "prompt"
            )
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
                # Like the completion's text: no BOS or other special tokens.
                prefix = tokenizer.decode(
                    plans[result.index].prompt_token_ids, skip_special_tokens=True
                )
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
        texts = [m.text() for m in request.messages]
        refused = self._check_sizes(texts, request.n, info, "messages")
        if refused is not None:
            return refused
        try:
            prompt_ids = await self._tokenize(
                self._num_chars(texts, request.tools),
                lambda tokenizer: serving.chat_prompt_token_ids(
                    request, tokenizer, self._chat_format
                ),
            )
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
            plans = plan_fn(request, prompts, info.max_model_len, info.sampling_defaults)
        except ValueError as exc:  # InvalidRequestError is one
            return error_response(
                400,
                getattr(exc, "message", None) or str(exc),
                "invalid_request_error",
                getattr(exc, "param", None),
            )
        request_id = random_id(id_prefix)
        opened = await self._open(request_id, plans)
        if isinstance(opened, JSONResponse):
            return opened
        return request_id, plans, self._merge(*opened)

    async def _open(self, request_id: str, plans: list[serving.ChoicePlan]):
        """Start the first `max_live_sequences_per_request` choices and wait for each one's
        first item: -> (request id, their streams, their first items, the choices still to
        start), `_merge`'s arguments; or the error response when one of them failed."""
        num_live = self._limits.max_live_sequences_per_request
        streams = [self._start_choice(request_id, plan) for plan in plans[:num_live]]
        try:
            firsts = await asyncio.gather(*(_first_item(s) for s in streams))
        except BaseException:
            for stream in streams:
                stream.cancel()
            raise
        failures = [item for item in firsts if isinstance(item, GenerateFailure)]
        if failures:
            for stream in streams:
                stream.cancel()
            return failure_response(min(failures, key=lambda f: f.status_code))
        return request_id, streams, firsts, plans[num_live:]

    def _start_choice(self, request_id: str, plan: serving.ChoicePlan):
        """A streamed choice is a streaming call; one not streamed a plain call (one reply,
        read as a stream of one item), which costs Ray less than a stream of one item."""
        request = GenerateRequest(
            f"{request_id}-{plan.index}", plan.prompt_token_ids, plan.params, plan.stream
        )
        if plan.stream:
            return self._stream_server.generate.remote(request)
        return _OneItem(self._model_server.generate_whole.remote(request))

    async def _merge(
        self, request_id, streams, firsts, later: list[serving.ChoicePlan]
    ) -> AsyncIterator[tuple[int, GenerateChunk | GenerateFailure]]:
        """Interleave the choices' streams as items arrive: yields (choice index, item). The
        `later` choices start one by one, each when a live one finishes, in index order."""
        if len(streams) == 1 and not later:  # one choice (most requests): read here
            async with contextlib.aclosing(self._one(streams[0], firsts[0])) as items:
                async for item in items:
                    yield 0, item
            return
        queue: asyncio.Queue = asyncio.Queue()
        pending = list(reversed(later))
        streams = list(streams)
        tasks: list[asyncio.Task] = []
        # Streams that reached their last item need no cancel: a cancel is a call to the model
        # server's replica, where it raises and formats a cancellation in the engine's process.
        ended: set[int] = set()

        async def pump(index: int, stream, first) -> None:
            try:
                if first is None:
                    first = await _first_item(stream)
                await queue.put((index, first))
                item = first
                if not (isinstance(first, GenerateChunk) and first.finished):
                    async for item in stream:
                        await queue.put((index, item))
                if isinstance(item, GenerateFailure) or item.finished:  # the model server's last
                    ended.add(id(stream))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001
                await queue.put((index, _failure_from_handle_error(exc)))
            finally:
                queue.put_nowait((index, _END))

        def launch(index: int, stream, first) -> None:
            tasks.append(asyncio.create_task(pump(index, stream, first)))

        for i, (stream, first) in enumerate(zip(streams, firsts)):
            launch(i, stream, first)
        remaining = len(tasks) + len(pending)
        try:
            while remaining:
                index, item = await queue.get()
                if item is _END:
                    remaining -= 1
                    if pending:  # a live choice ended: the next one takes its place
                        plan = pending.pop()
                        streams.append(self._start_choice(request_id, plan))
                        launch(plan.index, streams[-1], None)
                    continue
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            for stream in streams:
                if id(stream) not in ended:
                    stream.cancel()

    @staticmethod
    async def _one(stream, first) -> AsyncIterator[GenerateChunk | GenerateFailure]:
        """One choice's items as `_merge`'s pump reads them, without its task and queue: a
        task switch and two queue operations fewer per item on the replica's loop."""
        item, ended = first, False
        try:
            while True:
                # The model server's last item: the stream needs no cancel, even if the reader
                # stops here.
                ended = isinstance(item, GenerateFailure) or item.finished
                yield item
                if ended:
                    return
                try:
                    item = await anext(stream)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    yield _failure_from_handle_error(exc)
                    return
        finally:
            if not ended:
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
                    prompt_text = tokenizer.decode(plan.prompt_token_ids, skip_special_tokens=True)
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
