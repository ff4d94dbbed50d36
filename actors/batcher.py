"""The batcher actor: one per application, an asyncio shell over `predictor.batcher.Batcher`.

Callers `await submit(request)` (or iterate `stream(request)`) and get the request's final result,
however many cut-off attempts it took. Micro-batches reach the decoders one of two ways:
- push (the Serve application): with `send_batch`, the actor's own loop hands each micro-batch to a
  decoder replica (through Serve's router, so the decoders' load drives their autoscaling) and
  routes the streamed events and results back (a decoder streams items, or lists of the items
  ready at once);
- pull: decoders call `next_batch`, decode, then `report` or `fail`.
With `predict`, requests that arrive without a predicted length get one first; a predictor that
fails or is slow leaves the prediction empty, which the core sends to its default bin.
Everything crossing the boundary is plain data.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from pydantic import BaseModel, Field

from engine.types import FinishReason, GenerationRequest, Result, TokenLogprob
from predictor.batcher import Batcher, BatcherConfig, HolderOf

log = logging.getLogger(__name__)
REPLICAS_RECHECK_S = 1.0  # how soon more running decoder replicas let more requests out (requests_per_replica)
SendBatch = Callable[[dict], AsyncIterator[dict]]
# predict(prompt_ids, share) -> the length, or {"length", "kv_len"} where the predictor published the
# KV of the prompt's first kv_len tokens to the context cache (asked with share=True)
Predict = Callable[[list[int], bool], Awaitable["int | dict"]]
# aborts requests of a micro-batch on the decoder running it: {"batch_id": ..., "abort": [request ids]}
AbortOnDecoder = Callable[[dict], Awaitable[int]]


class DispatchConfig(BaseModel):
    """How the push loop feeds the decoders. The decoders batch continuously, so a micro-batch joins
    the running engine batch at once: what limits dispatch is their free sequence slots, not how many
    micro-batches are out. Requests past that wait in their bins, where they group by length."""

    max_requests_in_flight: int = Field(
        32, ge=1, description="Requests handed to decoders and not yet finished, across all replicas: about the "
        "engine's max_batch_size times the replicas you expect. Past it, new micro-batches wait.")
    requests_per_replica: int | None = Field(
        None, ge=1, description="Requests in flight follow the Decoder's running replicas: this many a replica "
        "(its engine's slots, plus a few queued there to show the autoscaler a backlog), at most "
        "max_requests_in_flight. Keep it above the autoscaling policy's target_sequences "
        "(deployments.autoscaling), or the requests held back in the bins never add a replica. None: "
        "max_requests_in_flight, whatever the replicas.")
    max_batches_in_flight: int = Field(
        32, ge=1, description="Micro-batches handed to decoders and not yet finished; keep it at or below the "
        "Decoder deployment's max_ongoing_requests times its replicas, so none waits in Serve's router. Requests "
        "that arrive one by one leave as micro-batches of one, so keep it near max_requests_in_flight.")
    preempt: bool = Field(
        True, description="With the decoders' slots all taken, still hand out requests of a higher priority than "
        "some in flight (one for each such lower one), so the decoder's engine preempts a lower one for each "
        "(engine.preempt_for_priority) instead of the request waiting for an answer to end.")
    predict_timeout_s: float = Field(5.0, gt=0, description="A prediction slower than this is skipped (default bin).")
    stream_interval_s: float = Field(
        0.05, ge=0, description="A streamed answer's tokens after its first are sent on at most this often, "
        "those that arrived meanwhile as one event (as Ray Serve LLM batches streamed tokens, 50 ms by "
        "default), so a fast engine does not pay one message per token on every hop to the client. "
        "0: every engine step's token is sent on its own.")
    max_stream_messages_per_s: float | None = Field(
        None, gt=0, description="At most about this many streamed messages a second across all the answers "
        "streaming at once: with N streaming, each gathers its tokens for N / this seconds when that is longer "
        "than stream_interval_s. For a CPU host, where every message on every hop (batcher, ingress, proxy, "
        "client) takes CPU from the decoders; None: no cap (GPU hosts).")
    split_by_holder: bool = Field(
        True, description="Keep prompts that different decoder replicas hold cached (a conversation's earlier "
        "turns, as the Decoder's prefix router saw them sent) in different micro-batches, so each goes to its "
        "holder; a micro-batch runs on one replica. Only while more than one micro-batch may still go out: "
        "else they would wait for one to end. No effect without the prefix router.")
    caller_check_s: float = Field(
        5.0, gt=0, description="A decoder running a micro-batch asks this often whether the batcher replica that "
        "sent it is still alive, and aborts it if not: Ray lets a stream decode on for a caller that died, and "
        "the batcher Serve starts in its place has the requests sent again.")


class RequestFailed(RuntimeError):
    """The request is answered with this error: the decoder refused it (it never fits) or failed on it
    alone, or its micro-batch failed too often (BatcherConfig.max_failed_attempts)."""


def _refusal(batch: dict, request_id: str) -> Result:
    """The final result of a request the decoder refused (answered with its error, see report)."""
    prompt = next(r for r in batch["requests"] if r["id"] == request_id)["prompt_ids"]
    return Result(request_id=request_id, prompt_tokens=len(prompt), token_ids=[], text="",
                  finish_reason=FinishReason.ABORT, ttft_s=0.0, latency_s=0.0)


def _drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _merged(events: list[dict]) -> dict:
    """Consecutive TokenEvents (as dicts) of one request as one."""
    if len(events) == 1:
        return events[0]
    merged = {**events[-1], "token_ids": [t for e in events for t in e["token_ids"]],
              "text": "".join(e["text"] for e in events)}
    if events[-1].get("logprobs") is not None:
        merged["logprobs"] = [lp for e in events for lp in e["logprobs"] or []]
    merged["prompt_logprobs"] = next((e["prompt_logprobs"] for e in events if e.get("prompt_logprobs") is not None),
                                     None)  # an attempt's first event has them
    return merged


def _logprobs(partial: dict[str, list[dict]] | None) -> dict[str, list[TokenLogprob]] | None:
    return None if partial is None else {k: [TokenLogprob.model_validate(d) for d in v] for k, v in partial.items()}


class BatcherActor:
    """Start it with `ray.remote(BatcherActor).remote(config)`, or hold it in a Serve deployment with
    `send_batch`/`predict`. `config` is a `BatcherConfig` as a dict."""

    def __init__(self, config: dict | None = None, send_batch: SendBatch | None = None,
                 predict: Predict | None = None, dispatch: dict | None = None, observer=None,
                 abort_on_decoder: AbortOnDecoder | None = None, holder_of: HolderOf | None = None,
                 decoder_replicas: Callable[[], int | None] | None = None):
        """`observer` (deployments.metrics.BatcherMetrics or None) hears of batches, queues and lengths;
        `holder_of` says which decoder replica holds a prompt (see DispatchConfig.split_by_holder);
        `decoder_replicas` how many decoder replicas run now, None while unknown (see
        DispatchConfig.requests_per_replica)."""
        self.core = Batcher(BatcherConfig.model_validate(config or {}))
        self.dispatch = DispatchConfig.model_validate(dispatch or {})
        self._send_batch, self._predict, self._abort_on_decoder = send_batch, predict, abort_on_decoder
        self._holder_of = holder_of if self.dispatch.split_by_holder else None
        self._decoder_replicas = decoder_replicas
        self._aborting: set[asyncio.Task] = set()  # abort calls under way, held: the loop keeps weak references
        self._waiters: dict[str, asyncio.Future] = {}
        self._listeners: dict[str, asyncio.Queue] = {}
        self._streaming: set[str] = set()  # streamed requests that have sent their first token
        self._progress: dict[str, list[int]] = {}  # tokens each request holds so far in its current attempt
        self._progress_logprobs: dict[str, list[dict]] = {}  # and their logprobs, for requests that ask
        self._predicted: dict[str, int | None] = {}
        self.observer = observer
        self._queued = asyncio.Event()  # set whenever a request may have become available
        self._loop_task: asyncio.Task | None = None
        self._room = asyncio.Event()  # set whenever a dispatched request or micro-batch finishes
        self._out_batches = 0  # micro-batches pushed to decoders, not yet finished
        self._out_priority: dict[str, int] = {}  # request id -> priority, of the requests in them not yet settled
        self._out_tasks: dict[str, asyncio.Task] = {}  # batch id -> the task streaming it from a decoder
        self._abandoned: set[str] = set()  # batch ids whose every request's caller went away
        self.counts = {"predictions": 0, "predictions_skipped": 0, "prediction_failures": 0, "refused": 0,
                       "decoder_aborts": 0}  # requests a decoder said it aborted when asked

    # ---- requests in ----------------------------------------------------------------------------
    async def submit(self, request: dict) -> dict:
        """Queue a `GenerationRequest` (as a dict) and return its final `Result` as a dict.
        Raises ValueError naming the field for an invalid request or a duplicate id."""
        parsed = await self._with_prediction(GenerationRequest.model_validate(request))
        waiter = self._enqueue(parsed)
        try:
            result: Result = await waiter
        finally:
            self._waiters.pop(parsed.id, None)
            if waiter.cancelled() or not waiter.done():  # a cancelled call cancels the future it awaits
                self._forget(parsed.id)
        return result.model_dump(mode="json")

    async def stream(self, request: dict) -> AsyncIterator[dict]:
        """{"event": TokenEvent} as the answer grows (continuing across cut-off attempts), then
        {"result": Result}."""
        parsed = await self._with_prediction(GenerationRequest.model_validate(request))
        listener: asyncio.Queue = asyncio.Queue()
        self._listeners[parsed.id] = listener
        waiter = self._enqueue(parsed)
        sent = False
        try:
            while True:
                getter = asyncio.ensure_future(listener.get())
                await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if getter.done():
                    if sent and (interval := self._stream_interval()):  # the first token goes at once
                        await asyncio.wait({waiter}, timeout=interval)
                    yield {"event": _merged([getter.result(), *_drain(listener)])}
                    sent = True
                    self._streaming.add(parsed.id)
                    continue
                getter.cancel()
                if not listener.empty():
                    yield {"event": _merged(_drain(listener))}
                yield {"result": waiter.result().model_dump(mode="json")}
                return
        finally:
            self._listeners.pop(parsed.id, None)
            self._streaming.discard(parsed.id)
            self._waiters.pop(parsed.id, None)
            if not waiter.done():
                self._forget(parsed.id)

    def _forget(self, request_id: str) -> None:
        """Its caller went away before the answer (a client that disconnects: Serve cancels the calls
        made for it): the request leaves its queue, or its micro-batch in flight. Once nobody waits for
        any request of that micro-batch its call to the decoder is cancelled, which aborts them there;
        before that, the decoder running it is asked to abort this one (`abort_on_decoder`), else it
        decodes on, unread."""
        batch_id = self.core.batch_of(request_id)
        if self.core.cancel(request_id) and self.observer is not None:
            self.observer.cancel()
        for table in (self._progress, self._progress_logprobs, self._predicted):
            table.pop(request_id, None)
        task = self._out_tasks.get(batch_id) if batch_id is not None else None
        if task is None:
            return
        if not self.core.left_in(batch_id):
            self._abandoned.add(batch_id)
            task.cancel()
        elif self._abort_on_decoder is not None:
            # outside the context of the request being cancelled, whose calls Serve cancels with it
            call = asyncio.create_task(self._abort_remote({"batch_id": batch_id, "abort": [request_id]}),
                                       context=contextvars.Context())
            self._aborting.add(call)
            call.add_done_callback(self._aborting.discard)

    async def _abort_remote(self, call: dict) -> None:
        try:
            aborted = await self._abort_on_decoder(call)
            self.counts["decoder_aborts"] += aborted if isinstance(aborted, int) else 0
        except Exception:  # the replica is gone, or so is the batch: nothing left to abort
            log.warning("batcher: aborting %s on its decoder failed", call, exc_info=True)

    def _stream_interval(self) -> float:
        """How long a streamed answer gathers tokens before its next message (see DispatchConfig)."""
        cap = self.dispatch.max_stream_messages_per_s
        shared = len(self._streaming) / cap if cap else 0.0  # answers still queued send nothing: not counted
        return max(self.dispatch.stream_interval_s, shared)

    def _enqueue(self, request: GenerationRequest) -> asyncio.Future:
        self.core.submit(request, time.monotonic())
        waiter = asyncio.get_running_loop().create_future()
        self._waiters[request.id] = waiter
        self._progress[request.id] = list(request.resume_ids)
        if request.params.logprobs is not None:
            self._progress_logprobs[request.id] = [lp.model_dump() for lp in request.resume_logprobs]
        self._predicted[request.id] = request.predicted_len
        self._queued.set()
        self._room.set()  # a higher priority than some in flight may go at once (`_dispatch_room`)
        if self._send_batch is not None and self._loop_task is None:
            # in a context of its own, not the one of the request that happens to start it: Serve reads
            # a call's request ids from the context, and each micro-batch is a call of its own
            self._loop_task = asyncio.create_task(self._push_loop(), context=contextvars.Context())
        return waiter

    async def _with_prediction(self, request: GenerationRequest) -> GenerationRequest:
        """The request with its predicted length. A request without a shared prefix of its own asks
        the predictor to share the prompt KV it computes anyway; the request then names that KV as
        its shared prefix, which the decoder replica fetches instead of prefilling the prompt."""
        if request.predicted_len is not None or self._predict is None:
            return request
        bins = self.core.bins
        if bins.bin_of(request.params.max_tokens) == bins.bin_of(0):
            # its answer fits the lowest bin whatever its length (a scoring request's one token, say): no
            # prediction could place it elsewhere, and the decoder prefills what the predictor would have
            self.counts["predictions_skipped"] += 1
            return request.model_copy(update={"predicted_len": request.params.max_tokens})
        share = not request.shared_prefix_len and request.params.prompt_logprobs is None  # scored: computed whole
        try:
            got = await asyncio.wait_for(self._predict(request.prompt_ids, share), self.dispatch.predict_timeout_s)
            length, kv_len = (got["length"], got.get("kv_len", 0)) if isinstance(got, dict) else (got, 0)
            update = {"predicted_len": length}
            if share and 0 < kv_len <= len(request.prompt_ids):
                update["shared_prefix_len"] = kv_len
            parsed = GenerationRequest.model_validate({**request.model_dump(), **update})
        except Exception:  # the core's default bin takes it; counted, never fatal
            self.counts["prediction_failures"] += 1
            return request
        self.counts["predictions"] += 1
        return parsed

    # ---- push: the actor's own loop feeds the decoders -----------------------------------------
    async def _push_loop(self) -> None:
        running: set[asyncio.Task] = set()  # held here: the event loop keeps only weak references
        while True:
            while not self._dispatch_room():
                self._room.clear()
                # with the limit following the decoder replicas, look again now and then: one added
                # to them frees no slot, so nothing would set `_room`
                recheck = REPLICAS_RECHECK_S if self.dispatch.requests_per_replica is not None else None
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._room.wait(), recheck)
            try:
                batch = await self.next_batch(wait_s=1.0, max_requests=self._dispatch_room(),
                                              holder_of=self._holder_of if self._batch_room() > 1 else None)
            except Exception:  # never let one bad batch stop all dispatch
                log.exception("batcher: forming a micro-batch failed")
                batch = None
                await asyncio.sleep(1.0)
            if batch is None:
                continue
            self._out_batches += 1
            self._out_priority.update((r["id"], r["priority"]) for r in batch["requests"])
            task = asyncio.create_task(self._run_remote(batch))
            self._out_tasks[batch["id"]] = task
            running.add(task)
            task.add_done_callback(running.discard)

    def _batch_room(self) -> int:
        """Micro-batches that may still go out now. Prompts kept apart for their holder leave in a
        micro-batch of their own right after, if one more may go; with only this one left, they would
        wait for a micro-batch to end, which costs more than prefilling what their holder had cached
        (measured: `python -m bench routing --busy`), so then they ride along."""
        return self.dispatch.max_batches_in_flight - self._out_batches

    def _dispatch_room(self) -> int:
        """How many more requests may go to the decoders now (0: wait until a request or batch ends):
        their free sequence slots, or with every slot taken, as many requests of a higher priority than
        some in flight as there are lower ones in flight for the decoders to preempt."""
        if self._batch_room() <= 0:
            return 0
        room = self.request_limit() - len(self._out_priority)
        if room > 0 or not self.dispatch.preempt or not self._out_priority:
            return max(0, room)
        lowest = min(self._out_priority.values())
        above = self.core.queued_above(lowest)
        return min(above, sum(p == lowest for p in self._out_priority.values())) if above else 0

    def request_limit(self) -> int:
        """Requests the decoders may hold at once: `requests_per_replica` for each running replica (one
        while their number is unknown), at most `max_requests_in_flight`."""
        per_replica = self.dispatch.requests_per_replica
        if per_replica is None:
            return self.dispatch.max_requests_in_flight
        replicas = self._decoder_replicas() if self._decoder_replicas is not None else None
        return min(self.dispatch.max_requests_in_flight, per_replica * max(1, replicas or 0))

    async def _run_remote(self, batch: dict) -> None:
        """Stream one micro-batch from a decoder. Each request is settled, and its sequence slot
        freed for the next request, the moment its own result arrives, not when its batch ends."""
        failed, failed_logprobs, stream = None, None, None
        try:
            stream = self._send_batch(batch)
            async for message in stream:
                for item in message if isinstance(message, list) else [message]:  # a decoder may group items
                    if "event" in item:
                        self._on_event(item["event"])
                        continue
                    if "result" in item:
                        result, refused = Result.model_validate(item["result"]), None
                    else:
                        result, refused = _refusal(batch, item["error"]["request_id"]), item["error"]["message"]
                    self._settle(self.core.report_one(batch["id"], result), result, refused)
                    self._out_priority.pop(result.request_id, None)
                    self._room.set()
        except asyncio.CancelledError:
            if batch["id"] not in self._abandoned:
                raise
            task = asyncio.current_task()  # cancelled by `_forget`: nobody waits for any of its requests
            if hasattr(task, "uncancel"):  # Python 3.11 on counts cancel requests; 3.10 has no count to undo
                task.uncancel()
            if callable(getattr(stream, "cancel", None)):
                stream.cancel()  # a Serve call is not cancelled with the task that reads it: cancel it there
        except Exception:  # the replica died or the call failed: what it finished is settled already;
            # the rest is re-queued after the tokens it streamed
            failed = {r["id"]: self._progress.get(r["id"], []) for r in batch["requests"]}
            failed_logprobs = {r["id"]: self._progress_logprobs[r["id"]] for r in batch["requests"]
                               if r["id"] in self._progress_logprobs}
        finally:
            self._out_tasks.pop(batch["id"], None)
            self._abandoned.discard(batch["id"])
            self._out_batches -= 1
            for request in batch["requests"]:  # those not settled: the replica failed or the stream ended early
                self._out_priority.pop(request["id"], None)
            self._room.set()
        await self.report(batch["id"], [], partial=failed, partial_logprobs=failed_logprobs)

    def _on_event(self, event: dict) -> None:
        request_id = event["request_id"]
        progress = self._progress.get(request_id)
        if progress is None:  # cancelled while its micro-batch decodes on for the others
            return
        progress.extend(event["token_ids"])
        if request_id in self._progress_logprobs:
            self._progress_logprobs[request_id].extend(event.get("logprobs") or [])
        listener = self._listeners.get(request_id)
        if listener is not None:
            listener.put_nowait(event)

    # ---- pull: decoders ask for work ------------------------------------------------------------
    async def next_batch(self, budget_override: int | None = None, wait_s: float = 0.0,
                         max_requests: int | None = None, holder_of: HolderOf | None = None) -> dict | None:
        """The next `MicroBatch` as a dict, or None when nothing is queued within `wait_s` seconds.
        `budget_override` replaces the configured token budget (the caller's free KV memory);
        `max_requests` caps the batch's size (the caller's free sequence slots); `holder_of` (the push
        loop's) keeps prompts held by different replicas apart."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            splits = self.core.holder_splits
            batch = self.core.next_batch(time.monotonic(), budget_override, max_requests, holder_of)
            left = deadline - loop.time()
            if batch is not None and self.observer is not None:
                self.observer.batch(len(batch.requests), batch.tokens)
                self.observer.queues(self.core.stats()["queued_per_bin"])
                if self.core.holder_splits > splits:
                    self.observer.split(self.core.holder_splits - splits)
            if batch is not None or left <= 0:
                return None if batch is None else batch.model_dump(mode="json")
            self._queued.clear()
            try:
                await asyncio.wait_for(self._queued.wait(), left)
            except asyncio.TimeoutError:
                pass

    async def report(self, batch_id: str, results: list[dict], refused: dict[str, str] | None = None,
                     partial: dict[str, list[int]] | None = None,
                     partial_logprobs: dict[str, list[dict]] | None = None) -> int:
        """Hand in a batch's results (`Result` dicts); returns how many were final and answered.
        `refused` (request id -> why) answers those requests with a RequestFailed error; `partial`
        (and `partial_logprobs`, TokenLogprob dicts) says the decoder failed partway (see Batcher.report)."""
        parsed = [Result.model_validate(r) for r in results]
        if partial is not None and self.observer is not None and self.core.left_in(batch_id):
            self.observer.failed_batch()
        final = {r.request_id: r for r in self.core.report(batch_id, parsed, partial, _logprobs(partial_logprobs))}
        for result in parsed:
            self._settle(final.get(result.request_id), result, (refused or {}).get(result.request_id))
        reported = {r.request_id for r in parsed}
        for result in final.values():  # failed too often to be re-queued again
            if result.request_id not in reported:
                self._settle(result, result)
        self._wake_if_pending()
        return len(final)

    def _settle(self, final: Result | None, result: Result, refused: str | None = None) -> None:
        """Answer a request whose final result came (`final`), or note a cut attempt's kept tokens."""
        if final is not None:
            self._progress.pop(final.request_id, None)
            self._progress_logprobs.pop(final.request_id, None)
            predicted = self._predicted.pop(final.request_id, None)
            if self.observer is not None:
                self.observer.finished(predicted, final.completion_tokens)
            waiter = self._waiters.get(final.request_id)
            if final.finish_reason == FinishReason.ERROR:
                refused = refused or final.error
            if waiter is not None and not waiter.done():
                if refused is not None:
                    self.counts["refused"] += 1
                    if self.observer is not None:
                        self.observer.error()
                    waiter.set_exception(RequestFailed(refused))
                else:
                    waiter.set_result(final)
        elif result.finish_reason == FinishReason.CUT:  # the next attempt starts from its kept tokens
            self._progress[result.request_id] = list(result.token_ids)
            if result.logprobs is not None:
                self._progress_logprobs[result.request_id] = [lp.model_dump() for lp in result.logprobs]
            if self.observer is not None:
                self.observer.requeue()
            self._wake_if_pending()

    async def fail(self, batch_id: str, partial: dict[str, list[int]] | None = None,
                   partial_logprobs: dict[str, list[dict]] | None = None) -> int:
        """The batch will not be finished (its decoder died): re-queue it; returns how many requests."""
        count = self.core.left_in(batch_id)
        await self.report(batch_id, [], partial=partial or {}, partial_logprobs=partial_logprobs)
        return count

    async def stats(self) -> dict:
        return {**self.core.stats(), **self.counts, "requests_out": len(self._out_priority),
                "request_limit": self.request_limit()}

    async def holder(self, prompt_ids: list[int]) -> str | None:
        """Which decoder replica (its id, as text) holds this prompt's start as far as the micro-batches
        are kept apart by it (DispatchConfig.split_by_holder), or None: for looking into prefix-affinity
        routing from outside."""
        found = self._holder_of(prompt_ids) if self._holder_of is not None else None
        return None if found is None else str(found)

    def _wake_if_pending(self) -> None:
        if self.core.pending():
            self._queued.set()
