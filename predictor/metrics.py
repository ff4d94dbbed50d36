"""How good a set of length predictions is, in the terms of Zheng et al. (2023)."""
from __future__ import annotations

from collections.abc import Sequence


def length_metrics(predicted: Sequence[float], actual: Sequence[int], edges: Sequence[int]) -> dict:
    """Mean absolute error (tokens), share within 50 and 100 tokens, share predicted into the same
    length bin (bins end at `edges`; longer than the last edge is the last bin), and share
    under-predicted (those are the requests a capped micro-batch cuts and re-queues)."""
    if len(predicted) != len(actual) or not actual:
        raise ValueError("predicted and actual must be non-empty and of the same length")

    def bin_of(length: float) -> int:
        return next((i for i, edge in enumerate(edges) if length <= edge), len(edges) - 1)

    errors = [abs(p - a) for p, a in zip(predicted, actual)]
    n = len(actual)
    return {
        "n": n,
        "mae": round(sum(errors) / n, 1),
        "within_50": round(sum(e <= 50 for e in errors) / n, 3),
        "within_100": round(sum(e <= 100 for e in errors) / n, 3),
        "bin_accuracy": round(sum(bin_of(p) == bin_of(a) for p, a in zip(predicted, actual)) / n, 3),
        "under_rate": round(sum(p < a for p, a in zip(predicted, actual)) / n, 3),
    }
