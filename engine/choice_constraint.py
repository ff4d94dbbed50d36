"""vLLM's `guided_choice`: a decoding constraint under which the answer is exactly one of a list of
strings. The machine's state is the text written so far; a token is allowed where some choice
continues with its whole text. Where the text is a whole choice that a longer one extends ("yes"
and "yes, please"), the end of sequence is allowed beside the tokens that go on, so the model
decides; elsewhere a whole choice ends the answer.
"""
from __future__ import annotations

import torch

from engine.constraints import DONE, CharGrammar, TokenConstraint
from engine.json_constraint import token_vocab

MAX_CHOICES = 256


class ChoiceGrammar(CharGrammar):
    def __init__(self, choices: tuple[str, ...]):
        self.choices = choices
        self.start = ("",)

    def step(self, state: tuple, ch: str) -> tuple | None:
        if state == DONE:
            return None
        text = state[0] + ch
        longer = [c for c in self.choices if c.startswith(text)]
        if not longer:
            return None
        return DONE if longer == [text] else (text,)

    @staticmethod
    def string_budget(state: tuple) -> None:
        return None  # few tokens fit: found through the index (engine.constraints.narrow_mask)

    def may_end(self, state: tuple) -> bool:
        """The text is a whole choice, though a longer one goes on from it."""
        return state != DONE and state[0] in self.choices


class StopWhereGrammarMayEnd(TokenConstraint):
    """A character grammar lifted to tokens (the shared masks of `engine.json_constraint`), with the
    end of sequence allowed wherever the grammar's `may_end(state)` says the answer may stop.
    Subclasses set `grammar`, `_vocab`, `stops` and `state`, and name what is written in `WHAT`."""

    WHAT = "this answer"

    def allowed(self) -> torch.Tensor:
        mask = self._vocab.mask(self.grammar, self.state)
        if self.stops and self.grammar.may_end(self.state):
            mask = mask.clone()
            mask[self.stops] = True
        return mask

    def advance(self, token_id: int) -> None:
        piece = self._vocab.strings[token_id] if 0 <= token_id < self._vocab.size else ""
        state = self.grammar.run(self.state, piece) if piece else None
        if state is None:
            raise ValueError(f"token {token_id} ({piece!r}) cannot come next in {self.WHAT}")
        self.state = state


class ChoiceConstraint(StopWhereGrammarMayEnd):
    """Token-level `ChoiceGrammar` for one sequence (registered in the engine as "choice"; its
    argument {"choices": [...]}). ValueError for no choices, an empty one, too many, or one the
    tokenizer cannot spell."""

    WHAT = "any choice"

    def __init__(self, tokenizer, arg: dict):
        choices = tuple(dict.fromkeys(arg.get("choices") or ()))
        if not choices or len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"choices: 1 to {MAX_CHOICES} non-empty strings")
        self._vocab = token_vocab(tokenizer)
        unspellable = [c for c in choices if not self._vocab.spells(c)]
        if unspellable:
            raise ValueError(f"the tokenizer cannot spell the choice {unspellable[0]!r}")
        self.grammar = ChoiceGrammar(choices)
        self.stops = [t for t in (tokenizer.eos_token_id,) if t is not None]
        self.state: tuple = self.grammar.start

    @property
    def is_complete(self) -> bool:
        return self.state == DONE
