"""vLLM's `priority` on the API (lower goes first): it reaches the batcher and the decoder's engine as
their priority (higher goes first) for plain and planned answers alike, batch jobs set it per row or
for the whole job, and a bad value is a 400 naming it."""
from __future__ import annotations

import asyncio

import pytest

from actors.batcher import BatcherActor
from actors.decode_client import BatcherClient, Tokenizing
from actors.decoder import DecoderReplica
from deployments.completion_service import ApiLimits, CompletionService
from deployments.openai_schema import ChatCompletionRequest, CompletionRequest
from graph.orchestrator import AnswerConfig, Orchestrator
from test_api import WORDS, _chat, assert_refused, client, make_client  # noqa: F401  (fixtures)
from test_jobs import FakeOpenAI, run, write_jsonl


@pytest.fixture
def recorded(make_engine, tiny_tokenizer):
    """(service, priorities): the app's request path in one process (as tests/test_request_path.py
    wires it), each request's engine priority recorded as the batcher hands it to the decoder."""
    engine = make_engine(max_batch_size=8)
    decoder = DecoderReplica({}, engine=engine)
    priorities = []

    async def send_batch(batch: dict):
        priorities.extend(r["priority"] for r in batch["requests"])
        async for message in decoder.run_batch(batch):
            yield message

    async def predict(prompt_ids, share):
        return 7

    batcher = BatcherActor({"bins": {"edges": [8, 16, 64]}}, send_batch=send_batch, predict=predict)
    client = BatcherClient(batcher, Tokenizing(tiny_tokenizer, engine.model_name, engine.max_model_len))
    answer = AnswerConfig(max_tokens=24, plan_max_tokens=16, node_max_tokens=8, plan_constraint=None)
    yield CompletionService(client, ApiLimits(default_max_tokens=6), Orchestrator(client, answer)), priorities
    decoder.engine.shutdown()


def _answer(service, *requests):
    """The requests answered one after another, in one event loop (the batcher's loop lives in it)."""
    async def main():
        return [await service.complete(request) for request in requests]

    return asyncio.run(asyncio.wait_for(main(), timeout=60))


def test_a_plain_answer_waits_at_the_priority_it_asked_the_other_way_round(recorded):
    service, priorities = recorded
    _answer(service, ChatCompletionRequest(messages=[{"role": "user", "content": WORDS}], priority=-2),
            CompletionRequest(prompt=[WORDS, "bobo"], priority=3),
            ChatCompletionRequest(messages=[{"role": "user", "content": WORDS}], n=2, temperature=1.0))
    assert priorities == [2, -3, -3, 0, 0]


@pytest.mark.parametrize("mode", ["plato", "sot"])
def test_every_request_of_a_planned_answer_goes_at_its_priority(recorded, mode):
    service, priorities = recorded
    [response] = _answer(service, ChatCompletionRequest(messages=[{"role": "user", "content": "How do I paint a room?"}],
                                                        mode=mode, priority=4))
    assert response.mode == mode  # planned, or fallen back to plain decoding: that request counts too
    assert len(priorities) >= 1 and set(priorities) == {-4}


def test_a_priority_that_is_no_integer_or_out_of_range_is_refused(client):
    assert_refused(_chat(client, priority="high"), 400, "priority")
    assert_refused(_chat(client, priority=2**40), 400, "priority")
    assert _chat(client, priority=-7).status_code == 200


def test_a_job_sends_its_default_priority_and_a_rows_own_goes_first(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "one"},
        {"id": "b", "prompt": "two", "priority": -1},
        {"id": "c", "prompt": "three", "priority": "1"},  # strict types: a bad row, not a 1
    ])
    with FakeOpenAI() as fake:
        summary = run(fake, path, tmp_path / "out", priority=5)
    sent = {r["messages"][-1]["content"]: r for r in fake.requests}
    assert sent["one"]["priority"] == 5 and sent["two"]["priority"] == -1 and "three" not in sent
    assert summary.errors == 1
