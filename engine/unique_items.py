"""`uniqueItems` for the schema grammar (pydantic writes it for `set[...]` fields): an array whose items
are scalars (strings, under a pattern or format too, numbers, booleans, null, enum and const values) keeps
the values it has so far, and an item is taken only while it can still end as a value not among them,
so no answer reaches a dead end and none repeats a value. The same holds for an object's free keys
where they are kept (engine.json_schema: counted, or under propertyNames or patternProperties).

Values compare as JSON Schema compares them: 1 and 1.0 are one value, true and 1 are two, a string by
the text it decodes to. Items that are objects or arrays are refused (a ValueError naming the array):
their equality is not decided one character at a time here.
"""
from __future__ import annotations

import json
import math
from fractions import Fraction
from functools import lru_cache

from engine.number_bounds import NumberRange, exact

_ANY_NUMBER = {"integer": NumberRange(integer=True), "number": NumberRange()}


def canonical(value):
    """A JSON value as JSON Schema's equality sees it, hashable."""
    if value is None or isinstance(value, bool):
        return ("literal", value)
    if isinstance(value, (int, float)):
        return ("number", exact(value))
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, list):
        return ("array", tuple(canonical(v) for v in value))
    return ("object", frozenset((k, canonical(v)) for k, v in value.items()))


@lru_cache(maxsize=4096)
def literal_value(text: str):
    """The canonical value of an enum or const value's JSON text."""
    return canonical(json.loads(text))


def number_range(node) -> NumberRange:
    """A number node's bounds, or none but its kind (a unique array's numbers are written as bounded ones)."""
    return node.bounds if node.bounds is not None else _ANY_NUMBER[node.kind]


def numbers_in(seen: frozenset) -> frozenset[Fraction]:
    return frozenset(v for kind, v in seen if kind == "number")


def item_leaves(nodes, index: int) -> list[int]:
    """The nodes a value of node `index` may be, through any_of (and $ref)."""
    leaves, stack, visited = [], [index], set()
    while stack:
        i = stack.pop()
        if i in visited:
            continue
        visited.add(i)
        if nodes[i].kind == "any_of":
            stack.extend(reversed(nodes[i].options))
        else:
            leaves.append(i)
    return leaves


def check_unique_items(nodes, index: int, where: str) -> None:
    """ValueError when an array's uniqueItems cannot be honoured: items of a kind not supported, or
    fewer distinct values than its minItems."""
    array = nodes[index]
    if array.items is None:
        return
    leaves = item_leaves(nodes, array.items)
    for leaf in leaves:
        node = nodes[leaf]
        if node.kind in ("object", "array"):
            raise ValueError(f"{where}.uniqueItems: only items that are strings, numbers, booleans, null or enum "
                             f"and const values are supported, not {node.kind}s")
    if array.min_items and not _distinct_at_least(nodes, leaves, array.min_items):
        raise ValueError(f"{where}: its items take fewer than minItems {array.min_items} distinct values, "
                         "and uniqueItems is true")


def check_distinct_keys(nodes, index: int, where: str) -> None:
    """ValueError when an object whose free keys are kept (each written once) cannot have minProperties of
    them: fewer distinct names than that follow its propertyNames or pattern."""
    node = nodes[index]
    if node.min_properties and not _distinct_at_least(nodes, item_leaves(nodes, node.key_node), node.min_properties):
        raise ValueError(f"{where}: its property names take fewer than minProperties {node.min_properties} distinct "
                         "values")


def _distinct_at_least(nodes, leaves: list[int], needed: int) -> bool:
    values = set()
    for leaf in leaves:
        node = nodes[leaf]
        if node.kind == "literal":
            values.update(literal_value(t) for t in node.texts)
        elif node.kind == "string" and node.pattern is not None:
            if _matches_at_least(node, needed):
                return True
        elif node.kind == "string":
            if node.max_length != 0:
                return True
            values.add(("string", ""))
        else:
            bounds = number_range(node)
            if bounds.count() >= needed:
                return True
            values.update(("number", v) for v in bounds.values())
        if len(values) >= needed:
            return True
    return False


