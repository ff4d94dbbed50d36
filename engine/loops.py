"""Detect degenerate repetition: small models (the embedded 135M one above all) often fall into a
loop, writing the same sentence until max_tokens. Such an answer is done, and the tokens after the
loop starts are waste that also makes response lengths meaningless to predict."""
from __future__ import annotations

MAX_PERIOD = 96  # longest repeated block looked for, in tokens
MIN_SPAN = 32  # a repetition of short blocks must cover this many tokens before it counts


class LoopDetector:
    """Incremental: after each token, `run[p]` is how many trailing positions i satisfy
    tokens[i] == tokens[i - p]. A loop of period p is declared once that run reaches
    max(2p, MIN_SPAN), i.e. the block has been written three times in a row (many more for
    blocks of a few tokens, so that a legitimate '| --- | --- |' table row is not cut)."""

    def __init__(self, max_period: int = MAX_PERIOD, min_span: int = MIN_SPAN):
        self.max_period = max_period
        self.min_span = min_span
        self.tokens: list[int] = []
        self.run = [0] * (max_period + 1)

    def add(self, token: int) -> bool:
        """Append one token; True when the sequence now ends in a loop."""
        tokens, run = self.tokens, self.run
        tokens.append(token)
        n = len(tokens)
        looping = False
        for p in range(1, min(self.max_period, n - 1) + 1):
            if tokens[n - 1 - p] == token:
                run[p] += 1
                if run[p] >= max(2 * p, self.min_span):
                    looping = True
            else:
                run[p] = 0
        return looping
