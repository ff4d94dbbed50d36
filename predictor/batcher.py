"""The central length-binned batcher (Zheng et al., 2023, "Response Length Perception and Sequence
Scheduling"): requests and DAG nodes are grouped by predicted answer length into micro-batches
sized to a token budget (variable batch size); each answer is capped at its bin's upper edge and
the few that overrun are re-queued one bin up (failure collection and recomputation), keeping
their partial answer so decoding resumes instead of starting over.

Ray-free and clock-free: callers pass `now`, so the policy is tested without sleeping.
"""
from __future__ import annotations

import itertools
import numbers
import uuid
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.types import FinishReason, GenerationRequest, Result, TokenLogprob
from predictor.bins import LengthBins

if TYPE_CHECKING:
    from engine.base import Engine

# prompt ids -> the decoder replica that holds their start's KV, or None (deployments.prefix_holders)
HolderOf = Callable[[Sequence[int]], Hashable | None]


class BatcherConfig(BaseModel):
    """How the batcher bins, sizes and caps micro-batches."""

    model_config = ConfigDict(extra="forbid")

    bins: LengthBins = Field(default_factory=LengthBins, description="Length bins by predicted answer length.")
    token_budget: int = Field(
        16384,
        ge=1,
        description="KV-memory budget of one micro-batch in tokens (variable batch size). A request "
        "costs its prompt plus the answer length it may reach: its resumed tokens and the new tokens "
        "its cap allows (max_tokens without failure_recompute).",
    )
    max_batch_size: int = Field(32, ge=1, description="Most requests in one micro-batch, in either mode.")
    variable_batch_size: bool = Field(
        True,
        description="Pack by token_budget; False packs a fixed count of max_batch_size (the paper's baseline).",
    )
    failure_recompute: bool = Field(
        True,
        description="Cap each answer at its bin's upper edge and re-queue overruns one bin up; False runs "
        "every answer uncapped to max_tokens.",
    )
    aging_s: float = Field(
        30.0,
        gt=0,
        description="A request in the batcher longer than this (counted from its first submit) is served "
        "before any other bin's of its priority, so long requests never starve.",
    )
    max_failed_attempts: int = Field(
        3,
        ge=1,
        description="A request whose micro-batch failed this many times (its replica died, or its result went "
        "missing) is answered with an error (finish_reason `error`) rather than re-queued again: a request that "
        "brings down every engine it meets must not go round the fleet forever. Cut answers do not count.",
    )
    default_bin: int | None = Field(
        None,
        ge=0,
        description="Bin for a request whose predicted_len is missing or unusable (not an int, negative); "
        "None is the last bin, so an unknown answer is not cut early.",
    )

    @model_validator(mode="after")
    def _default_bin_exists(self) -> "BatcherConfig":
        if self.default_bin is not None and self.default_bin > self.bins.last:
            raise ValueError(f"default_bin: {self.default_bin} is not a bin (0 to {self.bins.last})")
        return self


class MicroBatch(BaseModel):
    """Requests of one length bin to decode together; report their results under `id`."""

    id: str = Field(description="Batch id, to pass back to Batcher.report or Batcher.fail.")
    bin: int = Field(description="Index of the length bin the requests were taken from.")
    requests: list[GenerationRequest] = Field(description="Requests with their length_cap set for this attempt.")
    tokens: int = Field(description="The batch's token cost: prompts plus the answer lengths they may reach.")


@dataclass
class _Entry:
    request: GenerationRequest  # as submitted, with resume_ids and predicted_len of the latest cut
    bin: int
    submitted_at: float  # first submit: aging counts across re-queues
    seq: int  # arrival order, to tell the oldest bin when submit times tie
    holder: Hashable | None = None  # the decoder replica holding its prompt, as last asked (holder_of)
    holder_asked_at: float | None = None
    failed_attempts: int = 0  # micro-batches of it that failed (see BatcherConfig.max_failed_attempts)
    prediction_counts: tuple[int, int] = (0, 0)  # its cut attempts' accepted and rejected prediction tokens


# A queued prompt's holder is asked again after this long: it changes only when a prompt sharing its
# start is sent elsewhere, and each asking walks the prompt's blocks, with every pack scanning the queue.
HOLDER_TTL_S = 1.0


