"""Length bins: predicted answer lengths grouped into ranges, each capped at its upper edge."""
from __future__ import annotations

import bisect

from pydantic import BaseModel, ConfigDict, Field, field_validator


class LengthBins(BaseModel):
    """Upper edges of the length bins, in tokens. Bin i holds predictions in (edges[i-1], edges[i]];
    predictions beyond the last edge fall in the last bin. A bin's cap is its upper edge: the
    batcher stops an answer there and re-queues it one bin up if it is not done."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    edges: list[int] = Field(
        default_factory=lambda: [32, 64, 128, 256, 512, 1024],
        min_length=1,
        description="Upper edge of each bin in tokens: positive and strictly increasing.",
    )

    @field_validator("edges")
    @classmethod
    def _positive_increasing(cls, edges: list[int]) -> list[int]:
        if edges[0] < 1:
            raise ValueError(f"edges: must be positive, got {edges[0]}")
        for low, high in zip(edges, edges[1:]):
            if high <= low:
                raise ValueError(f"edges: must be strictly increasing, got {low} then {high}")
        return edges

    def __len__(self) -> int:
        return len(self.edges)

    @property
    def last(self) -> int:
        """Index of the last (longest) bin."""
        return len(self.edges) - 1

    def bin_of(self, predicted_len: int) -> int:
        """Index of the first bin whose edge is >= predicted_len; the last bin beyond the last edge."""
        return min(bisect.bisect_left(self.edges, predicted_len), self.last)

    def cap(self, bin: int) -> int:
        """The bin's upper edge: the answer length at which its requests are cut."""
        return self.edges[self._check(bin)]

    def next_bin(self, bin: int) -> int:
        """The bin one up; the last bin is its own next."""
        return min(self._check(bin) + 1, self.last)

    def _check(self, bin: int) -> int:
        if not 0 <= bin <= self.last:
            raise ValueError(f"bin: {bin} is not a bin index (0 to {self.last})")
        return bin
