"""Drafting: guess a sequence's next tokens from its own earlier text (prompt lookup), or from a text
the caller expects the answer to repeat (OpenAI's predicted outputs).

Small models repeat phrases of their prompt (a plan line quotes the question, a node answer
quotes its plan line) and of their own answer, so the tokens that followed the last earlier
occurrence of the sequence's final few tokens are often the ones the model writes next. The
engine checks such a draft in the next forward pass and keeps the part the model agrees with.

A prediction (a file being edited, a form being filled in again) is followed the same way: the answer's
last few tokens are found in it, near where the answer has got to, and what follows them there is the
draft; an answer that leaves the prediction (an edit) finds its way back once it writes a few of its
tokens again.
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


PREDICTION_NGRAM = 8  # the longest answer tail looked up in a prediction; 2 the shortest (see PredictionDrafts)


class PredictionDrafts:
    """Drafts from one request's prediction (its token ids), indexed once by token."""

    def __init__(self, prediction: list[int]):
        self.prediction = prediction
        self.positions: dict[int, list[int]] = {}
        for i, token in enumerate(prediction):
            self.positions.setdefault(token, []).append(i)

    def draft(self, generated: list[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens of the prediction to check next: its start while nothing is generated,
        else what follows the longest tail of `generated` (8 tokens down to 2, or the one token of an answer
        that has only one) found in it, at the occurrence nearest to where an answer that copied it would be."""
        prediction = self.prediction
        if max_tokens <= 0 or not prediction:
            return []
        size = len(generated)
        if not size:
            return prediction[:max_tokens]
        longest = min(PREDICTION_NGRAM, size)
        best, best_end = 0, 0
        for at in self.positions.get(generated[-1], ()):
            n = 1
            while n < longest and n <= at and prediction[at - n] == generated[size - 1 - n]:
                n += 1
            end = at + 1
            if n > best or (n == best and abs(end - size) < abs(best_end - size)):
                best, best_end = n, end
        if best < min(2, size):
            return []
        return prediction[best_end:best_end + max_tokens]
