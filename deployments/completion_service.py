"""Turn OpenAI chat and text completion requests into engine requests, and engine results into
OpenAI responses.

Ray-free: the Serve decoder deployment holds one of these; tests use it directly."""
from __future__ import annotations

import time
from collections.abc import AsyncIterator

from pydantic import BaseModel, ConfigDict, Field

from deployments.openai_schema import (
    AssistantMessage,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Choice,
    ChunkChoice,
    CompletionRequest,
    OpenAIRequest,
    RequestError,
    TextChoice,
    TextCompletion,
    Usage,
)
from engine.async_engine import AsyncEngine
from engine.types import FinishReason, GenerationRequest, Result, SamplingParams
from graph.orchestrator import Answer, Orchestrator

PLAIN_MODE = "ar"


def _finish(result: Result) -> str:
    return "length" if result.finish_reason in (FinishReason.LENGTH, FinishReason.CUT) else "stop"


def _usage(result: Result) -> Usage:
    total = result.prompt_tokens + result.completion_tokens
    return Usage(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens, total_tokens=total)


def is_planned(request: OpenAIRequest) -> bool:
    """Planning answers one question: a single user message asked in a mode other than `ar`. Any
    other request is answered by plain decoding, whatever its mode."""
    return (isinstance(request, ChatCompletionRequest) and request.mode != PLAIN_MODE and len(request.messages) == 1
            and request.messages[0].role == "user")


class ApiLimits(BaseModel):
    """What a single API request may ask for, and how many requests an ingress replica holds."""

    model_config = ConfigDict(extra="forbid")

    default_max_tokens: int = Field(512, ge=1, description="max_tokens when the request gives none.")
    max_tokens_limit: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for.")
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="Longest prompt a request may send, in tokens (chat template included); "
        "default: as long as the model's context leaves room for one answer token.",
    )
    max_queued_requests: int = Field(
        256,
        ge=1,
        description="Most requests one ingress replica holds at once, decoding or waiting for a decoder; "
        "past it a request is refused at once with HTTP 503 and Retry-After. Counted per ingress replica.",
    )
    stop_on_loop: bool = Field(
        True,
        description="End an answer once it repeats itself verbatim (engine.loops); the length predictor's "
        "labels are made with the same setting.",
    )


