"""Prefix-affinity routing of micro-batches to decoder replicas: the index (deployments.prefix_index)
and Serve's router over it (deployments.prefix_router), with stand-in replicas, no cluster."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from deployments.prefix_index import PrefixIndex, block_names
from deployments.prefix_holders import holder_lookup
from deployments.prefix_router import PrefixAffinityRouter, batch_prompts

SYSTEM = list(range(100, 164))  # 64 tokens every prompt below starts with


def test_block_names_chain_so_equal_blocks_after_different_starts_differ():
    assert len(block_names(list(range(40)), 16)) == 2  # the last 8 tokens make no whole block
    a, b = block_names([1] * 16 + [2] * 16, 16), block_names([3] * 16 + [2] * 16, 16)
    assert a[0] != b[0] and a[1] != b[1]
    assert block_names([1] * 16 + [2] * 16 + [9] * 5, 16) == a


def test_match_finds_the_replicas_sent_the_longest_shared_start_most_recent_first():
    index = PrefixIndex(block_tokens=16)
    index.record(SYSTEM + [1] * 32, "a")
    index.record(SYSTEM + [2] * 32, "b")
    assert index.match(SYSTEM + [1] * 40, ["a", "b"]) == (["a"], 96, True)  # goes on from a's whole prompt
    assert index.match(SYSTEM + [3] * 40, ["a", "b"]) == (["b", "a"], 64, False)  # both hold the system; b later
    assert index.match(SYSTEM + [1] * 40, ["b"]) == (["b"], 64, False)  # only candidates count
    assert index.match([7] * 64, ["a", "b"]) == ([], 0, False)
    assert index.match(SYSTEM[:15], ["a", "b"]) == ([], 0, False)  # no whole block


def test_a_prompt_that_goes_on_from_a_whole_earlier_one_is_known_to_the_token():
    index = PrefixIndex(block_tokens=16)
    index.record(SYSTEM + [1] * 5, "a")  # 69 tokens: four whole blocks and a tail of 5
    index.record(SYSTEM + [2] * 5, "b")
    assert index.match(SYSTEM + [1] * 5 + [9] * 40, ["a", "b"]) == (["a"], 69, True)
    assert index.match(SYSTEM + [1] * 5, ["a", "b"]) == (["a"], 69, True)  # the same prompt again
    assert index.match(SYSTEM + [1] * 4, ["a", "b"]) == (["b", "a"], 64, False)  # a tail cut short is not whole
    assert index.match(SYSTEM + [2] * 5 + [1] * 20, ["a"]) == (["a"], 64, False)
    index.record(SYSTEM + [1] * 5 + [9] * 11, "b")  # 80 tokens: ends on a block's edge
    assert index.match(SYSTEM + [1] * 5 + [9] * 30, ["a", "b"]) == (["b"], 80, True)


def test_the_index_forgets_its_least_recently_sent_names_and_dead_replicas():
    index = PrefixIndex(block_tokens=4, max_blocks=6)  # names: each whole block, and each whole prompt
    index.record([1, 1, 1, 1, 2, 2, 2, 2], "a")  # 3 names
    index.record([3, 3, 3, 3, 4, 4, 4, 4], "b")  # 6
    index.record([1, 1, 1, 1], "a")  # its block is sent again, its whole prompt is new: a's second block goes
    index.record([5, 5, 5, 5], "c")  # two new names: a's first whole prompt and b's first block go
    assert len(index) == 6
    assert index.match([1, 1, 1, 1, 2, 2, 2, 2], ["a", "b", "c"]) == (["a"], 4, True)  # goes on from [1, 1, 1, 1]
    assert index.match([3, 3, 3, 3, 4, 4, 4, 4], ["a", "b", "c"]) == ([], 0, False)  # the chain starts dropped
    index.forget("a")
    assert len(index) == 4
    assert index.match([1, 1, 1, 1], ["a", "b", "c"]) == ([], 0, False)
    assert index.match([5, 5, 5, 5], ["a", "b", "c"]) == (["c"], 4, True)


def test_bad_sizes_are_refused_naming_them():
    with pytest.raises(ValueError, match="block_tokens"):
        PrefixIndex(block_tokens=0)
    with pytest.raises(ValueError, match="max_blocks"):
        PrefixIndex(max_blocks=0)


@dataclass
class Replica:
    """What the router reads of a running replica."""

    replica_id: ReplicaID
    max_ongoing_requests: int = 32


def _replicas(*names: str) -> list[Replica]:
    deployment = DeploymentID(name="Decoder", app_name="plato")
    return [Replica(ReplicaID(unique_id=n, deployment_id=deployment)) for n in names]


def _pending(*prompts: list[int]) -> PendingRequest:
    batch = {"id": "b", "requests": [{"id": str(i), "prompt_ids": p} for i, p in enumerate(prompts)]}
    return _request([batch])


def _request(args: list) -> PendingRequest:  # no future: the router never touches it, and it would need a loop
    return PendingRequest(args=args, kwargs={}, metadata=RequestMetadata(request_id="r", internal_request_id="r"),
                          future=None)


def _router(**kwargs) -> PrefixAffinityRouter:
    router = PrefixAffinityRouter(deployment_id=DeploymentID(name="Decoder", app_name="plato"),
                                  handle_source=DeploymentHandleSource.REPLICA, use_replica_queue_len_cache=True)
    router.initialize_state(**kwargs)
    return router


def _choose(router, replicas, request):
    """The router's ranks; the choice is then forgotten, as if sent and counted by the test itself."""
    ranks = asyncio.run(router.choose_replicas(replicas, request))
    router.unsent.clear()
    return ranks


