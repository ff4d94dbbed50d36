"""Keep an answer's lines from opening with given words. Asked for one part of a plan, the embedded
135M model often writes questions instead of an answer: the sub-question again ("What is a
productive way to work from home?"), or a numbered list of new ones, as if planning on. Nearly all
of those open a line with an interrogative word; banning such words where a line opens leaves the
model to write a statement there ("The most productive way to work from home is ..."), and a list
may still follow an opening sentence, its items starting with anything else."""
from __future__ import annotations

import re
from collections.abc import Iterable

# what a line holds before its first word: perhaps a list marker, perhaps bold
LINE_OPENING = re.compile(r"[ \t]*(?:(?:[-*\u2022]|\d+[.)])[ \t]*)?(?:\*\*)?")


class OpeningGuard:
    """`banned(text)`: the word tokens that may not come next, where `text` (the answer so far) ends at a
    line's opening; nothing elsewhere. A word is banned in each of its single-token spellings (opening a
    line, after a space): a word the tokenizer splits is left out rather than banning a first piece that
    other words share."""

    def __init__(self, token_ids: Iterable[int]):
        self.token_ids = frozenset(token_ids)

    @classmethod
    def for_words(cls, words: Iterable[str], tokenizer) -> "OpeningGuard":
        ids = set()
        for word in words:
            word = word.strip()
            if word:
                for spelled in (word, " " + word):
                    encoded = tokenizer.encode(spelled, add_special_tokens=False)
                    if len(encoded) == 1:
                        ids.add(encoded[0])
        return cls(ids)

    def banned(self, text: str) -> frozenset[int]:
        last_line = text[text.rfind("\n") + 1:]
        return self.token_ids if LINE_OPENING.fullmatch(last_line) else frozenset()
