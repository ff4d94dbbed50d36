"""OpenAI's Responses API (`POST /v1/responses`, the `openai` client's `responses.create`) over the chat
completions this server answers: a request is read as the chat request it amounts to, and the chat answer
(or its chunks) written back as a response (or its events), streamed or not: text, `instructions`,
`text.format` (JSON mode and structured outputs), `max_output_tokens`, function tools (the calls are
`function_call` output items; a later request sends them back as input items, with their
`function_call_output`s), and this server's `mode`. A response is stored (unless `store` is false, see
`deployments.response_store`) with the conversation up to it, so a later request may name it as its
`previous_response_id` and send only what follows, and `GET` / `DELETE /v1/responses/{id}` fetch or forget it."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deployments.openai_schema import ChatCompletionRequest, RequestError
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


class FunctionCallItem(BaseModel):
    """A call an earlier response made, sent back as input."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="Its arguments' JSON text, as the response gave it.")


class FunctionCallOutputItem(BaseModel):
    """What the caller's function returned for a call."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: str


InputItem = Annotated[InputMessage | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")]


class FunctionTool(BaseModel):
    """A function the model may call, as the Responses API lists it (flat, not under `function`)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def for_chat(self) -> dict:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class ResponsesRequest(BaseModel):
    """The fields of a Responses request this server reads; others are ignored, as the chat route does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="The served model's name; any other name is a 404.")
    input: list[InputItem] = Field(description="The user's text, or the conversation as messages, calls and their "
                                   "outputs (text alone is read as one user message).")
    instructions: str | None = Field(None, description="A system message put before the input.")
    max_output_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 (greedy) unless given, as on this server's "
                               "chat route.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = Field(False, description="Answer as server-sent events (response.output_text.delta, ...).")
    text: dict | None = Field(None, description="{'format': {'type': 'text' | 'json_object' | 'json_schema', "
                              "...}}: json_schema's name, schema and strict sit beside its type.")
    tools: list[FunctionTool] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | dict | None = Field(
        None, description="As chat's, a named function written {'type': 'function', 'name': ...}.")
    parallel_tool_calls: bool = Field(True, description="With 'required' or 'auto': false allows one call only.")
    previous_response_id: str | None = Field(None, description="A stored response this one follows: its conversation "
                                             "(not its instructions) comes before this input.")
    store: bool = Field(True, description="Keep this response, for `previous_response_id` and GET, as OpenAI does "
                        "by default.")
    metadata: dict | None = Field(None, description="Returned as it was sent.")
    mode: RequestMode = Field("ar", description="This server's answer mode (see the chat route's `mode`).")

    @field_validator("input", mode="before")
    @classmethod
    def _some_input(cls, value):
        if isinstance(value, str):
            value = [{"role": "user", "content": value}] if value.strip() else []
        if not value:
            raise ValueError("the input is empty")
        if isinstance(value, list):  # a message may leave its type out
            value = [{"type": "message", **item} if isinstance(item, dict) and "type" not in item else item
                     for item in value]
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
        raise RequestError("text.format", f"the 'text', 'json_object' and 'json_schema' formats are served, not {kind!r}")

    def to_chat(self, history: list[dict] | None = None) -> ChatCompletionRequest:
        """The chat request this amounts to, after `history` (the chat messages of the conversation this
        request follows; see `conversation`): a RequestError for its format, or a pydantic ValidationError."""
        instructions = [{"role": "system", "content": self.instructions}] if self.instructions else []
        messages = instructions + list(history or []) + self.input_messages()
        choice = self.tool_choice
        if isinstance(choice, dict):
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        if self.tools:
            tools = {"tools": [t.for_chat() for t in self.tools], "tool_choice": choice,
                     "parallel_tool_calls": self.parallel_tool_calls}
        else:  # "auto" and "none" mean no call where there is nothing to call; a named or required one is refused
            tools = {"tool_choice": choice} if choice not in (None, "auto", "none") else {}
        return ChatCompletionRequest(model=self.model, messages=messages, max_tokens=self.max_output_tokens,
                                     temperature=self.temperature, top_p=self.top_p, stream=self.stream,
                                     stream_options={"include_usage": True} if self.stream else None,
                                     response_format=self.response_format(), mode=self.mode, **tools)

    def input_messages(self) -> list[dict]:
        """`input` as chat messages."""
        messages = []
        for item in self.input:
            if isinstance(item, InputMessage):
                messages.append({"role": _ROLES[item.role], "content": item.text})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
            else:  # calls in a row are one assistant turn's
                call = _chat_call(item.call_id, item.name, item.arguments)
                if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return messages

    def listed_input(self) -> list[dict]:
        """`input` as the Responses API lists a stored response's input items, each with an id of its own."""
        items = []
        for item in self.input:
            if isinstance(item, InputMessage):
                kind = "output_text" if item.role == "assistant" else "input_text"
                items.append({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": item.role,
                              "status": "completed", "content": [{"type": kind, "text": item.text}]})
            elif isinstance(item, FunctionCallItem):
                items.append(ResponseWriter.call(item.call_id, item.name, item.arguments))
            else:
                items.append({"id": f"fco_{uuid.uuid4().hex}", "type": "function_call_output",
                              "call_id": item.call_id, "output": item.output, "status": "completed"})
        return items

    def conversation(self, history: list[dict] | None, response: dict) -> list[dict]:
        """The chat messages of the conversation up to and with `response` (this request's answer), which a
        request that follows it continues: `history`, this input, then the answer's output as one assistant
        turn (its text, its calls). This request's instructions are left out, as OpenAI leaves them."""
        text = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                       for part in item["content"])
        calls = [_chat_call(item["call_id"], item["name"], item["arguments"])
                 for item in response["output"] if item["type"] == "function_call"]
        turn = {"role": "assistant", "content": text if text or not calls else None}
        return [*(history or []), *self.input_messages(), {**turn, **({"tool_calls": calls} if calls else {})}]


