"""The batcher actor: one per application, an asyncio shell over `predictor.batcher.Batcher`.

Callers `await submit(request)` and get back the request's final result, however many cut-off
attempts it took; decoder replicas pull `next_batch`, decode it, and `report` the results, or
`fail` the batch when they cannot finish it. Everything crossing the boundary is plain data.
"""
from __future__ import annotations

import asyncio
import time

from engine.types import GenerationRequest, Result
from predictor.batcher import Batcher, BatcherConfig


class BatcherActor:
    """Start it with `ray.remote(BatcherActor).remote(config)` (or wrap it in `serve.deployment`);
    `config` is a `BatcherConfig` as a dict. All methods are async, so one actor serves many
    concurrent submitters and decoders on its event loop without locks."""

    def __init__(self, config: dict | None = None):
        self.core = Batcher(BatcherConfig.model_validate(config or {}))
        self._waiters: dict[str, asyncio.Future] = {}
        self._queued = asyncio.Event()  # set whenever a request may have become available

    async def submit(self, request: dict) -> dict:
        """Queue a `GenerationRequest` (as a dict) and return its final `Result` as a dict.
        Raises ValueError naming the field for an invalid request or a duplicate id."""
        parsed = GenerationRequest.model_validate(request)
        self.core.submit(parsed, time.monotonic())
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[parsed.id] = waiter
        self._queued.set()
        try:
            result: Result = await waiter
        finally:
            self._waiters.pop(parsed.id, None)
        return result.model_dump(mode="json")

    async def next_batch(self, budget_override: int | None = None, wait_s: float = 0.0) -> dict | None:
        """The next `MicroBatch` as a dict, or None when nothing is queued within `wait_s` seconds.
        `budget_override` replaces the configured token budget (the caller's free KV memory)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            batch = self.core.next_batch(time.monotonic(), budget_override)
            left = deadline - loop.time()
            if batch is not None or left <= 0:
                return None if batch is None else batch.model_dump(mode="json")
            self._queued.clear()
            try:
                await asyncio.wait_for(self._queued.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def report(self, batch_id: str, results: list[dict]) -> int:
        """Hand in a batch's results (`Result` dicts); returns how many were final and answered."""
        final = self.core.report(batch_id, [Result.model_validate(r) for r in results])
        for result in final:
            waiter = self._waiters.get(result.request_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(result)
        self._wake_if_pending()
        return len(final)

    async def fail(self, batch_id: str) -> int:
        """The batch will not be finished (its decoder died): re-queue it; returns how many requests."""
        count = self.core.fail(batch_id)
        self._wake_if_pending()
        return count

    async def stats(self) -> dict:
        return self.core.stats()

    def _wake_if_pending(self) -> None:
        if self.core.pending():
            self._queued.set()
