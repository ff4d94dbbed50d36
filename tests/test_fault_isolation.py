"""A fault in one request's own part of an engine step (its constraint, its sampling, its scores)
ends that request alone with FinishReason.ERROR; its batch mates decode on exactly as they would
have, the engine keeps serving, and the caller is told why: RequestFaulted from AsyncEngine, a 500
in OpenAI's error shape (or an error event in a started stream) from the API."""
from __future__ import annotations

import asyncio
import json
import random

import pytest
from fastapi.testclient import TestClient

import engine.engine as engine_module
from deployments.api import create_app
from deployments.completion_service import ApiLimits, CompletionService
from engine.async_engine import AsyncEngine, RequestFaulted
from engine.types import FinishReason, GenerationRequest, SamplingParams, TokenEvent


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 256) for _ in range(n)]


def req(rid, prompt, **sampling):
    return GenerationRequest(id=rid, prompt_ids=prompt, params=SamplingParams(**sampling))


class FaultyConstraint:
    """Allows every token; its `method` raises once it has seen `after` tokens."""

    def __init__(self, method: str, after: int):
        self.method, self.after, self.seen = method, after, 0

    def allowed(self):
        if self.method == "allowed" and self.seen >= self.after:
            raise KeyError("state 7 has no mask")
        return None

    def advance(self, token):
        self.seen += 1
        if self.method == "advance" and self.seen > self.after:
            raise IndexError("token past the grammar's table")

    def forced(self):
        return None

    def wrap_up(self):
        return False

    @property
    def is_complete(self):
        return False


def run_all(engine) -> dict:
    while engine.has_work():
        engine.step()
    return {rid: engine.pop_result(rid) for rid in list(engine._results)}


@pytest.mark.parametrize("method", ["allowed", "advance"])
def test_a_constraint_that_raises_ends_its_request_alone(make_engine, decode_alone, method):
    engine = make_engine(max_batch_size=4)
    prompts = {"a": ids(7, 1), "bad": ids(9, 2), "c": ids(5, 3)}
    for rid, prompt in prompts.items():
        engine.add(req(rid, prompt, max_tokens=12, ignore_eos=True))
    engine._by_id["bad"].constraint = FaultyConstraint(method, after=3)
    results = run_all(engine)

    bad = results["bad"]
    assert bad.finish_reason == FinishReason.ERROR
    assert bad.error.startswith("KeyError" if method == "allowed" else "IndexError")
    assert len(bad.token_ids) <= 4
    for rid in ("a", "c"):
        alone = decode_alone(prompts[rid], max_tokens=12, ignore_eos=True)
        assert results[rid].finish_reason == FinishReason.LENGTH and results[rid].error is None
        assert results[rid].token_ids == alone.token_ids
    # its slot was freed: the engine serves the next request as a fresh one would
    engine.add(req("after", prompts["bad"], max_tokens=6))
    assert run_all(engine)["after"].token_ids == decode_alone(prompts["bad"], max_tokens=6).token_ids
    assert not engine._running and not engine._by_id


def test_a_row_whose_sampling_raises_fails_alone_and_seeded_mates_draw_as_without_it(make_engine, decode_alone,
                                                                                   monkeypatch):
    real_sample = engine_module.sample

    def sample(logits, params, *rest):
        if any(p.seed == 13 for p in params):
            raise RuntimeError("a sampler bug that only seed 13 meets")
        return real_sample(logits, params, *rest)

    monkeypatch.setattr(engine_module, "sample", sample)
    engine = make_engine(max_batch_size=4)
    sampled = dict(temperature=0.9, top_p=0.9, max_tokens=10, ignore_eos=True)
    engine.add(req("seeded", ids(6, 4), seed=5, **sampled))
    engine.add(req("bad", ids(6, 5), seed=13, **sampled))
    engine.add(req("greedy", ids(8, 6), max_tokens=10, ignore_eos=True))
    results = run_all(engine)

    assert results["bad"].finish_reason == FinishReason.ERROR and "seed 13" in results["bad"].error
    assert results["bad"].token_ids == []
    monkeypatch.setattr(engine_module, "sample", real_sample)
    assert results["seeded"].token_ids == decode_alone(ids(6, 4), seed=5, **sampled).token_ids
    assert results["greedy"].token_ids == decode_alone(ids(8, 6), max_tokens=10, ignore_eos=True).token_ids


