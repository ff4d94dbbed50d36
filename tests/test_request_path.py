"""The application's request path in one process, on the tiny model: CompletionService ->
BatcherClient -> BatcherActor (push mode, predictions) -> DecoderReplica -> engine. The same
objects the Serve deployments hold, minus Ray, so every mode and the prefix sharing of plan nodes
are checked without starting a cluster."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from actors.batcher import BatcherActor
from actors.decode_client import BatcherClient, Tokenizing
from actors.decoder import DecoderReplica
from deployments.completion_service import ApiLimits, CompletionService
from deployments.openai_schema import ChatCompletionRequest, RequestError
from engine.types import GenerationRequest, SamplingParams
from graph.orchestrator import AnswerConfig, Orchestrator


@pytest.fixture
def path(make_engine, tiny_tokenizer):
    """(service, batcher, decoder) wired like the Serve app, with a predictor that says 7."""
    engine = make_engine(max_batch_size=8)
    decoder = DecoderReplica({}, engine=engine)
    asked = []

    async def predict(prompt_ids, share):
        asked.append(prompt_ids)
        return 7

    batcher = BatcherActor({"bins": {"edges": [8, 16, 64]}}, send_batch=decoder.run_batch, predict=predict)
    client = BatcherClient(batcher, Tokenizing(tiny_tokenizer, engine.model_name, engine.max_model_len))
    answer = AnswerConfig(max_tokens=24, plan_max_tokens=16, node_max_tokens=8, plan_constraint=None)
    service = CompletionService(client, ApiLimits(default_max_tokens=20), Orchestrator(client, answer))
    yield service, batcher, decoder, asked
    decoder.engine.shutdown()


def chat(content: str, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": content}], **fields)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def test_plain_answers_go_through_the_batcher_and_equal_direct_decoding(path, decode_alone, tiny_tokenizer):
    service, batcher, decoder, asked = path

    async def main():
        plain = await service.complete(chat("hello there", temperature=0))
        streamed = [c async for c in service.stream(chat("hello there", temperature=0))]
        return plain, streamed, await batcher.stats()

    plain, streamed, stats = run(main())
    prompt = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
    direct = decode_alone(list(prompt), max_tokens=20)
    assert plain.choices[0].message.content == direct.text and plain.usage.completion_tokens == 20
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in streamed if c["choices"]) == direct.text
    # predicted 7, so both went through the 8-token bin, were cut and resumed to the full 20
    assert len(asked) == 2 and stats["requeues"] >= 2 and stats["finished"] == 2


def test_n_plain_choices_go_through_the_batcher_with_the_prompt_computed_once(path):
    from deployments.openai_schema import RequestError

    service, batcher, decoder, _ = path
    question = "tell me about the weather in spring and what to wear"

    async def main():
        before = await decoder.stats()
        response = await service.complete(chat(question, n=3, temperature=1.0, seed=11, max_tokens=6))
        after = await decoder.stats()
        refused = []
        for mode in ("sot", "plato", "auto"):
            try:
                await service.complete(chat(question, n=2, mode=mode))
            except RequestError as exc:
                refused.append(exc.param)
        return response, after["prefill_tokens"] - before["prefill_tokens"], refused

    response, prefilled, refused = run(main())
    assert [c.index for c in response.choices] == [0, 1, 2] and response.usage.completion_tokens == 18
    prompt = response.usage.prompt_tokens
    # one choice computes the prompt; the other two start from its KV and compute only its last token
    assert prefilled == prompt + 2, (prefilled, prompt)
    assert refused == ["n", "n", "n"]


def test_planned_modes_answer_and_report_their_plan(path):
    service, batcher, decoder, _ = path

    async def main():
        return [await service.complete(chat("Explain why the sky is blue.", mode=m, return_plan=True))
                for m in ("sot", "plato", "auto")]

    for response in run(main()):
        assert response.choices[0].message.content
        assert response.mode in ("ar", "sot", "plato") and response.plan is not None
        assert response.usage.completion_tokens > 0


def test_a_prediction_goes_through_the_batcher_and_counts_what_every_attempt_took(path):
    """Predicted 7 tokens, the answer is cut at its bin's 8 and resumed: the answer is the plain one, and
    the usage adds up the prediction tokens both attempts took. A planned mode refuses a prediction."""
    service, batcher, _, _ = path

    async def main():
        plain = await service.complete(chat("hello there", temperature=0))
        text = plain.choices[0].message.content
        predicted = await service.complete(chat("hello there", temperature=0,
                                                prediction={"type": "content", "content": text}))
        return plain, predicted, await batcher.stats()

    plain, predicted, stats = run(main())
    assert predicted.choices[0].message.content == plain.choices[0].message.content
    assert stats["requeues"] >= 2  # each answer cut at 8 at least once
    details = predicted.usage.completion_tokens_details
    # an attempt capped at 8 keeps at most 6 drafted tokens (the prompt's pass and one step choose the rest)
    assert details.accepted_prediction_tokens > 6 and plain.usage.completion_tokens_details is None
    with pytest.raises(RequestError) as refused:
        run(service.complete(chat("hello there", mode="plato", prediction={"type": "content", "content": "hi"})))
    assert refused.value.param == "prediction"


def test_node_prompts_marked_with_a_shared_prefix_reuse_its_kv_on_the_replica(path):
    service, batcher, decoder, _ = path
    client = service.orchestrator.client
    prefix = list(range(10, 50))

    async def main():
        requests = [GenerationRequest(prompt_ids=prefix + [60 + i, 61], params=SamplingParams(max_tokens=4),
                                      shared_prefix_len=len(prefix)) for i in range(3)]
        results = await asyncio.gather(*(client.generate(r) for r in requests))
        return results, await decoder.stats()

    results, stats = run(main())
    assert all(r.completion_tokens == 4 for r in results)
    assert stats["prefix_computed"] == 1 and stats["prefix_local"] == 2  # computed once, then found
    # the first computes it in its own prefill; the others reuse it
    assert sorted(r.prefix_hit_tokens for r in results) == [0, len(prefix), len(prefix)]
    assert stats["prefill_tokens"] == len(prefix) + 3 * 2


def test_a_decoder_streams_what_is_ready_at_once_as_one_message(make_engine):
    """One engine step makes a token for every request of the micro-batch: they travel to the batcher
    as one message, not one each, and per request they add up to exactly its final answer."""
    decoder = DecoderReplica({}, engine=make_engine(max_batch_size=4))
    batch = {"id": "b", "requests": [
        GenerationRequest(id=f"r{i}", prompt_ids=[5 + i, 6], params=SamplingParams(max_tokens=8, temperature=0.0))
        .model_dump(mode="json") for i in range(4)]}

    async def main():
        return [message async for message in decoder.run_batch(batch)]

    try:
        messages = run(main())
    finally:
        decoder.engine.shutdown()
    items = [item for message in messages for item in message]
    assert len(messages) < len(items)
    results = {i["result"]["request_id"]: i["result"] for i in items if "result" in i}
    assert sorted(results) == ["r0", "r1", "r2", "r3"]
    for rid, result in results.items():
        streamed = [t for i in items if "event" in i and i["event"]["request_id"] == rid for t in i["event"]["token_ids"]]
        assert streamed == result["token_ids"]


def test_the_ingress_sends_plain_requests_to_the_batcher_and_questions_to_plan_to_the_planner(path):
    from deployments.openai_schema import CompletionRequest
    from deployments.routing import RoutedBackend

    service, _, _, _ = path
    asked_planner = []

    class Planner:  # the planner deployment's backend: records what reached it, answers with the full service
        async def complete(self, request):
            asked_planner.append(request)
            return await service.complete(request)

        async def health(self):
            return {"healthy": True}

    plain = CompletionService(service.engine, service.limits)  # no orchestrator: never plans
    routed = RoutedBackend(plain, Planner())
    conversation = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}, {"role": "assistant",
                                         "content": "hello"}, {"role": "user", "content": "and?"}], mode="plato")

    async def main():
        answers = {"ar": await routed.complete(chat("hello there")),
                   "completion": await routed.complete(CompletionRequest(prompt="once upon")),
                   "conversation": await routed.complete(conversation),
                   "streamed": [c async for c in routed.stream(chat("hello there", max_tokens=4))]}
        for mode in ("sot", "plato", "auto"):
            answers[mode] = await routed.complete(chat("How do I plan a trip?", mode=mode, max_tokens=24))
        return answers, await routed.health(), await routed.info()

    answers, health, info = run(main())
    assert [r.mode for r in asked_planner] == ["sot", "plato", "auto"]  # and nothing else reached it
    assert answers["ar"].mode == "ar" and answers["conversation"].mode == "ar"
    assert answers["completion"].usage.completion_tokens > 0 and answers["streamed"][-1]["choices"][0]["finish_reason"]
    assert answers["plato"].mode in ("plato", "ar") and answers["sot"].choices[0].message.content
    assert health == {"healthy": True} and info["id"] == service.model_name


def _logprob_values(entries) -> list[float]:
    return [e["logprob"] if isinstance(e, dict) else e.logprob for e in entries]


def test_logprobs_of_an_answer_cut_and_resumed_by_the_batcher_are_those_of_direct_decoding(path, decode_alone,
                                                                                          tiny_tokenizer):
    from deployments.openai_schema import RequestError

    service, batcher, _, _ = path

    async def main():
        response = await service.complete(chat("hello there", logprobs=True, top_logprobs=1))
        try:
            await service.complete(chat("Explain why the sky is blue.", mode="plato", logprobs=True))
        except RequestError as exc:
            return response, await batcher.stats(), exc.param
        return response, await batcher.stats(), None

    response, stats, refused = run(main())
    prompt = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)
    direct = decode_alone(list(prompt), max_tokens=20, logprobs=1)
    content = response.choices[0].logprobs["content"]
    assert stats["requeues"] >= 2  # predicted 7: cut at 8 and at 16, resumed each time
    assert [c["token"] for c in content] == [e.token for e in direct.logprobs]
    assert _logprob_values(content) == pytest.approx(_logprob_values(direct.logprobs), abs=1e-4)
    assert refused == "logprobs"


def test_a_replica_that_dies_mid_answer_leaves_the_resumed_answer_every_tokens_logprob_once(make_engine,
                                                                                           decode_alone):
    decoder = DecoderReplica({}, engine=make_engine(max_batch_size=4))
    calls = []

    async def dies_once(batch):  # the first batch's replica stops (its engine drops the batch) mid-answer
        calls.append(batch)
        sent = 0
        async with contextlib.aclosing(decoder.run_batch(batch)) as messages:
            async for message in messages:
                if len(calls) == 1 and sent == 5:
                    raise ConnectionError("replica died")
                sent += 1
                yield message

    batcher = BatcherActor({"bins": {"edges": [64]}}, send_batch=dies_once,
                           dispatch={"stream_interval_s": 0})
    prompt = [1, 3, 40, 41, 42, 2, 1, 4]
    request = GenerationRequest(prompt_ids=prompt, params=SamplingParams(max_tokens=16, logprobs=2))

    async def main():
        streamed, result = [], None
        async for item in batcher.stream(request.model_dump(mode="json")):
            if "event" in item:
                streamed += item["event"]["logprobs"]
            else:
                result = item["result"]
        return streamed, result

    try:
        streamed, result = run(main())
    finally:
        decoder.engine.shutdown()
    direct = decode_alone(prompt, max_tokens=16, logprobs=2)
    resumed = calls[1]["requests"][0]
    assert len(calls) == 2 and 0 < len(resumed["resume_logprobs"]) == len(resumed["resume_ids"]) < 16
    assert result["token_ids"] == direct.token_ids, (result["token_ids"], direct.token_ids)
    assert streamed == result["logprobs"]
    assert _logprob_values(result["logprobs"]) == pytest.approx(_logprob_values(direct.logprobs), abs=1e-4)


def test_a_call_that_fails_while_its_replica_lives_on_is_retried_there_and_answered_in_full(make_engine,
                                                                                           decode_alone):
    # the batcher gives up on a call (a network error, say) while the replica keeps the old stream open;
    # the retry, under the same request id, lands on that replica and must replace the old attempt
    decoder = DecoderReplica({}, engine=make_engine(max_batch_size=4))
    calls, abandoned = [], []

    async def fails_once(batch):
        calls.append(batch)
        messages = decoder.run_batch(batch)
        if len(calls) == 1:
            abandoned.append(messages)  # never closed by the caller: the replica still streams it
        sent = 0
        async for message in messages:
            if len(calls) == 1 and sent == 3:
                raise ConnectionError("call lost")
            sent += 1
            yield message

    batcher = BatcherActor({"bins": {"edges": [64]}}, send_batch=fails_once, dispatch={"stream_interval_s": 0})
    prompt = [1, 3, 40, 41, 42, 2, 1, 4]

    async def main():
        try:
            return await batcher.submit(GenerationRequest(prompt_ids=prompt, params=SamplingParams(max_tokens=16))
                                        .model_dump(mode="json"))
        finally:
            await abandoned[0].aclose()

    try:
        result = run(main())
    finally:
        decoder.engine.shutdown()
    assert len(calls) == 2 and 0 < len(calls[1]["requests"][0]["resume_ids"]) < 16
    assert result["token_ids"] == decode_alone(prompt, max_tokens=16).token_ids


def test_an_echoed_prompt_cut_and_resumed_by_the_batcher_is_scored_and_echoed_once(path, decode_alone, tiny_tokenizer):
    from deployments.openai_schema import CompletionRequest

    service, batcher, _, _ = path
    request = CompletionRequest(prompt="hello there", echo=True, logprobs=1, max_tokens=20)

    async def main():
        whole = await service.complete(request)
        streamed = [chunk async for chunk in service.stream(request.model_copy(update={"stream": True}))]
        return whole, streamed, await batcher.stats()

    whole, streamed, stats = run(main())
    prompt = tiny_tokenizer.encode("hello there", add_special_tokens=False)
    direct = decode_alone(prompt, max_tokens=20, logprobs=1, prompt_logprobs=1)
    assert stats["requeues"] >= 4  # predicted 7: each answer cut at 8 and at 16, resumed each time
    [choice] = whole.choices
    assert choice.text == "hello there" + direct.text
    expected = [None] + [e.logprob for e in direct.prompt_logprobs] + [e.logprob for e in direct.logprobs]
    assert choice.logprobs["token_logprobs"][1:] == pytest.approx(expected[1:], abs=1e-4)
    assert choice.logprobs["token_logprobs"][0] is None and len(choice.logprobs["tokens"]) == len(prompt) + 20
    pieces = [c["choices"][0] for c in streamed if c["choices"]]
    assert "".join(p["text"] for p in pieces) == choice.text
    parts = [p["logprobs"] for p in pieces if p["logprobs"]]
    assert {k: [x for part in parts for x in part[k]] for k in choice.logprobs} == choice.logprobs
