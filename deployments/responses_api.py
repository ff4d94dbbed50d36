"""OpenAI's Responses API (`POST /v1/responses`, the `openai` client's `responses.create`) over the chat
completions this server answers: a request is read as the chat request it amounts to, and the chat answer
(or its chunks) written back as a response (or its events). Text in and out, streamed or not, with
`instructions`, `text.format` (JSON mode and structured outputs), `max_output_tokens`, and this server's
`mode`. Nothing is stored: `previous_response_id` is a 400, so a conversation is sent whole as `input`.
Function tools are served on /v1/chat/completions only (a 400 names `tools` here)."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deployments.openai_schema import ChatCompletionRequest
from graph.orchestrator import RequestMode

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class InputMessage(BaseModel):
    """One message of `input`: a role and its text, or its text parts."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict] = Field(description="The text, or parts of type input_text or output_text.")

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, value):
        if isinstance(value, list):
            for i, part in enumerate(value):
                if part.get("type") not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
                    raise ValueError(f"part {i}: only input_text and output_text parts with a text are served, "
                                     f"not {part.get('type')!r}")
        return value

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part["text"] for part in self.content)


class ResponsesRequest(BaseModel):
    """The fields of a Responses request this server reads; others are ignored, as the chat route does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="The served model's name; any other name is a 404.")
    input: list[InputMessage] = Field(description="The user's text, or the conversation as messages (text alone "
                                      "is read as one user message).")
    instructions: str | None = Field(None, description="A system message put before the input.")
    max_output_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="As OpenAI's: 1 unless given.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = Field(False, description="Answer as server-sent events (response.output_text.delta, ...).")
    text: dict | None = Field(None, description="{'format': {'type': 'text' | 'json_object' | 'json_schema', "
                              "...}}: json_schema's name, schema and strict sit beside its type.")
    tools: list | None = Field(None, description="Served on /v1/chat/completions only; must be absent or [].")
    previous_response_id: str | None = Field(None, description="Nothing is stored here; must be absent.")
    metadata: dict | None = Field(None, description="Returned as it was sent.")
    mode: RequestMode = Field("ar", description="This server's answer mode (see the chat route's `mode`).")

    @field_validator("input", mode="before")
    @classmethod
    def _some_input(cls, value):
        if isinstance(value, str):
            value = [{"role": "user", "content": value}] if value.strip() else []
        if not value:
            raise ValueError("the input is empty")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value):
        if value:
            raise ValueError("tools are served on /v1/chat/completions; this route answers in text")
        return value

    @field_validator("previous_response_id")
    @classmethod
    def _nothing_stored(cls, value):
        if value is not None:
            raise ValueError("this server stores no responses; send the whole conversation as input")
        return value

    def response_format(self) -> dict | None:
        form = (self.text or {}).get("format") or {"type": "text"}
        kind = form.get("type") if isinstance(form, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            return {"type": "json_schema", "json_schema": {k: v for k, v in form.items() if k != "type"}}
        raise ValueError(f"text.format: the 'text', 'json_object' and 'json_schema' formats are served, not {kind!r}")

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request this amounts to (ValueError, or a pydantic one, naming what is wrong)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages += [{"role": _ROLES[m.role], "content": m.text} for m in self.input]
        return ChatCompletionRequest(model=self.model, messages=messages, max_tokens=self.max_output_tokens,
                                     temperature=self.temperature, top_p=self.top_p, stream=self.stream,
                                     stream_options={"include_usage": True} if self.stream else None,
                                     response_format=self.response_format(), mode=self.mode)


def _usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


class ResponseWriter:
    """Writes one response: its ids and the request's settings, then its output as it comes."""

    def __init__(self, request: ResponsesRequest, model: str):
        self.request, self.model = request, model
        self.id, self.message_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def message(self, text: str, status: str) -> dict:
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" \
            else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def response(self, status: str, text: str | None = None, finish: str | None = None, usage: dict | None = None,
                 extra: dict | None = None) -> dict:
        """The response object; `text` None while nothing is output yet, `finish` the chat finish reason."""
        incomplete = status == "incomplete"
        output = [] if text is None else [self.message(text, "incomplete" if incomplete else "completed")]
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": self.request.instructions, "max_output_tokens": self.request.max_output_tokens,
            "temperature": self.request.temperature, "top_p": self.request.top_p, "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "previous_response_id": None, "metadata": self.request.metadata or {},
            "text": self.request.text or {"format": {"type": "text"}}, "usage": _usage(usage), **(extra or {}),
        }

    def from_chat(self, chat: dict) -> dict:
        """The whole response from the whole chat answer."""
        choice = chat["choices"][0]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        return self.response(status, choice["message"]["content"] or "", choice["finish_reason"], chat.get("usage"),
                             {"mode": chat.get("mode"), "plan": chat.get("plan")})

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
        """The response's stream events from the chat answer's chunks (`include_usage` asked)."""
        number = 0

        def event(kind: str, **fields) -> dict:
            nonlocal number
            number += 1
            return {"type": kind, "sequence_number": number - 1, **fields}

        place = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
        yield event("response.created", response=self.response("in_progress"))
        yield event("response.in_progress", response=self.response("in_progress"))
        yield event("response.output_item.added", output_index=0, item=self.message("", "in_progress"))
        yield event("response.content_part.added", **place,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        text, finish, usage, mode = "", None, None, None
        async for chunk in chunks:
            mode = chunk.get("mode", mode)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    text += piece
                    yield event("response.output_text.delta", **place, delta=piece, logprobs=[])
                finish = choice.get("finish_reason") or finish
        status = "incomplete" if finish == "length" else "completed"
        yield event("response.output_text.done", **place, text=text, logprobs=[])
        yield event("response.content_part.done", **place,
                    part={"type": "output_text", "text": text, "annotations": [], "logprobs": []})
        yield event("response.output_item.done", output_index=0, item=self.message(text, status))
        yield event(f"response.{status}", response=self.response(status, text, finish, usage, {"mode": mode}))
