"""The stored responses' bounds: at most so many, at most so many bytes, least recently used out first."""
from __future__ import annotations

import asyncio
import json

import pytest

from deployments.response_store import LocalResponses, ResponseStore


def _record(n: int, size: int = 10) -> dict:
    return {"response": {"id": f"resp_{n}"}, "messages": [{"role": "user", "content": "x" * size}]}


def test_past_the_count_the_least_recently_used_go():
    store = ResponseStore(max_responses=2)
    store.put("a", _record(1))
    store.put("b", _record(2))
    assert store.get("a") == _record(1)  # now "b" is the least recently used
    store.put("c", _record(3))
    assert store.get("b") is None and store.get("a") and store.get("c")
    assert store.stats()["responses"] == 2 and store.stats()["responses_evicted"] == 1


def test_past_the_bytes_the_least_recently_used_go_and_one_too_big_is_refused():
    size = len(json.dumps(_record(1, 100)))
    store = ResponseStore(max_bytes=2 * size + 5)
    assert store.put("a", _record(1, 100)) and store.put("b", _record(2, 100)) and store.put("c", _record(3, 100))
    assert store.get("a") is None and store.bytes == 2 * size
    assert not store.put("d", _record(4, 10 * size)) and store.get("d") is None
    assert store.stats()["responses_too_big"] == 1


def test_a_record_put_again_replaces_itself_and_a_deleted_one_is_gone():
    store = ResponseStore()
    store.put("a", _record(1, 5))
    store.put("a", _record(1, 50))
    assert store.stats()["responses"] == 1 and store.bytes == len(json.dumps(_record(1, 50)))
    assert store.delete("a") and not store.delete("a") and store.get("a") is None and store.bytes == 0


def test_bounds_must_be_positive():
    with pytest.raises(ValueError, match="max_bytes"):
        ResponseStore(max_bytes=0)


def test_the_context_cache_actor_and_the_local_store_offer_the_same_calls():
    from actors.context_cache import ContextCache

    async def round_trip(store):
        assert await store.put_response("a", _record(1))
        assert await store.get_response("a") == _record(1)
        assert await store.delete_response("a") and await store.get_response("a") is None

    asyncio.run(round_trip(LocalResponses()))
    cache = ContextCache({"max_responses": 1})
    asyncio.run(round_trip(cache))
    assert asyncio.run(cache.stats())["responses_deleted"] == 1
