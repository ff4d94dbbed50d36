"""Scored prompts (`echo` with `logprobs`) reuse each other's KV and scores: the answers to one
multiple-choice question, as lm-evaluation-harness sends them, share the question, and each one after
the first computes only its own part (`EngineConfig.reuse_scored_prompts`)."""
from __future__ import annotations

import pytest
import torch

from engine.prefix_cache import PrefixCache, PrefixEntry, common_length
from engine.types import GenerationRequest, SamplingParams
from test_logprobs import _check_prompt_scores

QUESTION = [1] + [3 + (i * 37) % 250 for i in range(60)]  # 61 tokens: past the wait threshold (32)
ANSWERS = [[200, 201, 202], [210, 211], [220, 221, 222, 223], [230]]


def _scored(request_id: str, prompt: list[int], top: int = 1, max_tokens: int = 2, **fields) -> GenerationRequest:
    return GenerationRequest(id=request_id, prompt_ids=prompt, params=SamplingParams(
        max_tokens=max_tokens, prompt_logprobs=top), **fields)


def _prefill_tokens(engine, requests: list[GenerationRequest]):
    before = engine.stats()["prefill_tokens"]
    results = engine.generate(requests)
    return results, engine.stats()["prefill_tokens"] - before


def test_a_later_scored_prompt_takes_the_shared_start_and_computes_only_the_rest(make_engine, tiny_model,
                                                                                  decode_alone):
    engine = make_engine(max_batch_size=4)
    first, second = QUESTION + ANSWERS[0], QUESTION + ANSWERS[1]
    _, computed_first = _prefill_tokens(engine, [_scored("first", first)])
    [result], computed = _prefill_tokens(engine, [_scored("second", second)])
    # all they share but the last shared token, whose row scores the first token that differs
    assert result.prefix_hit_tokens == len(QUESTION) - 1
    assert computed_first == len(first) and computed == len(second) - len(QUESTION) + 1
    _check_prompt_scores(result.prompt_logprobs, tiny_model, second, 1)
    assert result.token_ids == decode_alone(second, max_tokens=2).token_ids


@pytest.mark.parametrize("mixed_batches", [True, False])
def test_answers_admitted_together_wait_a_step_for_the_first_ones_question(make_engine, tiny_model, decode_alone,
                                                                           mixed_batches):
    engine = make_engine(max_batch_size=5, mixed_batches=mixed_batches)
    engine.add(GenerationRequest(id="running", prompt_ids=[1, 5, 6], params=SamplingParams(max_tokens=12)))
    engine.step()  # the choices prefill while it decodes
    prompts = [QUESTION + answer for answer in ANSWERS]
    results, computed = _prefill_tokens(engine, [_scored(f"choice{i}", p) for i, p in enumerate(prompts)])
    assert [r.prefix_hit_tokens for r in results] == [0] + [len(QUESTION) - 1] * 3
    assert computed == len(prompts[0]) + sum(len(p) - len(QUESTION) + 1 for p in prompts[1:])
    assert engine.pop_result("running").token_ids == decode_alone([1, 5, 6], max_tokens=12).token_ids
    for result, prompt in zip(results, prompts):
        _check_prompt_scores(result.prompt_logprobs, tiny_model, prompt, 1)
        assert result.token_ids == decode_alone(prompt, max_tokens=2).token_ids


def test_a_short_shared_start_does_not_hold_a_prompt_back(make_engine):
    engine = make_engine(max_batch_size=4)
    short = QUESTION[:10]
    engine.add(_scored("a", short + [200] * 30))
    engine.add(_scored("b", short + [210] * 30))
    engine.step()
    assert engine.stats()["prefill_tokens"] == 80  # both in the first step, each whole


def test_scores_with_fewer_alternatives_do_not_serve_a_prompt_asking_more(make_engine, tiny_model):
    engine = make_engine(max_batch_size=4)
    engine.generate([_scored("few", QUESTION + ANSWERS[0], top=1)])
    [more] = engine.generate([_scored("more", QUESTION + ANSWERS[1], top=3)])
    assert more.prefix_hit_tokens == 0
    _check_prompt_scores(more.prompt_logprobs, tiny_model, QUESTION + ANSWERS[1], 3)
    [fewer] = engine.generate([_scored("fewer", QUESTION + ANSWERS[2], top=2)])  # cut from the entry's three
    assert fewer.prefix_hit_tokens == len(QUESTION) - 1
    _check_prompt_scores(fewer.prompt_logprobs, tiny_model, QUESTION + ANSWERS[2], 2)


