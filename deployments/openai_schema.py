"""OpenAI-compatible request and response shapes for /v1/chat/completions, /v1/completions and
/v1/models, and the error every refusal becomes."""
from __future__ import annotations

import json
import time
import uuid
from functools import cached_property
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from deployments.tool_calls import NamedToolChoice, ToolSpec, call_schema, calls_schema
from engine.choice_constraint import MAX_CHOICES
from engine.json_schema import compile_schema
from graph.orchestrator import Mode, RequestMode

FinishReason = Literal["stop", "length", "tool_calls"]
MAX_STOPS = 16  # above OpenAI's 4: lm-evaluation-harness sends a task's stop sequences and the end of sequence


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's predicted outputs: text the answer is expected to repeat mostly (a file being edited)."""

    type: Literal["content"] = Field(description="The one kind OpenAI has: the predicted content.")
    content: str | list[TextPart] = Field(description="The predicted text, or its parts.")

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


def _not_blank(text: str) -> str:
    if not text.strip():
        raise ValueError("the text is empty")
    return text


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(description="The function called.")
    arguments: str | dict = Field("{}", description="Its arguments: JSON text, as OpenAI sends them, or an object.")


class MessageToolCall(BaseModel):
    """One call of an assistant message in the conversation, as a response gave it."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    tool_calls: list[MessageToolCall] | None = Field(None, description="An assistant message's calls, as a response "
                                                     "gave them.")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")
    content: str | list[TextPart] | None = Field(None, validate_default=True, description="The text; null only for "
                                                 "an assistant message that calls tools.")

    @field_validator("content")
    @classmethod
    def _joined(cls, value, info):
        if value is None:
            if info.data.get("role") == "assistant" and info.data.get("tool_calls"):
                return value
            raise ValueError("needed, except in an assistant message with tool_calls")
        return _not_blank(value if isinstance(value, str) else "".join(p.text for p in value))

    def for_template(self) -> dict:
        """The message as a chat template reads it."""
        message = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _schema(value):
    """A JSON Schema given as an object or as its text, checked to be one structured outputs serve."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"not JSON: {error}") from None
    if value is not None:
        compile_schema(value)
    return value


