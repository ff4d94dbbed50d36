"""Structured outputs (OpenAI's `response_format: {"type": "json_schema"}`): a decoding constraint
under which the answer is one JSON value that validates against a schema, and ends where it closes.

`SchemaGrammar` is a character-level machine over the nodes `engine.json_schema` compiles. A state
is a frozenset of branches, since `anyOf` (and a type list, and any JSON value) leaves more than one
reading of the same text open until a character tells them apart. A branch is a stack of frames, the
open containers (object, array) and on top the value being written, with the run of whitespace
since the last token. A container's frame already says what comes after the value on top of it, so
a finished value is simply popped. Counts (array items, string characters) are kept only where a
bound needs them, so that unbounded strings and arrays keep few states, and a state's token mask is
computed once (masks are cached per state, as in JSON mode, whose token lift this reuses).
"""
from __future__ import annotations

import json
import math
from fractions import Fraction
from functools import lru_cache

from engine.constraints import DONE, CharGrammar
from engine.json_constraint import (ESCAPES, HEX, JSON_CHARACTERS, NUMBER_ENDS, WHITESPACE, GrammarConstraint,
                                    number_start, number_step, token_vocab)
from engine.json_schema import Program, compile_schema, schema_key
from engine.unique_items import (fresh_item_exists, fresh_match_exists, fresh_string_exists, item_leaves,
                                 literal_value, number_range, numbers_in, string_budget_is_exact)

JSON_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}  # -> the character
MAX_CACHED_STEPS = 1 << 17  # for all schemas together: a step's states are kept while it is cached
_STEPS: dict = {}


