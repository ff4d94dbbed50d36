"""The decoder replica aborts requests of a running micro-batch whose callers went away, while the
rest of the micro-batch decodes on (tiny model, no Ray)."""
from __future__ import annotations

import asyncio

from actors.decoder import DecoderReplica
from engine.types import GenerationRequest, SamplingParams


def _batch(*ids: str) -> dict:
    requests = [GenerationRequest(id=i, prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=60, ignore_eos=True))
                for i in ids]
    return {"id": "b1", "requests": [r.model_dump(mode="json") for r in requests]}


def test_an_aborted_request_ends_with_an_error_and_its_batch_mates_finish(make_engine):
    async def main():
        decoder = DecoderReplica({}, engine=make_engine(max_batch_size=4))
        ends, tokens, aborted = {}, {"a": 0, "b": 0}, None
        async for message in decoder.run_batch(_batch("a", "b")):
            for item in message:
                if "event" in item:
                    tokens[item["event"]["request_id"]] += len(item["event"]["token_ids"])
                else:
                    result = item.get("result") or item["error"]
                    ends[result["request_id"]] = item
            if aborted is None and tokens["a"] >= 3:
                aborted = await decoder.abort({"batch_id": "b1", "abort": ["a", "not-here"]})
        again = await decoder.abort({"batch_id": "b1", "abort": ["a", "b"]})  # the batch has ended
        running = (await decoder.stats())["running"]
        return ends, tokens, aborted, again, running, decoder._pumps, decoder._aborted

    ends, tokens, aborted, again, running, pumps, marks = asyncio.run(asyncio.wait_for(main(), 120))
    assert aborted == 1 and again == 0
    assert ends["a"] == {"error": {"request_id": "a", "message": "aborted: its caller went away"}}
    assert tokens["a"] < 60
    assert ends["b"]["result"]["finish_reason"] == "length" and len(ends["b"]["result"]["token_ids"]) == 60
    assert running == 0 and pumps == {} and marks == set()


def test_a_micro_batch_whose_batcher_died_is_aborted_where_it_runs(make_engine):
    """Ray lets a decoder stream on for a caller that died: the replica asks, every caller_check_s of the
    batch, whether its batcher lives (here: alive twice, then dead), and stops the whole micro-batch
    when it does not, its requests aborted in the engine; a batch without a caller is never asked about."""
    asked = []

    async def caller_alive(caller) -> bool:
        asked.append(caller)
        return len(asked) < 3

    async def main():
        decoder = DecoderReplica({}, engine=make_engine(max_batch_size=4), caller_alive=caller_alive)
        tokens, ends = 0, 0
        batch = {**_batch("a", "b"), "caller": "batcher-1", "caller_check_s": 0.01}
        batch["requests"] = [{**r, "params": {**r["params"], "max_tokens": 400}} for r in batch["requests"]]
        async for message in decoder.run_batch(batch):
            tokens += sum(len(i["event"]["token_ids"]) for i in message if "event" in i)
            ends += sum("event" not in i for i in message)
        for _ in range(100):  # the engine hears of the aborts as the cancelled streams unwind
            stats = await decoder.stats()
            if stats["running"] == 0:
                break
            await asyncio.sleep(0.05)
        async for _ in decoder.run_batch(_batch("c")):  # no caller named: decodes to its end unasked
            pass
        return tokens, ends, stats, len(asked)

    tokens, ends, stats, times_asked = asyncio.run(asyncio.wait_for(main(), 120))
    assert ends == 0 and tokens < 2 * 400
    assert stats["orphaned_batches"] == 1 and stats["running"] == 0
    assert times_asked == 3  # and never again, for the batch without a caller
