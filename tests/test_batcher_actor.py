"""The batcher actor on a local Ray: concurrent submitters are all answered while a fake decoder
pulls micro-batches, fails one of them and reports the rest, cut-off answers included."""
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