class Batcher:
    """Queues requests per length bin and hands out micro-batches.

    Picking the bin (`next_batch`):
      1. the bin holding the highest priority (the API's `priority`: chats before a batch job; DAG
         nodes on a critical path);
      2. among those, a bin holding an aged request (in the batcher aging_s or longer), the oldest
         first, so no request starves behind others of its priority;
      3. else the fullest bin: the share of a batch its queue fills (tokens against the budget, or
         count against max_batch_size), capped at one, so every bin that fills a batch ties;
      4. ties go to the bin whose oldest request came first.
    Packing the bin: by priority, then aged requests (oldest first), then queue order, first fit
    under the token budget and max_batch_size; the first request always goes, even alone over the
    budget. Given `holder_of` (a prompt -> the decoder replica holding its start's KV, or None), a
    micro-batch holds prompts of one holder, besides prompts no replica holds: the first it takes
    with a holder decides, and prompts of other holders wait for a micro-batch of their own, since a
    micro-batch runs on one replica and the others would prefill there what their holder has cached.
    A queued prompt's holder is asked at most once a second (HOLDER_TTL_S), and a pack asks at most
    twice its size, so a long queue held by many replicas costs a pack bounded work.
    Failed batches and requests missing from a report return to the front of their queue, up to
    `max_failed_attempts` times each, and go out again each in a micro-batch of its own; a request
    failed that often is answered with an error.
    Priority is strict, as vLLM's priority scheduling is: a lower one waits while a higher one
    waits (a batch job behind chats however long it has queued).
    """

    def __init__(self, config: BatcherConfig | None = None):
        self.config = config or BatcherConfig()
        self.bins = self.config.bins
        default = self.config.default_bin
        self.default_bin = self.bins.last if default is None else default
        self._queues: list[deque[_Entry]] = [deque() for _ in range(len(self.bins))]
        self._in_flight: dict[str, dict[str, _Entry]] = {}
        self._live: set[str] = set()
        self._seq = itertools.count()
        self._batch_ids = itertools.count()
        self._batch_prefix = uuid.uuid4().hex[:8]  # a restarted batcher never reuses a stale batch id
        self._batch_sizes: Counter[int] = Counter()
        self._counts = Counter(dict.fromkeys(("finished", "requeues", "requeued_tokens", "recompute_tokens",
            "default_bin_uses", "clamped_predictions", "failed_batches", "missing_results", "ignored_results",
            "cancelled", "holder_splits", "failed_out"), 0))

    # ---- requests in ----------------------------------------------------------------------------
    def submit(self, request: GenerationRequest, now: float) -> None:
        """Queue a request in the bin of its predicted length."""
        if request.id in self._live:
            raise ValueError(f"id: request {request.id!r} is already queued or in flight; ids must be unique")
        entry = _Entry(request, self._bin_for(request), now, next(self._seq))
        self._queues[entry.bin].append(entry)
        self._live.add(request.id)

    def _bin_for(self, request: GenerationRequest) -> int:
        predicted = request.predicted_len
        if isinstance(predicted, bool) or not isinstance(predicted, numbers.Integral) or predicted < 0:
            self._counts["default_bin_uses"] += 1
            return self.default_bin
        if predicted > request.params.max_tokens:
            self._counts["clamped_predictions"] += 1
            predicted = request.params.max_tokens
        return self.bins.bin_of(int(predicted))

    # ---- batches out ----------------------------------------------------------------------------
    def next_batch(self, now: float, token_budget: int | None = None, max_requests: int | None = None,
                   holder_of: HolderOf | None = None) -> MicroBatch | None:
        """The next micro-batch (see the class docstring for the policy), or None if nothing waits.
        `token_budget` overrides the configured budget for this batch (a replica's free KV);
        `max_requests` caps its size below max_batch_size (the decoders' free sequence slots);
        `holder_of` keeps prompts held by different decoder replicas apart."""
        budget = self.config.token_budget if token_budget is None else token_budget
        if budget < 1:
            raise ValueError(f"token_budget: must be at least 1, got {budget}")
        if max_requests is not None and max_requests < 1:
            raise ValueError(f"max_requests: must be at least 1, got {max_requests}")
        bin = self._pick_bin(now, budget)
        if bin is None:
            return None
        limit = self.config.max_batch_size if max_requests is None else min(max_requests, self.config.max_batch_size)
        taken = self._pack(self._queues[bin], now, budget, limit, holder_of)
        chosen = {id(e) for e in taken}
        self._queues[bin] = deque(e for e in self._queues[bin] if id(e) not in chosen)
        batch = MicroBatch(
            id=f"{self._batch_prefix}-{next(self._batch_ids)}",
            bin=bin,
            requests=[self._attempt(e) for e in taken],
            tokens=sum(self._cost(e) for e in taken),
        )
        self._in_flight[batch.id] = {e.request.id: e for e in taken}
        self._batch_sizes[len(taken)] += 1
        return batch

    def _pick_bin(self, now: float, budget: int) -> int | None:
        best, best_key = None, None
        for bin, queue in enumerate(self._queues):
            if not queue:
                continue
            oldest = min(queue, key=lambda e: (e.submitted_at, e.seq))
            age = now - oldest.submitted_at
            key = (
                max(e.request.priority for e in queue),
                age if age >= self.config.aging_s else 0.0,
                self._fill(queue, budget),
                -oldest.submitted_at,
                -oldest.seq,
            )
            if best_key is None or key > best_key:
                best, best_key = bin, key
        return best

    def _fill(self, queue: deque[_Entry], budget: int) -> float:
        by_count = len(queue) / self.config.max_batch_size
        if not self.config.variable_batch_size:
            return min(1.0, by_count)
        return min(1.0, max(by_count, sum(self._cost(e) for e in queue) / budget))

    def _pack(self, queue: deque[_Entry], now: float, budget: int, limit: int,
              holder_of: HolderOf | None) -> list[_Entry]:
        def order(indexed: tuple[int, _Entry]):
            index, e = indexed
            aged = now - e.submitted_at >= self.config.aging_s
            return (-e.request.priority, not aged, e.submitted_at if aged else 0.0, index)

        taken, used, group, asked = [], 0, None, 0
        for _, entry in sorted(enumerate(queue), key=order):
            if len(taken) == limit or (taken and taken[0].failed_attempts):
                break
            if entry.failed_attempts and taken:  # retried alone: one that brings its replica down takes no
                continue  # batch mates with it again (and the engine batches lone micro-batches together anyway)
            cost = self._cost(entry)
            if self.config.variable_batch_size and taken and used + cost > budget:
                continue
            holder = None
            if holder_of is not None:
                if entry.holder_asked_at is None or now - entry.holder_asked_at > HOLDER_TTL_S:
                    if asked == 2 * limit and taken:  # bounded work a pack: the rest wait for the next
                        break
                    asked += 1
                    entry.holder, entry.holder_asked_at = holder_of(entry.request.prompt_ids), now
                holder = entry.holder
            if holder is not None and group is not None and holder != group:
                self._counts["holder_splits"] += 1
                continue
            group = holder if holder is not None else group
            taken.append(entry)
            used += cost
        return taken

    def _answer_limit(self, entry: _Entry) -> int:
        """The answer length (resumed tokens included) this attempt may reach."""
        params = entry.request.params
        if not self.config.failure_recompute:
            return params.max_tokens
        cap = self.bins.cap(entry.bin)
        if cap <= len(entry.request.resume_ids):  # cut at the last bin's edge: run to the end
            return params.max_tokens
        return min(cap, params.max_tokens)

    def _cost(self, entry: _Entry) -> int:
        return len(entry.request.prompt_ids) + self._answer_limit(entry)

    def _attempt(self, entry: _Entry) -> GenerationRequest:
        cap = self._answer_limit(entry) if self.config.failure_recompute else None
        params = entry.request.params.model_copy(update={"length_cap": cap})
        return entry.request.model_copy(update={"params": params})

    # ---- results back ---------------------------------------------------------------------------
    def report(self, batch_id: str, results: list[Result], partial: dict[str, list[int]] | None = None,
               partial_logprobs: dict[str, list[TokenLogprob]] | None = None) -> list[Result]:
        """Take a batch's results; returns the final ones (STOP, LENGTH, ABORT, ERROR). A CUT result is
        re-queued one bin up, resuming after its tokens; a request without a result is re-queued as
        it was, or, failed `max_failed_attempts` times now, given an ERROR result, which is among those
        returned. Results of an unknown batch, of requests not in it, or repeated, are ignored.
        `partial` says the replica failed partway (see `fail`): the requests it finished are final,
        the others resume after their tokens in `partial` (and, for those that ask for logprobs, after
        theirs in `partial_logprobs`)."""
        entries = self._in_flight.pop(batch_id, None)
        if entries is None:
            self._counts["ignored_results"] += len(results)
            return []
        final = [r for r in (self._take(entries, result) for result in results) if r is not None]
        if partial is None:
            self._counts["missing_results"] += len(entries)
        else:
            self._counts["failed_batches"] += 1
            self._resume_after(entries, partial, partial_logprobs or {})
        again = []
        for entry in entries.values():
            entry.failed_attempts += 1
            if entry.failed_attempts < self.config.max_failed_attempts:
                again.append(entry)
                continue
            self._live.discard(entry.request.id)
            self._counts["failed_out"] += 1
            final.append(Result(request_id=entry.request.id, prompt_tokens=len(entry.request.prompt_ids), token_ids=[],
                                text="", finish_reason=FinishReason.ERROR, ttft_s=0.0, latency_s=0.0,
                                error=f"its micro-batch failed {entry.failed_attempts} times (the decoder replica died "
                                "or lost it); it is not retried again"))
        self._requeue_front(again)
        return final

    def report_one(self, batch_id: str, result: Result) -> Result | None:
        """One result of a batch that is still running (a decoder streams each as it finishes): the
        result if final, None if it was cut (re-queued now) or is ignored. The batch stays in flight
        until `report` (its remaining results, or none) or `fail`."""
        entries = self._in_flight.get(batch_id)
        if entries is None:
            self._counts["ignored_results"] += 1
            return None
        return self._take(entries, result)

    def _take(self, entries: dict[str, _Entry], result: Result) -> Result | None:
        entry = entries.pop(result.request_id, None)
        if entry is None:
            self._counts["ignored_results"] += 1
            return None
        if result.finish_reason == FinishReason.CUT:
            self._requeue_cut(entry, result)
            return None
        self._live.discard(entry.request.id)
        self._counts["finished"] += 1
        accepted, rejected = entry.prediction_counts
        if accepted or rejected:  # the usage counts the whole answer's, its cut attempts' too
            result = result.model_copy(update={
                "accepted_prediction_tokens": result.accepted_prediction_tokens + accepted,
                "rejected_prediction_tokens": result.rejected_prediction_tokens + rejected})
        return result

    def fail(self, batch_id: str, partial: dict[str, list[int]] | None = None,
             partial_logprobs: dict[str, list[TokenLogprob]] | None = None) -> int:
        """A replica died with the batch in flight: its requests go back to the front of their
        queue. `partial` (request id -> all tokens generated so far, e.g. already streamed to the
        client) makes a request resume after those tokens instead of starting over. Returns how
        many; 0 for a batch already reported or failed."""
        entries = self._in_flight.get(batch_id)
        if entries is None:
            return 0
        count = len(entries)
        self.report(batch_id, [], partial or {}, partial_logprobs)
        return count

    @staticmethod
    def _resume_after(entries: dict[str, _Entry], partial: dict[str, list[int]],
                      partial_logprobs: dict[str, list[TokenLogprob]]) -> None:
        for request_id, tokens in partial.items():
            entry = entries.get(request_id)
            if entry is None or not len(entry.request.resume_ids) < len(tokens) < entry.request.params.max_tokens:
                continue
            update = {"resume_ids": list(tokens)}
            if entry.request.params.logprobs is not None:
                logprobs = partial_logprobs.get(request_id, [])
                if len(logprobs) != len(tokens):  # cannot happen with whole events; never resume unscored
                    continue
                update["resume_logprobs"] = list(logprobs)
            entry.request = entry.request.model_copy(update=update)

    def _requeue_cut(self, entry: _Entry, result: Result) -> None:
        kept = list(result.token_ids)
        accepted, rejected = entry.prediction_counts
        entry.prediction_counts = (accepted + result.accepted_prediction_tokens,
                                   rejected + result.rejected_prediction_tokens)
        entry.bin = self.bins.next_bin(entry.bin)
        predicted = max(self.bins.cap(entry.bin), len(kept) + 1)
        update = {"resume_ids": kept, "predicted_len": predicted}
        if result.logprobs is not None:
            update["resume_logprobs"] = list(result.logprobs)
        entry.request = entry.request.model_copy(update=update)
        self._queues[entry.bin].append(entry)
        self._counts["requeues"] += 1
        self._counts["requeued_tokens"] += len(kept)
        self._counts["recompute_tokens"] += len(entry.request.prompt_ids) + len(kept)

    def _requeue_front(self, entries) -> None:
        for entry in reversed(list(entries)):
            self._queues[entry.bin].appendleft(entry)

    def cancel(self, request_id: str) -> bool:
        """Forget a request whose caller went away: out of its queue, or out of its batch in flight
        (a result of it is then ignored, and a failure of the batch never re-queues it). False for a
        request neither queued nor in flight (answered already, or never submitted)."""
        for queue in self._queues:
            entry = next((e for e in queue if e.request.id == request_id), None)
            if entry is not None:
                queue.remove(entry)
                break
        else:
            batch_id = self.batch_of(request_id)
            if batch_id is None:
                return False
            del self._in_flight[batch_id][request_id]
        self._live.discard(request_id)
        self._counts["cancelled"] += 1
        return True

    def batch_of(self, request_id: str) -> str | None:
        """The id of the batch in flight that holds the request, if one does."""
        return next((b for b, entries in self._in_flight.items() if request_id in entries), None)

    def left_in(self, batch_id: str) -> int:
        """Requests of a batch in flight still waited for (not answered, re-queued or cancelled)."""
        return len(self._in_flight.get(batch_id, ()))

    # ---- state ----------------------------------------------------------------------------------
    @property
    def holder_splits(self) -> int:
        """How often a request was left for a later micro-batch because another replica holds its prompt."""
        return self._counts["holder_splits"]

    def pending(self) -> int:
        """Requests waiting in the queues."""
        return sum(len(q) for q in self._queues)

    def queued_above(self, priority: int) -> int:
        """Requests waiting with a priority above `priority`."""
        return sum(e.request.priority > priority for queue in self._queues for e in queue)

    def in_flight(self) -> int:
        """Requests handed out in batches not yet reported or failed."""
        return sum(len(entries) for entries in self._in_flight.values())

    def stats(self) -> dict:
        """Counters for metrics: queue depth per bin, batches and their sizes, re-queues, recompute
        cost (requeued_tokens kept from cut answers; recompute_tokens prefilled again on resume),
        default-bin uses and clamped predictions, failed batches, missing and ignored results,
        requests answered with an error after max_failed_attempts (failed_out),
        requests cancelled by their callers, and holder_splits: how often a request was left for a
        later micro-batch because another replica than the batch's holds its prompt."""
        batches = sum(self._batch_sizes.values())
        return {
            "queued_per_bin": [len(q) for q in self._queues],
            "pending": self.pending(),
            "in_flight": self.in_flight(),
            "batches": batches,
            "batch_sizes": dict(sorted(self._batch_sizes.items())),
            "mean_batch_size": sum(s * n for s, n in self._batch_sizes.items()) / batches if batches else 0.0,
            **self._counts,
        }


def run_batch(engine: "Engine", batch: MicroBatch) -> list[Result]:
    """Decode one micro-batch to completion on an engine; results in request order."""
    return engine.generate(batch.requests)


def drain(batcher: Batcher, engine: "Engine", clock: Callable[[], float]) -> list[Result]:
    """Serve every queued request on one engine, batch after batch; final results in finishing order."""
    final = []
    while (batch := batcher.next_batch(clock())) is not None:
        final += batcher.report(batch.id, run_batch(engine, batch))
    return final
