"""The decoder replica: one engine loop that runs the micro-batches the batcher hands it and
streams back every request's tokens and final result.

Node prompts of a plan carry `shared_prefix_len`; before such a request runs, the replica looks for
that prefix's KV: already here, else fetched from the shared context cache (computed by another
replica). Else the engine caches it as the request's own prompt is prefilled (no separate step,
which would stall every sequence decoding here), and the replica publishes it to the context cache
once that prefill is done, for the others. A whole prompt's KV (shared by the length predictor) is
only ever fetched, never published: no other request starts with all of it. A request that asked to
keep its KV (`keep_kv`: a plan node with children) has its prompt and answer published when it
finishes, before its result goes back, so a child node's follow-up prompt finds them on any replica."""
from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections import defaultdict
from collections.abc import Awaitable, Callable

from deployments.autoscaling import SEQUENCES_METRIC
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import EngineConfig
from engine.types import GenerationRequest, Result, TokenEvent
from graph.context_store import prefix_key


log = logging.getLogger(__name__)
_CALLER_GONE = object()  # put in a micro-batch's queue when the batcher that sent it is found dead


def exit_replica(error: BaseException) -> None:
    """End this replica's process at once: its engine died, so it can serve nothing. A replica whose
    actor is gone is dropped by the routers at their first failed call and replaced by Serve, where one
    that only fails its health check stays in rotation until the next check, failing (at once, so
    looking idle to the routers) every micro-batch sent to it. What it had in flight the batcher re-queues."""
    log.critical("the engine died (%r); this decoder replica exits for Serve to start a fresh one", error)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(1)


