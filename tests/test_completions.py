"""POST /v1/completions (OpenAI's legacy text completions) in-process over the tiny engine, and the
official `openai` client against the in-process app."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from test_api import SERVED, WORDS, assert_close, assert_refused, client, events, make_client  # noqa: F401  (fixtures)


def _complete(client, **body):
    body.setdefault("prompt", WORDS)
    return client.post("/v1/completions", json=body)


def test_completion_has_openai_shape_and_uses_no_chat_template(client):
    response = _complete(client, max_tokens=5)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == SERVED
    [choice] = body["choices"]
    assert choice["text"] and choice["finish_reason"] == "length" and choice["index"] == 0
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,  # the 3 words alone
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_a_list_of_one_prompt_is_the_same_as_the_string(client):
    plain = _complete(client, max_tokens=6).json()["choices"]
    assert _complete(client, prompt=[WORDS], max_tokens=6).json()["choices"] == plain


def test_streaming_sends_text_pieces_finish_and_usage_matching_the_plain_answer(client):
    plain = _complete(client, max_tokens=6).json()
    chunks = events(_complete(client, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == plain["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]["usage"]  # the same prompt again: all of it cached but its last token
    assert chunks[-1]["choices"] == [] and usage == {**plain["usage"], "prompt_tokens_details": {
        "cached_tokens": plain["usage"]["prompt_tokens"] - 1}}


def test_n_completions_are_indexed_choices_streamed_or_not(client):
    body = _complete(client, n=2, temperature=1.0, seed=5, max_tokens=5).json()
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["completion_tokens"] == 10
    chunks = events(_complete(client, n=2, temperature=1.0, seed=5, max_tokens=5, stream=True))
    for choice in body["choices"]:
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == choice["index"]) \
            == choice["text"]


def test_logprobs_are_openais_parallel_lists_streamed_or_not(client):
    body = _complete(client, max_tokens=5, logprobs=3).json()
    [choice] = body["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 5
    assert all(len(top) == 3 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0 and all(
        b - a == len(t) for a, b, t in zip(logprobs["text_offset"], logprobs["text_offset"][1:], logprobs["tokens"]))
    chunks = events(_complete(client, max_tokens=5, logprobs=3, stream=True))
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    _assert_same_logprobs(streamed, logprobs)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": [WORDS] * 9}, "prompt"),
        ({"prompt": [WORDS] * 3, "n": 3}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "  "}, "prompt"),
        ({"prompt": [[1, 2], []]}, "prompt"),
        ({"prompt": [5, -1]}, "prompt"),
        ({"prompt": [5, 10**9]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": ["a", [1, 2]]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": " ".join(["baba"] * 200)}, "prompt"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"echo": "maybe"}, "echo"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 9}, "n"),
        ({"suffix": " the end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"logit_bias": {"-50": -100}}, "logit_bias"),
        ({"max_tokens": 65}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stream": True, "logprobs": -1}, "logprobs"),
    ],
)
def test_bad_input_is_400_naming_the_field(client, body, param):
    assert_refused(_complete(client, **body), 400, param)


def test_prompt_limit_and_model_name_apply_as_for_chat(make_client):
    client = make_client(max_prompt_tokens=2)
    assert "at most 2" in assert_refused(_complete(client), 400, "prompt")["message"]
    assert_refused(_complete(client, prompt="baba", model="gpt-4"), 404, "model", "model_not_found")


def test_several_prompts_are_answered_as_choices_in_prompt_order(client):
    alone = [_complete(client, prompt=p, max_tokens=4).json() for p in (WORDS, "bobo")]
    body = _complete(client, prompt=[WORDS, "bobo"], n=2, max_tokens=4).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [alone[0]["choices"][0]["text"]] * 2 + [
        alone[1]["choices"][0]["text"]] * 2
    prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in alone)  # each prompt once, not once per choice
    # each prompt was answered alone first: its KV is cached but for the last token, whose logits start the answer
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 16, "total_tokens": prompt_tokens + 16,
                             "prompt_tokens_details": {"cached_tokens": prompt_tokens - 2}}
    chunks = events(_complete(client, prompt=[WORDS, "bobo"], n=2, max_tokens=4, stream=True,
                              stream_options={"include_usage": True}))
    for choice in body["choices"]:
        assert "".join(c["choices"][0]["text"] for c in chunks
                       if c["choices"] and c["choices"][0]["index"] == choice["index"]) == choice["text"]
    assert chunks[-1]["usage"] == body["usage"]


def test_a_prompt_of_token_ids_is_the_text_it_encodes(client, tiny_tokenizer):
    ids = tiny_tokenizer.encode(WORDS, add_special_tokens=False)
    assert _complete(client, prompt=ids, max_tokens=5).json()["choices"] == \
        _complete(client, max_tokens=5).json()["choices"]
    assert _complete(client, prompt=[ids, ids], max_tokens=5).json()["usage"]["prompt_tokens"] == 2 * len(ids)


def test_echo_puts_the_prompt_in_front_of_the_answer(client, tiny_tokenizer):
    answer = _complete(client, max_tokens=5).json()["choices"][0]["text"]
    assert _complete(client, max_tokens=5, echo=True).json()["choices"][0]["text"] == WORDS + answer
    ids = tiny_tokenizer.encode(WORDS, add_special_tokens=False)
    assert _complete(client, prompt=ids, max_tokens=5, echo=True).json()["choices"][0]["text"] == \
        tiny_tokenizer.decode(ids) + answer


def _hf_prompt_logprobs(model, ids: list[int]):
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(client, tiny_model, tiny_tokenizer):
    # lm-evaluation-harness's local-completions: token ids, echo, logprobs 1, max_tokens 1; it sums
    # token_logprobs[ctxlen:-1] for a continuation's loglikelihood
    context = tiny_tokenizer.encode("baba babe", add_special_tokens=False)
    continuation = tiny_tokenizer.encode(" babi bobo", add_special_tokens=False)
    ids = context + continuation
    body = _complete(client, prompt=[ids], max_tokens=1, logprobs=1, echo=True, temperature=0).json()
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1 and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None and all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
    reference = _hf_prompt_logprobs(tiny_model, ids)
    expected = [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert logprobs["token_logprobs"][1:-1] == pytest.approx(expected, abs=1e-4)
    loglikelihood = sum(logprobs["token_logprobs"][len(context):-1])
    assert loglikelihood == pytest.approx(sum(expected[len(context) - 1:]), abs=1e-3)
    greedy = [max(top.values()) for top in logprobs["top_logprobs"][1:]]
    assert [lp >= g - 1e-6 for lp, g in zip(logprobs["token_logprobs"][1:], greedy)] == [
        reference[i - 1].argmax().item() == ids[i] for i in range(1, len(ids))] + [True]  # the answer is greedy
    assert logprobs["tokens"][:len(ids)] == [tiny_tokenizer.decode([t]) for t in ids]
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[len(ids)] == len(tiny_tokenizer.decode(ids))
    assert body["usage"]["completion_tokens"] == 1


def test_max_tokens_0_with_echo_scores_the_prompt_and_generates_nothing(client, tiny_tokenizer):
    ids = tiny_tokenizer.encode(WORDS, add_special_tokens=False)
    scored = _complete(client, prompt=WORDS, max_tokens=0, echo=True, logprobs=0).json()
    with_answer = _complete(client, prompt=WORDS, max_tokens=2, echo=True, logprobs=0).json()
    [choice] = scored["choices"]
    assert choice["text"] == WORDS and choice["finish_reason"] == "length"
    assert scored["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids),
                               "prompt_tokens_details": {"cached_tokens": 0}}
    assert choice["logprobs"] == {k: v[:len(ids)] for k, v in with_answer["choices"][0]["logprobs"].items()}
    chunks = events(_complete(client, prompt=WORDS, max_tokens=0, echo=True, logprobs=0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == WORDS
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert {k: [x for part in streamed for x in part[k]] for k in choice["logprobs"]} == choice["logprobs"]


def test_echo_with_logprobs_streams_what_it_answers_whole(client):
    body = _complete(client, prompt=[WORDS, "bobo"], max_tokens=5, echo=True, logprobs=2).json()
    chunks = events(_complete(client, prompt=[WORDS, "bobo"], max_tokens=5, echo=True, logprobs=2, stream=True))
    for choice in body["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        parts = [c["logprobs"] for c in mine if c["logprobs"]]
        _assert_same_logprobs(parts, choice["logprobs"])


def _assert_same_logprobs(parts: list[dict], whole: dict) -> None:
    """Streamed `logprobs` parts, joined, are the whole answer's (its floats to rounding: `assert_close`)."""
    assert_close({k: [x for part in parts for x in part[k]] for k in whole}, whole)