def test_a_row_whose_logprobs_raise_fails_alone(make_engine, decode_alone, monkeypatch):
    real = engine_module.token_logprobs

    def token_logprobs(logits, chosen, tops, text):
        if 3 in tops:
            raise ValueError("top 3 is cursed")
        return real(logits, chosen, tops, text)

    monkeypatch.setattr(engine_module, "token_logprobs", token_logprobs)
    engine = make_engine(max_batch_size=4)
    engine.add(req("ok", ids(6, 7), max_tokens=8, ignore_eos=True, logprobs=2))
    engine.add(req("bad", ids(6, 8), max_tokens=8, ignore_eos=True, logprobs=3))
    results = run_all(engine)

    assert results["bad"].finish_reason == FinishReason.ERROR and "cursed" in results["bad"].error
    ok = results["ok"]
    assert ok.finish_reason == FinishReason.LENGTH and len(ok.logprobs) == 8
    assert ok.token_ids == decode_alone(ids(6, 7), max_tokens=8, ignore_eos=True).token_ids


def test_a_forward_pass_that_raises_still_stops_the_engine(make_engine):
    """No single request owns the batched pass: that fault is the engine's, and AsyncEngine fails all."""
    engine = make_engine(max_batch_size=2)
    engine.add(req("a", ids(5, 9), max_tokens=4))
    engine.runner.prefill = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()


def test_async_stream_raises_request_faulted_and_the_engine_serves_on(make_engine, decode_alone):
    engine = make_engine(max_batch_size=4)
    real_add = engine.add

    def add(request):
        real_add(request)
        if request.id == "bad":
            engine._by_id["bad"].constraint = FaultyConstraint("advance", after=2)

    engine.add = add
    served = AsyncEngine(engine)

    async def consume(rid, prompt):
        tokens = []
        async for item in served.stream(req(rid, prompt, max_tokens=10, ignore_eos=True)):
            if isinstance(item, TokenEvent):
                tokens.extend(item.token_ids)
        return tokens

    async def main():
        outcomes = await asyncio.gather(consume("good", ids(6, 10)), consume("bad", ids(6, 11)),
                                        return_exceptions=True)
        again = await served.generate(req("again", ids(6, 11), max_tokens=5))
        return outcomes, again

    try:
        (good, bad), again = asyncio.run(asyncio.wait_for(main(), 30))
        assert isinstance(bad, RequestFaulted) and "IndexError" in str(bad) and "'bad'" in str(bad)
        assert good == decode_alone(ids(6, 10), max_tokens=10, ignore_eos=True).token_ids
        assert again.token_ids == decode_alone(ids(6, 11), max_tokens=5).token_ids
        assert served.health()["healthy"]
    finally:
        served.shutdown()


@pytest.fixture
def faulty_seed_client(make_engine, monkeypatch):
    """An in-process API over the tiny engine whose sampler raises for a request seeded 13 (only
    its own row, see the sampling test above) once that answer has `FAULT_AFTER` tokens."""
    real_sample = engine_module.sample

    def sample(logits, params, generators, masks, histories):
        if any(p.seed == 13 and len(h) >= FAULT_AFTER for p, h in zip(params, histories)):
            raise RuntimeError("a sampler bug that only seed 13 meets")
        return real_sample(logits, params, generators, masks, histories)

    monkeypatch.setattr(engine_module, "sample", sample)
    engine = AsyncEngine(make_engine(max_batch_size=4, max_model_len=128))
    service = CompletionService(engine, ApiLimits(default_max_tokens=8, max_tokens_limit=64))
    with TestClient(create_app(service, api_key=None, max_in_flight=8), raise_server_exceptions=False) as client:
        yield client
    engine.shutdown()


