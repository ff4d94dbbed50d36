"""The HTTP API in-process (FastAPI test client) over the tiny engine: chat completions, the
request checks, the answer mode, the API key and the in-flight limit."""
from __future__ import annotations

import asyncio
import contextlib
import json
from unittest.mock import ANY

import httpx
import pytest
from fastapi.testclient import TestClient

from deployments.api import create_app
from deployments.completion_service import ApiLimits, CompletionService
from deployments.openai_schema import ChatCompletionRequest, RequestError
from engine.async_engine import AsyncEngine

WORDS = "baba babe babi"
SERVED = "embedded:smollm2-135m"  # EngineConfig's default model, the tiny engine's name


@pytest.fixture
def make_client(make_engine):
    """`make_client(api_key=None, max_in_flight=8, **limits)`: a test client over a fresh tiny
    engine (context 128), with default_max_tokens 8 and max_tokens_limit 64 unless `limits` say."""
    with contextlib.ExitStack() as stack:

        def build(api_key: str | None = None, max_in_flight: int = 8, **limits) -> TestClient:
            engine = AsyncEngine(make_engine(max_batch_size=4, max_model_len=128))
            stack.callback(engine.shutdown)
            service = CompletionService(engine, ApiLimits(**{"default_max_tokens": 8, "max_tokens_limit": 64, **limits}))
            return stack.enter_context(TestClient(create_app(service, api_key=api_key, max_in_flight=max_in_flight)))

        yield build


@pytest.fixture
def client(make_client):
    return make_client()


def events(response) -> list:
    """The JSON payloads of a server-sent-events response, checking it ends with [DONE]."""
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def assert_close(got, want, tolerance: float = 1e-5) -> None:
    """Equal JSON, floats to `tolerance`: a second request that starts from the first's cached KV computes
    its own rows in passes of other shapes, which round differently in the last bits."""
    if isinstance(want, float):
        assert got == pytest.approx(want, abs=tolerance)
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for key in want:
            assert_close(got[key], want[key], tolerance)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for mine, theirs in zip(got, want):
            assert_close(mine, theirs, tolerance)
    else:
        assert got == want