def _balanced(router, replicas, request) -> bool:
    before = router.routed["balanced"]
    _choose(router, replicas, request)
    return router.routed["balanced"] == before + 1


def test_a_batch_goes_first_to_the_replica_sent_its_start_then_to_two_random_ones():
    router, replicas = _router(), _replicas("a", "b", "c")
    turn = SYSTEM + [1] * 20
    first = _choose(router, replicas, _pending(turn))
    assert len(first) == 2 and all(len(rank) == 1 for rank in first)  # nothing shared: power of two choices
    router.on_request_routed(_pending(turn), replicas[2].replica_id, None)
    next_turn = turn + [2] * 30
    for _ in range(5):
        ranks = _choose(router, replicas, _pending(next_turn))
        assert ranks[0] == [replicas[2]] and replicas[2] not in ranks[1] and ranks[1]
    assert router.routed == {"preferred": 5, "balanced": 1}


def test_a_batch_of_several_prompts_goes_where_most_of_them_were_sent():
    router, (a, b) = _router(), _replicas("a", "b")
    router.on_request_routed(_pending(SYSTEM + [1] * 16), a.replica_id, None)
    router.on_request_routed(_pending([5] * 32 + [1] * 16, [6] * 32), b.replica_id, None)
    assert _choose(router, [a, b], _pending([5] * 48, [6] * 48))[0] == [b]  # 32 + 32 tokens against none
    assert _choose(router, [a, b], _pending(SYSTEM + [1] * 16, [6] * 48))[0] == [a]  # 80 against 32


def test_a_conversations_next_turn_follows_its_last_however_little_it_shares():
    router, (a, b) = _router(), _replicas("a", "b")
    router.on_request_routed(_pending(SYSTEM[:24] + [1] * 7), a.replica_id, None)  # a short first turn: 31 tokens
    router.on_request_routed(_pending(SYSTEM[:24] + [2] * 7), b.replica_id, None)
    assert _choose(router, [a, b], _pending(SYSTEM[:24] + [1] * 7 + [3] * 80))[0] == [a]  # 31 of 111 shared
    assert _balanced(router, [a, b], _pending(SYSTEM[:24] + [4] * 80))  # the system part alone


def test_too_little_shared_or_a_busy_holder_falls_back_to_balancing():
    router, (a, b) = _router(min_shared_tokens=64, imbalanced_threshold=2), _replicas("a", "b")
    router.on_request_routed(_pending(SYSTEM + [1] * 32), a.replica_id, None)
    assert _balanced(router, [a, b], _pending(SYSTEM[:48]))  # 48 shared tokens < 64
    assert _balanced(router, [a, b], _pending(SYSTEM + [2] * 80))  # 64 shared of 144: under half
    assert _choose(router, [a, b], _pending(SYSTEM + [2] * 60))[0] == [a]  # 64 of 124
    assert _choose(router, [a, b], _pending(SYSTEM + [1] * 32))[0] == [a]
    router.replica_queue_len_cache.update(a.replica_id, 5)
    router.replica_queue_len_cache.update(b.replica_id, 2)
    assert _balanced(router, [a, b], _pending(SYSTEM + [1] * 32))  # 5 - 2 > 2: balance instead
    router.replica_queue_len_cache.update(b.replica_id, 3)
    assert _choose(router, [a, b], _pending(SYSTEM + [1] * 32))[0] == [a]


def test_micro_batches_routed_in_one_instant_are_spread_by_the_choices_not_yet_sent():
    """Serve counts a call once it is sent, after every call routed in the same instant was chosen:
    without the choices counted, six new conversations would all go to the replica then least busy."""
    async def choose_six() -> tuple[list[str], PrefixAffinityRouter]:
        router, (a, b) = _router(), _replicas("a", "b")
        router.replica_queue_len_cache.update(b.replica_id, 1)
        firsts = [(await router.choose_replicas([a, b], _pending([n] * 40)))[0] for n in range(6)]
        return [rank[0].replica_id.unique_id for rank in firsts], router

    chosen, router = asyncio.run(choose_six())
    assert all(len(name) == 1 for name in chosen)
    assert sorted([chosen.count("a"), chosen.count("b") + 1]) in ([3, 4], [4, 3])  # as even as 7 calls can be
    a, b = _replicas("a", "b")
    for name in chosen:  # Serve sends each: its count holds them now, and the choices are spent
        router.on_send_request(a.replica_id if name == "a" else b.replica_id)
    assert sum(map(len, router.unsent.values())) == 0
    assert router.replica_queue_len_cache.get(a.replica_id) == chosen.count("a")


