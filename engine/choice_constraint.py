"""vLLM's `guided_choice`: a decoding constraint under which the answer is exactly one of a list of
strings. The machine's state is the text written so far; a token is allowed where some choice
continues with its whole text. Where the text is a whole choice that a longer one extends ("yes"
and "yes, please"), the end of sequence is allowed beside the tokens that go on, so the model
decides; elsewhere a whole choice ends the answer.
"""
from __future__ import annotations

from engine.constraints import DONE, CharGrammar
from engine.json_constraint import GrammarConstraint

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


class ChoiceConstraint(GrammarConstraint):
    """Token-level `ChoiceGrammar` for one sequence (registered in the engine as "choice"; its
    argument {"choices": [...]}). ValueError for no choices, an empty one, too many, or one the
    tokenizer cannot spell."""

    def __init__(self, tokenizer, arg: dict):
        choices = tuple(dict.fromkeys(arg.get("choices") or ()))
        if not choices or len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"choices: 1 to {MAX_CHOICES} non-empty strings")
        super().__init__(tokenizer, ChoiceGrammar(choices), characters=set(), texts=choices, writes="any choice")