def _chat_call(call_id: str, name: str, arguments: str) -> dict:
    """A function call as a chat assistant turn lists it."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


class ResponseWriter:
    """Writes one response: its ids and the request's settings, then its output items as they come (a
    message with the answer's text, where it has any, then a `function_call` item per call)."""

    def __init__(self, request: ResponsesRequest, model: str):
        self.request, self.model = request, model
        self.id, self.message_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())

    def message(self, text: str, status: str) -> dict:
        content = [] if status == "in_progress" else [_text_part(text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def call(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
        return {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
                "arguments": arguments, "status": status}

    def response(self, status: str, output: list[dict] | None = None, usage: dict | None = None,
                 extra: dict | None = None) -> dict:
        """The response object with `output` as far as it is written."""
        request = self.request
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output or [], "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "temperature": request.temperature, "top_p": request.top_p,
            "parallel_tool_calls": request.parallel_tool_calls, "tool_choice": request.tool_choice or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in request.tools or []],
            "previous_response_id": request.previous_response_id, "store": request.store,
            "metadata": request.metadata or {}, "text": request.text or {"format": {"type": "text"}},
            "usage": _usage(usage), **(extra or {}),
        }

    def from_chat(self, chat: dict) -> dict:
        """The whole response from the whole chat answer."""
        choice = chat["choices"][0]
        status = "incomplete" if choice["finish_reason"] == "length" else "completed"
        message, calls = choice["message"], choice["message"].get("tool_calls") or []
        output = [self.message(message["content"] or "", status)] if message["content"] or not calls else []
        output += [self.call(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
        return self.response(status, output, chat.get("usage"), {"mode": chat.get("mode"), "plan": chat.get("plan")})

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
        """The response's stream events from the chat answer's chunks (`include_usage` asked): the message
        item opens at the answer's first text, a call's item at the call's first delta."""
        number, indexes = 0, iter(range(1 << 30))

        def event(kind: str, **fields) -> dict:
            nonlocal number
            number += 1
            return {"type": kind, "sequence_number": number - 1, **fields}

        text, message_at, calls, finish, usage, mode = "", None, {}, None, None, None

        def open_message():
            nonlocal message_at
            message_at = next(indexes)
            place = {"item_id": self.message_id, "output_index": message_at, "content_index": 0}
            return [event("response.output_item.added", output_index=message_at, item=self.message("", "in_progress")),
                    event("response.content_part.added", **place, part=_text_part(""))]

        yield event("response.created", response=self.response("in_progress"))
        yield event("response.in_progress", response=self.response("in_progress"))
        async for chunk in chunks:
            mode = chunk.get("mode", mode)
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    if message_at is None:
                        for opened in open_message():
                            yield opened
                    text += delta["content"]
                    yield event("response.output_text.delta", item_id=self.message_id, output_index=message_at,
                                content_index=0, delta=delta["content"], logprobs=[])
                for piece in delta.get("tool_calls") or []:
                    call = calls.get(piece["index"])
                    if call is None:
                        call = calls[piece["index"]] = {"at": next(indexes), "id": piece["id"],
                                                        "name": piece["function"]["name"], "arguments": ""}
                        yield event("response.output_item.added", output_index=call["at"],
                                    item=self.call(call["id"], call["name"], "", "in_progress"))
                    arguments = (piece.get("function") or {}).get("arguments")
                    if arguments:
                        call["arguments"] += arguments
                        yield event("response.function_call_arguments.delta", item_id=f"fc_{call['id']}",
                                    output_index=call["at"], delta=arguments)
                finish = choice.get("finish_reason") or finish
        status = "incomplete" if finish == "length" else "completed"
        output = []
        if message_at is None and not calls:  # an empty answer is still one message
            for opened in open_message():
                yield opened
        if message_at is not None:
            place = {"item_id": self.message_id, "output_index": message_at, "content_index": 0}
            yield event("response.output_text.done", **place, text=text, logprobs=[])
            yield event("response.content_part.done", **place, part=_text_part(text))
            output.append(self.message(text, status))
            yield event("response.output_item.done", output_index=message_at, item=output[-1])
        for call in calls.values():
            yield event("response.function_call_arguments.done", item_id=f"fc_{call['id']}", output_index=call["at"],
                        name=call["name"], arguments=call["arguments"])
            output.append(self.call(call["id"], call["name"], call["arguments"]))
            yield event("response.output_item.done", output_index=call["at"], item=output[-1])
        yield event(f"response.{status}", response=self.response(status, output, usage, {"mode": mode}))


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
