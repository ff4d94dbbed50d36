"""Actors on a local Ray: the batcher answers concurrent submitters while a fake decoder pulls
micro-batches, fails one of them and reports the rest, cut-off answers included; a prefix KV one
decoder replica computed reaches another through the context cache actor and the object store."""
from __future__ import annotations

import pytest

from engine.types import GenerationRequest, SamplingParams
from predictor.batcher import MicroBatch
from test_batcher import fake_decode

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_concurrent_submits_are_all_answered(local_ray):
    from actors.batcher import BatcherActor

    actor = ray.remote(BatcherActor).options(num_cpus=0).remote({"bins": {"edges": [4, 8, 16]}, "token_budget": 40})
    lengths = {f"r{i}": 2 + 3 * i for i in range(8)}  # 2 to 23 tokens: most are cut at least once
    requests = [GenerationRequest(id=rid, prompt_ids=[5, 6], params=SamplingParams(max_tokens=64), predicted_len=3)
                for rid in lengths]
    answers = [actor.submit.remote(r.model_dump()) for r in requests]
    failed_one = False
    for _ in range(100):  # the fake decoder loop, bounded so a lost request fails instead of hanging
        if not ray.wait(answers, num_returns=len(answers), timeout=0)[1]:
            break
        data = ray.get(actor.next_batch.remote(wait_s=1.0))
        if data is None:
            continue
        batch = MicroBatch.model_validate(data)
        if not failed_one:  # the first batch's replica "dies": its requests must come back
            failed_one = ray.get(actor.fail.remote(batch.id)) > 0
            continue
        results = [r.model_dump(mode="json") for r in fake_decode(batch.requests, lengths)]
        ray.get(actor.report.remote(batch.id, results))
    answered = {a["request_id"]: a for a in ray.get(answers, timeout=10)}
    assert {rid: a["token_ids"] for rid, a in answered.items()} == {rid: list(range(n)) for rid, n in lengths.items()}
    assert {a["finish_reason"] for a in answered.values()} == {"stop"}
    stats = ray.get(actor.stats.remote())
    assert stats["failed_batches"] == 1 and stats["requeues"] > 0
    assert stats["pending"] == stats["in_flight"] == 0 and stats["finished"] == len(lengths)
    actor.submit.remote(requests[0].model_dump())  # answered ids are free again: this one queues
    with pytest.raises(ValueError, match="id: request 'r0' is already queued"):
        ray.get(actor.submit.remote(requests[0].model_dump()))


def test_a_prefix_computed_on_one_replica_is_fetched_by_another_through_the_context_cache(local_ray, make_engine):
    """Replica a prefills a plan node's shared prefix and publishes its KV through Ray's object store;
    replica b, asked for a node with the same prefix, fetches it from the ContextCache actor instead
    of prefilling, and answers exactly as a replica that computed it would."""
    import asyncio

    from actors.context_cache import ContextCache
    from actors.decoder import DecoderReplica

    cache = ray.remote(ContextCache).options(num_cpus=0).remote({})
    a = DecoderReplica({}, cache, name="a", engine=make_engine(max_batch_size=2))
    b = DecoderReplica({}, cache, name="b", engine=make_engine(max_batch_size=2))
    prefix = [5 + i % 40 for i in range(48)]

    def node(rid: str, tail: list[int]) -> dict:
        return GenerationRequest(id=rid, prompt_ids=prefix + tail, shared_prefix_len=len(prefix),
                                 params=SamplingParams(max_tokens=6, temperature=0.0)).model_dump(mode="json")

    async def results(replica, batch: dict) -> list[dict]:
        return [item["result"] async for message in replica.run_batch(batch) for item in message if "result" in item]

    async def main():
        first = await results(a, {"id": "x", "requests": [node("n1", [7, 8])]})
        second = await results(b, {"id": "y", "requests": [node("n2", [7, 8]), node("n3", [9])]})
        return first, second

    try:
        first, second = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        a.engine.shutdown()
        b.engine.shutdown()
    assert (a.counts["prefix_computed"], a.counts["prefix_fetched"]) == (1, 0)
    assert (b.counts["prefix_computed"], b.counts["prefix_fetched"], b.counts["prefix_fetch_failed"]) == (0, 1, 0)
    assert second[0]["token_ids"] == first[0]["token_ids"]  # fetched KV decodes exactly as computed KV
    assert all(r["prefix_hit_tokens"] >= len(prefix) for r in second)
    assert ray.get(cache.stats.remote())["prefix_entries"] == 1