def test_off_each_scored_prompt_is_computed_whole(make_engine, tiny_model):
    engine = make_engine(max_batch_size=4, reuse_scored_prompts=False)
    prompts = [QUESTION + answer for answer in ANSWERS]
    results, computed = _prefill_tokens(engine, [_scored(f"choice{i}", p) for i, p in enumerate(prompts)])
    assert [r.prefix_hit_tokens for r in results] == [0] * 4 and computed == sum(map(len, prompts))
    assert engine.stats()["prefix_entries"] == 0
    for result, prompt in zip(results, prompts):
        _check_prompt_scores(result.prompt_logprobs, tiny_model, prompt, 1)


def test_a_plain_prompt_starts_from_a_scored_one(make_engine, decode_alone):
    engine = make_engine(max_batch_size=4)
    engine.generate([_scored("scored", QUESTION)])
    [plain] = engine.generate([GenerationRequest(prompt_ids=QUESTION + [7], params=SamplingParams(max_tokens=4))])
    assert plain.prefix_hit_tokens == len(QUESTION)
    assert plain.token_ids == decode_alone(QUESTION + [7], max_tokens=4).token_ids


def test_a_resumed_scored_prompt_neither_takes_nor_leaves_scores(make_engine, tiny_model, decode_alone):
    engine = make_engine(max_batch_size=4)
    engine.generate([_scored("first", QUESTION + ANSWERS[0])])
    [resumed] = engine.generate([_scored("resumed", QUESTION + ANSWERS[1], max_tokens=4, resume_ids=[9, 10])])
    assert resumed.prefix_hit_tokens == 0
    _check_prompt_scores(resumed.prompt_logprobs, tiny_model, QUESTION + ANSWERS[1], 1)
    assert engine.prefix_cache.longest_scored(QUESTION + ANSWERS[1], 1)[1] == len(QUESTION)  # only the first's


def test_the_cache_finds_the_scored_entry_sharing_the_longest_start():
    cache = PrefixCache(max_bytes=10**9)
    kv = (torch.zeros(1, 1, 6, 2), torch.zeros(1, 1, 6, 2))
    cache.put(PrefixEntry((1, 2, 3, 4, 5, 6), kv, torch.zeros(4), scores=[object()] * 5, scores_top=2))
    cache.put(PrefixEntry((1, 2, 3, 9, 9, 9), kv, torch.zeros(4), scores=[object()] * 5, scores_top=0))
    cache.put(PrefixEntry((1, 2, 3, 4, 5, 7), kv, torch.zeros(4)))  # not scored: never offered for scores
    entry, shared = cache.longest_scored([1, 2, 3, 4, 5, 7, 8], top=0)
    assert entry.token_ids == (1, 2, 3, 4, 5, 6) and shared == 5
    assert cache.longest_scored([1, 2, 3, 9, 9], top=1)[0].token_ids == (1, 2, 3, 4, 5, 6)  # top 0 cannot serve 1
    assert cache.longest_scored([1, 8], top=0) is None  # one shared token is no reuse
    assert cache.longest_scored([1, 2, 3, 4, 5, 6], top=3) is None


def test_common_length_counts_the_shared_start():
    assert common_length((1, 2, 3), (1, 2, 3)) == 3
    assert common_length((1, 2, 3), (1, 2)) == 2
    assert common_length((1, 2, 3, 4, 5), (1, 2, 9, 4, 5)) == 2
    assert common_length((), (1,)) == 0 and common_length((5,), (1,)) == 0


def test_stored_scores_count_against_the_memory_bound():
    kv = (torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    plain = PrefixEntry((1, 2, 3), kv, None)
    scored = PrefixEntry((1, 2, 3), kv, None, scores=[object()] * 2, scores_top=1)
    assert scored.nbytes > plain.nbytes


def test_common_length_takes_lists_and_tuples_alike():
    assert common_length([1, 2, 3], (1, 2, 4)) == 2 and common_length([1, 2], [1, 2, 3]) == 2
