"""How the planner side reaches the decoders: through the central batcher, never around it.

`BatcherClient` is both what `CompletionService` needs (an AsyncEngine-like object: tokenize, then
`generate` / `stream`) and what the plan `Orchestrator` needs (a `DecodeClient`). It tokenizes
locally, with the served model's tokenizer, and submits every request to the batcher."""
from __future__ import annotations

from collections.abc import AsyncIterator

from engine.base import chat_ids
from engine.types import GenerationRequest, Result, TokenEvent


class Tokenizing:
    """The tokenizer side of an engine: what a request is checked and encoded with."""

    def __init__(self, tokenizer, model_name: str, max_model_len: int):
        self.tokenizer, self.model_name, self.max_model_len = tokenizer, model_name, max_model_len

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return chat_ids(self.tokenizer, messages, add_generation_prompt)


class HandleBatcher:
    """A Serve handle to the batcher deployment, seen as an object with submit / stream."""

    def __init__(self, handle):
        self.handle = handle

    async def submit(self, request: dict) -> dict:
        return await self.handle.submit.remote(request)

    def stream(self, request: dict) -> AsyncIterator[dict]:
        return self.handle.options(stream=True).stream.remote(request)


class BatcherClient:
    """`batcher` has `async submit(dict) -> dict` and `stream(dict)` yielding {"event"} / {"result"}:
    a BatcherActor in-process, or a HandleBatcher."""

    def __init__(self, batcher, tokenizing: Tokenizing):
        self.batcher = batcher
        self.engine = tokenizing  # CompletionService reads model_name / max_model_len here

    async def call(self, fn):
        return fn(self.engine)

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.engine.encode_chat(messages, add_generation_prompt)

    async def generate(self, request: GenerationRequest) -> Result:
        return Result.model_validate(await self.batcher.submit(request.model_dump(mode="json")))

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent | Result]:
        async for item in self.batcher.stream(request.model_dump(mode="json")):
            if "event" in item:
                yield TokenEvent.model_validate(item["event"])
            else:
                yield Result.model_validate(item["result"])

    def health(self) -> dict:
        return {"healthy": True, "note": "the decoders' health is checked by Serve on each replica"}
