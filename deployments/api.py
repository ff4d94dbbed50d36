"""The HTTP surface: OpenAI-compatible routes over any backend with complete/stream/info/health."""
from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Literal, Protocol

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from deployments.admission import RETRY_AFTER_S, Admission
from deployments.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIRequest,
    RequestError,
    TokenizeRequest,
    check_model,
)
from deployments.response_store import LocalResponses
from deployments.responses_api import ResponsesRequest, ResponseWriter

log = logging.getLogger(__name__)


class CompletionBackend(Protocol):
    """Where the routes send work: a CompletionService in-process, or a Serve handle to decoder replicas.
    `complete` returns the response (a pydantic model or its dict); `stream` yields chunk dicts."""

    async def complete(self, request: OpenAIRequest): ...

    def stream(self, request: OpenAIRequest) -> AsyncIterator[dict]: ...

    async def info(self) -> dict: ...

    async def health(self) -> dict: ...

    async def tokenize(self, request: TokenizeRequest) -> dict: ...

    async def detokenize(self, request: DetokenizeRequest) -> dict: ...

    async def tokenizer_info(self) -> dict: ...


def _field_path(loc: tuple) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "body"


def _as_request_error(exc: Exception) -> RequestError:
    """What a client is told of a failure: a RequestError as it is, anything else as a 500 naming the
    exception (the one a Ray call carried, not Ray's wrapper and its traceback)."""
    if isinstance(exc, RequestError):
        return exc
    cause = getattr(exc, "cause", None) or exc
    return RequestError(None, f"the server failed to answer this request: {type(cause).__name__}: {cause}", status=500)


async def _started(chunks: AsyncIterator[dict]) -> tuple[dict, AsyncIterator[dict]]:
    """A stream's first chunk, awaited now (a RequestError surfaces here, before any byte is sent), and the
    whole stream, that chunk first (for a reader that takes chunks from one iterator, as the Responses
    writer does; the chat route iterates the backend's own stream, its disconnect path as it was)."""
    first = await anext(chunks)

    async def whole():
        yield first
        async for chunk in chunks:
            yield chunk

    return first, whole()


async def _answer(backend: CompletionBackend, body: OpenAIRequest):
    if not body.stream:
        return await backend.complete(body)
    chunks = backend.stream(body)
    first = await anext(chunks)  # a RequestError surfaces here, before any byte is sent

    async def events():
        yield f"data: {json.dumps(first)}\n\n"
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as exc:  # the status is sent already: the stream ends with an error event, as vLLM's do
            log.exception("a streamed answer failed partway")
            yield f"data: {json.dumps(_as_request_error(exc).to_body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


# a chat field a Responses request's error names by the Responses field it came from
_RESPONSES_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


class ResponseRecords(Protocol):
    """Where responses are stored (deployments.response_store): in this process, or the context-cache actor."""

    async def put_response(self, response_id: str, record: dict) -> bool: ...

    async def get_response(self, response_id: str) -> dict | None: ...

    async def delete_response(self, response_id: str) -> bool: ...


def _responses_chat(body: ResponsesRequest, history: list[dict] | None) -> ChatCompletionRequest:
    try:
        return body.to_chat(history)
    except ValidationError as error:
        first = error.errors()[0]
        path = _field_path(first["loc"])
        head, _, rest = path.partition(".")
        raise RequestError(".".join(filter(None, [_RESPONSES_FIELDS.get(head, head), rest])), first["msg"]) from None


async def _stored(records: ResponseRecords, response_id: str, param: str | None) -> dict:
    """A stored response's record; a 400 naming `param` (a follow-up's `previous_response_id`), or a 404 (a
    route's own id), where none is kept under that id."""
    record = await records.get_response(response_id)
    if record is None:
        raise _not_stored(response_id, param)
    return record


def _not_stored(response_id: str, param: str | None) -> RequestError:
    message = f"no response with id {response_id!r} is stored here (never stored, deleted or forgotten)"
    if param:
        return RequestError(param, message, code="previous_response_not_found")
    return RequestError(None, message, status=404, code="not_found")


