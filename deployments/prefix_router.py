"""Prefix-affinity routing for the Decoder deployment: a Ray Serve request router
(`request_router_config`) that sends a micro-batch to the decoder replica that was sent the longest
start of its prompts, where that replica's KV is most likely still cached (a conversation's next
turn, whose prompt goes on from the last one; a plan's sibling nodes), unless that replica is
busier than the least busy by more than `imbalanced_threshold` sequences. Otherwise, and for prompts
that share too little, Serve's power of two choices, by sequences too.

Its state lives in the process that holds the handle, so the index sees every micro-batch only
because the one Batcher replica sends them all. A replica's load is counted in sequences: the calls
Serve's router already caches from its probes and replies (none are probed for this), plus the
sequences beyond the first of each micro-batch out there (Serve counts a micro-batch of 30 answers as
one call), plus what this router chose for it in the last second in calls not sent yet: Serve counts
a call only once it is sent, after every call routed in the same instant has been chosen, so
micro-batches pushed together would all see the same counts and pile onto one replica. An abort call
for requests of a micro-batch (`Decoder.abort`) goes to the replica that micro-batch was sent to.

A micro-batch goes to one replica, so the batcher, in the same process, asks which
replica each queued prompt would be sent to alone, and keeps prompts held by different replicas in
different micro-batches (actors.batcher's `split_by_holder`), through deployments.prefix_holders."""
from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments import prefix_holders
from deployments.prefix_index import PrefixIndex

UNSENT_TTL_S = 1.0  # a choice not followed by a send within this long was dropped (Serve backed off)
MAX_HOLDERS = 4096  # micro-batches whose replica is remembered, for aborts of their requests


def batch_prompts(pending_request: PendingRequest | None) -> list[list[int]]:
    """The prompts of the micro-batch a request carries (`Decoder.run_batch(batch)`), else none."""
    if pending_request is None or not pending_request.args:
        return []
    batch = pending_request.args[0]
    if not isinstance(batch, dict) or not isinstance(batch.get("requests"), list):
        return []
    return [r["prompt_ids"] for r in batch["requests"] if isinstance(r, dict) and isinstance(r.get("prompt_ids"), list)]


def aborted_batch(pending_request: PendingRequest | None) -> str | None:
    """The micro-batch an abort call names (`Decoder.abort({"batch_id", "abort"})`), else None."""
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], dict):
        return None
    call = pending_request.args[0]
    return call.get("batch_id") if "abort" in call else None


