"""The shared context of planned answers: each request's question, plan and node answers, and an
index of node-prompt prefixes to their KV caches, bounded in bytes with least-recently-used
eviction. Ray-free; `actors.context_cache` puts one behind an actor so every decoder replica
reaches the same index, and the KV payloads themselves live in Ray's object store."""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


def prefix_key(token_ids: list[int]) -> str:
    """A stable name for a prefix, the same in every process."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]


@dataclass
class _Prefix:
    payload: Any
    nbytes: int
    holders: set[str] = field(default_factory=set)


_MERGED = ("question", "plan", "answers", "failures", "prompts", "opened")


class ContextStore:
    """`put_prefix` / `get_prefix` with an LRU byte bound; `open` / `update` / `get` for request
    contexts, of which the oldest are dropped past `max_contexts`."""

    def __init__(self, max_bytes: int, max_contexts: int = 10_000):
        if max_bytes < 1 or max_contexts < 1:
            raise ValueError("max_bytes and max_contexts must be positive")
        self.max_bytes, self.max_contexts = max_bytes, max_contexts
        self._prefixes: OrderedDict[str, _Prefix] = OrderedDict()
        self._contexts: OrderedDict[str, dict] = OrderedDict()
        self.bytes = 0
        self.counts = {"prefix_hits": 0, "prefix_misses": 0, "prefix_puts": 0, "prefix_evictions": 0,
                       "prefix_too_big": 0, "contexts_dropped": 0}

    # ---- prefix KV index ------------------------------------------------------------------------
    def put_prefix(self, key: str, payload: Any, nbytes: int, holder: str) -> list[str]:
        """Store a prefix's KV payload; returns the keys evicted to make room."""
        if nbytes > self.max_bytes:
            self.counts["prefix_too_big"] += 1
            return []
        old = self._prefixes.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        entry = _Prefix(payload, nbytes, (old.holders if old else set()) | {holder})
        self._prefixes[key] = entry
        self.bytes += nbytes
        self.counts["prefix_puts"] += 1
        evicted = []
        while self.bytes > self.max_bytes:
            gone, dropped = self._prefixes.popitem(last=False)
            self.bytes -= dropped.nbytes
            evicted.append(gone)
        self.counts["prefix_evictions"] += len(evicted)
        return evicted

    def get_prefix(self, key: str, holder: str | None = None) -> Any | None:
        """The payload, or None; a hit makes the entry most recent and records the new holder."""
        entry = self._prefixes.get(key)
        if entry is None:
            self.counts["prefix_misses"] += 1
            return None
        self._prefixes.move_to_end(key)
        if holder is not None:
            entry.holders.add(holder)
        self.counts["prefix_hits"] += 1
        return entry.payload

    def holders(self, key: str) -> set[str]:
        entry = self._prefixes.get(key)
        return set(entry.holders) if entry else set()

    # ---- request contexts -----------------------------------------------------------------------
    def open(self, request_id: str, question: str, facts: dict | None = None) -> None:
        """A new request context, with `facts` as `update` takes them."""
        self._contexts[request_id] = {"question": question, "plan": None, "answers": {}, "failures": {},
                                      "prompts": {}, "opened": time.time()}
        self.update(request_id, facts=facts)
        while len(self._contexts) > self.max_contexts:
            self._contexts.popitem(last=False)
            self.counts["contexts_dropped"] += 1

    def update(self, request_id: str, plan: dict | None = None, answers: dict | None = None,
               failures: dict | None = None, prompts: dict | None = None, facts: dict | None = None) -> bool:
        """Add to a request's context: node answers, failure reasons and prompts are merged by node id (as
        strings, the way they travel as JSON), `plan` and each of `facts` (mode, tokens spent, ...) replace
        what was there. False when the context is not open (never opened, closed or dropped)."""
        context = self._contexts.get(request_id)
        if context is None:
            return False
        if plan is not None:
            context["plan"] = plan
        for name, values in (("answers", answers), ("failures", failures), ("prompts", prompts)):
            context[name].update({str(k): v for k, v in (values or {}).items()})
        context.update({k: v for k, v in (facts or {}).items() if k not in _MERGED})
        return True

    def get(self, request_id: str) -> dict | None:
        return self._contexts.get(request_id)

    def close(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)

    def stats(self) -> dict:
        lookups = self.counts["prefix_hits"] + self.counts["prefix_misses"]
        return {**self.counts, "prefix_entries": len(self._prefixes), "prefix_bytes": self.bytes,
                "prefix_hit_rate": round(self.counts["prefix_hits"] / lookups, 3) if lookups else None,
                "contexts": len(self._contexts)}
