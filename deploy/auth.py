"""`--api-key`: the OpenAI API answers only requests that carry the key.

Clients send it as OpenAI's do (`Authorization: Bearer <key>`, what the official client's
`api_key` becomes). Without it, or with another key, a request to the API is a 401 with an
OpenAI error body; `/health` and `/metrics` stay open (probes and scrapers carry no key). The
comparison takes the same time whatever the key sent.

The key may also come from the environment (`MTPSERVE_API_KEY`), so that it stays out of command
lines and Serve configs: `mtpserve serve` reads it, and so does the ingress replica when its
args carry no key (a Serve config deployed with the variable in its runtime_env).
"""

from __future__ import annotations

import hmac
import os

from deploy.openai_protocol import ErrorBody, ErrorResponse

OPEN_PATHS = ("/health", "/metrics")
API_KEY_ENV = "MTPSERVE_API_KEY"


def api_key_from(explicit: str | None) -> str | None:
    """The key to require: the one given, else the environment's, else none."""
    return explicit or os.environ.get(API_KEY_ENV) or None


def app_path(scope) -> str:
    """The request's path within the app: under a Serve route prefix, the part after it."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if path.startswith(root) else path


class ApiKeyCheck:
    """ASGI middleware; the key is read from `app.state.api_key` (None: no key required)."""

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or app_path(scope) in OPEN_PATHS:
            return await self.app(scope, receive, send)
        key = getattr(getattr(scope.get("app"), "state", None), "api_key", None)
        if key is None:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        sent = headers.get(b"authorization", b"")
        if hmac.compare_digest(sent, b"Bearer " + key.encode()):
            return await self.app(scope, receive, send)
        body = ErrorResponse(
            error=ErrorBody(
                message="a valid API key is required (Authorization: Bearer <key>)",
                type="invalid_request_error",
                code="invalid_api_key",
            )
        ).model_dump_json()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body.encode()})
