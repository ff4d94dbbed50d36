"""An LRU of prefix KV caches keyed by token ids, bounded in bytes."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

SCORE_BYTES = 160  # a rough size of one stored prompt score (a TokenLogprob), and of each of its alternatives


@dataclass
class PrefixEntry:
    """KV of a token prefix ([layers, kv_heads, length, head_dim] each) and the logits after it.

    `last_logits` is None for a finished answer kept for its continuations (`keep_kv`): its last
    token's logits were spent sampling the token that ended it, so the entry serves only prompts
    that go on past it.

    `scores`: for a prompt that was scored (`echo` with `logprobs`), each token's log probability after
    the first (`engine.types.TokenLogprob`, with `scores_top` alternatives each), so that a later scored
    prompt sharing its start takes those scores and KV and computes only the rest."""

    token_ids: tuple[int, ...]
    kv: tuple[torch.Tensor, torch.Tensor]
    last_logits: torch.Tensor | None
    scores: list | None = None
    scores_top: int = 0
    spare: bool = False  # kept on the chance a later prompt goes on from it: evicted before the rest

    @property
    def nbytes(self) -> int:
        tensors = (*self.kv, self.last_logits) if self.last_logits is not None else self.kv
        scores = len(self.scores) * SCORE_BYTES * (1 + self.scores_top) if self.scores is not None else 0
        return sum(t.numel() * t.element_size() for t in tensors) + scores

    def to(self, device) -> "PrefixEntry":
        """The same entry with its tensors on `device` (on "cpu" before it goes into Ray's object
        store: a process without a GPU cannot unpickle a CUDA tensor)."""
        logits = self.last_logits.to(device) if self.last_logits is not None else None
        return PrefixEntry(tuple(self.token_ids), tuple(t.to(device) for t in self.kv), logits, self.scores,
                           self.scores_top, self.spare)


@dataclass(frozen=True)
class PrefixHandle:
    """What a caller keeps after `prefill_prefix`: enough to recognise the prefix again."""

    length: int
    key: int


class PrefixCache:
    """Longest-match lookup over cached prefixes. Past the bound, the least recently used spare entry
    (an answer or a scored prompt kept on the chance a later prompt goes on from it) goes first, then
    the least recently used of the prefixes callers asked to share."""

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
            spare = next((key for key, e in self._entries.items() if e.spare), None)
            evicted = self._entries.pop(spare) if spare is not None else self._entries.popitem(last=False)[1]
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

    def best_start(self, prompt_ids: list[int]) -> tuple[PrefixEntry, int] | None:
        """The entry whose KV covers the longest start of `prompt_ids`, and how many of its tokens to
        take: a whole entry that the prompt goes on from, or the start an entry shares with the prompt
        (its KV there depends only on those tokens), but never the prompt's last token unless the entry
        is exactly the prompt and has the logits after it (a pass must compute that token's row to
        sample the first answer token). None when no entry shares a token."""
        best, taken, prompt = None, 0, tuple(prompt_ids)
        for key, entry in self._entries.items():
            shared = common_length(key, prompt)
            usable = shared if shared < len(prompt) or (len(key) == shared and entry.last_logits is not None) \
                else shared - 1
            if usable > taken or (usable == taken and best is not None and len(key) == usable < len(best.token_ids)):
                best, taken = entry, usable
        return (best, taken) if best is not None else None

    def longest_scored(self, prompt_ids: list[int], top: int) -> tuple[PrefixEntry, int] | None:
        """The scored entry (one with `scores`, `top` alternatives or more each) whose tokens share the
        longest start with `prompt_ids`, and how many tokens they share; None when none shares two."""
        best, shared, prompt = None, 1, tuple(prompt_ids)
        for entry in self._entries.values():
            if entry.scores is not None and entry.scores_top >= top:
                length = common_length(entry.token_ids, prompt)
                if length > shared:
                    best, shared = entry, length
        return (best, shared) if best is not None else None

    def count(self, entry: PrefixEntry | None, tokens: int | None = None) -> None:
        """Record one lookup's outcome (and refresh the entry's recency); `tokens`: how many of the
        entry's were used, when not all."""
        if entry is None:
            self.misses += 1
            return
        self._entries.move_to_end(entry.token_ids)
        self.hits += 1
        self.hit_tokens += len(entry.token_ids) if tokens is None else tokens


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share: a binary search over slices, each compared in C."""
    if type(a) is not type(b):  # a list slice never equals a tuple slice
        a, b = tuple(a), tuple(b)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