class CompletionService:
    """Serves chat and text completions from one engine: checks a request against the served model
    and the limits, decodes it, and shapes the answer the way its endpoint expects."""

    def __init__(self, engine: AsyncEngine, limits: ApiLimits, orchestrator: Orchestrator | None = None,
                 observer=None):
        """`observer`: deployments.metrics.AnswerMetrics, or None."""
        self.engine = engine
        self.observer = observer
        self.limits = limits
        self.orchestrator = orchestrator  # answers sot / plato / auto; without it every mode is `ar`
        self.model_name = engine.engine.model_name
        self.max_model_len = engine.engine.max_model_len

    async def _encode(self, request: OpenAIRequest) -> tuple[list[int], str]:
        """The prompt's token ids and the field that holds the prompt. Tokenized on the engine
        thread: the tokenizer is not shared across threads."""
        if isinstance(request, CompletionRequest):
            text = request.prompt
            return await self.engine.call(lambda engine: engine.encode(text)), "prompt"
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        return await self.engine.call(lambda engine: engine.encode_chat(messages)), "messages"

    async def to_engine_request(self, request: OpenAIRequest) -> GenerationRequest:
        if request.model is not None and request.model != self.model_name:
            raise RequestError(
                "model",
                f"the model `{request.model}` does not exist; this server serves `{self.model_name}`",
                status=404,
                code="model_not_found",
            )
        prompt_ids, param = await self._encode(request)
        limit = self.limits.max_prompt_tokens
        if limit is not None and len(prompt_ids) > limit:
            raise RequestError(param, f"the prompt has {len(prompt_ids)} tokens; this server accepts at most {limit}")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise RequestError(
                param, f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.max_model_len}"
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
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            stop=request.stop,
            stop_on_loop=self.limits.stop_on_loop,
        )
        return GenerationRequest(prompt_ids=prompt_ids, params=params)

    def _planned(self, request: OpenAIRequest) -> bool:
        return self.orchestrator is not None and is_planned(request)

    async def _plan_and_answer(self, request: ChatCompletionRequest, engine_request: GenerationRequest) -> Answer:
        budget = {"max_tokens": engine_request.params.max_tokens, "stop_on_loop": self.limits.stop_on_loop}
        orchestrator = Orchestrator(self.orchestrator.client, self.orchestrator.config.model_copy(update=budget))
        return await orchestrator.answer(request.messages[0].content, request.mode)

    def _planned_response(self, request, engine_request, answer: Answer) -> ChatCompletionResponse:
        usage = Usage(prompt_tokens=len(engine_request.prompt_ids), completion_tokens=answer.completion_tokens,
                      total_tokens=len(engine_request.prompt_ids) + answer.completion_tokens)
        plan = None
        if request.return_plan:
            plan = {"nodes": [n.model_dump() for n in answer.plan.nodes] if answer.plan else [],
                    "plan_s": answer.plan_s, "fallback": answer.fallback, "routed": answer.routed,
                    "node_timings": [t.model_dump() for t in answer.nodes]}
        choice = Choice(message=AssistantMessage(content=answer.text), finish_reason="stop")
        return ChatCompletionResponse(model=self.model_name, choices=[choice], usage=usage, mode=answer.mode, plan=plan)

    def _observe(self, mode: str, planned: bool, fell_back: bool, started: float) -> None:
        if self.observer is not None:
            self.observer.answered(mode, planned, fell_back, time.perf_counter() - started)

    async def complete(self, request: OpenAIRequest) -> ChatCompletionResponse | TextCompletion:
        started = time.perf_counter()
        engine_request = await self.to_engine_request(request)
        if self._planned(request):
            answer = await self._plan_and_answer(request, engine_request)
            self._observe(answer.mode, True, answer.fallback is not None, started)
            return self._planned_response(request, engine_request, answer)
        result = await self.engine.generate(engine_request)
        self._observe(PLAIN_MODE, False, False, started)
        finish, usage = _finish(result), _usage(result)
        if isinstance(request, CompletionRequest):
            choice = TextChoice(text=result.text, finish_reason=finish)
            return TextCompletion(model=self.model_name, choices=[choice], usage=usage)
        choice = Choice(message=AssistantMessage(content=result.text), finish_reason=finish)
        return ChatCompletionResponse(model=self.model_name, choices=[choice], usage=usage, mode=PLAIN_MODE)

    async def stream(self, request: OpenAIRequest) -> AsyncIterator[dict]:
        """OpenAI chunk dicts (`chat.completion.chunk`, or `text_completion` for a raw prompt): for
        chat the role first, then text pieces as tokens arrive, the finish reason, then usage when
        `stream_options.include_usage` asks. The request is checked before the first chunk, so a bad
        one fails before anything is sent."""
        started = time.perf_counter()
        engine_request = await self.to_engine_request(request)
        if self._planned(request):  # a planned answer is assembled from its nodes, then sent whole
            answer = await self._plan_and_answer(request, engine_request)
            self._observe(answer.mode, True, answer.fallback is not None, started)
            if self.observer is not None:
                self.observer.first_token(time.perf_counter() - started)
            response = self._planned_response(request, engine_request, answer)
            chunk = ChatCompletionChunk(model=self.model_name, choices=[], mode=response.mode)
            yield chunk.model_copy(update={"choices": [ChunkChoice(delta={"role": "assistant"})]}).model_dump()
            yield chunk.piece(response.choices[0].message.content)
            yield chunk.piece("", "stop")
            if request.include_usage:
                yield chunk.model_copy(update={"choices": [], "usage": response.usage}).model_dump()
            return
        if isinstance(request, CompletionRequest):
            chunk = TextCompletion(model=self.model_name, choices=[])
        else:
            chunk = ChatCompletionChunk(model=self.model_name, choices=[], mode=PLAIN_MODE)
            yield chunk.model_copy(update={"choices": [ChunkChoice(delta={"role": "assistant"})]}).model_dump()
        first = True
        async for item in self.engine.stream(engine_request):
            if isinstance(item, Result):
                self._observe(PLAIN_MODE, False, False, started)
                yield chunk.piece("", _finish(item))
                if request.include_usage:
                    yield chunk.model_copy(update={"choices": [], "usage": _usage(item)}).model_dump()
            elif item.text:
                if first and self.observer is not None:
                    self.observer.first_token(time.perf_counter() - started)
                first = False
                yield chunk.piece(item.text)

    async def info(self) -> dict:
        return {"id": self.model_name, "max_model_len": self.max_model_len}

    async def health(self) -> dict:
        return self.engine.health()