def test_a_busy_replica_is_counted_in_sequences_not_micro_batches():
    """One micro-batch of 8 answers on the holder is 8 sequences, not one call: past the threshold, the
    next turn is balanced away, until that micro-batch completes."""
    router, (a, b) = _router(imbalanced_threshold=4), _replicas("a", "b")
    router.on_request_routed(_pending(SYSTEM + [1] * 32), a.replica_id, None)
    assert _choose(router, [a, b], _pending(SYSTEM + [1] * 32 + [2] * 8))[0] == [a]
    eight = PendingRequest(args=[{"id": "mb8", "requests": [{"id": str(i), "prompt_ids": [9, i] * 20} for i in range(8)]}],
                           kwargs={}, metadata=RequestMetadata(request_id="r8", internal_request_id="call-8"), future=None)
    router.on_request_routed(eight, a.replica_id, None)
    router.replica_queue_len_cache.update(a.replica_id, 1)  # Serve's count: one call
    assert router._ongoing(a.replica_id) == 8
    assert _balanced(router, [a, b], _pending(SYSTEM + [1] * 32 + [2] * 8))  # 8 - 0 > 4
    router.on_request_completed(a.replica_id, "call-8")
    router.replica_queue_len_cache.update(a.replica_id, 0)
    assert router._ongoing(a.replica_id) == 0 and router.beyond_first == {}
    assert _choose(router, [a, b], _pending(SYSTEM + [1] * 32 + [2] * 8))[0] == [a]


def test_choices_not_yet_sent_count_their_micro_batches_sequences():
    async def choose() -> PrefixAffinityRouter:
        router, (a, b) = _router(), _replicas("a", "b")
        await router.choose_replicas([a, b], _pending(*[[n] * 40 for n in range(6)]))
        return router

    router = asyncio.run(choose())
    [(replica, choices)] = router.unsent.items()
    assert [n for _, n in choices] == [6] and router._ongoing(replica) == 6


def test_a_choice_never_sent_stops_counting_after_a_second():
    router, (a, b) = _router(), _replicas("a", "b")
    router.unsent[a.replica_id] = [(time.monotonic() - 2, 1), (time.monotonic() - 2, 1)]
    router.unsent[b.replica_id] = [(time.monotonic(), 1)]
    ranks = asyncio.run(router.choose_replicas([a, b], _pending([1] * 40)))
    assert ranks[0] == [a]  # a's two stale choices are dropped: 0 against b's 1


def test_an_abort_goes_to_the_replica_that_was_sent_its_micro_batch():
    router, (a, b, c) = _router(), _replicas("a", "b", "c")
    batch = {"id": "mb1", "requests": [{"id": "x", "prompt_ids": [3] * 40}, {"id": "y", "prompt_ids": [4] * 40}]}
    router.on_request_routed(_request([batch]), b.replica_id, None)
    abort = _request([{"batch_id": "mb1", "abort": ["x"]}])
    assert all(_choose(router, [a, b, c], abort) == [[b]] for _ in range(5))
    unknown = _choose(router, [a, b, c], _request([{"batch_id": "mb2", "abort": ["z"]}]))
    assert len(unknown) == 1 and len(unknown[0]) == 2  # no replica runs it: anywhere, where it finds nothing
    router.on_replica_actor_died(b.replica_id)
    assert router.holders == {} and len(_choose(router, [a, c], abort)[0]) == 2


def test_the_holder_of_a_prompt_is_the_replica_it_would_be_preferred_on_and_the_batcher_can_ask():
    """What the batcher asks to keep prompts of different holders apart: the same rule as routing a
    micro-batch of that prompt alone, through the router Serve built in this process."""
    ask = holder_lookup("plato", "Decoder")
    router, (a, b) = _router(min_shared_tokens=64), _replicas("a", "b")
    router.on_request_routed(_pending(SYSTEM + [1] * 32), a.replica_id, None)
    router.on_request_routed(_pending(SYSTEM[:24] + [2] * 7), b.replica_id, None)
    assert router.holder_of(SYSTEM + [1] * 32 + [3] * 40) == a.replica_id  # goes on from a's whole prompt
    assert router.holder_of(SYSTEM + [2] * 60) == a.replica_id  # 64 of 124 shared
    assert router.holder_of(SYSTEM + [2] * 80) is None  # 64 of 144: under half
    assert router.holder_of(SYSTEM[:24] + [2] * 7 + [4] * 90) == b.replica_id  # a short turn's next
    assert router.holder_of([9] * 50) is None
    assert ask(SYSTEM + [1] * 32) == a.replica_id
    assert holder_lookup("plato", "Planner")(SYSTEM + [1] * 32) is None  # no prefix router for it here
    router.on_replica_actor_died(a.replica_id)
    assert ask(SYSTEM + [1] * 32) is None