def test_a_stop_token_sampled_after_an_echoed_prompt_is_listed_as_the_generated_entry(make_engine, decode_alone,
                                                                                        tiny_tokenizer):
    # lm-evaluation-harness reads token_logprobs[ctxlen:-1]: the last entry must be the generated token's,
    # even when that token is the end of sequence (which the answer's text and token count leave out)
    import asyncio

    from deployments.completion_service import ApiLimits, CompletionService
    from deployments.openai_schema import CompletionRequest
    from engine.async_engine import AsyncEngine

    ids = tiny_tokenizer.encode(WORDS, add_special_tokens=False)
    engine = make_engine()
    engine.stop_token_ids = {decode_alone(ids, max_tokens=1).token_ids[0]}
    served = AsyncEngine(engine)
    try:
        service = CompletionService(served, ApiLimits())
        request = CompletionRequest(prompt=[ids], echo=True, logprobs=1, max_tokens=1)
        response = asyncio.run(service.complete(request))
        chunks = asyncio.run(_collect(service.stream(request.model_copy(update={"stream": True}))))
    finally:
        served.shutdown()
    [choice] = response.choices
    assert choice.finish_reason == "stop" and choice.text == tiny_tokenizer.decode(ids)
    assert len(choice.logprobs["tokens"]) == len(ids) + 1 and response.usage.completion_tokens == 0
    assert choice.logprobs["tokens"][-1] == tiny_tokenizer.decode(list(engine.stop_token_ids))
    _assert_same_logprobs([c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]], choice.logprobs)


