"""OpenAI-compatible request and response shapes for /v1/chat/completions and /v1/models."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content")
    @classmethod
    def _not_blank(cls, value):
        text = value if isinstance(value, str) else "".join(p.text for p in value)
        if not text.strip():
            raise ValueError("content is empty")
        return text


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send a last chunk with the usage.")


class ChatCompletionRequest(BaseModel):
    """The subset of OpenAI's chat request this server honours; unknown fields are ignored, like
    OpenAI's own optional knobs (presence_penalty, user, ...) that do not change greedy decoding."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="Served model name; any value is accepted for the one model.")
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation, oldest first.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens.")
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = Field(None, validate_default=True, description="Up to 4 strings that end the answer.")
    n: int = Field(1, ge=1, le=1, description="Only one choice per request is supported.")
    stream: bool = Field(False, description="Answer as server-sent events of chat.completion.chunk objects.")
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes at most 4 non-empty strings")
        return stops

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]


class _Completion(BaseModel):
    """Fields every completion object and chunk carries."""

    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class ChatCompletionResponse(_Completion):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[Choice]
    usage: Usage


class ChunkChoice(BaseModel):
    index: int = 0
    delta: dict
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(_Completion):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: Usage | None = None


class RequestError(ValueError):
    """A request the server understood but cannot serve; becomes HTTP 400 naming `param`."""

    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(f"{param}: {message}")
        self.param, self.message, self.status = param, message, status

    def to_data(self) -> dict:
        """A plain dict that crosses Ray intact; `RequestError(**data["error"])` rebuilds it."""
        return {"error": {"param": self.param, "message": self.message, "status": self.status}}

    def to_body(self) -> dict:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param}}
