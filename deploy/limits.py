"""What one HTTP request may take from the server (issue 16: no request may hurt another).

`IngressLimits` are the ingress's per-request bounds (set through the Serve app's args);
`BodySizeLimit` answers an oversized body with a 413 before it is parsed; `max_chars_per_token`
bounds a text's token count from below without tokenizing it, so a prompt no context could hold
is refused before the tokenizer spends time on it.
"""

from __future__ import annotations

import dataclasses

from deploy.openai_protocol import ErrorBody, ErrorResponse


@dataclasses.dataclass(frozen=True)
class IngressLimits:
    """What one HTTP request may take. Defaults: a 4 MiB body holds a full 8k-token context
    many times over; 2048 sequences is 16 prompts x OpenAI's n = 128; 32 live sequences per
    request leave room in a 64-sequence engine batch for others. A request's text of at most
    `max_inline_tokenize_chars` characters (no tools) is tokenized on the event loop: 1,024
    characters take ~0.35 ms on the 2-core box with a byte-level vocabulary, about what the
    hand-off to the tokenizer's thread and back costs (BENCHMARKS.md, session 37)."""

    max_request_body_bytes: int = 4 * 2**20
    max_sequences_per_request: int = 2048
    max_live_sequences_per_request: int = 32
    max_inline_tokenize_chars: int = 1024


class BodySizeLimit:
    """ASGI middleware: a request body past the limit is a 413 with an OpenAI error body, decided
    from its Content-Length before anything is parsed, or as soon as a chunked body passes it.

    The rest of a refused body is read and dropped (never kept, never parsed) before the answer:
    a server that answers and closes while the client is still sending makes most clients report
    a broken connection instead of the 413."""

    def __init__(self, asgi_app, max_bytes: int = IngressLimits.max_request_body_bytes):
        self.app = asgi_app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = getattr(getattr(scope.get("app"), "state", None), "max_body_bytes", None)
        limit = limit or self.max_bytes
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            return await self._refuse(receive, send, limit)
        if declared is not None:
            return await self.app(scope, receive, send)
        # Chunked: read it here, up to the limit, then replay it.
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > limit:
                return await self._refuse(receive, send, limit, more=message.get("more_body"))
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(receive, send, limit: int, more: bool = True) -> None:
        while more:  # drop the rest of the body
            message = await receive()
            more = message["type"] == "http.request" and message.get("more_body", False)
        error = ErrorBody(
            message=f"the request body is larger than {limit} bytes",
            type="invalid_request_error",
            code="request_too_large",
        )
        body = ErrorResponse(error=error).model_dump_json().encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


def max_chars_per_token(tokenizer) -> int:
    """An upper bound on the characters of text one token covers, from the vocabulary: a
    byte-level token's string has one character per byte it covers, and a text has no more
    characters than bytes, so a text of c characters has at least c / bound tokens. A
    normalizer (NFKC may shrink a text) gets a margin of 4."""
    bound = max((len(token) for token in tokenizer.get_vocab()), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        bound *= 4
    return max(bound, 1)