async def _collect(chunks) -> list:
    return [chunk async for chunk in chunks]


def test_tokenizer_routes_answer_as_vllms_do(client, tiny_tokenizer):
    ids = tiny_tokenizer.encode(WORDS, add_special_tokens=False)
    tokenized = client.post("/tokenize", json={"prompt": WORDS, "model": SERVED}).json()
    assert tokenized == {"count": len(ids), "max_model_len": 128, "tokens": ids}
    assert _complete(client, prompt=tokenized["tokens"], max_tokens=3).json()["usage"]["prompt_tokens"] == len(ids)
    messages = [{"role": "user", "content": WORDS}]
    chat = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert chat == tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": tiny_tokenizer.decode(ids)}
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == tiny_tokenizer.eos_token and info["chat_template"] == tiny_tokenizer.chat_template
    assert info["vocab_size"] == len(tiny_tokenizer)


@pytest.mark.parametrize("route, body, status, param", [
    ("/tokenize", {}, 400, "messages"),
    ("/tokenize", {"prompt": WORDS, "messages": [{"role": "user", "content": "hi"}]}, 400, "messages"),
    ("/tokenize", {"prompt": WORDS, "model": "other"}, 404, "model"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_tokenizer_routes_refuse_bad_input_naming_the_field(client, route, body, status, param):
    error = client.post(route, json=body)
    assert error.status_code == status, error.text
    assert error.json()["error"]["param"] == param


def test_tokenizer_routes_want_the_api_key_when_one_is_set(make_client):
    keyed = make_client(api_key="k3y")
    assert keyed.post("/tokenize", json={"prompt": WORDS}).status_code == 401
    assert keyed.get("/tokenizer_info").status_code == 401
    assert keyed.post("/tokenize", json={"prompt": WORDS}, headers={"Authorization": "Bearer k3y"}).status_code == 200


openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")  # what the openai client (3.x) speaks HTTP with


def _openai(client: TestClient, api_key: str) -> "openai.OpenAI":
    """The official client, its HTTP calls answered by the in-process app."""

    def forward(request: httpx2.Request) -> httpx2.Response:
        reply = client.request(request.method, str(request.url), headers=dict(request.headers), content=request.read())
        return httpx2.Response(reply.status_code, headers=reply.headers, content=reply.content)

    return openai.OpenAI(base_url="http://testserver/v1", api_key=api_key, max_retries=0,
                         http_client=httpx2.Client(transport=httpx2.MockTransport(forward)))


@pytest.fixture
def keyed(make_client):
    return _openai(make_client(api_key="k3y"), api_key="k3y")


def test_openai_client_completes_and_streams_unchanged(keyed):
    reply = keyed.completions.create(model=SERVED, prompt=WORDS, max_tokens=6)
    assert reply.object == "text_completion" and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6
    stream = keyed.completions.create(model=SERVED, prompt=WORDS, max_tokens=6, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == reply.choices[0].text


def test_openai_client_chats_with_a_mode_and_sees_which_mode_answered(keyed):
    reply = keyed.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": WORDS}],
                                          max_tokens=4, extra_body={"mode": "plato", "return_plan": True})
    assert reply.choices[0].message.content and reply.model_extra["mode"] == "ar"


def test_openai_client_sends_a_prediction_and_reads_what_of_it_was_taken(keyed):
    messages = [{"role": "user", "content": WORDS}]
    plain = keyed.chat.completions.create(model=SERVED, messages=messages, max_tokens=12)
    text = plain.choices[0].message.content
    reply = keyed.chat.completions.create(model=SERVED, messages=messages, max_tokens=12,
                                          prediction={"type": "content", "content": text})
    assert reply.choices[0].message.content == text
    assert reply.usage.completion_tokens_details.accepted_prediction_tokens > 0
    assert plain.usage.completion_tokens_details is None


def test_openai_client_lists_and_retrieves_the_served_model(keyed):
    assert [m.id for m in keyed.models.list()] == [SERVED]
    assert keyed.models.retrieve(SERVED).id == SERVED
    with pytest.raises(openai.NotFoundError):
        keyed.models.retrieve("gpt-4")


def test_openai_client_raises_its_own_errors(keyed, make_client):
    with pytest.raises(openai.NotFoundError) as missing:
        keyed.completions.create(model="other", prompt=WORDS)
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    with pytest.raises(openai.BadRequestError, match="suffix"):
        keyed.completions.create(model=SERVED, prompt=WORDS, suffix="!")
    with pytest.raises(openai.AuthenticationError):
        _openai(make_client(api_key="k3y"), api_key="wrong").completions.create(model=SERVED, prompt=WORDS)


def test_more_stop_strings_than_openais_four_are_honoured(client):
    answer = _complete(client, max_tokens=8).json()["choices"][0]["text"]
    cut = answer[len(answer) // 2:][:3]
    stops = [f"never{i}" for i in range(9)] + [cut]
    body = _complete(client, max_tokens=8, stop=stops).json()
    assert body["choices"][0]["text"] == answer[:answer.index(cut)] and body["choices"][0]["finish_reason"] == "stop"
