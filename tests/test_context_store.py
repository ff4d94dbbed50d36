"""The context store: prefix index with an LRU byte bound, and request contexts."""
from __future__ import annotations

import pytest

from graph.context_store import ContextStore, prefix_key


def test_prefix_keys_are_stable_and_distinct():
    assert prefix_key([1, 2, 3]) == prefix_key([1, 2, 3])
    assert prefix_key([1, 2, 3]) != prefix_key([1, 23])


def test_prefixes_are_evicted_least_recently_used_first_within_the_byte_bound():
    store = ContextStore(max_bytes=100)
    assert store.put_prefix("a", "A", 40, "r1") == []
    assert store.put_prefix("b", "B", 40, "r1") == []
    assert store.get_prefix("a", holder="r2") == "A"  # a is now the most recent
    assert store.put_prefix("c", "C", 40, "r2") == ["b"]
    assert store.get_prefix("b") is None and store.bytes == 80
    assert store.holders("a") == {"r1", "r2"}
    assert store.put_prefix("huge", "H", 101, "r1") == [] and store.get_prefix("huge") is None
    stats = store.stats()
    assert (stats["prefix_hits"], stats["prefix_misses"], stats["prefix_too_big"]) == (1, 2, 1)
    assert stats["prefix_evictions"] == 1 and stats["prefix_entries"] == 2


def test_replacing_a_prefix_keeps_bytes_right():
    store = ContextStore(max_bytes=100)
    store.put_prefix("a", "A1", 60, "r1")
    store.put_prefix("a", "A2", 30, "r2")
    assert store.bytes == 30 and store.get_prefix("a") == "A2" and store.holders("a") == {"r1", "r2"}


def test_request_contexts_hold_question_plan_and_answers_and_drop_the_oldest():
    store = ContextStore(max_bytes=10, max_contexts=2)
    store.open("q1", "why?")
    assert store.update("q1", plan={"nodes": [1]}, answers={1: "because"})
    assert store.get("q1")["answers"] == {"1": "because"} and store.get("q1")["plan"] == {"nodes": [1]}
    store.open("q2", "how?")
    store.open("q3", "what?")
    assert store.get("q1") is None and not store.update("q1", answers={2: "x"})
    assert store.stats()["contexts_dropped"] == 1
    store.close("q2")
    assert store.get("q2") is None


def test_bounds_must_be_positive():
    with pytest.raises(ValueError):
        ContextStore(max_bytes=0)
