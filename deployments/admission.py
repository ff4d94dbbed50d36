"""Who may use the /v1 routes, and whether there is room: an ASGI middleware in front of them."""
from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from deployments.openai_schema import RequestError

RETRY_AFTER_S = 1
TOKENIZER_ROUTES = ("/tokenize", "/detokenize", "/tokenizer_info")  # vLLM's: keyed like /v1, never queued


def _route_path(scope: Scope) -> str:
    """The path the app routes on: Serve mounts an application under its route_prefix (root_path)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _bearer(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class Admission:
    """Refuses a /v1 (or tokenizer) request without the API key (401, when a key is set), or a completion request
    once this replica already holds `max_in_flight` of them (503 with Retry-After), and counts the
    rest until their response, streamed or not, is fully sent. Other routes (/healthz, /docs) pass untouched.

    The count is per replica on purpose: each ingress replica sees only its own requests, and a
    cluster-wide count would put a shared actor on every request's path. Serve's proxy spreads
    requests over the ingress replicas, so the cluster holds at most this times their number."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_in_flight: int):
        self.app = app
        self.api_key = api_key
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = _route_path(scope) if scope["type"] == "http" else ""
        if not (path.startswith("/v1/") or path in TOKENIZER_ROUTES):
            await self.app(scope, receive, send)
            return
        # GET /v1/models and the tokenizer routes are cheap: they never wait for room
        generates = scope.get("method") == "POST" and path.startswith("/v1/")
        refusal = self._refusal(scope, generates)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        if not generates:
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1

    def _refusal(self, scope: Scope, generates: bool) -> JSONResponse | None:
        if self.api_key is not None:
            token = _bearer(scope)
            if token is None or not hmac.compare_digest(token.encode(), self.api_key.encode()):
                error = RequestError(
                    None,
                    "a valid API key is required: send the header `Authorization: Bearer <key>`",
                    status=401,
                    code="invalid_api_key",
                )
                return JSONResponse(error.to_body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        if generates and self.in_flight >= self.max_in_flight:
            error = RequestError(
                None,
                f"this replica is serving its limit of {self.max_in_flight} requests; retry in {RETRY_AFTER_S} s",
                status=503,
                code="server_overloaded",
            )
            return JSONResponse(error.to_body(), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return None
