"""Turn OpenAI chat requests into engine requests and engine results into OpenAI responses.

Ray-free: the Serve decoder deployment holds one of these; tests use it directly."""
from __future__ import annotations

from pydantic import BaseModel, Field

from deployments.openai_schema import (
    AssistantMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Choice,
    RequestError,
    Usage,
)
from engine.async_engine import AsyncEngine
from engine.types import FinishReason, GenerationRequest, SamplingParams


class ApiLimits(BaseModel):
    """What a single API request may ask for."""

    default_max_tokens: int = Field(512, ge=1, description="max_tokens when the request gives none.")
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for.")


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
        )
        return GenerationRequest(prompt_ids=prompt_ids, params=params)

    async def complete(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        if request.stream:
            raise RequestError("stream", "streaming responses are not supported yet; send stream=false")
        result = await self.engine.generate(await self.to_engine_request(request))
        finish = "length" if result.finish_reason in (FinishReason.LENGTH, FinishReason.CUT) else "stop"
        return ChatCompletionResponse(
            model=self.model_name,
            choices=[Choice(message=AssistantMessage(content=result.text), finish_reason=finish)],
            usage=Usage(
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                total_tokens=result.prompt_tokens + result.completion_tokens,
            ),
        )

    async def info(self) -> dict:
        return {"id": self.model_name, "max_model_len": self.max_model_len}

    async def health(self) -> dict:
        return self.engine.health()
