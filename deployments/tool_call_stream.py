"""Tool calls streamed as OpenAI streams them: a call's first delta carries its index, id, type and
name with empty `arguments`, the deltas after it the arguments' JSON text piece by piece, so a client
(the `openai` SDK's stream helpers, LangChain, ...) shows them while they are written.

The answer's text is read as it comes, one character at a time, as JSON: the calls are the objects
`call_depth` brackets deep (1 for 'auto''s `<tool_call>{...}</tool_call>` blocks, whose tags lie
outside any bracket; 2 for 'required''s list of calls); in each, the `name` string's value opens the
call, and the value of `arguments_key` is passed on as the call's arguments, as written (the
grammar keeps it valid JSON; a non-streamed answer writes them again without the model's whitespace).
A named `tool_choice` makes the whole answer the arguments of the one call.
"""
from __future__ import annotations

import uuid

from deployments.tool_calls import NamedToolChoice
from engine.tool_call_constraint import OPEN


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallStream:
    def __init__(self, call_depth: int = 1, arguments_key: str = "arguments", named: str | None = None):
        self.call_depth, self.arguments_key, self.named = call_depth, arguments_key, named
        self.calls = 0  # calls opened so far
        self.depth, self.in_string, self.escaped = 0, False, False
        self.string = ""  # the string being read at the calls' depth (a key or the name)
        self.key = None  # the key whose value comes next, at the calls' depth
        self.expect_value = False
        self.capturing = False  # inside the arguments' value
        self.bare = False  # that value is a number or a literal, not a string or a container
        self.capture_depth = 0

    @property
    def started(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> list[dict]:
        """The tool-call deltas (OpenAI's `delta.tool_calls` items) that `text`, the answer's next piece,
        makes, in order: a call's opening (id, name, empty arguments), then its arguments' text."""
        deltas: list[dict] = []
        if self.named is not None:
            if not self.calls:
                self._open(deltas, self.named)
            if text:
                self._arguments(deltas, text)
            return deltas
        piece = []
        for ch in text:
            if self.capturing:
                if self.bare and ch in ",}] \t\r\n":  # a bare value (a number, true, ...) ends before these
                    self.capturing = False
                    self._arguments(deltas, "".join(piece))
                    piece = []
                    self._step(ch, deltas)
                    continue
                piece.append(ch)
                if not self.bare and self._step_capture(ch):
                    self.capturing = False
                    self._arguments(deltas, "".join(piece))
                    piece = []
                continue
            self._step(ch, deltas)
            if self.capturing:  # ch is the arguments' first character
                piece.append(ch)
                self.bare = ch not in '{["'
        if piece:
            self._arguments(deltas, "".join(piece))
        return deltas

    def _open(self, deltas: list[dict], name: str) -> None:
        self.calls += 1
        deltas.append({"index": self.calls - 1, "id": call_id(), "type": "function",
                       "function": {"name": name, "arguments": ""}})

    def _arguments(self, deltas: list[dict], text: str) -> None:
        index = self.calls - 1
        if deltas and deltas[-1]["index"] == index and "id" not in deltas[-1]:
            deltas[-1]["function"]["arguments"] += text
        else:  # an opening delta keeps its empty arguments, as OpenAI sends it
            deltas.append({"index": index, "function": {"arguments": text}})

    def _step(self, ch: str, deltas: list[dict]) -> None:
        """One character outside the arguments: brackets, strings, and the calls' keys and names."""
        at_calls = self.depth == self.call_depth
        if self.in_string:
            if self._string_ends(ch):
                if at_calls and self.expect_value and self.key == "name":
                    self._open(deltas, self.string)
                    self.expect_value, self.key = False, None
                elif at_calls and not self.expect_value:
                    self.key = self.string
                return
            if at_calls:
                self.string += ch
            return
        if ch in " \t\r\n":
            return
        if at_calls and self.expect_value and self.key == self.arguments_key:
            self.expect_value, self.key = False, None
            self.capturing, self.capture_depth = True, 0
            self._step_capture(ch)
            return
        if ch == '"':
            self.in_string, self.string = True, ""
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
        elif ch == ":" and at_calls:
            self.expect_value = True
        elif ch == "," and at_calls:
            self.expect_value, self.key = False, None

    def _string_ends(self, ch: str) -> bool:
        """One character inside a string; True when it is the closing quote."""
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.in_string = False
            return True
        return False

    def _step_capture(self, ch: str) -> bool:
        """One character of a string or container value of the arguments; True when it closes the value."""
        if self.in_string:
            return self._string_ends(ch) and self.capture_depth == 0
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.capture_depth += 1
        elif ch in "}]":
            self.capture_depth -= 1
            return self.capture_depth == 0
        return False


def answer_stream(choice: str | NamedToolChoice) -> CallStream:
    """The stream of an answer that is calls (a named function or 'required', `tool_calls.calls_schema`)."""
    if isinstance(choice, NamedToolChoice):
        return CallStream(named=choice.function.name)
    return CallStream(call_depth=2, arguments_key="parameters")


def opens_calls(text: str) -> bool:
    """An 'auto' answer begun with this text is calls (it opened the tag)."""
    return text.lstrip().startswith(OPEN)
