"""Automatic prefix caching (`EngineConfig.cache_answers`): every finished answer's prompt-and-answer KV
stays as a spare entry, so a conversation's next turn and an answer cut to be continued prefill only
what is new; any prompt starts from the longest start it shares with an entry; spare entries go first
when the cache is full."""
from __future__ import annotations

import torch

from engine.prefix_cache import PrefixCache, PrefixEntry
from engine.types import FinishReason, GenerationRequest, SamplingParams

PROMPT = [1] + [9 + (i * 7) % 230 for i in range(24)]


def _plain(prompt: list[int], max_tokens: int = 6, **fields) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prompt, params=SamplingParams(max_tokens=max_tokens), **fields)


def _generate(engine, request: GenerationRequest):
    before = engine.stats()["prefill_tokens"]
    [result] = engine.generate([request])
    return result, engine.stats()["prefill_tokens"] - before


def test_the_next_turn_of_a_conversation_prefills_only_what_is_new(make_engine, decode_alone):
    engine = make_engine()
    first, _ = _generate(engine, _plain(PROMPT))
    assert first.kept_kv_tokens == 0  # kept as a spare, not as asked (`keep_kv`)
    turn = PROMPT + first.token_ids + [2, 1, 3, 40, 41]
    second, computed = _generate(engine, _plain(turn))
    cached = len(PROMPT) + len(first.token_ids) - 1  # the last answer token was sampled, never fed back
    assert second.prefix_hit_tokens == cached and computed == len(turn) - cached
    assert second.token_ids == decode_alone(turn, max_tokens=6).token_ids


def test_a_prompt_starts_from_what_it_shares_with_a_cached_one(make_engine, decode_alone):
    engine = make_engine()
    _generate(engine, _plain(PROMPT))
    other = PROMPT[:20] + [200, 201, 202]
    result, computed = _generate(engine, _plain(other))
    assert result.prefix_hit_tokens == 20 and computed == 3
    assert result.token_ids == decode_alone(other, max_tokens=6).token_ids
    inside = PROMPT[:15]  # wholly inside the cached entry: its last token is computed again for its row
    result, computed = _generate(engine, _plain(inside))
    assert result.prefix_hit_tokens == 14 and computed == 1
    assert result.token_ids == decode_alone(inside, max_tokens=6).token_ids


def test_an_answer_cut_at_its_cap_continues_from_its_kv(make_engine, decode_alone):
    engine = make_engine()
    cut, _ = _generate(engine, GenerationRequest(prompt_ids=PROMPT, params=SamplingParams(max_tokens=10, length_cap=4)))
    assert cut.finish_reason == FinishReason.CUT and len(cut.token_ids) == 4
    resumed, computed = _generate(engine, GenerationRequest(prompt_ids=PROMPT, resume_ids=cut.token_ids,
                                                            params=SamplingParams(max_tokens=10)))
    assert resumed.prefix_hit_tokens == len(PROMPT) + 3 and computed == 1
    assert resumed.token_ids == decode_alone(PROMPT, max_tokens=10).token_ids


def test_off_nothing_is_kept_and_only_whole_entries_serve(make_engine):
    engine = make_engine(cache_answers=False)
    _generate(engine, _plain(PROMPT))
    assert engine.stats()["prefix_entries"] == 0
    engine.prefill_prefix(PROMPT[:10])
    result, computed = _generate(engine, _plain(PROMPT[:8] + [200, 201]))
    assert result.prefix_hit_tokens == 0 and computed == 10  # it shares 8 of the 10: no use without partial starts


def test_an_aborted_answer_is_not_kept(make_engine):
    engine = make_engine()
    engine.add(_plain(PROMPT, max_tokens=20, id="gone"))
    engine.step()
    engine.abort("gone")
    assert engine.stats()["prefix_entries"] == 0


def _entry(*tokens, spare=False, logits=True) -> PrefixEntry:
    kv = (torch.zeros(1, 1, len(tokens), 2), torch.zeros(1, 1, len(tokens), 2))
    return PrefixEntry(tuple(tokens), kv, torch.zeros(4) if logits else None, spare=spare)


def test_the_best_start_is_the_longest_shared_never_the_last_token_without_its_logits():
    cache = PrefixCache(10**9)
    cache.put(_entry(1, 2, 3, 4, 5, logits=False))
    cache.put(_entry(1, 2, 3))
    assert cache.best_start([1, 2, 3, 4, 9]) == (cache.get((1, 2, 3, 4, 5)), 4)
    assert cache.best_start([1, 2, 3]) == (cache.get((1, 2, 3)), 3)  # exactly an entry with its logits
    assert cache.best_start([1, 2, 3, 4, 5]) == (cache.get((1, 2, 3, 4, 5)), 4)  # no logits: its last is computed
    assert cache.best_start([1, 2, 7])[1] == 2 and cache.best_start([1, 2, 3, 4])[1] == 3
    assert cache.best_start([8, 1]) is None


def test_spare_entries_are_evicted_before_the_prefixes_callers_asked_for():
    one = _entry(1, 2).nbytes
    cache = PrefixCache(3 * one)
    cache.put(_entry(1, 2))  # asked for, and the oldest
    cache.put(_entry(3, 4, spare=True))
    cache.put(_entry(5, 6, spare=True))
    cache.put(_entry(7, 8))
    assert cache.get((1, 2)) is not None and cache.get((3, 4)) is None and cache.get((5, 6)) is not None
    cache.put(_entry(9, 9))
    cache.put(_entry(10, 10))  # no spare left: the least recently used of the rest
    assert len(cache) == 3 and cache.get((7, 8)) is None
