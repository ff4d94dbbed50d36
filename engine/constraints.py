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

# name -> "module:Class"; the class is called with the engine's tokenizer.
CONSTRAINTS: dict[str, str] = {
    "plan_lines": "graph.plan_constraint:PlanLineConstraint",
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

    def forced(self) -> int | None:
        """The one token that may come next, or None when there is a choice (or no constraint)."""
        mask = self.allowed()
        if mask is None:
            return None
        ids = mask.nonzero()
        return int(ids[0, 0]) if len(ids) == 1 else None


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


def make_constraint(name: str, tokenizer, resume_ids: Iterable[int] = ()) -> TokenConstraint:
    """A fresh constraint of kind `name` for one sequence decoded with `tokenizer`, advanced past
    `resume_ids` (tokens an earlier, cut-off pass already generated)."""
    try:
        constraint = resolve_constraint(name)(tokenizer)
    except ValueError as error:
        if str(error).startswith("constraint:"):
            raise
        raise ValueError(f"constraint: {name!r} cannot be used with this model's tokenizer: {error}") from None
    try:
        for token in resume_ids:
            constraint.advance(token)
    except ValueError as error:
        raise ValueError(f"resume_ids: not admitted by constraint {name!r}: {error}") from None
    return constraint
