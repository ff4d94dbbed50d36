"""Prompt-lookup drafting: guess a sequence's next tokens from its own earlier text.

Small models repeat phrases of their prompt (a plan line quotes the question, a node answer
quotes its plan line) and of their own answer, so the tokens that followed the last earlier
occurrence of the sequence's final few tokens are often the ones the model writes next. The
engine checks such a draft in the next forward pass and keeps the part the model agrees with.
"""
from __future__ import annotations


def lookup_draft(tokens: list[int], max_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """The up to `max_tokens` tokens that followed the latest earlier occurrence of the longest
    tail n-gram of `tokens` (n from `max_ngram` down to `min_ngram`); [] when none recurs."""
    if max_tokens <= 0:
        return []
    size = len(tokens)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        tail = tokens[size - n :]
        last = tail[-1]
        # scan backwards for the tail's last token first: cheap, and most positions fail there
        for end in range(size - 2, n - 2, -1):
            if tokens[end] == last and tokens[end - n + 1 : end + 1] == tail:
                return tokens[end + 1 : end + 1 + max_tokens]
    return []
