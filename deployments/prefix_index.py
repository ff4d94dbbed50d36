"""Which decoder replica has seen which prompt starts: the index behind prefix-affinity routing
(deployments.prefix_router). Plain Python, no Ray.

A prompt is cut into blocks of `block_tokens` tokens, each named by a hash chained over the blocks
before it (as vLLM names its KV blocks), so a block's name stands for the whole start up to its end.
Each name maps to the replicas that were sent a prompt with that start, most recent last; the names
are kept in least-recently-used order and the oldest dropped past `max_blocks`. A whole prompt is
named too (its last whole block's name and the tokens after it), so that a prompt that goes on from
an earlier one, every token of it, is known as such: a conversation's next turn, whose prompt is the
last one, its answer and a new message. The replica sent the earlier prompt likely holds the answer's
KV as well, which the index never sees. The index is a guess at the replicas' caches, not a mirror:
a replica may have evicted what the index still lists, so a wrong guess costs a prefill, never a
wrong answer. It is thread-safe: Serve runs the router on a loop of its own, while the batcher,
which groups micro-batches by the replica holding their prompts, asks from the replica's loop."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import NamedTuple


def block_names(prompt_ids: Sequence[int], block_tokens: int) -> list[int]:
    """The chained names of the prompt's whole blocks (a last partial block has none)."""
    names, name = [], 0
    for start in range(0, len(prompt_ids) - block_tokens + 1, block_tokens):
        name = hash((name, tuple(prompt_ids[start : start + block_tokens])))
        names.append(name)
    return names


def _whole_name(after: int, tail: Sequence[int]) -> tuple:
    return ("whole", after, tuple(tail))


class Match(NamedTuple):
    replicas: list  # the candidates that were sent the longest shared start, most recent first
    tokens: int  # that start's length
    whole: bool  # the start is an entire earlier prompt (the new one goes on from it)


class PrefixIndex:
    """`record` what was sent where; `match` says which replicas share the longest start with a prompt."""

    def __init__(self, block_tokens: int = 16, max_blocks: int = 65_536):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, got {block_tokens}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {max_blocks}")
        self.block_tokens, self.max_blocks = block_tokens, max_blocks
        # a block's name, or a whole prompt's (_whole_name) -> replicas, oldest first; least recent first
        self._holders: OrderedDict[Hashable, dict[Hashable, None]] = OrderedDict()
        self._tails: dict[int, dict[int, int]] = {}  # block name -> lengths of whole prompts' tails after it -> count
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._holders)

    def record(self, prompt_ids: Sequence[int], replica: Hashable) -> None:
        """`replica` was sent this prompt: it will hold the KV of the prompt's start."""
        names = block_names(prompt_ids, self.block_tokens)
        with self._lock:
            self._record(prompt_ids, names, replica)

    def _record(self, prompt_ids: Sequence[int], names: list[int], replica: Hashable) -> None:
        after = names[-1] if names else 0
        whole = _whole_name(after, prompt_ids[len(names) * self.block_tokens :])
        for name in [*names, whole]:
            holders = self._holders.get(name)
            if holders is None:
                holders = self._holders[name] = {}
                if name is whole:
                    tails = self._tails.setdefault(after, {})
                    tails[len(whole[2])] = tails.get(len(whole[2]), 0) + 1
            else:
                self._holders.move_to_end(name)
                holders.pop(replica, None)
            holders[replica] = None
        while len(self._holders) > self.max_blocks:
            self._drop(*self._holders.popitem(last=False))

    def _drop(self, name: Hashable, holders: dict) -> None:
        if isinstance(name, tuple):  # a whole prompt's name: one tail fewer after its block
            tails = self._tails[name[1]]
            tails[len(name[2])] -= 1
            if not tails[len(name[2])]:
                del tails[len(name[2])]
                if not tails:
                    del self._tails[name[1]]

    def match(self, prompt_ids: Sequence[int], candidates: Iterable[Hashable] | None = None) -> Match:
        """The candidates (None: any replica) sent the longest start this prompt shares, be it whole
        blocks or an entire earlier prompt; Match([], 0, False) when none shares anything."""
        with self._lock:
            return self._match(prompt_ids, None if candidates is None else set(candidates))

    def _match(self, prompt_ids: Sequence[int], candidates: set | None) -> Match:
        def held(name) -> list:
            return [r for r in reversed(self._holders.get(name, {})) if candidates is None or r in candidates]

        best = Match([], 0, False)
        after, depth = 0, 0
        while True:
            start = depth * self.block_tokens
            for length in sorted(self._tails.get(after, {}), reverse=True):  # an earlier prompt ending here
                if 0 < start + length <= len(prompt_ids):
                    replicas = held(_whole_name(after, prompt_ids[start : start + length]))
                    if replicas and start + length >= best.tokens:  # a whole prompt beats blocks as long
                        best = Match(replicas, start + length, True)
                        break
            if start + self.block_tokens > len(prompt_ids):
                return best
            after = hash((after, tuple(prompt_ids[start : start + self.block_tokens])))
            replicas = held(after)
            if not replicas:
                return best
            depth += 1
            if depth * self.block_tokens > best.tokens:
                best = Match(replicas, depth * self.block_tokens, False)

    def forget(self, replica: Hashable) -> None:
        """The replica is gone: drop it, and the names no one else holds."""
        with self._lock:
            self._forget(replica)

    def _forget(self, replica: Hashable) -> None:
        for name in [n for n, holders in self._holders.items() if replica in holders]:
            del self._holders[name][replica]
            if not self._holders[name]:
                self._drop(name, self._holders.pop(name))
