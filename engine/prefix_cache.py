"""An LRU of prefix KV caches keyed by token ids, bounded in bytes."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class PrefixEntry:
    """KV of a token prefix ([layers, kv_heads, length, head_dim] each) and the logits after it.

    `last_logits` is None for a finished answer kept for its continuations (`keep_kv`): its last
    token's logits were spent sampling the token that ended it, so the entry serves only prompts
    that go on past it."""

    token_ids: tuple[int, ...]
    kv: tuple[torch.Tensor, torch.Tensor]
    last_logits: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        tensors = (*self.kv, self.last_logits) if self.last_logits is not None else self.kv
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device) -> "PrefixEntry":
        """The same entry with its tensors on `device` (on "cpu" before it goes into Ray's object
        store: a process without a GPU cannot unpickle a CUDA tensor)."""
        logits = self.last_logits.to(device) if self.last_logits is not None else None
        return PrefixEntry(tuple(self.token_ids), tuple(t.to(device) for t in self.kv), logits)


@dataclass(frozen=True)
class PrefixHandle:
    """What a caller keeps after `prefill_prefix`: enough to recognise the prefix again."""

    length: int
    key: int


class PrefixCache:
    """Longest-match lookup over cached prefixes; least recently used entries go first."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, token_ids: tuple[int, ...]) -> PrefixEntry | None:
        entry = self._entries.get(token_ids)
        if entry is not None:
            self._entries.move_to_end(token_ids)
        return entry

    def put(self, entry: PrefixEntry) -> bool:
        """Store an entry; returns False when it alone exceeds the bound."""
        if entry.nbytes > self.max_bytes:
            return False
        old = self._entries.pop(entry.token_ids, None)
        if old is not None:
            self.bytes -= old.nbytes
        self._entries[entry.token_ids] = entry
        self.bytes += entry.nbytes
        while self.bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.bytes -= evicted.nbytes
        return True

    def clear(self) -> None:
        """Drop every entry (the hit counts stay)."""
        self._entries.clear()
        self.bytes = 0

    def longest_match(self, prompt_ids: list[int], count: bool = True) -> PrefixEntry | None:
        """The longest cached prefix of `prompt_ids` (one without logits only when the prompt goes on
        past it); `count` records it as a hit or a miss."""
        best = None
        for key, entry in self._entries.items():
            fits = len(key) < len(prompt_ids) or (len(key) == len(prompt_ids) and entry.last_logits is not None)
            if fits and (best is None or len(key) > len(best.token_ids)):
                if tuple(prompt_ids[: len(key)]) == key:
                    best = entry
        if count:
            self.count(best)
        return best

    def count(self, entry: PrefixEntry | None) -> None:
        """Record one lookup's outcome (and refresh the entry's recency)."""
        if entry is None:
            self.misses += 1
            return
        self._entries.move_to_end(entry.token_ids)
        self.hits += 1
        self.hit_tokens += len(entry.token_ids)
