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
