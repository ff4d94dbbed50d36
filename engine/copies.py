"""Keep an answer from copying given texts. A plan node's prompt shows the whole plan, and the
embedded 135M model often answers a node by writing the plan out again ("1. What is X?\n2. How
does Y?") or by restating its own sub-question, which leaves nothing to show for that node. The
guard bans the token that would carry such a copy on, so the model writes something else there."""
from __future__ import annotations

from collections.abc import Iterable


class CopyGuard:
    """`banned(generated)`: the tokens that would make the answer's end a copy of more than the first
    `allowed` tokens of one of the texts. Each text is matched in both of its encodings, as it reads
    at the start of a line and after a space, since a tokenizer spells a word differently in the two.
    Only copies of a text's beginning count: an answer may quote a phrase from inside a sub-question
    ("... the body and mind"), but not write the sub-question itself out again."""

    def __init__(self, encodings: Iterable[list[int]], allowed: int):
        self.allowed = allowed
        self._texts = [list(ids) for ids in encodings if len(ids) > allowed]

    @classmethod
    def for_texts(cls, texts: Iterable[str], tokenizer, allowed: int) -> "CopyGuard":
        encodings = []
        for text in texts:
            text = text.strip()
            if text:
                for spelled in (text, " " + text):
                    encodings.append(tokenizer.encode(spelled, add_special_tokens=False))
        return cls(encodings, allowed)

    def banned(self, generated: list[int]) -> set[int]:
        out = set()
        for ids in self._texts:
            for length in range(self.allowed, min(len(ids), len(generated) + 1)):
                # the first-token test spares slicing for every length of a long text (a pasted question)
                if length == 0 or (generated[-length] == ids[0] and generated[-length:] == ids[:length]):
                    out.add(ids[length])
        return out
