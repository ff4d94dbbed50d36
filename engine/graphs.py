"""CUDA graphs of the plain decode pass, so a GPU step is not bound by Python and kernel launches.

A decode step of a small model (or of a 7B one at small batch) is a few hundred small kernels; run
eagerly, launching them costs more than the GPU's work (measured on an H200 with the embedded
135M model: 8.8 ms a step at batch 1 and 11.8 at 16, where the arithmetic is well under 1 ms). A
CUDA graph replays all of a step's kernels with one launch (1.9 and 2.2 ms there). A graph fixes its tensors' shapes, so one is
captured per (batch bucket, attention span bucket) the first time a step needs it: the batch is
padded up to a bucket (1, 2, 4, 8, ... up to the cache's slots) and attention runs over a span
bucket (256, 512, ... up to the cache's length) with the positions past each row's own masked.

Padding rows decode token 0 at position 0 in the slots just past the running batch. Those slots are
free whenever a plain decode pass runs (the engine keeps its running sequences in slots 0..B-1, and
a prompt prefilled into a higher slot shares a pass with the decodes, which is not a plain pass), so
they only scribble on position 0 of a slot that its next prompt overwrites.

Only the plain pass is graphed: one token for each running sequence and nothing else. A pass that
also runs forced, drafted or prompt tokens has ragged shapes and runs eagerly, as does everything
on the CPU, where launches are cheap next to the arithmetic.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

SMALLEST_SPAN = 256


def batch_buckets(max_slots: int) -> list[int]:
    """1, 2, 4, ... below `max_slots`, then `max_slots`."""
    sizes, size = [], 1
    while size < max_slots:
        sizes.append(size)
        size *= 2
    return sizes + [max_slots]


def span_buckets(max_len: int) -> list[int]:
    """256, 512, ... below `max_len`, then `max_len`."""
    spans, span = [], SMALLEST_SPAN
    while span < max_len:
        spans.append(span)
        span *= 2
    return spans + [max_len]


def _bucket(value: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= value)


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    logits: torch.Tensor  # the graph's output buffer, overwritten by every replay


class DecodeGraphs:
    """Runs the plain decode pass at fixed shapes: `forward(tokens, positions, span)` is the pass
    (the runner's), run on `self`'s padded buffers. With `capture` (CUDA only) each shape is
    captured as a CUDA graph on first use and replayed after; without it the same padded pass runs
    eagerly, which is how the padding and bucketing are checked on a CPU."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], max_slots: int,
                 max_len: int, device: torch.device, capture: bool):
        if capture and device.type != "cuda":
            raise ValueError(f"cuda_graphs: CUDA graphs need a CUDA device, the model is on {device.type}")
        self.forward = forward
        self.batches, self.spans = batch_buckets(max_slots), span_buckets(max_len)
        self.capture = capture
        self.tokens = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_slots, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0

    @property
    def captured(self) -> int:
        """Graphs captured so far."""
        return len(self._graphs)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The runner's plain decode pass for `tokens` at `positions` (one per running sequence, in
        slots 0..B-1); returns float32 logits [B, vocab], a tensor of the caller's own."""
        batch = tokens.shape[0]
        padded = _bucket(batch, self.batches)
        span = _bucket(int(positions.max()) + 1, self.spans)
        self.tokens[:batch].copy_(tokens)
        self.tokens[batch:padded].zero_()
        self.positions[:batch].copy_(positions)
        self.positions[batch:padded].zero_()
        if not self.capture:
            return self.forward(self.tokens[:padded], self.positions[:padded], span)[:batch]
        entry = self._graphs.get((padded, span)) or self._capture(padded, span)
        entry.graph.replay()
        self.replays += 1
        return entry.logits[:batch].clone()

    def _capture(self, padded: int, span: int) -> _Graph:
        tokens, positions = self.tokens[:padded], self.positions[:padded]
        # warm-up passes on a side stream, as capture requires: they write the same KV as the pass
        # the graph then replays for these inputs, so running them is harmless
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward(tokens, positions, span)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a length predictor or another engine working on the GPU from another thread of
        # the same replica neither breaks the capture nor lands in it
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits = self.forward(tokens, positions, span)
        entry = self._graphs[(padded, span)] = _Graph(graph, logits)
        return entry
