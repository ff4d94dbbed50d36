"""Constrained decoding: per-sequence objects that say which tokens may come next.

A request names its constraint (`SamplingParams.constraint`) rather than carrying an object, so
its params stay plain data across process boundaries; the engine looks the name up in
`CONSTRAINTS` and builds one constraint per sequence when the request is added. Constraint
modules are imported lazily, so the engine needs none of them until a request asks.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch

# name -> "module:Class"; the class is called with the engine's tokenizer, and the request's
# `constraint_arg` after it for the constraints that take one.
CONSTRAINTS: dict[str, str] = {
    "plan_lines": "graph.plan_constraint:PlanLineConstraint",
    "json_object": "engine.json_constraint:JsonObjectConstraint",
    "json_schema": "engine.json_schema_constraint:JsonSchemaConstraint",
    "choice": "engine.choice_constraint:ChoiceConstraint",
    "tool_calls_or_text": "engine.tool_call_constraint:ToolCallOrTextConstraint",
}


class TokenConstraint(ABC):
    """The decoding state of one sequence under a grammar.

    Each step the engine asks `allowed()` for the tokens that may come next, samples among them
    only, then reports the chosen token to `advance()`. Once `is_complete`, the grammar has
    reached an accepting end and the engine finishes the sequence with FinishReason.STOP.
    """

    @abstractmethod
    def allowed(self) -> torch.Tensor | None:
        """A bool mask over the vocabulary (True: may come next), or None when anything may.
        Never all False. Ids past its length are disallowed."""

    @abstractmethod
    def advance(self, token_id: int) -> None:
        """Move past a token; ValueError if the grammar does not admit it here."""

    @property
    @abstractmethod
    def is_complete(self) -> bool:
        """True once the text is a whole sentence of the grammar and nothing more may follow."""

    def wrap_up(self) -> bool:
        """Finish the answer the shortest way the grammar allows from now on, where the engine would
        otherwise cut it (it loops); True if the constraint does, False (the default) if it cannot
        and the answer is cut where it stands."""
        return False

    def forced(self) -> int | None:
        """The one token that may come next, or None when there is a choice (or no constraint)."""
        mask = self.allowed()
        if mask is None:
            return None
        ids = mask.nonzero()
        return int(ids[0, 0]) if len(ids) == 1 else None


DONE = ("done",)  # a grammar's accepting end: nothing may follow


class CharGrammar:
    """A character-level machine for a constraint to lift to tokens: a subclass gives `start` and
    `step(state, ch)`, the next state or None where `ch` cannot come next (DONE accepts nothing)."""

    start: tuple

    def step(self, state: tuple, ch: str) -> tuple | None:
        raise NotImplementedError

    def run(self, state: tuple | None, text: str) -> tuple | None:
        """The state after `text`, or None where the text leaves the grammar."""
        for ch in text:
            if state is None:
                return None
            state = self.step(state, ch)
        return state

    def accepts(self, text: str) -> bool:
        """True when `text` is a whole sentence of the grammar: it ends exactly at DONE."""
        return self.run(self.start, text) == DONE


def token_strings(tokenizer) -> list[str]:
    """Each token's text decoded alone, as a grammar reads it: "" for special tokens and for tokens
    holding part of a UTF-8 character (U+FFFD alone), which a grammar then never allows."""
    ids = list(range(len(tokenizer)))
    strings = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    pieces = tokenizer.convert_ids_to_tokens(ids)
    special = set(tokenizer.all_special_ids)
    out = []
    for i, (s, piece) in enumerate(zip(strings, pieces)):
        if piece and piece.startswith("\u2581") and not s.startswith(" "):
            s = " " + s  # SentencePiece drops a word's leading space when it is decoded alone
        out.append("" if i in special or "\ufffd" in s else s)
    return out


def first_two_index(strings: list[str]) -> dict[str, dict[str, list[tuple[int, str]]]]:
    """The tokens (id, string) by their first character, then their second ("" for one-character tokens)."""
    index: dict[str, dict[str, list[tuple[int, str]]]] = {}
    for i, s in enumerate(strings):
        if s:
            index.setdefault(s[0], {}).setdefault(s[1:2], []).append((i, s))
    return index


def narrow_mask(grammar, state, index: dict[str, dict[str, list[tuple[int, str]]]], size: int) -> torch.Tensor:
    """The tokens whose whole string `grammar` (with `step(state, ch)` and `run(state, text)`, None
    where the text leaves it) accepts from `state`, found through `first_two_index`: where few
    tokens fit, most are ruled out by their first two characters, so few are run whole."""
    allowed = []
    for first, by_second in index.items():
        after_first = grammar.step(state, first)
        if after_first is None:
            continue
        for second, tokens in by_second.items():
            if not second:
                allowed.extend(i for i, _ in tokens)
                continue
            after_second = grammar.step(after_first, second)
            if after_second is not None:
                allowed.extend(i for i, s in tokens if grammar.run(after_second, s[2:]) is not None)
    mask = torch.zeros(size, dtype=torch.bool)
    mask[allowed] = True
    return mask


def resolve_constraint(name: str) -> type:
    """The constraint class registered under `name`; ValueError naming `constraint` if unknown."""
    path = CONSTRAINTS.get(name)
    if path is None:
        known = ", ".join(sorted(CONSTRAINTS)) or "none"
        raise ValueError(f"constraint: unknown constraint {name!r}; known: {known}")
    module_name, _, class_name = path.partition(":")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"constraint: {name!r} is registered as {path!r}, which cannot be loaded: {error}") from None


def make_constraint(name: str, tokenizer, resume_ids: Iterable[int] = (), arg=None) -> TokenConstraint:
    """A fresh constraint of kind `name` (given `arg`, for one that takes an argument) for one sequence
    decoded with `tokenizer`, advanced past `resume_ids` (tokens an earlier, cut-off pass already generated)."""
    kind = resolve_constraint(name)
    try:
        constraint = kind(tokenizer) if arg is None else kind(tokenizer, arg)
    except ValueError as error:
        if str(error).startswith("constraint:"):
            raise
        raise ValueError(f"constraint: {name!r} cannot be used here: {error}") from None
    try:
        for token in resume_ids:
            constraint.advance(token)
    except ValueError as error:
        raise ValueError(f"resume_ids: not admitted by constraint {name!r}: {error}") from None
    if constraint.is_complete:  # nothing may follow: a finished answer is not resumed
        raise ValueError(f"resume_ids: already a whole answer under constraint {name!r}; nothing can follow")
    return constraint
