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
    # address="local": a Ray of its own, never one that RAY_ADDRESS or an earlier `ray start` left behind
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
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


def test_a_kept_answer_on_one_replica_serves_a_follow_up_on_another(local_ray, make_engine, decode_alone):
    """A plan node with children asks to keep its KV: replica a publishes its prompt and answer as it
    finishes; the child's follow-up prompt (that conversation, then its own turn) runs on replica b,
    which fetches them instead of prefilling them, and answers as a replica that computed them would."""
    import asyncio

    from actors.context_cache import ContextCache
    from actors.decoder import DecoderReplica

    cache = ray.remote(ContextCache).options(num_cpus=0).remote({})
    a = DecoderReplica({}, cache, name="a", engine=make_engine(max_batch_size=2))
    b = DecoderReplica({}, cache, name="b", engine=make_engine(max_batch_size=2))
    prompt = [5 + i % 40 for i in range(24)]
    params = SamplingParams(max_tokens=6, temperature=0.0).model_dump(mode="json")

    async def results(replica, request: dict) -> list[dict]:
        return [item["result"] async for message in replica.run_batch({"id": request["id"], "requests": [request]})
                for item in message if "result" in item]

    async def main():
        [parent] = await results(a, {"id": "p", "prompt_ids": prompt, "params": params, "keep_kv": True})
        kept = (prompt + parent["token_ids"])[: parent["kept_kv_tokens"]]
        follow_up = kept + [7, 8, 9]
        [child] = await results(b, {"id": "c", "prompt_ids": follow_up, "params": params, "shared_prefix_len": len(kept)})
        return kept, follow_up, child

    try:
        kept, follow_up, child = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        a.engine.shutdown()
        b.engine.shutdown()
    assert len(kept) == len(prompt) + 5  # the answer ran to max_tokens: its last token has no KV
    assert (b.counts["prefix_fetched"], b.counts["prefix_computed"]) == (1, 0)
    assert child["prefix_hit_tokens"] == len(kept)
    assert child["token_ids"] == decode_alone(follow_up, max_tokens=6).token_ids


def test_the_predictors_prompt_kv_reaches_the_decoder_so_the_prompt_is_not_prefilled_twice(
        local_ray, make_engine, decode_alone, tiny_model, tiny_tokenizer, tmp_path):
    """The batcher asks the length predictor to share the prompt KV it computes anyway; the predictor
    publishes it to the ContextCache actor, the decoder replica fetches it instead of prefilling and
    answers exactly as without it. A plan node keeps its own shared prefix: nothing is shared for it."""
    import asyncio
    import copy

    from actors.batcher import BatcherActor
    from actors.context_cache import ContextCache
    from actors.decoder import DecoderReplica
    from actors.length_predictor import LengthPredictorReplica
    from predictor.model import LengthRegressor, PredictorSettings
    from test_predictor import adapted, predictor_on

    regressor = LengthRegressor(copy.deepcopy(tiny_model).model, max_tokens=200)
    adapted(regressor).save_pretrained(tmp_path)
    (tmp_path / "settings.json").write_text(PredictorSettings(max_tokens=200, lora_layers=1, rank=4).model_dump_json())
    cache = ray.remote(ContextCache).options(num_cpus=0).remote({})
    predictor = LengthPredictorReplica({}, {}, cache, name="p", predictor=predictor_on(tiny_model, tiny_tokenizer, tmp_path))
    decoder = DecoderReplica({}, cache, name="d", engine=make_engine(max_batch_size=4))
    shared_asked = []

    async def predict(prompt_ids, share):
        shared_asked.append(share)
        call = predictor.predict_and_share_many if share else predictor.predict_many
        return (await call([prompt_ids]))[0]

    prompt = [5 + i % 40 for i in range(30)]
    plain = GenerationRequest(id="plain", prompt_ids=prompt, params=SamplingParams(max_tokens=6, temperature=0.0))
    node = GenerationRequest(id="node", prompt_ids=prompt[:20] + [9, 9], shared_prefix_len=20,
                             params=SamplingParams(max_tokens=6, temperature=0.0))

    async def main():
        # a generous prediction timeout: on a loaded machine the first prediction (and its ray.put) can
        # take longer than the 5 s default, and a skipped prediction shares nothing, which is not under test here
        # the lowest bin ends below max_tokens: an answer that fits it whatever its length is not predicted
        batcher = BatcherActor({"bins": {"edges": [4, 64]}}, send_batch=decoder.run_batch, predict=predict,
                               dispatch={"predict_timeout_s": 120})
        return [await batcher.submit(r.model_dump(mode="json")) for r in (plain, node)]

    try:
        plain_out, node_out = asyncio.run(asyncio.wait_for(main(), 240))
    finally:
        decoder.engine.shutdown()
    assert shared_asked == [True, False]
    assert predictor.counts == {"kv_shared": 1, "kv_share_failed": 0}
    assert decoder.counts["prefix_fetched"] == 1 and decoder.counts["prefix_computed"] == 1  # the node's own prefix
    assert plain_out["prefix_hit_tokens"] == len(prompt)  # nothing of the prompt prefilled again
    assert not decoder._computing  # every prefix computed here was handed on or dropped
    assert plain_out["token_ids"] == decode_alone(prompt, max_tokens=6).token_ids
    assert node_out["token_ids"] == decode_alone(node.prompt_ids, max_tokens=6).token_ids