FAULT_AFTER = 3
CHAT = {"messages": [{"role": "user", "content": "baba babe babi"}], "max_tokens": 8, "temperature": 1.0}


def test_the_api_answers_a_faulted_request_with_a_500_that_says_why_and_serves_on(faulty_seed_client):
    response = faulty_seed_client.post("/v1/chat/completions", json={**CHAT, "seed": 13})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and error["param"] is None
    assert "RequestFaulted" in error["message"] and "only seed 13 meets" in error["message"]
    for _ in range(2):  # the same replica serves on
        assert faulty_seed_client.post("/v1/chat/completions", json={**CHAT, "seed": 12}).status_code == 200
    assert faulty_seed_client.get("/health").status_code == 200


def test_a_stream_that_faults_partway_ends_with_an_error_event_then_done(faulty_seed_client):
    response = faulty_seed_client.post("/v1/chat/completions", json={**CHAT, "seed": 13, "stream": True,
                                                                       "stop": ["no such text"], "ignore_eos": True})
    assert response.status_code == 200  # sent before the fault
    lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    payloads = [json.loads(line) for line in lines[:-1]]
    assert any("choices" in p for p in payloads[:-1])  # some of the answer came first
    error = payloads[-1]["error"]
    assert error["type"] == "server_error" and "only seed 13 meets" in error["message"]


# ---- a fault no single request owns: the engine dies, its replica goes, its work is re-queued ----
def test_a_decoder_whose_engine_dies_yields_what_finished_then_fails_its_micro_batch(make_engine):
    """The batcher re-queues a micro-batch whose stream raises (tests/test_batcher_push.py); the
    request that finished before the death keeps its result, and the replica is told to go."""
    from actors.decoder import DecoderReplica
    from engine.async_engine import EngineDeadError

    engine, deaths = make_engine(max_batch_size=4), []
    real_decode, steps = engine.runner.decode, []

    def decode(*args, **kwargs):
        steps.append(1)
        if len(steps) > 6:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_decode(*args, **kwargs)

    engine.runner.decode = decode
    requests = [req("short", ids(5, 12), max_tokens=3, ignore_eos=True),
                req("long", ids(5, 13), max_tokens=40, ignore_eos=True)]
    batch = {"id": "b1", "requests": [r.model_dump(mode="json") for r in requests]}

    async def main():
        decoder = DecoderReplica({}, engine=engine, on_engine_death=deaths.append)
        items = []
        with pytest.raises(EngineDeadError, match="illegal memory access"):
            async for message in decoder.run_batch(batch):
                items.extend(message)
        return items, decoder.engine.health()

    items, health = asyncio.run(asyncio.wait_for(main(), 30))
    results = [item["result"] for item in items if "result" in item]
    assert [r["request_id"] for r in results] == ["short"] and len(results[0]["token_ids"]) == 3
    assert not any("error" in item for item in items)  # no request is answered with the engine's death
    assert len(deaths) == 1 and "illegal memory access" in str(deaths[0]) and not health["healthy"]


def test_on_death_is_called_when_the_loop_dies_and_not_on_shutdown(make_engine):
    deaths = []
    AsyncEngine(make_engine(), on_death=deaths.append).shutdown()
    assert deaths == []
    engine = make_engine()
    engine.step = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))
    served = AsyncEngine(engine, on_death=deaths.append)
    with pytest.raises(Exception, match="device lost"):
        asyncio.run(asyncio.wait_for(served.generate(req("x", ids(4, 14), max_tokens=3)), 10))
    served._thread.join(5)
    assert [str(d) for d in deaths] == ["device lost"]


def test_exit_replica_ends_the_process_with_status_1():
    import subprocess
    import sys

    code = "from actors.decoder import exit_replica; exit_replica(RuntimeError('gone')); print('still here')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "still here" not in done.stdout
    assert "this decoder replica exits" in done.stderr and "gone" in done.stderr
