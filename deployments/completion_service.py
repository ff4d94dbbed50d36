"""Turn OpenAI chat requests into engine requests and engine results into OpenAI responses.

Ray-free: the Serve decoder deployment holds one of these; tests use it directly."""
from __future__ import annotations

from collections.abc import AsyncIterator

from pydantic import BaseModel, Field

from deployments.openai_schema import (
    AssistantMessage,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Choice,
    ChunkChoice,
    RequestError,
    Usage,
)
from engine.async_engine import AsyncEngine
from engine.types import FinishReason, GenerationRequest, Result, SamplingParams


def _finish(result: Result) -> str:
    return "length" if result.finish_reason in (FinishReason.LENGTH, FinishReason.CUT) else "stop"


def _usage(result: Result) -> Usage:
    total = result.prompt_tokens + result.completion_tokens
    return Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens, total_tokens=total)


class ApiLimits(BaseModel):
    """What a single API request may ask for."""

    default_max_tokens: int = Field(512, ge=1, description="max_tokens when the request gives none.")
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for.")
    stop_on_loop: bool = Field(
        True,
        description="End an answer once it repeats itself verbatim (engine.loops); the length predictor's "
        "labels are made with the same setting.",
    )


class ChatService:
    """Validates a chat request against the model and the limits, decodes it, and shapes the answer."""

    def __init__(self, engine: AsyncEngine, limits: ApiLimits):
        self.engine = engine
        self.limits = limits
        self.model_name = engine.engine.model_name
        self.max_model_len = engine.engine.max_model_len

    async def to_engine_request(self, request: ChatCompletionRequest) -> GenerationRequest:
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        # on the engine thread: the tokenizer is not shared across threads
        prompt_ids = await self.engine.call(lambda engine: engine.encode_chat(messages))
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise RequestError(
                "messages",
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.max_model_len}",
            )
        asked = request.requested_max_tokens
        if asked is not None and asked > self.limits.max_tokens_limit:
            raise RequestError("max_tokens", f"{asked} is above this server's limit of {self.limits.max_tokens_limit}")
        if asked is not None and asked > room:
            raise RequestError(
                "max_tokens",
                f"{asked} new tokens do not fit: the prompt has {len(prompt_ids)} tokens and the context "
                f"is {self.max_model_len}, so at most {room} remain",
            )
        params = SamplingParams(
            max_tokens=asked or min(self.limits.default_max_tokens, room),
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop=request.stop,
            stop_on_loop=self.limits.stop_on_loop,
        )
        return GenerationRequest(prompt_ids=prompt_ids, params=params)

    async def complete(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        result = await self.engine.generate(await self.to_engine_request(request))
        return ChatCompletionResponse(
            model=self.model_name,
            choices=[Choice(message=AssistantMessage(content=result.text), finish_reason=_finish(result))],
            usage=_usage(result),
        )

    async def stream(self, request: ChatCompletionRequest) -> AsyncIterator[dict]:
        """OpenAI `chat.completion.chunk` dicts: the role, content deltas as tokens arrive, the
        finish reason, then usage when `stream_options.include_usage` asks. Validation happens
        before the first chunk, so a bad request fails before anything is sent."""
        engine_request = await self.to_engine_request(request)
        chunk = ChatCompletionChunk(model=self.model_name, choices=[ChunkChoice(delta={"role": "assistant"})])
        yield chunk.model_dump()
        async for item in self.engine.stream(engine_request):
            if isinstance(item, Result):
                yield chunk.model_copy(update={"choices": [ChunkChoice(delta={}, finish_reason=_finish(item))]}).model_dump()
                if request.stream_options and request.stream_options.include_usage:
                    yield chunk.model_copy(update={"choices": [], "usage": _usage(item)}).model_dump()
            elif item.text:
                yield chunk.model_copy(update={"choices": [ChunkChoice(delta={"content": item.text})]}).model_dump()

    async def info(self) -> dict:
        return {"id": self.model_name, "max_model_len": self.max_model_len}

    async def health(self) -> dict:
        return self.engine.health()
