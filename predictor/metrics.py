"""How good a set of length predictions is, in the terms of Zheng et al. (2023)."""
from __future__ import annotations

from collections.abc import Sequence


def length_metrics(predicted: Sequence[float], actual: Sequence[int], edges: Sequence[int]) -> dict:
    """Mean absolute error (tokens), share within 50 and 100 tokens, share predicted into the same
    length bin (bins end at `edges`; longer than the last edge is the last bin), and share
    under-predicted (those are the requests a capped micro-batch cuts and re-queues); and the rank
    correlation (Spearman) with the actual lengths: how well they order requests shortest first."""
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
        "rank_correlation": round(rank_correlation(predicted, actual), 3),
    }


def rank_correlation(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rho: the Pearson correlation of the ranks (ties share their mean rank); 0 where
    either side is constant."""
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    spread = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / spread if spread else 0.0


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start : end + 1]:
            ranks[i] = (start + end) / 2 + 1
        start = end + 1
    return ranks
