"""JSON mode: the character grammar of one JSON object, its exact lift to tokens, and the engine
decoding under it. The shared tiny tokenizer has only 4-letter words, so these tests build their
own from JSON's characters and pieces that span its boundaries ('{"', '":', '},', 'true', ...)."""
from __future__ import annotations

import json
import random

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.json_constraint import DONE, JsonGrammar, JsonObjectConstraint
from engine.types import FinishReason, GenerationRequest, SamplingParams

EOS = 2
PIECES = list(dict.fromkeys(  # each piece once: a repeated one would leave an id that decodes to nothing
    list('{}[]:,"\\ \n\t-+.0123456789abcdefghijklmnopqrstuvwxyzABCDEFPé/')
    + ['{"', '":', '": ', '",', '", "', '"}', '},', '}}', '}]', '],', ']}', '[]', '{}', '[{', 'true', 'false', 'null',
       'tr', 'ue', ' "', '\\n', '\\u', '00e9', '12', '3.5', 'e-', ' name', 'name', 'Paris', ' Paris', 'city',
       '  ', '\n  ', ', ', '1,', '0]', '"x\\"y"', "'", '\x01', '\ufffd']
))
GOOD = ['{}', '{"a":1}', ' {"a": [1, 2.5e-3, -0, true, false, null, "x\\n\\u00e9", {"b": []}]}',
        '{"k": "v", "n": {"m": [[]]}}', '{"a":-12.0E+5}', '{"a/b": "\\"quoted\\""}']
BAD = ['[]', '{"a":1,}', '{a:1}', "{'a':1}", '{"a":01}', '{"a":1} ', '{"a" 1}', '{"a":[1,]}', '{"a":tru}',
       '{"a":"\\x"}', '{"a":"\x01"}', '{"a":1.}', '{"a":-}', '{"a":1}}', '{"a":[}', '{"a":"\\u12"}', '"a"', '1']


@pytest.fixture(scope="module")
def json_tokenizer():
    from bench.random_model import piece_tokenizer

    return piece_tokenizer(PIECES)


@pytest.fixture(scope="module")
def json_engine(json_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(99)
    config = LlamaConfig(vocab_size=len(json_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=EOS, pad_token_id=0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield lambda **overrides: LLMEngine(model, json_tokenizer, EngineConfig(**overrides))
    torch.set_num_threads(threads)


@pytest.mark.parametrize("text", GOOD)
def test_the_grammar_accepts_json_objects(text):
    assert JsonGrammar().accepts(text)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("text", BAD)
def test_the_grammar_refuses_what_is_not_one_json_object(text):
    assert not JsonGrammar().accepts(text)


def test_number_parts_are_bounded_so_a_repeating_digit_cannot_run_to_max_tokens():
    grammar = JsonGrammar()
    assert grammar.accepts('{"a":' + "9" * 19 + "." + "5" * 19 + "e-123}")
    assert not grammar.accepts('{"a":' + "9" * 20 + "}") and not grammar.accepts('{"a":1.' + "5" * 20 + "}")
    assert not grammar.accepts('{"a":1e1234}')


def test_whitespace_runs_and_nesting_are_bounded():
    grammar = JsonGrammar(max_depth=3, max_whitespace=4)
    assert grammar.accepts('{"a":    [[1]]}') and not grammar.accepts('{"a":     1}')
    assert not grammar.accepts('{"a": [[[1]]]}')


def test_the_token_mask_is_exactly_the_tokens_the_grammar_accepts_whole(json_tokenizer):
    constraint = JsonObjectConstraint(json_tokenizer)
    strings = [json_tokenizer.decode([i]) for i in range(len(json_tokenizer))]
    rng = random.Random(7)
    for _ in range(6):  # random walks, checked against every token at every step
        constraint = JsonObjectConstraint(json_tokenizer)
        for _ in range(40):
            if constraint.is_complete:
                break
            mask = constraint.allowed()
            expected = [i > EOS and s != "" and "\ufffd" not in s and constraint.grammar.run(constraint.state, s)
                        is not None for i, s in enumerate(strings)]
            assert mask.tolist() == expected
            assert mask.any()  # never a dead end
            constraint.advance(rng.choice(mask.nonzero()[:, 0].tolist()))
        assert constraint.grammar.run(constraint.grammar.start, constraint.text) is not None


def test_a_token_the_grammar_refuses_is_an_error_naming_it(json_tokenizer):
    constraint = JsonObjectConstraint(json_tokenizer)
    with pytest.raises(ValueError, match="'true'"):
        constraint.advance(json_tokenizer.convert_tokens_to_ids("true"))


def _decode(engine, seed: int, max_tokens: int = 60, resume_ids=()):
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, constraint="json_object")
    [result] = engine.generate([GenerationRequest(prompt_ids=[1, 10, 11], resume_ids=list(resume_ids),
                                                  params=params)])
    return result


def test_answers_decoded_under_it_are_json_objects_or_their_beginnings(json_engine):
    engine, grammar, finished = json_engine(max_batch_size=4), JsonGrammar(), 0
    for seed in range(12):
        result = _decode(engine, seed)
        assert grammar.run(grammar.start, result.text) is not None, result.text
        if result.finish_reason == FinishReason.STOP:  # the object closed: the engine ends the answer there
            assert grammar.run(grammar.start, result.text) == DONE and isinstance(json.loads(result.text), dict)
            finished += 1
        else:
            assert result.finish_reason == FinishReason.LENGTH
    assert finished  # some answers close their object within the budget


def test_a_json_answer_cut_and_resumed_is_the_answer_never_cut(json_engine):
    engine = json_engine()
    for seed in range(4):
        whole = _decode(engine, seed=seed, max_tokens=30)
        resumed = _decode(engine, seed=seed, max_tokens=30, resume_ids=whole.token_ids[: len(whole.token_ids) // 2])
        assert resumed.token_ids == whole.token_ids and resumed.text == whole.text
        if whole.finish_reason == FinishReason.STOP:  # a closed object is a whole answer: nothing resumes it
            with pytest.raises(ValueError, match="resume_ids"):
                _decode(engine, seed=seed, max_tokens=40, resume_ids=whole.token_ids)


def test_json_mode_on_the_api_answers_with_json_objects(json_engine):
    import asyncio

    from deployments.completion_service import ApiLimits, CompletionService
    from deployments.openai_schema import CompletionRequest
    from engine.async_engine import AsyncEngine

    served = AsyncEngine(json_engine(max_batch_size=4))
    try:
        service = CompletionService(served, ApiLimits(default_max_tokens=60))
        requests = [CompletionRequest(prompt=[[1, 10, 11]], temperature=1.0, seed=seed,
                                      response_format={"type": "json_object"}) for seed in range(6)]
        responses = asyncio.run(_all(service, requests))
        plain = asyncio.run(service.complete(CompletionRequest(prompt=[[1, 10, 11]], max_tokens=12)))
    finally:
        served.shutdown()
    closed = [json.loads(r.choices[0].text) for r in responses if r.choices[0].finish_reason == "stop"]
    assert closed and all(isinstance(c, dict) for c in closed)
    assert all(JsonGrammar().run(JsonGrammar.start, r.choices[0].text) for r in responses)
    assert not JsonGrammar().accepts(plain.choices[0].text)  # unconstrained, the random model writes no JSON


async def _all(service, requests):
    return [await service.complete(r) for r in requests]
