"""Tool calling (OpenAI's `tools` and `tool_choice`) by constrained decoding.

- `tool_choice: {"type": "function", "function": {"name": N}}`: the answer is N's arguments, decoded
  under its `parameters` schema; the response carries one call to N.
- `tool_choice: "required"`: the answer is a JSON list of calls, `[{"name": ..., "parameters": {...}}]`,
  each one a tool of the request with arguments that validate against its schema (one call at most
  with `parallel_tool_calls: false`); the response carries them as `tool_calls`.
- `"auto"` (OpenAI's default when tools are given): text, or calls written as Hermes-style models
  write them, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (vLLM's `hermes` parser
  reads the same); once the answer opens a call, the call is held to the tools' schemas
  (engine.tool_call_constraint), so a call is never malformed; text is left free.
- `"none"`: a plain answer; the tools are still shown to the model.

A model whose chat template renders `tools` gets them through it; for one whose template does not
(the embedded SmolLM2's), the tools and the expected answer are described in a system message, and
earlier calls and their results in the conversation are written as text it can render.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from engine.tool_call_constraint import CLOSE, OPEN

CALLS_FORMAT = 'a JSON list of calls, each {"name": the function\'s name, "parameters": its arguments}'


class FunctionSpec(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="The function's name, as OpenAI allows it.")
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}},
                             description="A JSON Schema of the arguments (an object); none: no arguments.")
    strict: bool | None = Field(None, description="Accepted: the arguments always follow the schema here.")


class ToolSpec(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


def calls_schema(tools: list[ToolSpec], choice: str | NamedToolChoice, parallel: bool) -> dict:
    """The JSON Schema the answer is decoded under: the named function's parameters, or for
    "required" a list of calls to any of the tools."""
    if isinstance(choice, NamedToolChoice):
        return next(t.function.parameters for t in tools if t.function.name == choice.function.name)
    schema = {"type": "array", "items": call_schema(tools, "parameters"), "minItems": 1}
    schema["$defs"] = schema["items"].pop("$defs", {})
    if not schema["$defs"]:
        del schema["$defs"]
    if not parallel:
        schema["maxItems"] = 1
    return schema


def call_schema(tools: list[ToolSpec], arguments_key: str = "arguments") -> dict:
    """The JSON Schema of one call to any of the tools: {"name": its name, `arguments_key`: its
    arguments}. Each tool's $defs move to the root, renamed, with its references rewritten to them."""
    definitions, options = {}, []
    for i, tool in enumerate(tools):
        prefix, parameters = f"tool{i}-", dict(tool.function.parameters)
        for where in ("$defs", "definitions"):
            for name, body in (parameters.pop(where, None) or {}).items():
                definitions[prefix + name] = _prefixed_refs(body, prefix)
        options.append({"type": "object", "properties": {"name": {"const": tool.function.name},
                                                         arguments_key: _prefixed_refs(parameters, prefix)},
                        "required": ["name", arguments_key], "additionalProperties": False})
    schema = {"anyOf": options}
    if definitions:
        schema["$defs"] = definitions
    return schema


def _prefixed_refs(value, prefix: str):
    """`value` with its references into `#/$defs/X` (or `#/definitions/X`) pointing at `#/$defs/<prefix>X`."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if key == "$ref" and isinstance(item, str):
                old = next((o for o in ("#/$defs/", "#/definitions/") if item.startswith(o)), None)
                item = f"#/$defs/{prefix}{item[len(old):]}" if old else item
            out[key] = _prefixed_refs(item, prefix)
        return out
    if isinstance(value, list):
        return [_prefixed_refs(item, prefix) for item in value]
    return value


def tool_calls(text: str, choice: str | NamedToolChoice) -> list[dict] | None:
    """The calls an answer decoded under `calls_schema` makes, in OpenAI's shape (`arguments` as JSON
    text); None when the answer is not whole (it ran out of tokens), so it cannot be read as calls."""
    try:
        answer = json.loads(text)
    except ValueError:
        return None
    if isinstance(choice, NamedToolChoice):
        return [_call(choice.function.name, answer)]
    return [_call(call["name"], call["parameters"]) for call in answer]


def tagged_calls(text: str) -> list[dict] | None:
    """The calls of an 'auto' answer that makes them (`<tool_call>{"name", "arguments"}</tool_call>`
    blocks; engine.tool_call_constraint), in OpenAI's shape; None for a text answer, or one cut
    before its calls are whole."""
    if not text.lstrip().startswith(OPEN):
        return None
    blocks = re.findall(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), text, flags=re.DOTALL)
    try:
        calls = [json.loads(block) for block in blocks]
    except ValueError:
        return None
    rest = re.sub(re.escape(OPEN) + r".*?" + re.escape(CLOSE), "", text, flags=re.DOTALL)
    if not calls or rest.strip():  # an unclosed call
        return None
    return [_call(call["name"], call["arguments"]) for call in calls]


def may_be_calls(text: str) -> bool:
    """So far, an 'auto' answer could still be calls: it is empty or the opening tag's beginning."""
    lead = text.lstrip()
    return lead.startswith(OPEN) or OPEN.startswith(lead)


def _call(name: str, arguments) -> dict:
    """One call; its arguments written as JSON text the same way whatever whitespace the model put in."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def tools_text(tools: list[ToolSpec], choice: str | NamedToolChoice | None) -> str:
    """The system message that shows the tools to a model whose chat template does not."""
    described = "\n".join(json.dumps(t.function.model_dump(exclude_none=True, exclude={"strict"}), ensure_ascii=False)
                          for t in tools)
    if isinstance(choice, NamedToolChoice):
        ask = f"Call {choice.function.name}: answer with its arguments as one JSON object."
    elif choice == "required":
        ask = f"Call one or more of them: answer with {CALLS_FORMAT}."
    elif choice == "auto":
        ask = (f"To call one, answer with {OPEN}{{\"name\": the function's name, \"arguments\": its arguments}}"
               f"{CLOSE}, one such block a call, and nothing else; otherwise answer in text.")
    else:
        ask = f"To call them, answer with {CALLS_FORMAT}."
    return f"You can call these functions:\n{described}\n{ask}"


def template_messages(messages: list[dict], tools: list[ToolSpec] | None, choice, template_renders_tools: bool
                      ) -> tuple[list[dict], list[dict] | None]:
    """The conversation as the chat template gets it, and the `tools` argument for the template (None
    when it cannot render them: they go in a system message, and earlier calls in the text)."""
    if template_renders_tools:
        return messages, [t.model_dump(exclude_none=True) for t in tools] if tools else None
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            text = _calls_text(calls, choice)
            message = {"role": message["role"], "content": f"{message['content']}\n{text}" if message.get("content")
                       else text}
        else:
            message = {"role": message["role"], "content": message.get("content") or ""}
        out.append(message)
    if tools:
        text = tools_text(tools, choice)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None


def _calls_text(calls: list[dict], choice) -> str:
    """Earlier calls written as the model is asked to write calls now."""
    if choice == "auto":
        return "".join(f"{OPEN}" + json.dumps({"name": c["function"]["name"], "arguments": _arguments(
            c["function"].get("arguments"))}, ensure_ascii=False) + CLOSE for c in calls)
    return json.dumps([{"name": c["function"]["name"], "parameters": _arguments(c["function"].get("arguments"))}
                       for c in calls], ensure_ascii=False)


def _arguments(arguments):
    """A call's arguments as a value: OpenAI sends them as JSON text."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
