"""Attention for several packed items (prompts, or tokens run after a sequence's decode token) in a
few kernel calls per layer instead of several per item.

Each item's tokens attend to its own slot's cache, from position 0 to themselves. Run item by item,
a pass over 16 prompts and their length questions is about ten kernels per item and layer; on a GPU
each launch costs more than its work (an H200 took 22 s to predict 512 lengths that way). Here
items of similar length are padded into groups, and each group is one masked attention call over
its slots' cache: its queries scattered into a [items, longest, heads, dim] block, its keys read
from the cache up to the group's furthest position, positions past each query's own masked.

The sums run over a padded, masked span, so the results differ from the item-by-item path in the
last bits: on the CPU, where launches are cheap and answers are kept batch-invariant, the runner
stays item by item (`LlamaRunner.batched_item_attention`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GROUP_SPREAD = 2  # an item joins a group only while the group's longest is at most this many times its own


@dataclass
class _Group:
    rows: torch.Tensor  # the items' token rows in the packed tokens, item after item
    padded_rows: torch.Tensor  # where each of those rows sits in the group's [items x longest] block
    slots: torch.Tensor  # each item's cache slot
    mask: torch.Tensor  # [items, 1, longest, span]: which cache positions each query sees
    items: int
    longest: int
    span: int


class ItemAttention:
    """The attention of `items` (each a `PrefillItem`: token_ids going into `slot` from `start`), packed
    one after another as `bounds` says, planned once for a pass and used for each of its layers."""

    def __init__(self, items, bounds: list[tuple[int, int]], device: torch.device):
        self.device = device
        lengths = [hi - lo for lo, hi in bounds]
        order = sorted(range(len(items)), key=lambda k: lengths[k])
        groups, current = [], []
        for k in order:
            if current and lengths[k] > GROUP_SPREAD * max(1, lengths[current[0]]):
                groups.append(current)
                current = []
            current.append(k)
        if current:
            groups.append(current)
        self.groups = [self._group([items[k] for k in g], [bounds[k] for k in g]) for g in groups]
        self.first_row = bounds[0][0] if bounds else 0  # the items' rows follow one another from here
        rows = [r for lo, hi in bounds for r in range(lo, hi)]
        self.token_rows = torch.tensor(rows, device=device)
        self.token_slots = torch.tensor([it.slot for it, (lo, hi) in zip(items, bounds) for _ in range(hi - lo)],
                                        device=device)
        self.token_positions = torch.tensor([it.start + j for it, (lo, hi) in zip(items, bounds)
                                             for j in range(hi - lo)], device=device)

    def _group(self, items, bounds) -> _Group:
        longest = max(hi - lo for lo, hi in bounds)
        span = max(it.start + hi - lo for it, (lo, hi) in zip(items, bounds))
        rows, padded, query_positions = [], [], []
        for n, (it, (lo, hi)) in enumerate(zip(items, bounds)):
            rows += range(lo, hi)
            padded += range(n * longest, n * longest + hi - lo)
            # a padding query stands at the item's last position: it sees something, and is dropped
            query_positions.append([it.start + min(j, hi - lo - 1) for j in range(longest)])
        positions = torch.tensor(query_positions, device=self.device)
        mask = torch.arange(span, device=self.device)[None, None] <= positions[:, :, None]
        return _Group(rows=torch.tensor(rows, device=self.device), padded_rows=torch.tensor(padded, device=self.device),
                      slots=torch.tensor([it.slot for it in items], device=self.device), mask=mask[:, None],
                      items=len(items), longest=longest, span=span)

    def write_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int, k: torch.Tensor,
                 v: torch.Tensor) -> None:
        """Put the items' keys and values (rows of the pass's [tokens, kv_heads, dim]) in their slots."""
        k_cache[layer, self.token_slots, :, self.token_positions] = k[self.token_rows]
        v_cache[layer, self.token_slots, :, self.token_positions] = v[self.token_rows]

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int) -> torch.Tensor:
        """The items' attention outputs [their tokens, heads, dim], item after item, from the pass's
        queries `q` [tokens, heads, dim]; their KV must be in the cache."""
        heads, dim = q.shape[1], q.shape[2]
        out = q.new_empty(len(self.token_rows), heads, dim)
        for g in self.groups:
            block = q.new_zeros(g.items * g.longest, heads, dim)
            block[g.padded_rows] = q[g.rows]
            block = block.view(g.items, g.longest, heads, dim).transpose(1, 2)
            keys, values = k_cache[layer, g.slots, :, : g.span], v_cache[layer, g.slots, :, : g.span]
            attended = F.scaled_dot_product_attention(block, keys, values, attn_mask=g.mask, enable_gqa=True)
            attended = attended.transpose(1, 2).reshape(g.items * g.longest, heads, dim)
            out[g.rows - self.first_row] = attended[g.padded_rows]
        return out
