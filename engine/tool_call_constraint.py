"""`tool_choice: "auto"`: the model answers in text, or with tool calls written the way Hermes-style
models write them (Qwen2.5, Hermes, and the system message this server gives a model whose template
shows no tools): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block a call.

The machine leaves text free: once the answer has begun with anything but the opening tag, every
token may follow (the mask is None, as unconstrained). An answer that begins with the tag is held
to calls: each call's JSON follows the schema of a call to one of the tools (`engine.json_schema`),
the closing tag follows it, and after it only another call or the end of the answer may come. So a
tool call is always whole and valid when the answer ends with `stop`, and text is never touched.
"""
from __future__ import annotations

import json
from functools import lru_cache

import torch

from engine.constraints import DONE, CharGrammar
from engine.json_constraint import JSON_CHARACTERS, WHITESPACE, GrammarConstraint
from engine.json_schema import schema_key
from engine.json_schema_constraint import schema_grammar

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_LEADING_WHITESPACE = 8
FREE = ("free",)  # text: anything may follow
END = ("end",)  # after the one call `parallel_tool_calls: false` allows: only the end of sequence


class ToolCallGrammar(CharGrammar):
    """States: ("lead", matched, whitespace, after_call): the opening tag's first `matched`
    characters (after up to MAX_LEADING_WHITESPACE of whitespace); ("call", state): inside a call's
    JSON, `state` its schema grammar's; ("close", matched, whitespace): the closing tag; FREE."""

    def __init__(self, call_schema: dict, parallel: bool = True):
        self.calls = schema_grammar(schema_key(call_schema))
        self.parallel = parallel  # false: one call at most, then the end
        self.start = ("lead", 0, 0, False)

    def step(self, state: tuple, ch: str) -> tuple | None:
        kind = state[0]
        if kind == "free":
            return FREE
        if kind == "end":
            return None
        if kind == "call":
            inner = self.calls.step(state[1], ch)
            if inner is None:
                return None
            return ("close", 0, 0) if inner == DONE else ("call", inner)
        if kind == "close":
            _, matched, ws = state
            if matched == 0 and ch in WHITESPACE:
                return ("close", 0, ws + 1) if ws < MAX_LEADING_WHITESPACE else None
            if ch != CLOSE[matched]:
                return None
            if matched + 1 < len(CLOSE):
                return ("close", matched + 1, ws)
            return ("lead", 0, 0, True) if self.parallel else END
        _, matched, ws, after_call = state
        if matched == 0 and ch in WHITESPACE and ws < MAX_LEADING_WHITESPACE:
            return ("lead", 0, ws + 1, after_call)
        if ch == OPEN[matched]:
            return ("call", self.calls.start) if matched + 1 == len(OPEN) else ("lead", matched + 1, ws, after_call)
        return None if after_call else FREE  # after a call, only another call or the end

    def run(self, state: tuple | None, text: str) -> tuple | None:
        for ch in text:
            if state is None or state == FREE:
                return state
            state = self.step(state, ch)
        return state

    def string_budget(self, state: tuple) -> float | None:
        return self.calls.string_budget(state[1]) if state[0] == "call" else None

    def may_end(self, state: tuple) -> bool:
        """The answer may end here: after its last call (or in text, where nothing is constrained)."""
        return state == END or (state[0] == "lead" and state[1] == 0 and state[3])


@lru_cache(maxsize=64)
def _grammar(call_schema_text: str, parallel: bool) -> ToolCallGrammar:
    return ToolCallGrammar(json.loads(call_schema_text), parallel)


class ToolCallOrTextConstraint(GrammarConstraint):
    """Token-level `ToolCallGrammar` for one sequence (registered in the engine as "tool_calls_or_text";
    its argument {"call_schema": the JSON Schema of one call, {"name", "arguments"}, "parallel": false
    for one call at most})."""

    def __init__(self, tokenizer, arg: dict):
        grammar = _grammar(schema_key(arg["call_schema"]), bool(arg.get("parallel", True)))
        super().__init__(tokenizer, grammar, characters=JSON_CHARACTERS | set(OPEN + CLOSE),
                         texts=grammar.calls.literal_texts(), writes="this answer of tool calls")

    def allowed(self) -> torch.Tensor | None:
        return None if self.state == FREE and not self.wrapping_up else super().allowed()

    def may_end(self, state) -> bool:
        return state == FREE or super().may_end(state)

    def advance(self, token_id: int) -> None:
        if self.state != FREE:
            super().advance(token_id)

    @property
    def is_complete(self) -> bool:
        return False  # text and calls alike end with the end of sequence