def _choice_name(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


class StreamOptions(BaseModel):
    include_usage: bool = Field(False, description="Send a last chunk with the usage.")


class _RequestFields(BaseModel):
    """The sampling and streaming fields both endpoints take. Unknown fields are ignored, as OpenAI's
    optional knobs that do not change the answer (user, metadata, store, ...) should be; the ones
    that would change it and are not implemented (per endpoint: functions and function_call, suffix,
    best_of) are declared so that anything but their neutral value is a 400."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="The served model's name (GET /v1/models); any other name is a 404.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: str | list[str] | None = Field(None, validate_default=True, description=f"Up to {MAX_STOPS} strings that "
                                         "end the answer (OpenAI takes 4, vLLM any number).")
    # vLLM's sampling extras, which its users send through the openai client's extra_body
    top_k: int | None = Field(None, ge=-1, description="vLLM's: sample among the k most likely tokens; -1, 0 or "
                              "null: no limit.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM's: drop tokens less likely than min_p times the "
                         "most likely one.")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="vLLM's (and Hugging Face's): divide the "
                                      "positive logits (multiply the negative) of tokens already in the prompt or "
                                      "answer by this; 1: off.")
    min_tokens: int = Field(0, ge=0, description="vLLM's: no end of sequence before this many tokens.")
    ignore_eos: bool = Field(False, description="vLLM's: go on past the end of sequence, to max_tokens "
                             "(benchmarks).")
    priority: int = Field(0, ge=-2**31, le=2**31 - 1, description="vLLM's: the lower, the sooner this request is "
                          "decoded when requests wait (0 by default; a batch job may send 1 to let interactive traffic "
                          "go first). It is strict, as vLLM's: a lower priority waits while a higher one waits; "
                          "within one priority the batcher's length bins and aging decide.")
    n: int = Field(1, ge=1, le=128, description="How many answers (choices) to the one prompt; the server's "
                   "limits.max_choices caps it. Plain answers only.")
    stream: bool = Field(False, description="Answer as server-sent events, tokens as they are decoded.")
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(None, description="Token id (as a string, as OpenAI's) -> a bias from "
                                                "-100 to 100 added to its logit: -100 bans it, 100 all but forces it.")
    # the answer's format, each by constrained decoding; one of them at most (`output_constraint`)
    response_format: dict | None = Field(
        None, description="{'type': 'text'} (the default); {'type': 'json_object'}: the answer is one JSON object; "
        "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}: the answer is JSON that validates "
        "against the schema (engine.json_schema lists the keywords served).")
    guided_json: dict | str | None = Field(None, description="vLLM's: a JSON Schema (or its text) the answer "
                                           "follows, as response_format's json_schema.")
    guided_choice: list[str] | None = Field(None, description="vLLM's: the answer is exactly one of these strings.")
    structured_outputs: dict | None = Field(None, description="vLLM's newer form of the guided fields: {'json': a "
                                            "schema}, {'choice': [...]} or {'json_object': true}.")

    @field_validator("logit_bias")
    @classmethod
    def _bias_by_token_id(cls, value):
        for token, bias in (value or {}).items():
            if not token.isdigit() or not -100.0 <= bias <= 100.0:
                raise ValueError(f"{token!r}: {bias}: keys are token ids, biases lie in [-100, 100]")
        if len(value or {}) > 300:
            raise ValueError(f"at most 300 tokens may be biased, got {len(value)}")
        return value

    @field_validator("response_format")
    @classmethod
    def _served_formats(cls, value):
        kind = (value or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise ValueError(f"the 'text', 'json_object' and 'json_schema' formats are served, not {kind!r}")
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise ValueError("json_schema: an object with the JSON Schema under 'schema' (and a 'name')")
            compile_schema(spec["schema"])  # an unsupported keyword is a 400 naming it, before any decoding
        return value

    @field_validator("guided_json")
    @classmethod
    def _guided_schema(cls, value):
        return _schema(value)

    @field_validator("guided_choice")
    @classmethod
    def _choices(cls, value):
        if value is not None and not (0 < len(value) <= MAX_CHOICES and all(value)):
            raise ValueError(f"1 to {MAX_CHOICES} non-empty strings")
        return value

    @field_validator("structured_outputs")
    @classmethod
    def _served_structures(cls, value):
        if value is None:
            return value
        given = {k: v for k, v in value.items() if v not in (None, False)}
        unknown = sorted(set(given) - {"json", "choice", "json_object"})
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not served (json, choice and json_object are)")
        if len(given) != 1:
            raise ValueError("give one of json, choice and json_object")
        if "json" in given:
            given["json"] = _schema(given["json"])
        if "choice" in given:
            given["choice"] = cls._choices(given["choice"]) if isinstance(given["choice"], list) else None
            if given["choice"] is None:
                raise ValueError("choice: a list of strings")
        return given

    @cached_property
    def formats(self) -> list[tuple[str, tuple[str, dict | None]]]:
        """Each format the request asks for, as (its field, (the engine's constraint, its argument)):
        tool calls first, then the answer's format fields."""
        return self._tool_formats() + self._text_formats()

    def _tool_formats(self) -> list[tuple[str, tuple[str, dict | None]]]:
        return []

    def _text_formats(self) -> list[tuple[str, tuple[str, dict | None]]]:
        asked = []
        kind = (self.response_format or {}).get("type", "text")
        if kind == "json_schema":
            asked.append(("response_format", ("json_schema", self.response_format["json_schema"]["schema"])))
        elif kind == "json_object":
            asked.append(("response_format", ("json_object", None)))
        if self.guided_json is not None:
            asked.append(("guided_json", ("json_schema", self.guided_json)))
        if self.guided_choice is not None:
            asked.append(("guided_choice", ("choice", {"choices": self.guided_choice})))
        for key, value in (self.structured_outputs or {}).items():
            constraint = {"json": ("json_schema", value), "choice": ("choice", {"choices": value}),
                          "json_object": ("json_object", None)}[key]
            asked.append(("structured_outputs", constraint))
        return asked

    @property
    def output_constraint(self) -> tuple[str, dict | None] | None:
        """The engine constraint (and its argument) the answer is decoded under; None for free text.
        When several formats are asked, the first (the service refuses such a request)."""
        return self.formats[0][1] if self.formats else None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop takes at most {MAX_STOPS} non-empty strings")
        return stops

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_RequestFields):
    """The subset of OpenAI's chat request this server honours, plus how to answer (`mode`)."""

    messages: list[ChatMessage] = Field(min_length=1, description="The conversation, oldest first.")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens.")
    mode: RequestMode = Field(
        "ar",
        description="How to answer: 'ar' plain decoding, 'sot' Skeleton-of-Thought, 'plato' a plan DAG, "
        "'auto' routed per question. The response's `mode` says which mode produced the answer.",
    )
    return_plan: bool = Field(False, description="With a planned answer (sot, plato), return its plan and "
                              "per-node timings in the response's `plan` field.")
    logprobs: bool | None = Field(None, description="Return each answer token's log probability (plain answers).")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="With logprobs: also the this-many most "
                                     "likely tokens at each place.")
    prediction: Prediction | None = Field(
        None, description="OpenAI's predicted outputs: text the answer is expected to repeat mostly. Its tokens are "
        "checked as drafts (engine.drafts.PredictionDrafts) and kept where the model would have written them: the "
        "answer is the same, sooner; the usage counts the accepted and rejected ones. Plain answers only.")
    tools: list[ToolSpec] | None = Field(None, description="Functions the model may call (deployments.tool_calls).")
    parallel_tool_calls: bool = Field(True, description="With 'required' or 'auto': false allows one call only.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, validate_default=True, description="'required' or a named function: the answer is tool calls; "
        "'auto' (the default with tools): text or calls, as the model decides, calls written in <tool_call> tags "
        "and held to the tools' schemas; 'none': a plain answer (deployments.tool_calls).")
    functions: list | None = Field(None, description="OpenAI's older tools field; must be absent, null or [].")
    function_call: str | dict | None = Field(None, description="Only 'none' (use tools and tool_choice).")

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, value, info):
        if value and not info.data.get("logprobs"):
            raise ValueError("set logprobs to true to ask for top_logprobs")
        return value

    @property
    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def prompts(self) -> list[list[ChatMessage]]:
        return [self.messages]  # one conversation

    @property
    def prompt_logprobs_asked(self) -> int | None:
        return None  # chat has no echo

    @field_validator("functions")
    @classmethod
    def _unsupported(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} is not supported; send tools instead")
        return value

    @field_validator("function_call")
    @classmethod
    def _no_calls(cls, value):
        if value not in (None, "none"):
            raise ValueError("only 'none' is accepted; send tools and tool_choice instead")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _served_choice(cls, value, info):
        tools = info.data.get("tools") or []
        if value is None:
            value = "auto" if tools else "none"
        if value == "none":
            return value
        if not tools:
            raise ValueError(f"{_choice_name(value)} needs tools")
        if value == "auto":
            compile_schema(call_schema(tools))
            return value
        if isinstance(value, NamedToolChoice) and value.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"{value.function.name!r} is not among the tools")
        compile_schema(calls_schema(tools, value, info.data.get("parallel_tool_calls", True)))
        return value

    @property
    def calls_tools(self) -> bool:
        """The answer is tool calls ('required' or a named function)."""
        return self.tool_choice not in (None, "none", "auto")

    @property
    def may_call_tools(self) -> bool:
        """The answer is text or tool calls, as the model decides ('auto')."""
        return self.tool_choice == "auto"

    def _tool_formats(self) -> list[tuple[str, tuple[str, dict | None]]]:
        if self.calls_tools:
            return [("tool_choice", ("json_schema", calls_schema(self.tools, self.tool_choice,
                                                                 self.parallel_tool_calls)))]
        if self.may_call_tools:
            return [("tool_choice", ("tool_calls_or_text", {"call_schema": call_schema(self.tools),
                                                            "parallel": self.parallel_tool_calls}))]
        return []

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_RequestFields):
    """OpenAI's legacy text completion: raw prompts, decoded without a chat template; with `echo` and
    `logprobs`, scores the prompt too (what lm-evaluation-harness's `local-completions` asks)."""

    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="The text to continue: a string, a list of token ids, or a list of either for several "
        "prompts in one request (choice i * n + j answers prompt i).")
    max_tokens: int | None = Field(None, ge=0, description="Most tokens to generate; 0 only with echo: the prompt "
                                   "is scored and nothing generated.")
    echo: bool = Field(False, description="Start each choice's text with its prompt; with logprobs, the prompt's "
                       "tokens are scored too (the first has no logprob).")
    logprobs: int | None = Field(None, ge=0, le=20, description="Return each answer token's log probability "
                                 "and the this-many most likely tokens at its place.")
    suffix: str | None = Field(None, description="Not supported (no insertion); must be absent, null or empty.")
    best_of: int | None = Field(None, description="Only 1 (or absent): every choice asked is returned.")

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value):
        """One clear message for a prompt of the wrong shape, before the union would name its members."""
        def one(item) -> bool:
            return isinstance(item, str) or (isinstance(item, list) and all(type(t) is int for t in item))

        several = isinstance(value, list) and all(one(item) for item in value) and len({type(i) for i in value}) <= 1
        if not (one(value) or several):
            raise ValueError("give a string, a list of token ids, or a list of either")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompts_not_empty(cls, value):
        prompts = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
        if not prompts:
            raise ValueError("no prompt given")
        for prompt in prompts:
            if isinstance(prompt, str):
                _not_blank(prompt)
            elif not prompt:
                raise ValueError("a prompt of token ids is empty")
            elif min(prompt) < 0:
                raise ValueError("token ids are not negative")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or several, each a string or token ids."""
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)

    @property
    def logprobs_asked(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_asked(self) -> int | None:
        return self.logprobs if self.echo else None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported; leave the field out")
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only best_of 1 is supported; ask for several answers with n")
        return value


class TokenizeRequest(BaseModel):
    """vLLM's POST /tokenize: a prompt's token ids (or a conversation's, with the chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="The served model's name; any other name is a 404.")
    prompt: str | None = Field(None, description="Text to tokenize as it is (give this or messages).")
    messages: list[ChatMessage] | None = Field(None, min_length=1, validate_default=True, description="A "
                                               "conversation to tokenize with the chat template (give this or prompt).")
    add_generation_prompt: bool = Field(True, description="With messages: end with the assistant's turn opening.")
    add_special_tokens: bool = Field(False, description="With prompt: add the tokenizer's special tokens (BOS). "
                                     "/v1/completions adds none, so the default gives its prompt's ids.")

    @field_validator("messages")
    @classmethod
    def _one_of(cls, value, info):
        if (value is None) == (info.data.get("prompt") is None):
            raise ValueError("give either prompt or messages")
        return value


class DetokenizeRequest(BaseModel):
    """vLLM's POST /detokenize: the text of token ids."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, description="The served model's name; any other name is a 404.")
    tokens: list[int] = Field(description="Token ids of the served model's vocabulary.")


OpenAIRequest = ChatCompletionRequest | CompletionRequest


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens whose KV came from the decoder's prefix cache (a "
                               "conversation's earlier turns, a shared system message) instead of being computed.")


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = Field(description="Tokens of the prediction that the answers wrote, as drafted.")
    rejected_prediction_tokens: int = Field(description="Tokens of the prediction checked as drafts and not written "
                                            "(each check counted): work spent on the prediction to no gain.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = Field(
        None, description="As OpenAI's; for plain answers (a planned answer's prompts are its nodes').")
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="With a prediction: how much of it the answers took (left out without one).")

    @model_serializer(mode="wrap")
    def _without_absent_details(self, handler):
        data = handler(self)
        if data.get("completion_tokens_details") is None:
            data.pop("completion_tokens_details", None)
        return data


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict] | None = Field(None, description="The calls the answer makes (deployments.tool_calls).")


class Choice(BaseModel):
    index: int = Field(0, description="Which of the request's n choices this is.")
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: dict | None = Field(None, description="With logprobs: {'content': [...], 'refusal': None}.")


class _Completion(BaseModel):
    """Fields every completion object and chunk carries."""

    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class ChatCompletionResponse(_Completion):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[Choice]
    usage: Usage
    mode: Mode = Field(description="The answer mode that produced this answer.")
    plan: dict | None = Field(None, description="With return_plan: the plan, its timings and any fallback.")


class ChunkChoice(BaseModel):
    index: int = 0
    delta: dict
    finish_reason: FinishReason | None = None
    logprobs: dict | None = None


class ChatCompletionChunk(_Completion):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]
    usage: Usage | None = None
    mode: Mode = Field(description="The answer mode that produced this answer.")

    def calls(self, calls: list[dict] | None, text: str | None, index: int = 0) -> dict:
        """A choice's tool calls, whole, in OpenAI's stream shape (each call with its index in the list);
        its text instead when the answer was cut before its calls were whole."""
        if calls is None:
            return self.piece(text or "", index=index)
        return self.call_deltas([{"index": k, **call} for k, call in enumerate(calls)], index)

    def call_deltas(self, deltas: list[dict], index: int = 0) -> dict:
        """Tool-call deltas (`deployments.tool_call_stream`) of a choice."""
        return self.model_copy(update={"choices": [ChunkChoice(index=index, delta={"tool_calls": deltas})]}).model_dump()

    def piece(self, text: str, finish_reason: FinishReason | None = None, index: int = 0,
              logprobs: dict | None = None) -> dict:
        delta = {"content": text} if text else {}
        choice = ChunkChoice(index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs)
        return self.model_copy(update={"choices": [choice]}).model_dump()

    def opening(self, index: int = 0) -> dict:
        """A choice's first chunk: the assistant's role, no text yet."""
        return self.model_copy(update={"choices": [ChunkChoice(index=index, delta={"role": "assistant"})]}).model_dump()


class TextChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: dict | None = None
    finish_reason: FinishReason | None = None


class TextCompletion(_Completion):
    """A `text_completion` object: the whole answer, or one streamed chunk of it."""

    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]
    usage: Usage | None = None

    def piece(self, text: str, finish_reason: FinishReason | None = None, index: int = 0,
              logprobs: dict | None = None) -> dict:
        choice = TextChoice(index=index, text=text, finish_reason=finish_reason, logprobs=logprobs)
        return self.model_copy(update={"choices": [choice]}).model_dump()


class RequestError(ValueError):
    """A request the server understood but will not serve: HTTP `status` with an OpenAI error
    body naming `param` (None when no single field is to blame) and, where OpenAI has one, a `code`."""

    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None):
        super().__init__(f"{param}: {message}" if param else message)
        self.param, self.message, self.status, self.code = param, message, status, code

    def to_data(self) -> dict:
        """A plain dict that crosses Ray intact; `RequestError(**data["error"])` rebuilds it."""
        return {"error": {"param": self.param, "message": self.message, "status": self.status, "code": self.code}}

    def to_body(self) -> dict:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def check_model(asked: str | None, served: str) -> None:
    """A request may name the served model, never another (404 `model_not_found`)."""
    if asked is not None and asked != served:
        raise RequestError("model", f"the model `{asked}` does not exist; this server serves `{served}`",
                           status=404, code="model_not_found")