def fresh_item_exists(nodes, leaves: list[int], seen: frozenset) -> bool:
    """Some item value is not among `seen`."""
    for leaf in leaves:
        node = nodes[leaf]
        if node.kind == "literal":
            if any(literal_value(t) not in seen for t in node.texts):
                return True
        elif node.kind == "string" and node.pattern is not None:
            if fresh_match_exists(node, node.pattern.initial(), "", seen):
                return True
        elif node.kind == "string":
            # a string of one character more than its least may be any of ~1.1M: far more than an answer holds
            if node.max_length != 0 or ("string", "") not in seen:
                return True
        else:
            bounds = number_range(node)
            if bounds.count() > sum(bounds.admits(v) for v in numbers_in(seen)):
                return True
    return False


def fresh_string_exists(node, text: str, seen: frozenset) -> bool:
    """A string item begun as `text` (no pattern, within its length bounds so far) can still end as a value
    not among `seen`: always while it may grow by one character more (see fresh_item_exists)."""
    high = node.max_length
    return (high is None or len(text) < high) or ("string", text) not in seen


SMALL_CLASS = 256  # a pattern's class of at most this many characters is read one by one


def fresh_match_exists(node, positions: frozenset, text: str, seen: frozenset) -> bool:
    """A string item under a pattern, begun as `text` with its NFA at `positions` (from which it can still
    end within its length bounds), can end as a value not among `seen`. The pattern is walked along the
    rests of the items already there that begin with `text`: a character it allows off them, or an end
    where none of them ends, is a new value."""
    rests = {v[len(text):] for kind, v in seen if kind == "string" and v.startswith(text)}
    if not rests:
        return True
    nfa, low, high = node.pattern, node.min_length, node.max_length
    stack = [("", positions)]
    while stack:
        prefix, state = stack.pop()
        count = len(text) + len(prefix)
        if nfa.accepts(state) and low <= count and (high is None or count <= high) and prefix not in rests:
            return True
        on = {r[len(prefix)] for r in rests if len(r) > len(prefix) and r.startswith(prefix)}
        for position in state:
            for cls, nxt in nfa.moves[position]:
                if _leaves_the_rests(nfa, state, cls, nxt, on, count + 1, low, high):
                    return True
        for ch in on:
            after = nfa.step(state, ch)
            if after and nfa.can_finish(after, count + 1, low, high):
                stack.append((prefix + ch, after))
    return False


def _matches_at_least(node, needed: int) -> bool:
    """At least `needed` strings match a string node's pattern within its length bounds (a walk over the
    texts it allows, each once; a large class counts as many strings as it has characters, at once)."""
    nfa, low, high = node.pattern, node.min_length, node.max_length
    found, stack = 0, [(nfa.initial(), 0)]
    while stack:
        state, count = stack.pop()
        if nfa.accepts(state) and low <= count and (high is None or count <= high):
            found += 1
            if found >= needed:
                return True
        chars = set()
        for position in state:
            for cls, nxt in nfa.moves[position]:
                if _size(cls) <= SMALL_CLASS:
                    chars.update(_characters(cls))
                elif _size(cls) >= needed and nfa.can_finish(nfa.closure([nxt]), count + 1, low, high):
                    return True  # (a large class with fewer characters than needed is not counted: refused)
        for ch in chars:
            after = nfa.step(state, ch)
            if after and nfa.can_finish(after, count + 1, low, high):
                stack.append((after, count + 1))
    return False


def _size(cls) -> float:
    return math.inf if cls.negated else sum(b - a + 1 for a, b in cls.ranges)


def _characters(cls) -> list[str]:
    """The characters of a class that is not large (see SMALL_CLASS) that a JSON string can hold."""
    return [chr(code) for a, b in cls.ranges for code in range(a, b + 1) if not 0xD800 <= code <= 0xDFFF]


def _leaves_the_rests(nfa, state: frozenset, cls, nxt: int, on: set[str], count: int, low: int, high) -> bool:
    """Some character of `cls` that is not in `on` can be read at `state` with the string still able to end.
    A large class: any of its characters reaches `nxt`, so it is enough that the string can end from there."""
    size = _size(cls)
    if size > SMALL_CLASS:
        return size > len(on) and nfa.can_finish(nfa.closure([nxt]), count, low, high)
    for ch in _characters(cls):
        if ch not in on:
            after = nfa.step(state, ch)
            if after and nfa.can_finish(after, count, low, high):
                return True
    return False


def string_budget_is_exact(node, text: str, seen: frozenset) -> bool:
    """Every text of up to its max_length that continues `text` is new: then any plain token that fits may
    be taken without stepping it (else a token that fills the string exactly may repeat an item)."""
    high = node.max_length
    return high is None or not any(kind == "string" and len(v) == high and v.startswith(text) for kind, v in seen)