def assert_refused(response, status: int, param: str | None, code: str | None = None) -> dict:
    """An OpenAI-style error: the status, the field to blame, the message starting with it."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == code
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert param is None or error["message"].startswith(param)
    return error


def _chat(client, **body):
    body.setdefault("messages", [{"role": "user", "content": WORDS}])
    return client.post("/v1/chat/completions", json=body)


def test_completion_has_openai_shape_and_usage(client):
    response = _chat(client, max_tokens=5)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5


def test_default_max_tokens_comes_from_limits(client):
    assert _chat(client).json()["usage"]["completion_tokens"] == 8


def test_greedy_answer_is_deterministic_and_text_parts_are_accepted(client):
    first = _chat(client, max_tokens=6).json()["choices"][0]["message"]["content"]
    parts = [{"role": "user", "content": [{"type": "text", "text": WORDS}]}]
    second = _chat(client, messages=parts, max_tokens=6).json()["choices"][0]["message"]["content"]
    assert first == second


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "   "}]}, "messages.0.content"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 65}, "max_tokens"),
        ({"max_tokens": 60, "messages": [{"role": "user", "content": " ".join(["baba"] * 100)}]}, "max_tokens"),
        ({"messages": [{"role": "user", "content": " ".join(["baba"] * 200)}]}, "messages"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"n": 9}, "n"),  # past limits.max_choices (8)
        ({"n": 129}, "n"),
        ({"stream": True, "n": 9}, "n"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logit_bias": {"abc": 5}}, "logit_bias"),
        ({"logit_bias": {"50": 101}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "mode": "plato"}, "response_format"),
        ({"response_format": {"type": "json_object"}}, "response_format"),  # the tiny tokenizer cannot write JSON
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # 'auto': the tokenizer cannot
        ({"tools": [{"type": "function", "function": {"name": "f g"}}], "tool_choice": "none"}, "tools.0.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "format": "ipv4network"}}}}}],
          "tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tools"),
        ({"messages": [{"role": "tool"}]}, "messages.0.content"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": {"name": "f"}}, "function_call"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"mode": "fast"}, "mode"),
        ({"stream": True, "temperature": 9}, "temperature"),
        ({"stream": True, "max_tokens": 65}, "max_tokens"),
        ({"prediction": "hello"}, "prediction"),
        ({"prediction": {"type": "text", "content": "hello"}}, "prediction.type"),
        ({"prediction": {"type": "content"}}, "prediction.content"),
        ({"prediction": {"type": "content", "content": " ".join(["baba"] * 200)}}, "prediction"),  # past the context
    ],
)
def test_bad_input_is_400_naming_the_field(client, body, param):
    assert_refused(_chat(client, **body), 400, param)


@pytest.mark.parametrize("stream", [False, True])
def test_another_model_name_is_404_model_not_found(client, stream):
    error = assert_refused(_chat(client, model="/etc/passwd", stream=stream), 404, "model", "model_not_found")
    assert "/etc/passwd" in error["message"] and SERVED in error["message"]
    assert _chat(client, model=SERVED, max_tokens=2).status_code == 200


def test_prompt_longer_than_max_prompt_tokens_is_400(make_client):
    client = make_client(max_prompt_tokens=20)
    error = assert_refused(_chat(client, messages=[{"role": "user", "content": " ".join(["baba"] * 30)}]), 400, "messages")
    assert "at most 20" in error["message"]
    assert _chat(client, max_tokens=2).status_code == 200


@pytest.mark.parametrize("mode", ["auto", "ar", "sot", "plato"])
def test_every_mode_is_accepted_and_the_answer_names_the_mode_that_made_it(client, mode):
    plain = _chat(client, max_tokens=4).json()
    body = _chat(client, max_tokens=4, mode=mode, return_plan=True).json()
    assert body["mode"] == "ar" and body["choices"] == plain["choices"]
    chunks = events(_chat(client, max_tokens=4, mode=mode, stream=True))
    assert {chunk["mode"] for chunk in chunks} == {"ar"}


def test_streaming_sends_role_deltas_finish_and_usage_matching_the_plain_answer(client):
    plain = _chat(client, max_tokens=6).json()
    response = _chat(client, max_tokens=6, stream=True, stream_options={"include_usage": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    chunks = events(response)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and _uncached(usage) == _uncached(plain["usage"])
    # the plain answer came first: every prompt token but the last (whose logits start the answer) is cached
    assert plain["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage["prompt_tokens_details"] == {"cached_tokens": usage["prompt_tokens"] - 1}


def _uncached(usage: dict) -> dict:
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


def test_n_choices_each_replay_as_a_request_with_seed_plus_index_and_usage_counts_the_prompt_once(client):
    body = _chat(client, n=3, temperature=1.0, seed=7, max_tokens=6).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    texts = [c["message"]["content"] for c in body["choices"]]
    singles = [_chat(client, temperature=1.0, seed=7 + i, max_tokens=6).json() for i in range(3)]
    assert texts == [s["choices"][0]["message"]["content"] for s in singles]
    assert len(set(texts)) > 1  # sampled with different seeds: not three copies of one answer
    assert _uncached(body["usage"]) == {"prompt_tokens": singles[0]["usage"]["prompt_tokens"],
                                        "completion_tokens": 18, "total_tokens": singles[0]["usage"]["prompt_tokens"] + 18}
    greedy = _chat(client, n=2, max_tokens=6).json()["choices"]
    assert greedy[0]["message"] == greedy[1]["message"] == _chat(client, max_tokens=6).json()["choices"][0]["message"]


def test_streamed_n_choices_carry_their_index_and_read_as_the_unstreamed_answers(client):
    plain = _chat(client, n=3, temperature=1.0, seed=3, max_tokens=6).json()
    chunks = events(_chat(client, n=3, temperature=1.0, seed=3, max_tokens=6, stream=True,
                          stream_options={"include_usage": True}))
    assert [c["choices"][0] for c in chunks[:3]] == [
        {"index": i, "delta": {"role": "assistant"}, "finish_reason": None, "logprobs": None} for i in range(3)]
    for choice in plain["choices"]:
        mine = [c["choices"][0] for c in chunks[3:] if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["delta"].get("content", "") for c in mine) == choice["message"]["content"]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [choice["finish_reason"]]
        assert mine[-1]["finish_reason"] is not None
    assert chunks[-1]["choices"] == [] and _uncached(chunks[-1]["usage"]) == _uncached(plain["usage"])


def test_logprobs_come_per_token_with_their_alternatives_streamed_or_not(client):
    body = _chat(client, max_tokens=6, logprobs=True, top_logprobs=2).json()
    [choice] = body["choices"]
    content = choice["logprobs"]["content"]
    assert len(content) == 6 and "".join(c["token"] for c in content).replace(" ", "") == \
        choice["message"]["content"].replace(" ", "")
    for entry in content:
        assert entry["logprob"] <= 0 and entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy takes the most likely
    chunks = events(_chat(client, max_tokens=6, logprobs=True, top_logprobs=2, stream=True))
    assert_close([e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                  for e in c["choices"][0]["logprobs"]["content"]], content)
    assert _chat(client, max_tokens=6).json()["choices"][0]["logprobs"] is None


def test_fields_left_at_their_neutral_value_are_accepted(client):
    neutral = {"logprobs": False, "top_logprobs": 0, "logit_bias": {}, "response_format": {"type": "text"},
               "tools": [], "tool_choice": "none", "user": "someone", "metadata": {"a": "b"}}
    assert _chat(client, max_tokens=4, **neutral).json()["choices"] == _chat(client, max_tokens=4).json()["choices"]


def test_malformed_json_is_400_and_service_keeps_working(client):
    response = client.post("/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert _chat(client, max_tokens=2).status_code == 200


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == SERVED and models["data"][0]["max_model_len"] == 128
    assert client.get(f"/v1/models/{SERVED}").json() == {**models["data"][0], "created": ANY}
    assert_refused(client.get("/v1/models/gpt-4"), 404, "model", "model_not_found")
    assert client.get("/healthz").json()["healthy"] is True
    assert client.get("/health").json() == client.get("/healthz").json()


def test_health_is_503_when_engine_loop_is_dead(client):
    service = client.app.state.backend
    service.engine.shutdown()
    service.engine.error = RuntimeError("boom")
    assert client.get("/healthz").status_code == 503
    assert client.get("/health").status_code == 503


def test_with_an_api_key_every_v1_route_wants_it_and_health_stays_open(make_client):
    client = make_client(api_key="s3cret")
    chat = {"messages": [{"role": "user", "content": WORDS}], "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
        assert_refused(client.get("/v1/models", headers=headers), 401, None, "invalid_api_key")
        assert_refused(client.post("/v1/chat/completions", json=chat, headers=headers), 401, None, "invalid_api_key")
    good = {"Authorization": "Bearer s3cret"}
    assert client.get("/v1/models", headers=good).status_code == 200
    assert client.post("/v1/chat/completions", json=chat, headers=good).status_code == 200
    assert client.get("/healthz").status_code == 200


class _HeldBackend:
    """A backend whose answers wait until `release` is set, to hold requests in flight."""

    def __init__(self):
        self.release = asyncio.Event()
        self.holding = 0

    async def _hold(self):
        self.holding += 1
        await self.release.wait()
        self.holding -= 1

    async def complete(self, request):
        await self._hold()
        return {"object": "chat.completion", "choices": []}

    async def stream(self, request):
        yield {"object": "chat.completion.chunk", "choices": []}
        await self._hold()
        yield {"object": "chat.completion.chunk", "choices": [], "usage": None}

    async def info(self):
        return {"id": SERVED, "max_model_len": 128}

    async def health(self):
        return {"healthy": True}


async def _until(condition) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), 5)


def test_past_max_in_flight_requests_get_503_with_retry_after_at_once():
    backend = _HeldBackend()
    chat = {"messages": [{"role": "user", "content": WORDS}]}

    async def scenario():
        transport = httpx.ASGITransport(app=create_app(backend, api_key=None, max_in_flight=2))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            held = [asyncio.create_task(http.post("/v1/chat/completions", json=chat)),
                    asyncio.create_task(http.post("/v1/chat/completions", json={**chat, "stream": True}))]
            await _until(lambda: backend.holding == 2)  # one answer and one open stream
            refused = await http.post("/v1/completions", json={"prompt": WORDS})
            health = await http.get("/healthz")
            models = await http.get("/v1/models")  # a cheap GET neither waits for nor takes room
            backend.release.set()
            answered = await asyncio.gather(*held)
            invalid = [await http.post("/v1/chat/completions", json={}) for _ in range(3)]
            after = await http.post("/v1/chat/completions", json=chat)
        return refused, health, models, answered, invalid, after

    refused, health, models, answered, invalid, after = asyncio.run(scenario())
    assert_refused(refused, 503, None, "server_overloaded")
    assert refused.headers["retry-after"] == "1"
    assert health.status_code == 200 and models.status_code == 200
    assert [r.status_code for r in answered] == [200, 200] and answered[1].text.endswith("data: [DONE]\n\n")
    assert [r.status_code for r in invalid] == [400] * 3 and after.status_code == 200  # nothing leaked


def test_a_streamed_n_choice_request_that_the_client_drops_stops_every_choice(make_engine):
    import time

    from deployments.openai_schema import ChatCompletionRequest

    slow = make_engine(max_batch_size=4, max_model_len=128)
    step = slow.step
    slow.step = lambda: (time.sleep(0.03), step())[1]  # 60 tokens take 1.8 s: a dropped client is seen mid-answer
    engine = AsyncEngine(slow)
    service = CompletionService(engine, ApiLimits(max_tokens_limit=64))
    request = ChatCompletionRequest(messages=[{"role": "user", "content": WORDS}], n=3, max_tokens=60,
                                    temperature=1.0, seed=1, stream=True)

    async def scenario():
        chunks = service.stream(request)
        seen = [await anext(chunks) for _ in range(5)]  # three openings, then text
        running = (await engine.call(lambda e: e.stats()))["running"]
        await chunks.aclose()
        for _ in range(25):  # half a second, well inside the answers' 1.8 s
            await asyncio.sleep(0.02)
            if not await engine.call(lambda e: e.has_work()):
                return seen, running, True
        return seen, running, False

    try:
        seen, running, stopped = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert running == 3 and stopped
    assert seen[3]["choices"][0]["delta"].get("content") is not None


def test_vllms_sampling_extras_reach_the_sampler(client):
    def answer(**body):
        return _chat(client, max_tokens=12, **body).json()["choices"][0]["message"]["content"]

    greedy = answer()
    assert answer(temperature=2.0, seed=1) != greedy  # hot sampling wanders off
    assert answer(temperature=2.0, seed=1, top_k=1) == greedy  # one candidate: the greedy one
    assert answer(top_k=-1) == answer(top_k=0) == greedy  # vLLM's ways of saying no limit
    assert answer(repetition_penalty=3.0) != greedy


def test_logit_bias_steers_the_answer_as_openais_does(client, tiny_tokenizer):
    first = _chat(client, max_tokens=1).json()["choices"][0]["message"]["content"]
    banned = str(tiny_tokenizer.convert_tokens_to_ids(first.strip()))
    assert _chat(client, max_tokens=1, logit_bias={banned: -100}).json()["choices"][0]["message"]["content"] != first
    forced = tiny_tokenizer.convert_ids_to_tokens(77)
    body = _chat(client, max_tokens=3, logit_bias={"77": 100}).json()
    assert body["choices"][0]["message"]["content"].split() == [forced] * 3


def test_answers_in_flight_are_counted_per_choice_and_past_the_limit_a_request_is_503(make_client):
    client = make_client(max_queued_requests=3)
    service = client.app.state.backend

    async def main():
        held = service.stream(_chat_request(n=2, max_tokens=30))
        await anext(held)  # its two answers are decoding
        refused = None
        try:
            await service.complete(_chat_request(n=2, max_tokens=2))
        except RequestError as exc:
            refused = exc
        fits = await service.complete(_chat_request(max_tokens=2))  # 2 + 1 answers: within 3
        during = service.choices_in_flight
        await held.aclose()
        return refused, fits, during, service.choices_in_flight

    refused, fits, during, after = asyncio.run(main())
    assert refused.status == 503 and refused.code == "server_overloaded" and fits.choices
    assert (during, after) == (2, 0)
    alone = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": WORDS}], "n": 5,
                                                      "max_tokens": 2})
    assert alone.status_code == 200 and len(alone.json()["choices"]) == 5  # above the limit, but nothing else held
    service.choices_in_flight = 3
    busy = _chat(client, max_tokens=2)
    assert busy.status_code == 503 and busy.headers["Retry-After"] == "1"
    service.choices_in_flight = 0


def _chat_request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": WORDS}], **fields)


def test_a_prediction_leaves_the_answer_as_it_was_and_the_usage_says_how_much_of_it_was_taken(client):
    plain = _chat(client, max_tokens=20).json()
    text = plain["choices"][0]["message"]["content"]
    assert "completion_tokens_details" not in plain["usage"]
    predicted = {"type": "content", "content": text}
    body = _chat(client, max_tokens=20, prediction=predicted).json()
    assert body["choices"] == plain["choices"]
    details = body["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] >= 15 and details["rejected_prediction_tokens"] <= 4
    parts = {"type": "content", "content": [{"type": "text", "text": text[:7]}, {"type": "text", "text": text[7:]}]}
    assert _chat(client, max_tokens=20, prediction=parts).json()["usage"]["completion_tokens_details"] == details
    chunks = events(_chat(client, max_tokens=20, prediction=predicted, stream=True,
                          stream_options={"include_usage": True}))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == text
    assert chunks[-1]["usage"]["completion_tokens_details"] == details
    wrong = _chat(client, max_tokens=20, prediction={"type": "content", "content": "baba " * 10}).json()
    assert wrong["choices"] == plain["choices"]
    assert wrong["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] < 15