SHIPPED_ROUTER_CHECK = """
import pickle, sys
from ray.serve._private.common import DeploymentHandleSource, DeploymentID
from ray.serve.request_router import ReplicaID
shipped = sys.stdin.buffer.read()
router_class = pickle.loads(shipped)
assert router_class.__module__ not in sys.modules or sys.modules[router_class.__module__].__dict__ \
    is not router_class.holder_of.__globals__  # a copy of the module's globals, as Serve makes it
deployment = DeploymentID(name="Decoder", app_name="plato")
router = router_class(deployment_id=deployment, handle_source=DeploymentHandleSource.REPLICA,
                      use_replica_queue_len_cache=True)
router.initialize_state()
prompt = list(range(100, 164))
router.index.record(prompt, "a")
assert pickle.loads(shipped) is router_class  # unpickled again, as Serve does: the class's functions are new
from deployments.prefix_holders import holder_lookup
print(holder_lookup("plato", "Decoder")(prompt + [1, 2]))
"""


def test_a_router_shipped_by_value_as_serve_ships_it_still_answers_the_batchers_lookup():
    """Serve pickles the router's module by value, so in the process that runs it the router's module
    globals are a copy: the registry the batcher reads must live in a module imported by name. And
    it unpickles the class more than once, each time replacing its functions."""
    import subprocess
    import sys

    from ray import cloudpickle

    module = sys.modules[PrefixAffinityRouter.__module__]
    cloudpickle.register_pickle_by_value(module)
    try:
        shipped = cloudpickle.dumps(PrefixAffinityRouter)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    run = subprocess.run([sys.executable, "-c", SHIPPED_ROUTER_CHECK], input=shipped, capture_output=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert run.stdout.decode().strip() == "a"


def test_a_dead_replica_is_forgotten():
    router, (a, b) = _router(), _replicas("a", "b")
    router.on_request_routed(_pending(SYSTEM), a.replica_id, None)
    router.on_request_routed(_pending(SYSTEM, SYSTEM[:20]), a.replica_id, None)  # two sequences: one beyond the first
    assert router.beyond_first_on == {a.replica_id: 1}
    router.on_replica_actor_died(a.replica_id)
    assert len(router.index) == 0 and router.beyond_first == {} and router.beyond_first_on == {}
    assert _choose(router, [b], _pending(SYSTEM)) == [[b]]


def test_requests_that_are_not_micro_batches_are_balanced():
    assert batch_prompts(None) == []
    assert batch_prompts(_request([])) == []
    assert batch_prompts(_request(["text"])) == []
    assert batch_prompts(_request([{"requests": [{"id": "x"}]}])) == []
    router, replicas = _router(), _replicas("a", "b")
    assert _balanced(router, replicas, _request([]))


@dataclass
class ProbedReplica(Replica):
    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def test_micro_batches_routed_at_once_under_one_request_id_each_reach_their_replica():
    """The batcher's calls share the request id of the request it was serving when it started;
    routed at once, each must still be fulfilled (Serve's base router left the second waiting forever)."""
    async def route_two() -> list:
        router = _router()
        deployment = DeploymentID(name="Decoder", app_name="plato")
        a, b = (ProbedReplica(ReplicaID(unique_id=n, deployment_id=deployment)) for n in "ab")
        router.update_replicas([a, b])
        router.on_request_routed(_pending(SYSTEM + [1] * 32), a.replica_id, None)
        router.on_request_routed(_pending(SYSTEM + [2] * 32), b.replica_id, None)
        await asyncio.sleep(0.1)  # the probes of the new replicas fill the queue-length cache

        def pending(prompt: list[int]) -> PendingRequest:
            return PendingRequest(args=_pending(prompt).args, kwargs={},
                                  metadata=RequestMetadata(request_id="r", internal_request_id="shared"))
        to_b, to_a = pending(SYSTEM + [2] * 32 + [3] * 8), pending(SYSTEM + [1] * 32 + [3] * 8)
        chosen = asyncio.gather(router._choose_replica_for_request(to_b), router._choose_replica_for_request(to_a))
        return [r.replica_id.unique_id for r in await asyncio.wait_for(chosen, 5)]

    assert asyncio.run(route_two()) == ["b", "a"]