class SchemaGrammar(CharGrammar):
    """The answers a compiled schema admits, character by character. Hashed by identity: one per
    schema (see `schema_grammar`), so that requests sending the same schema share its masks."""

    def __init__(self, program: Program, max_depth: int = 32, max_whitespace: int = 24):
        self.nodes = program.nodes
        self.depth = program.depth
        self.max_depth = max_depth
        self.max_whitespace = max_whitespace
        # a unique array's item nodes (engine.unique_items), by the array's node
        self.unique_leaves = {i: item_leaves(self.nodes, node.items) for i, node in enumerate(self.nodes)
                              if node.kind == "array" and node.unique and node.items is not None}
        # the leaves of the names an object's kept free keys may be, by the object's node
        self.key_leaves = {i: item_leaves(self.nodes, node.key_node) for i, node in enumerate(self.nodes)
                           if node.kind == "object" and node.key_node is not None}
        self.start = frozenset((frames, 0) for frames in self._pushes((), program.root))
        if not self.start:
            raise ValueError(f"schema: its values need more than {max_depth} nested containers")

    def step(self, state, ch: str):
        """The state after `ch` (None: it cannot come next). Cached: a token mask runs thousands of
        tokens through the same states, and tokens share their beginnings."""
        key = (self, state, ch)
        after = _STEPS.get(key, _STEPS)
        if after is _STEPS:
            if len(_STEPS) >= MAX_CACHED_STEPS:
                _STEPS.clear()
            after = _STEPS[key] = self._step_all(state, ch)
        return after

    def _step_all(self, state, ch: str):
        if state == DONE:
            return None
        out = set()
        for frames, ws in state:
            out.update(self._step(frames, ws, ch))
        if not out:
            return None
        if any(not frames for frames, _ in out):  # the root value closed (every reading closes it alike)
            return DONE
        return frozenset(out)

    def string_budget(self, state) -> float | None:
        """Inside a string's text in every branch: the most characters a token free of quotes,
        backslashes and control characters may add (such tokens are then allowed wholesale); else None."""
        if state == DONE:
            return None
        budget = None
        for frames, _ in state:
            top = frames[-1]
            if top[0] == "p" and top[5] is not None and top[3] == "" and self.nodes[top[1]].pattern is None:
                # a unique array's string item, whose text is kept: plain tokens are fine unless one that
                # fills it to its max_length could spell an item it has
                if not string_budget_is_exact(self.nodes[top[1]], top[5], _seen(frames[:-1])):
                    return None
            elif top[0] != "s" or top[3] != 0:
                return None
            high = self.nodes[top[1]].max_length if top[1] is not None else None
            left = math.inf if high is None else high - top[2]
            budget = left if budget is None else max(budget, left)
        return budget

    def completion_characters(self) -> set[str]:
        """A character of each class a pattern reads, so that a shortest completion can be searched."""
        return {c for node in self.nodes if node.pattern is not None for c in node.pattern.examples()}

    def literal_texts(self) -> list[str]:
        """The texts written exactly as the schema gives them: keys and enum values."""
        return [t for node in self.nodes for t in node.keys + node.texts]

    # ---- one branch -----------------------------------------------------------------------------
    def fits(self, index: int, open_containers: int) -> bool:
        """A value of node `index` begun inside `open_containers` containers can be finished without
        passing `max_depth`. Only such values are ever begun, so no answer reaches a dead end."""
        return open_containers + self.depth[index] <= self.max_depth

    def _pushes(self, below: tuple, index: int) -> list[tuple]:
        """The branches that start a value of node `index` above the frames `below`: one per
        alternative, through any_of (and $ref, a one-option any_of), less those that cannot be
        finished within `max_depth` (or at all)."""
        return [below + (("v", i),) for i in item_leaves(self.nodes, index) if self.fits(i, len(below))]

    def _step(self, frames: tuple, ws: int, ch: str) -> list[tuple]:
        top, below = frames[-1], frames[:-1]
        kind = top[0]
        if kind == "s":
            return self._string(below, top, ch)
        if kind == "l":
            return self._literal(below, top, ch)
        if kind == "n":
            return self._number(below, top, ch)
        if kind == "r":
            return self._ranged(below, top, ch)
        if kind == "p":
            return self._patterned(below, top, ch)
        if kind == "o" and top[2] == "keytext":
            return self._object(below, top, ch)
        if ch in WHITESPACE:  # before a value, and around a container's punctuation
            return [(frames, ws + 1)] if ws < self.max_whitespace else []
        if kind == "v":
            return self._begin(below, top[1], ch)
        if kind == "o":
            return self._object(below, top, ch)
        return self._array(below, top, ch)

    @staticmethod
    def _done(below: tuple, value=None) -> list[tuple]:
        """A value ended: the container below already awaits what follows it. In a unique array, the
        value (engine.unique_items.canonical, given by the item kinds such an array has) is taken only
        if new, and then counts among the array's values; so is a counted object's free key."""
        seen = _seen(below)
        if seen is None:
            return [(below, 0)]
        return [] if value in seen else [(below[:-1] + (below[-1][:-1] + (seen | {value},),), 0)]

    def _then(self, below: tuple, ch: str, value=None) -> list[tuple]:
        """A value that may end here ended before `ch`, which the container below reads."""
        return [step for frames, _ in self._done(below, value) for step in self._step(frames, 0, ch)] if below else []

    def _begin(self, below: tuple, index: int, ch: str) -> list[tuple]:
        node = self.nodes[index]
        kind = node.kind
        if kind in ("object", "array"):
            if ch != ("{" if kind == "object" else "["):
                return []
            if kind == "object":
                counting = (() if not node.counted else (0,) if node.keys else (frozenset(),))
                return [(below + (("o", index, "first", 0, "", *counting),), 0)]
            return [(below + (("a", index, "first", 0, *((frozenset(),) if node.unique else ())),), 0)]
        seen = _seen(below)
        if kind == "string":
            if ch != '"':
                return []
            if node.pattern is not None or seen is not None:  # a unique array's item keeps its text
                positions = node.pattern.initial() if node.pattern is not None else None
                return [(below + (("p", index, 0, "", positions, None if seen is None else ""),), 0)]
            return [(below + (("s", index, 0, 0),), 0)]
        if kind == "literal":
            return self._literal(below, ("l", index, ""), ch)
        start = number_start(ch)
        if start is None:
            return []
        if node.bounds is not None or seen is not None:  # a unique array's number keeps its text
            reachable = number_range(node).reachable(ch, numbers_in(seen or frozenset()))
            return [(below + (("r", index, *start, ch),), 0)] if reachable else []
        return [(below + (("n", index, *start),), 0)]

    def _string(self, below: tuple, top: tuple, ch: str) -> list[tuple]:
        _, index, count, escape = top
        low, high = (0, None) if index is None else (self.nodes[index].min_length, self.nodes[index].max_length)
        if escape == -1:  # after a backslash
            if ch == "u":
                return [(below + (("s", index, count, 4),), 0)]
            return [(below + (("s", index, count, 0),), 0)] if ch in ESCAPES else []
        if escape > 0:  # hex digits of \uXXXX still to come
            return [(below + (("s", index, count, escape - 1),), 0)] if ch in HEX else []
        if ch == '"':
            return self._done(below) if count >= low else []
        if ord(ch) < 0x20 or (high is not None and count >= high):
            return []
        count = count + 1 if high is not None else min(count + 1, low)  # counted only as far as a bound needs
        return [(below + (("s", index, count, -1 if ch == "\\" else 0),), 0)]

    def _patterned(self, below: tuple, top: tuple, ch: str) -> list[tuple]:
        """A string whose decoded text must match a pattern: the NFA reads each character as the JSON
        text decodes to it (an escape once whole), and takes it only if the string can still close
        matching, within its length bounds. `escape` holds the escape begun: "", "\\", or "u" and its
        hex digits so far. \\u escapes are for control characters only (others are written as they are),
        so that an escape is begun only where some way to finish it fits the pattern.
        A unique array's string item comes here too, without a pattern: `text` (else None) is what it
        decodes to so far, and a character is taken only if the item can still end as a new value."""
        _, index, count, escape, positions, text = top
        node = self.nodes[index]
        if escape == "":
            if ch == '"':
                if count < node.min_length or (node.pattern is not None and not node.pattern.accepts(positions)):
                    return []
                return self._done(below, None if text is None else ("string", text))
            if ch == "\\":
                return self._escape_begun(below, top, "\\")
            return self._pattern_read(below, top, ch) if ord(ch) >= 0x20 else []
        if escape == "\\":
            if ch == "u":
                return self._escape_begun(below, top, "u")
            decoded = JSON_ESCAPES.get(ch)
            return self._pattern_read(below, top, decoded) if decoded is not None else []
        if ch not in HEX:
            return []
        if len(escape) < 4:
            return self._escape_begun(below, top, escape + ch)
        code = int(escape[1:] + ch, 16)
        return self._pattern_read(below, top, chr(code)) if code < 0x20 else []

    def _escape_begun(self, below: tuple, top: tuple, escape: str) -> list[tuple]:
        """The string with `escape` begun, if some character it may still decode to can be read."""
        if escape == "\\":
            candidates = list(JSON_ESCAPES.values()) + [chr(c) for c in range(0x20)]
        else:
            candidates = [chr(c) for c in range(0x20) if f"{c:04x}".startswith(escape[1:].lower())]
        if any(self._pattern_read(below, top, c) for c in candidates):
            return [(below + (top[:3] + (escape,) + top[4:],), 0)]
        return []

    def _pattern_read(self, below: tuple, top: tuple, decoded: str) -> list[tuple]:
        _, index, count, _, positions, text = top
        node = self.nodes[index]
        if node.pattern is not None:
            positions = node.pattern.step(positions, decoded)
            if not positions or not node.pattern.can_finish(positions, count + 1, node.min_length, node.max_length):
                return []
        elif node.max_length is not None and count >= node.max_length:
            return []
        if text is not None:
            text += decoded
            seen = _seen(below)
            fresh = (fresh_match_exists(node, positions, text, seen) if node.pattern is not None
                     else fresh_string_exists(node, text, seen))
            if not fresh:
                return []
        # counted only as far as a bound needs, so that states (and their masks) repeat along the text
        count = count + 1 if node.max_length is not None else min(count + 1, node.min_length)
        return [(below + (("p", index, count, "", positions, text),), 0)]

    def _literal(self, below: tuple, top: tuple, ch: str) -> list[tuple]:
        _, index, written = top
        seen = _seen(below)
        texts = [t for t in self.nodes[index].texts if seen is None or literal_value(t) not in seen]
        text = written + ch
        out = []
        longer = [t for t in texts if t.startswith(text)]
        if longer:
            if longer == [text]:  # whole, and nothing longer: the value is done
                out += self._done(below, literal_value(text))
            else:
                out.append((below + (("l", index, text),), 0))
        if written in texts:  # a whole value (a number a longer one extends) that may end before ch
            out += self._then(below, ch, literal_value(written))
        return out

    def _number(self, below: tuple, top: tuple, ch: str) -> list[tuple]:
        _, index, phase, digits = top
        nxt = number_step(phase, digits, ch, integer=self.nodes[index].kind == "integer")
        if nxt is not None:
            return [(below + (("n", index, *nxt),), 0)]
        return self._then(below, ch) if phase in NUMBER_ENDS else []

    def _ranged(self, below: tuple, top: tuple, ch: str) -> list[tuple]:
        """A number with bounds: its text is kept, each character taken only if the number can still
        end within them, and no exponent (whose value the prefix cannot bound)."""
        _, index, phase, digits, text = top
        bounds, seen = number_range(self.nodes[index]), _seen(below)
        nxt = number_step(phase, digits, ch, integer=bounds.integer)  # a multipleOf's number is written whole
        if nxt is not None and nxt[0] not in ("exp", "expsign", "expdigit"):
            reachable = bounds.reachable(text + ch, numbers_in(seen or frozenset()))
            return [(below + (("r", index, *nxt, text + ch),), 0)] if reachable else []
        if phase in NUMBER_ENDS and bounds.admits(Fraction(text)):
            return self._then(below, ch, ("number", Fraction(text)))
        return []

    def _object(self, below: tuple, top: tuple, ch: str) -> list[tuple]:
        _, index, phase, first, written = top[:5]
        tail = top[5:]  # a counted object's: (how many listed keys it has,) or (its free keys so far,)
        node = self.nodes[index]
        inside = len(below) + 1
        if phase == "keytext":  # a listed key, written whole, whose value can be finished in the depth left
            text = written + ch
            matches = [j for j in node.key_choices(first) if node.keys[j].startswith(text)
                       and self._may_write(node, j, tail, inside)]
            whole = [j for j in matches if node.keys[j] == text]
            if whole:
                return [(below + (("o", index, "colon", whole[0], "", *(t + 1 for t in tail)),), 0)]
            return [(below + (("o", index, "keytext", first, text, *tail),), 0)] if matches else []
        count = (tail[0] if node.keys else len(tail[0])) if tail else None  # a counted object's keys so far
        room = count is None or node.max_properties is None or count < node.max_properties
        if phase in ("first", "key") and ch == '"':
            if node.keys:
                return self._object(below, ("o", index, "keytext", first, "", *tail), ch)
            if node.extra is None or not self.fits(node.extra, inside) or not room:
                return []
            if count is None:
                return [(below + (("o", index, "colon", -1, ""), ("s", None, 0, 0)), 0)]
            # a kept key: a string or a literal name, taken only while it can end as one not written yet
            return [step for frames in self._pushes(below + (("o", index, "colon", -1, "", *tail),), node.key_node)
                    for step in self._step(frames, 0, ch)]
        if phase in ("first", "after") and ch == "}":
            enough = count is None or count >= node.min_properties
            return self._done(below) if node.may_close(first) and enough else []
        if phase == "after" and ch == ",":
            if node.keys:
                more = any(self._may_write(node, j, tail, inside) for j in node.key_choices(first))
            else:
                more = (node.extra is not None and self.fits(node.extra, inside) and room
                        and (not tail or fresh_item_exists(self.nodes, self.key_leaves[index], tail[0])))
            return [(below + (("o", index, "key", first, "", *tail),), 0)] if more else []
        if phase == "colon" and ch == ":":
            value, after = (node.extra, 0) if first < 0 else (node.values[first], first + 1)
            return [(frames, 0) for frames in self._pushes(below + (("o", index, "after", after, "", *tail),), value)]
        return []

    def _may_write(self, node, j: int, tail: tuple, inside: int) -> bool:
        """Listed property j may come next: its value can be finished in the depth left, and, in a counted
        object (`tail`: the keys written so far), the properties after it can still bring the count within
        minProperties and maxProperties (the optional ones between are skipped)."""
        if not (node.required[j] or self.fits(node.values[j], inside)):
            return False
        if not tail:
            return True
        after = range(j + 1, len(node.keys))
        required = sum(node.required[k] for k in after)
        possible = sum(1 for k in after if node.required[k] or self.fits(node.values[k], inside))
        count = tail[0] + 1
        high = node.max_properties
        return (high is None or count + required <= high) and count + possible >= node.min_properties

    def _array(self, below: tuple, top: tuple, ch: str) -> list[tuple]:
        _, index, phase, count = top[:4]
        values = top[4:]  # a unique array's: (the values of its items so far,)
        node = self.nodes[index]
        if ch == "]" and phase in ("first", "after"):
            return self._done(below) if count >= node.min_items else []
        if values and not fresh_item_exists(self.nodes, self.unique_leaves[index], values[0]):
            return []  # every value its items may take is there already
        if phase == "after":
            if ch != "," or (node.max_items is not None and count >= node.max_items):
                return []
            if count >= node.min_items and not self.fits(node.items, len(below) + 1):
                return []
            return [(below + (("a", index, "next", count, *values),), 0)]
        if node.items is None or (node.max_items is not None and count >= node.max_items):
            return []
        if count >= node.min_items and not self.fits(node.items, len(below) + 1):
            return []  # an item it need not have and could not finish
        counted = count + 1 if node.max_items is not None else min(count + 1, node.min_items)
        out = []
        for frames in self._pushes(below + (("a", index, "after", counted, *values),), node.items):
            out += self._step(frames, 0, ch)  # ch is the item's first character
        return out