class DecoderReplica:
    """Wrap with `serve.deployment`; `context_cache` is a handle to the ContextCache actor, or None."""

    def __init__(self, engine_config: dict, context_cache=None, name: str = "decoder", engine=None, observer=None,
                 on_engine_death: Callable[[BaseException], None] | None = None,
                 caller_alive: Callable[[object], Awaitable[bool]] | None = None):
        """`engine`: an already built engine (tests); otherwise one is loaded from `engine_config`.
        `observer`: deployments.metrics.DecoderMetrics, or None. `on_engine_death`: see AsyncEngine
        (the Serve deployment passes `exit_replica`). A micro-batch running when the engine dies raises
        EngineDeadError, so the batcher re-queues its unfinished requests elsewhere. `caller_alive`: whether
        a micro-batch's `caller` (its batcher replica, which the Serve deployment names in the batch) is
        alive, asked every `caller_check_s` of the batch while it runs; a micro-batch whose caller died is
        aborted (None: never asked)."""
        if engine is None:
            from engine.engine import LLMEngine

            engine = lambda: LLMEngine.from_config(EngineConfig(**engine_config))  # noqa: E731  (built on its thread)
        self.engine = AsyncEngine(engine, on_death=on_engine_death)
        self.cache = context_cache
        self.name = name
        self._prefix_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._computing: set[str] = set()  # prefixes a running request's prefill is caching here
        self.observer = observer
        self.caller_alive = caller_alive
        self.counts = {"prefix_local": 0, "prefix_fetched": 0, "prefix_computed": 0, "prefix_fetch_failed": 0,
                       "orphaned_batches": 0}
        self._drafts_reported = (0, 0)  # the engine's (draft, kept) token counts the observer has heard of
        self._pumps: dict[str, asyncio.Task] = {}  # request id -> the task streaming it, while its micro-batch runs
        self._aborted: set[str] = set()  # ids `abort` cancelled, whose micro-batch goes on for the others

    async def run_batch(self, batch: dict):
        """Yield lists of items, each list all that was ready at once (one engine step's tokens for
        the whole micro-batch is one message, not one per request): {"event": TokenEvent}, then
        {"result": Result} for each request (or {"error": {"request_id", "message"}} for one the
        engine refuses)."""
        requests = [GenerationRequest.model_validate(r) for r in batch["requests"]]
        publish: dict[str, list[int]] = {}  # request id -> the prefix its prefill computes here
        for request in requests:
            prefix = request.prompt_ids[: request.shared_prefix_len]
            if prefix and not await self._find_prefix(prefix):
                publish[request.id] = prefix
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(request: GenerationRequest) -> None:
            prefix = publish.get(request.id)
            try:
                async for item in self.engine.stream(request):
                    if isinstance(item, Result) and item.kept_kv_tokens:  # for children on other replicas
                        await self._publish((request.prompt_ids + item.token_ids)[: item.kept_kv_tokens])
                    if isinstance(item, Result) and self.observer is not None:
                        self.observer.prompt_tokens(len(request.prompt_ids) + len(request.resume_ids),
                                                    item.prefix_hit_tokens)
                    queue.put_nowait(item)
                    if prefix is not None:  # the first item comes after its prefill: the prefix is cached
                        await self._publish(prefix, len(prefix) < len(request.prompt_ids))
                        prefix = None
            except EngineDeadError as exc:  # nothing more runs here: the whole micro-batch fails, to be re-queued
                queue.put_nowait(exc)
            except Exception as exc:  # refused by the engine, or failed alone: the batcher answers it with the error
                queue.put_nowait({"error": {"request_id": request.id, "message": f"{type(exc).__name__}: {exc}"}})
            finally:
                if prefix is not None:
                    self._computing.discard(prefix_key(prefix))

        def ended(task: asyncio.Task, request_id: str) -> None:
            if self._pumps.get(request_id) is task:  # (not a retry of the same id streaming here since)
                del self._pumps[request_id]
            if request_id in self._aborted:  # leaving the engine's stream aborted it there
                self._aborted.discard(request_id)
                queue.put_nowait({"error": {"request_id": request_id, "message": "aborted: its caller went away"}})

        tasks = []
        for request in requests:
            task = asyncio.create_task(pump(request))
            task.add_done_callback(lambda t, request_id=request.id: ended(t, request_id))
            self._pumps[request.id] = task
            tasks.append(task)
        unfinished, answered = len(requests), set()
        watcher = None
        if self.caller_alive is not None and batch.get("caller") is not None:
            watcher = asyncio.create_task(self._watch_caller(batch["caller"], batch["caller_check_s"], queue))
        try:
            while unfinished:
                ready = [await queue.get()]
                while not queue.empty():
                    ready.append(queue.get_nowait())
                out = []
                for item in ready:
                    if item is _CALLER_GONE:
                        self.counts["orphaned_batches"] += 1
                        log.warning("the batcher that sent a micro-batch of %d died; aborting its %d unfinished "
                                    "requests (the batcher Serve starts has them sent again)", len(requests), unfinished)
                        return  # (below: what still runs is cancelled)
                    if isinstance(item, EngineDeadError):
                        if out:
                            yield out  # what finished before the engine died stays finished
                        raise item
                    if isinstance(item, TokenEvent):
                        if self.observer is not None and item.token_ids:
                            self.observer.generated(len(item.token_ids))
                        if item.token_ids or item.text:
                            out.append({"event": item.model_dump(mode="json")})
                        continue
                    request_id = item.request_id if isinstance(item, Result) else item["error"]["request_id"]
                    if request_id in answered:  # aborted just after its result: answered already
                        continue
                    answered.add(request_id)
                    out.append({"result": item.model_dump(mode="json")} if isinstance(item, Result) else item)
                    unfinished -= 1
                if out:
                    yield out
            await self._report_drafts()
        finally:
            if watcher is not None:
                watcher.cancel()
            for request, task in zip(requests, tasks):
                task.cancel()  # a consumer that stops early aborts what is still running
                if self._pumps.get(request.id) is task:
                    del self._pumps[request.id]

    async def _watch_caller(self, caller, every_s: float, queue: asyncio.Queue) -> None:
        while True:
            await asyncio.sleep(every_s)
            if not await self.caller_alive(caller):
                queue.put_nowait(_CALLER_GONE)
                return

    async def abort(self, request: dict) -> int:
        """Abort requests of a micro-batch running here whose callers went away (`{"batch_id": ...,
        "abort": [request ids]}`) while the rest of it goes on; each is answered with an error, which
        the batcher ignores. Returns how many were running here: the Decoder's router sends this call
        to the replica it sent the micro-batch to, and elsewhere it finds none."""
        running = [(i, self._pumps[i]) for i in request.get("abort", []) if i in self._pumps]
        for request_id, task in running:
            self._aborted.add(request_id)
            task.cancel()
        return len(running)

    async def _report_drafts(self) -> None:
        """Hand the observer the draft tokens the engine checked since the last report (micro-batches
        overlap on one engine, so by its running totals, not per batch)."""
        if self.observer is None:
            return
        stats = await self.engine.call(lambda e: e.stats())
        seen_drafted, seen_kept = self._drafts_reported
        # totals only grow; a report whose stats were read before another's must not count backwards
        drafted = max(stats.get("draft_tokens", 0), seen_drafted)
        kept = max(stats.get("accepted_draft_tokens", 0), seen_kept)
        self._drafts_reported = (drafted, kept)
        self.observer.drafted(kept - seen_kept, (drafted - kept) - (seen_drafted - seen_kept))

    async def _find_prefix(self, token_ids: list[int]) -> bool:
        """True when the engine here holds the prefix (or a running request is caching it) or it was
        fetched from the context cache; False when this request's own prefill will compute it."""
        key = prefix_key(token_ids)
        async with self._prefix_locks[key]:
            if key in self._computing or await self.engine.call(lambda e: e.export_prefix(token_ids) is not None):
                self._count_prefix("local")
                return True
            if self.cache is not None and await self._fetch(key):
                return True
            self._count_prefix("computed")
            self._computing.add(key)
            return False

    async def _publish(self, token_ids: list[int], to_cache: bool = True) -> None:
        """The prefix is cached here now; hand it to the context cache too, unless it is a whole
        prompt (`to_cache` False: no other request starts with all of it)."""
        key = prefix_key(token_ids)
        self._computing.discard(key)
        if self.cache is None or not to_cache:
            return
        entry = await self.engine.call(lambda e: e.export_prefix(token_ids))
        if entry is not None:
            import ray

            await self.cache.put_prefix.remote(key, [ray.put(entry.to("cpu"))], entry.nbytes, self.name)

    async def _fetch(self, key: str) -> bool:
        payload = await self.cache.get_prefix.remote(key, self.name)
        if not payload:
            return False
        try:
            entry = await payload[0]
            await self.engine.call(lambda e: e.import_prefix(entry))
        except Exception:  # its owner is gone or it does not fit: compute it here instead
            self.counts["prefix_fetch_failed"] += 1
            return False
        self._count_prefix("fetched")
        return True

    def _count_prefix(self, outcome: str) -> None:
        self.counts[f"prefix_{outcome}"] += 1
        if self.observer is not None:
            self.observer.prefix_lookup(outcome)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics: the sequences this replica runs or queues in its engine
        (deployments.autoscaling scales on them; Serve's own count is micro-batches)."""
        return {SEQUENCES_METRIC: float(len(self._pumps))}

    async def info(self) -> dict:
        engine = self.engine.engine
        return {"id": engine.model_name, "max_model_len": engine.max_model_len}

    async def stats(self) -> dict:
        engine_stats = await self.engine.call(lambda e: e.stats())
        return {**engine_stats, **self.counts}

    async def health(self) -> dict:
        return self.engine.health()

    def check_health(self) -> None:
        """Called by Serve; a stuck or dead engine loop gets the replica replaced."""
        health = self.engine.health()
        if not health["healthy"]:
            raise RuntimeError(f"engine loop unhealthy: {health}")
