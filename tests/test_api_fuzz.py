"""Bad input never crashes the API: valid requests of every kind, mutated at random (a field removed,
renamed, replaced by a value of another type or size, or an unknown or extra field added), are
answered with a 2xx or a 4xx, never a 5xx or an exception, and in time. Run wide it found schemas the
compiler raised TypeError on, an earlier tool call without a function (KeyError), and a seed past 64
bits that stopped the engine (README, the paragraph on bad input under Quick start)."""
from __future__ import annotations

import copy
import json
import random
import time

import pytest
import torch
from fastapi.testclient import TestClient

from deployments.api import create_app
from deployments.completion_service import ApiLimits, CompletionService
from engine.async_engine import AsyncEngine

USER = [{"role": "user", "content": "baba babe"}]
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number", "exclusiveMaximum": 2}},
          "required": ["a"]}
CALLED = [*USER, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "x"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "babe"}]
CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
VALID = [
    (CHAT, {"messages": USER, "max_tokens": 4}),
    (CHAT, {"messages": [{"role": "system", "content": "babi"}, {"role": "user", "content": [
        {"type": "text", "text": "baba"}]}], "max_tokens": 4, "n": 2, "logprobs": True, "top_logprobs": 2,
        "stream": True, "stream_options": {"include_usage": True}}),
    (CHAT, {"messages": USER, "max_tokens": 6, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA}}}),
    (CHAT, {"messages": USER, "max_tokens": 4, "response_format": {"type": "json_object"}}),
    (CHAT, {"messages": USER, "max_tokens": 6, "tools": [TOOL], "tool_choice": "required"}),
    (CHAT, {"messages": USER, "max_tokens": 6, "tools": [TOOL], "tool_choice": "auto", "stream": True}),
    (CHAT, {"messages": CALLED, "max_tokens": 4, "tools": [TOOL]}),
    (CHAT, {"messages": USER, "max_tokens": 4, "stop": ["babe"], "logit_bias": {"7": 5}, "seed": 3,
            "temperature": 0.7, "top_p": 0.9, "top_k": 5, "priority": 2, "presence_penalty": 0.5,
            "frequency_penalty": 0.1, "repetition_penalty": 1.1, "min_tokens": 1}),
    (CHAT, {"messages": USER, "max_tokens": 8, "mode": "plato", "return_plan": True}),
    (TEXT, {"prompt": "baba babe", "max_tokens": 4}),
    (TEXT, {"prompt": [[7, 8, 9], [10, 11]], "max_tokens": 3, "echo": True, "logprobs": 2}),
    (TEXT, {"prompt": ["baba", "babe"], "max_tokens": 0, "echo": True, "logprobs": 1}),
    (TEXT, {"prompt": "baba", "max_tokens": 4, "stream": True, "n": 2, "best_of": 1}),
    (TEXT, {"prompt": "baba", "max_tokens": 4, "guided_choice": ["baba", "babe"]}),
    ("/tokenize", {"prompt": "baba babe"}),
    ("/tokenize", {"messages": USER}),
    ("/detokenize", {"tokens": [7, 8, 9]}),
]
ODD = [None, -1, 0, 1, 2**31, 2**64, -2**63, 1e308, -0.5, 3.7, "", "x", "baba", "\x00", "é", [], [1], ["a"],
       [[1]], {}, {"a": 1}, True, False, "nan", [None], [{}], "a" * 5000, list(range(600)), [-5], [300],
       {"type": "text"}]
KEYS = ["-1", "0", "7", "999999999", "1e3", "x", "", " ", "$ref", "é", "content", "role"]
FIELDS = ["n", "max_tokens", "stream", "logprobs", "top_logprobs", "echo", "best_of", "stop", "suffix", "tools",
          "tool_choice", "response_format", "mode", "priority", "min_tokens", "seed", "prompt_logprobs",
          "guided_json", "stream_options", "add_generation_prompt", "continue_final_message", "ignore_eos",
          "max_completion_tokens", "minimum", "required", "type", "unknown_field"]


def _places(value, at=()):
    """Every path into a JSON value, the value's own (empty) path first."""
    yield at
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        yield from _places(inner, at + (key,))


def mutated(body: dict, rng: random.Random) -> dict:
    body = copy.deepcopy(body)
    places = [p for p in _places(body) if p]
    if not places:
        body[rng.choice(FIELDS)] = rng.choice(ODD)
        return body
    place = rng.choice(places)
    parent = body
    for key in place[:-1]:
        parent = parent[key]
    roll = rng.random()
    if roll < 0.15:
        del parent[place[-1]]
    elif roll < 0.3 and isinstance(parent, dict):
        parent[rng.choice(FIELDS)] = rng.choice(ODD)
    elif roll < 0.4 and isinstance(parent, dict):  # a key renamed: logit_bias ids, property names, fields
        parent[rng.choice(KEYS)] = parent.pop(place[-1])
    else:
        parent[place[-1]] = rng.choice(ODD)
    return body


@pytest.fixture(scope="module")
def json_chat_engine():
    """`make(**overrides)`: an engine over a random tiny model whose tokenizer writes JSON (one-character
    pieces, JSON's usual ones, tool-call tags) and has a ChatML chat template, so every request kind gets through."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.random_model import piece_tokenizer
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from tests.conftest import CHATML_TEMPLATE
    from tests.test_json_constraint import EOS, PIECES

    tokenizer = piece_tokenizer(PIECES + ["<", ">", "_", "<tool_call>", "</tool_call>"])  # auto tool calls' tags
    tokenizer.chat_template = CHATML_TEMPLATE
    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1, eos_token_id=EOS,
        pad_token_id=0)).to(torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield lambda **overrides: LLMEngine(model, tokenizer, EngineConfig(**overrides))
    torch.set_num_threads(threads)


def test_the_valid_requests_are_valid(json_chat_engine):
    with _client(json_chat_engine) as client:
        for route, body in VALID:
            response = client.post(route, json=body)
            assert response.status_code == 200, (route, body, response.text)


@pytest.mark.parametrize("seed", range(4))
def test_mutated_requests_get_an_answer_or_a_4xx(json_chat_engine, seed):
    rng, failures = random.Random(seed), []
    with _client(json_chat_engine) as client:
        for _ in range(200):
            route, body = rng.choice(VALID)
            for _ in range(rng.randint(1, 3)):
                body = mutated(body, rng)
            started = time.perf_counter()
            try:
                response = client.post(route, json=body)
                status = failed_status(response)
            except Exception as error:  # noqa: BLE001 (what the server would have answered 500 to)
                status = repr(error)
            if not isinstance(status, int) or status >= 500 or time.perf_counter() - started > 20:
                failures.append((route, json.dumps(body)[:300], status))
    assert not failures, failures[:3]


def failed_status(response) -> int:
    """The response's status, or 500 for a stream that began (200) and then failed (an error event)."""
    if response.status_code == 200 and "\ndata: {\"error\"" in "\n" + response.text:
        return 500
    return response.status_code


class _client:
    """A test client over a fresh tiny engine (context 512, answers of at most 64 tokens), closed after."""

    def __init__(self, make_engine):
        self.engine = AsyncEngine(make_engine(max_batch_size=4, max_model_len=512))
        service = CompletionService(self.engine, ApiLimits(default_max_tokens=8, max_tokens_limit=64))
        self.client = TestClient(create_app(service, api_key=None, max_in_flight=8))

    def __enter__(self) -> TestClient:
        return self.client.__enter__()

    def __exit__(self, *exc):
        self.client.__exit__(*exc)
        self.engine.shutdown()
