"""The HTTP surface: OpenAI-compatible routes over any backend with complete/info/health."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from deployments.openai_schema import ChatCompletionRequest, RequestError


class ChatBackend(Protocol):
    """Where the routes send work: a ChatService in-process, or a Serve handle to decoder replicas."""

    async def complete(self, request: ChatCompletionRequest) -> dict: ...

    def stream(self, request: ChatCompletionRequest) -> AsyncIterator[dict]: ...

    async def info(self) -> dict: ...

    async def health(self) -> dict: ...


def _field_path(loc: tuple) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"


def create_app() -> FastAPI:
    """A FastAPI app whose routes use `app.state.backend` (set by whoever hosts the app)."""
    app = FastAPI(title="plato-serve", description="OpenAI-compatible LLM serving on Ray Serve")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = _field_path(first["loc"])
        message = f"{param}: {first['msg']}" + (f" ({len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else "")
        return JSONResponse(
            status_code=400, content={"error": {"message": message, "type": "invalid_request_error", "param": param}}
        )

    @app.exception_handler(RequestError)
    async def _refused(_: Request, exc: RequestError):
        return JSONResponse(status_code=exc.status, content=exc.to_body())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if not body.stream:
            return await request.app.state.backend.complete(body)
        chunks = request.app.state.backend.stream(body)
        first = await anext(chunks)  # a RequestError surfaces here, before any byte is sent

        async def events():
            yield f"data: {json.dumps(first)}\n\n"
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models(request: Request):
        info = await request.app.state.backend.info()
        card = {"id": info["id"], "object": "model", "created": int(time.time()), "owned_by": "plato-serve",
                "max_model_len": info["max_model_len"]}
        return {"object": "list", "data": [card]}

    @app.get("/healthz")
    async def healthz(request: Request):
        health = await request.app.state.backend.health()
        return JSONResponse(status_code=200 if health["healthy"] else 503, content=health)

    return app