async def _respond(backend: CompletionBackend, records: ResponseRecords, body: ResponsesRequest):
    """A Responses request answered as the chat request it amounts to (deployments.responses_api), after
    the conversation of the response it follows; stored with its own, unless `store` is false."""
    history = None
    if body.previous_response_id is not None:
        history = (await _stored(records, body.previous_response_id, "previous_response_id"))["messages"]
    chat = _responses_chat(body, history)

    async def keep(response: dict) -> None:
        if not body.store:
            return
        try:
            await records.put_response(response["id"], {"response": response, "input": body.listed_input(),
                                                        "messages": body.conversation(history, response)})
        except Exception:  # the answer is made: it goes out, and only a follow-up to it will be refused
            log.exception("response %s could not be stored", response["id"])

    if not body.stream:
        answer = await backend.complete(chat)
        answer = answer if isinstance(answer, dict) else answer.model_dump()
        response = ResponseWriter(body, answer["model"]).from_chat(answer)
        await keep(response)
        return response
    first, chunks = await _started(backend.stream(chat))

    async def events():
        writer, number = ResponseWriter(body, first["model"]), 0
        try:
            async for event in writer.events(chunks):
                number = event["sequence_number"] + 1
                if event["type"] in ("response.completed", "response.incomplete"):
                    await keep(event["response"])  # before the client hears it is done, so it can follow it up
                yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
        except Exception as exc:  # the status is sent already: the stream ends with an error event
            log.exception("a streamed response failed partway")
            error = _as_request_error(exc)
            payload = {"type": "error", "sequence_number": number, "message": error.message, "code": error.code,
                       "param": error.param}
            yield f"event: error\ndata: {json.dumps(payload)}\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def create_app(backend: CompletionBackend, *, api_key: str | None, max_in_flight: int,
               responses: ResponseRecords | None = None) -> FastAPI:
    """The FastAPI app over `backend`. With `api_key`, every /v1 route wants `Authorization: Bearer
    <api_key>`; past `max_in_flight` requests at once, new ones get 503 (see deployments.admission).
    `responses`: where the Responses API's responses are stored (default: in this process)."""
    app = FastAPI(title="plato-serve", description="OpenAI-compatible LLM serving on Ray Serve")
    app.state.backend = backend
    app.state.responses = responses if responses is not None else LocalResponses()
    app.add_middleware(Admission, api_key=api_key, max_in_flight=max_in_flight)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first, more = exc.errors()[0], len(exc.errors()) - 1
        error = RequestError(_field_path(first["loc"]), first["msg"] + (f" ({more} more)" if more else ""))
        return JSONResponse(status_code=400, content=error.to_body())

    @app.exception_handler(RequestError)
    async def _refused(_: Request, exc: RequestError):
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
        return JSONResponse(status_code=exc.status, content=exc.to_body(), headers=headers)

    @app.exception_handler(Exception)
    async def _failed(_: Request, exc: Exception):
        # a bug or a fault: a 500 that says which, in OpenAI's shape (Starlette raises the exception on
        # once this is sent, and the server logs it)
        return JSONResponse(status_code=500, content=_as_request_error(exc).to_body())

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _answer(request.app.state.backend, body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _answer(request.app.state.backend, body)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await _respond(request.app.state.backend, request.app.state.responses, body)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str, request: Request):
        return (await _stored(request.app.state.responses, response_id, None))["response"]

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                          order: Literal["asc", "desc"] = "desc", after: str | None = None):
        """A stored response's own input items (not those of the responses it follows), a page at a time."""
        items = (await _stored(request.app.state.responses, response_id, None))["input"]
        items = items if order == "asc" else items[::-1]
        start = 0
        if after is not None:
            start = next((i + 1 for i, item in enumerate(items) if item["id"] == after), None)
            if start is None:
                raise RequestError("after", f"no input item of response {response_id!r} has id {after!r}")
        page = items[start:start + limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)}

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        if not await request.app.state.responses.delete_response(response_id):
            raise _not_stored(response_id, None)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    async def model_card(request: Request) -> dict:
        info = await request.app.state.backend.info()
        return {"id": info["id"], "object": "model", "created": int(time.time()), "owned_by": "plato-serve",
                "max_model_len": info["max_model_len"]}

    @app.get("/v1/models")
    async def models(request: Request):
        return {"object": "list", "data": [await model_card(request)]}

    @app.get("/v1/models/{model:path}")  # the openai client's models.retrieve; ids may hold a slash
    async def model(model: str, request: Request):
        card = await model_card(request)
        check_model(model, card["id"])
        return card

    # vLLM's tokenizer routes, outside /v1 as vLLM has them: lm-evaluation-harness's API models look for
    # them and then tokenize through the server, so no client needs the model's files
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        return await request.app.state.backend.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request):
        return await request.app.state.backend.detokenize(body)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        return await request.app.state.backend.tokenizer_info()

    @app.get("/healthz")
    @app.get("/health")  # vLLM's name for it, which probes written for vLLM ask
    async def healthz(request: Request):
        health = await request.app.state.backend.health()
        return JSONResponse(status_code=200 if health["healthy"] else 503, content=health)

    return app