@lru_cache(maxsize=64)
def schema_grammar(schema_text: str) -> SchemaGrammar:
    """One grammar per schema text, so its masks are shared by every request that sends it."""
    return SchemaGrammar(compile_schema(json.loads(schema_text)))


class JsonSchemaConstraint(GrammarConstraint):
    """Token-level `SchemaGrammar` for one sequence (registered in the engine as "json_schema", its
    argument the schema). ValueError when the schema is not supported (naming the keyword), or when
    the tokenizer cannot spell JSON or one of the schema's keys and enum values."""

    def __init__(self, tokenizer, schema):
        grammar = schema_grammar(schema_key(schema))
        examples = grammar.completion_characters() & token_vocab(tokenizer).single_chars
        super().__init__(tokenizer, grammar, characters=JSON_CHARACTERS | examples, texts=grammar.literal_texts(),
                         writes="this schema's JSON")


def _seen(below: tuple) -> frozenset | None:
    """The values of the unique array whose item is being written above `below` (or the keys of the
    counted object whose free key is), or None (neither)."""
    if not below:
        return None
    frame = below[-1]
    if frame[0] == "a" and len(frame) > 4:
        return frame[4]
    if frame[0] == "o" and frame[2] == "colon" and len(frame) > 5 and isinstance(frame[5], frozenset):
        return frame[5]
    return None