def most_shared(index: PrefixIndex, prompts: list[list[int]], candidates: list[Any]) -> tuple[list[Any], int, bool]:
    """The candidates sent the most of the prompts' starts, the tokens they share in all (a
    micro-batch may hold several prompts, whose shared starts add up), and whether some prompt goes
    on from an entire earlier prompt sent there (a conversation's next turn)."""
    shared: dict[Any, int] = {}
    continued: set[Any] = set()
    for prompt in prompts:
        match = index.match(prompt, candidates)
        for replica in match.replicas:
            shared[replica] = shared.get(replica, 0) + match.tokens
            if match.whole:
                continued.add(replica)
    if not shared:
        return [], 0, False
    top = max(shared.values())
    best = [r for r, tokens in shared.items() if tokens == top]
    return best, top, any(r in continued for r in best)


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """The Decoder's router; see the module. Its keyword arguments (`request_router_kwargs`):
    - block_tokens: prompts are matched in whole blocks of this many tokens (16);
    - max_blocks: the index forgets its least recently sent blocks past this many (65,536);
    - min_shared_tokens: a replica is preferred when a prompt goes on from an entire earlier one sent
      there, or else when it shares at least this many tokens (32);
    - min_shared_share: ... and at least this share of the batch's prompt tokens (0.5), so that a
      system message every prompt starts with does not pull all traffic to one replica;
    - imbalanced_threshold: ... and has at most this many more ongoing sequences than the least busy
      replica (4)."""

    def initialize_state(self, block_tokens: int = 16, max_blocks: int = 65_536, min_shared_tokens: int = 32,
                         min_shared_share: float = 0.5, imbalanced_threshold: int = 4) -> None:
        self.index = PrefixIndex(block_tokens, max_blocks)
        self.min_shared_tokens, self.min_shared_share = min_shared_tokens, min_shared_share
        self.imbalanced_threshold = imbalanced_threshold
        self.routed = {"preferred": 0, "balanced": 0}  # what choose_replicas did, for tests and logs
        # when each replica was chosen for a call not sent yet, and the call's sequences
        self.unsent: dict[ReplicaID, list[tuple[float, int]]] = {}
        # micro-batches out, by (Serve's internal request id, replica): their sequences beyond the first,
        # and those summed per replica
        self.beyond_first: dict[tuple[str, ReplicaID], int] = {}
        self.beyond_first_on: dict[ReplicaID, int] = {}
        self.holders: OrderedDict[str, ReplicaID] = OrderedDict()  # micro-batch id -> the replica sent it
        prefix_holders.register(self._deployment_id.app_name, self._deployment_id.name, self)

    def holder_of(self, prompt_ids: Sequence[int]) -> ReplicaID | None:
        """The replica a micro-batch of this prompt alone would be preferred on (the rule of
        `choose_replicas`, business aside), or None when no replica holds enough of it."""
        match = self.index.match(prompt_ids)
        return match.replicas[0] if match.replicas and self._enough(match.tokens, match.whole, len(prompt_ids)) else None

    def _enough(self, shared_tokens: int, continued: bool, prompt_tokens: int) -> bool:
        """Whether a holder sharing this much is preferred: the prompt goes on from a whole earlier one,
        or shares min_shared_tokens and min_shared_share of its tokens."""
        return continued or shared_tokens >= max(self.min_shared_tokens, self.min_shared_share * prompt_tokens)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:  # every candidate is offered at once: back off before asking again
            pending_request.routing_context.should_backoff = True
        self._forget_unsent_before(time.monotonic() - UNSENT_TTL_S)
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        by_id = {r.replica_id: r for r in candidate_replicas}
        batch_id = aborted_batch(pending_request)
        if batch_id is not None:  # to the replica running the micro-batch; one that is gone runs nothing
            holder = by_id.get(self.holders.get(batch_id))
            return [[holder]] if holder is not None else [two]
        prompts = batch_prompts(pending_request)
        preferred, tokens, continued = most_shared(self.index, prompts, list(by_id))
        preferred = [by_id[i] for i in preferred if not self._too_busy(i, by_id)]
        sequences = max(1, len(prompts))
        if not self._enough(tokens, continued, sum(map(len, prompts))) or not preferred:
            self.routed["balanced"] += 1
            first = min(two, key=lambda r: self._ongoing(r.replica_id))  # power of two choices
            return self._chose([[first], [r for r in two if r is not first]], sequences)
        self.routed["preferred"] += 1
        preferred.sort(key=lambda r: self._ongoing(r.replica_id))
        rest = [r for r in two if r not in preferred] or [r for r in candidate_replicas if r not in preferred]
        return self._chose([preferred[:1], preferred[1:], rest], sequences)

    def _chose(self, ranks: list[list[RunningReplica]], sequences: int) -> list[list[RunningReplica]]:
        """The ranks without empty ones; the first rank's one replica is counted as chosen, not sent."""
        self.unsent.setdefault(ranks[0][0].replica_id, []).append((time.monotonic(), sequences))
        return [rank for rank in ranks if rank]

    def _ongoing(self, replica_id: ReplicaID) -> int:
        """Sequences ongoing on the replica: its calls as Serve's router caches them, the sequences beyond
        the first of its micro-batches out, and those chosen for it not sent yet."""
        return ((self.replica_queue_len_cache.get(replica_id) or 0) + self.beyond_first_on.get(replica_id, 0)
                + sum(n for _, n in self.unsent.get(replica_id, ())))

    def _forget_unsent_before(self, cutoff: float) -> None:
        for replica_id, choices in list(self.unsent.items()):
            choices[:] = [c for c in choices if c[0] >= cutoff]
            if not choices:
                del self.unsent[replica_id]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)  # Serve's cached count now holds the call
        choices = self.unsent.get(replica_id)
        if choices:
            choices.pop(0)

    def _get_pending_request_matching_metadata(self, request_metadata=None) -> PendingRequest | None:
        """The pending request a replica was chosen for (FIFOMixin's hook; it falls back to the
        oldest). Serve's base router matches by internal request id alone, but calls made while
        serving one request share that id: with two of them routing at once, it fulfils the first and
        then finds no call for the replica chosen for the second, which waits forever."""
        for pending in self._pending_requests_to_fulfill:
            if pending.metadata is request_metadata and not pending.future.done():
                return pending
        return None

    def _too_busy(self, replica_id: ReplicaID, by_id: dict[ReplicaID, RunningReplica]) -> bool:
        return self._ongoing(replica_id) - min(map(self._ongoing, by_id)) > self.imbalanced_threshold

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        prompts = batch_prompts(pending_request)
        for prompt in prompts:
            self.index.record(prompt, replica_id)
        if len(prompts) > 1:
            call = (pending_request.metadata.internal_request_id, replica_id)
            self.beyond_first[call] = self.beyond_first.get(call, 0) + len(prompts) - 1
            self.beyond_first_on[replica_id] = self.beyond_first_on.get(replica_id, 0) + len(prompts) - 1
        if prompts and isinstance(pending_request.args[0].get("id"), str):
            self.holders[pending_request.args[0]["id"]] = replica_id
            if len(self.holders) > MAX_HOLDERS:
                self.holders.popitem(last=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        done = self.beyond_first.pop((internal_request_id, replica_id), 0)
        left = self.beyond_first_on.get(replica_id, 0) - done
        if left > 0:
            self.beyond_first_on[replica_id] = left
        else:
            self.beyond_first_on.pop(replica_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget_replica(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone = set(self.curr_replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self._forget_replica(replica_id)

    def _forget_replica(self, replica_id: ReplicaID) -> None:
        self.index.forget(replica_id)
        self.unsent.pop(replica_id, None)
        self.beyond_first_on.pop(replica_id, None)
        for call in [c for c in self.beyond_first if c[1] == replica_id]:
            del self.beyond_first[call]
        for batch_id in [b for b, holder in self.holders.items() if holder == replica_id]:
            del self.holders[batch_id]
