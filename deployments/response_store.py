"""Stored responses of the Responses API, so that a request may name the one it follows
(`previous_response_id`) rather than send the whole conversation again, and a client may fetch or
delete one (`GET` / `DELETE /v1/responses/{id}`, and its input items). Each record holds the response as
it was returned, its input items as listed, and the conversation up to it as chat messages (the earlier
turns, this request's input, the answer), so a follow-up reads one record, however long the
conversation. Ray-free: in the Serve app the context-cache actor (`actors.context_cache`) holds one,
which every ingress replica reaches; in one process `LocalResponses` does. Memory-bound, least recently
used out first, as OpenAI's own store forgets responses after a while: a follow-up to a forgotten one is
a 400 that says so."""
from __future__ import annotations

import json
from collections import OrderedDict


class ResponseStore:
    """`put` / `get` / `delete` records by response id, at most `max_responses` of them and `max_bytes` of
    their JSON text; past either, the least recently used go."""

    def __init__(self, max_bytes: int = 256 << 20, max_responses: int = 10_000):
        if max_bytes < 1 or max_responses < 1:
            raise ValueError("max_bytes and max_responses must be positive")
        self.max_bytes, self.max_responses = max_bytes, max_responses
        self._records: OrderedDict[str, tuple[dict, int]] = OrderedDict()
        self.bytes = 0
        self.counts = {"stored": 0, "evicted": 0, "too_big": 0, "deleted": 0}

    def put(self, response_id: str, record: dict) -> bool:
        """Keep a record; False (and nothing kept) for one larger than the whole bound."""
        size = len(json.dumps(record))
        if size > self.max_bytes:
            self.counts["too_big"] += 1
            return False
        self.delete(response_id, counted=False)
        self._records[response_id] = (record, size)
        self.bytes += size
        self.counts["stored"] += 1
        while self.bytes > self.max_bytes or len(self._records) > self.max_responses:
            _, (_, dropped) = self._records.popitem(last=False)
            self.bytes -= dropped
            self.counts["evicted"] += 1
        return True

    def get(self, response_id: str) -> dict | None:
        entry = self._records.get(response_id)
        if entry is None:
            return None
        self._records.move_to_end(response_id)
        return entry[0]

    def delete(self, response_id: str, counted: bool = True) -> bool:
        entry = self._records.pop(response_id, None)
        if entry is None:
            return False
        self.bytes -= entry[1]
        self.counts["deleted"] += counted
        return True

    def stats(self) -> dict:
        return {"responses": len(self._records), "response_bytes": self.bytes,
                **{f"responses_{name}": n for name, n in self.counts.items()}}


class LocalResponses:
    """A `ResponseStore` behind the async methods the HTTP app calls: in this process, or as the
    context-cache actor's methods (`actors.context_cache.ContextCache` is one)."""

    def __init__(self, responses: ResponseStore | None = None):
        self.responses = responses or ResponseStore()

    async def put_response(self, response_id: str, record: dict) -> bool:
        return self.responses.put(response_id, record)

    async def get_response(self, response_id: str) -> dict | None:
        return self.responses.get(response_id)

    async def delete_response(self, response_id: str) -> bool:
        return self.responses.delete(response_id)
