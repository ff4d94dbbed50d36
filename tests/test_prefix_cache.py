"""PrefixCache: longest-prefix lookup, a byte-bounded LRU, hit/miss accounting; and how the engine
uses it through prefill_prefix."""
from __future__ import annotations

import pytest
import torch

from engine.prefix_cache import PrefixCache, PrefixEntry
from engine.types import GenerationRequest, SamplingParams


def entry(*token_ids: int, floats: int = 10) -> PrefixEntry:
    """An entry of exactly 8 * floats + 20 bytes (two float32 KV tensors and 5 float32 logits)."""
    kv = (torch.zeros(floats), torch.zeros(floats))
    return PrefixEntry(tuple(token_ids), kv, torch.zeros(5))


ENTRY_BYTES = 100  # entry() with the default size


def test_entry_size_counts_kv_and_logits():
    assert entry(1).nbytes == ENTRY_BYTES
    assert entry(1, floats=20).nbytes == 180


def test_longest_matching_prefix_wins():
    cache = PrefixCache(10_000)
    for key in [(1, 2), (1, 2, 3), (1, 2, 3, 4, 5), (9,), (1, 7)]:
        assert cache.put(entry(*key))
    assert cache.longest_match([1, 2, 3, 4, 7]).token_ids == (1, 2, 3)
    assert cache.longest_match([1, 2, 3, 4, 5, 6]).token_ids == (1, 2, 3, 4, 5)
    assert cache.longest_match([1, 2, 3, 4, 5]).token_ids == (1, 2, 3, 4, 5)  # the whole prompt
    assert cache.longest_match([1, 2, 3, 4]).token_ids == (1, 2, 3)  # a key longer than the prompt never matches
    assert cache.longest_match([1, 2]).token_ids == (1, 2)
    assert cache.longest_match([9, 1, 2]).token_ids == (9,)
    assert cache.longest_match([2, 1, 2, 3]) is None
    assert cache.longest_match([1]) is None


def test_hit_and_miss_counters():
    cache = PrefixCache(10_000)
    cache.put(entry(1, 2, 3))
    cache.longest_match([1, 2, 3, 4])
    cache.longest_match([1, 2, 3])
    cache.longest_match([5, 6])
    cache.longest_match([1, 2, 3, 9], count=False)  # a peek: not counted
    assert (cache.hits, cache.misses, cache.hit_tokens) == (2, 1, 6)
    cache.count(None)
    cache.count(cache.get((1, 2, 3)))
    assert (cache.hits, cache.misses, cache.hit_tokens) == (3, 2, 9)


def test_eviction_by_bytes_goes_in_lru_order():
    cache = PrefixCache(2 * ENTRY_BYTES + 50)  # room for two entries
    cache.put(entry(1))
    cache.put(entry(2))
    assert cache.get((1,)) is not None  # (1,) is now the most recently used
    cache.put(entry(3))
    assert cache.get((2,)) is None and cache.get((1,)) is not None and cache.get((3,)) is not None
    assert len(cache) == 2 and cache.bytes == 2 * ENTRY_BYTES
    cache.put(entry(4, floats=20))  # 180 bytes: both others must go to fit it
    assert len(cache) == 1 and cache.bytes == 180 and cache.get((4,)) is not None


def test_counted_hit_refreshes_recency_but_a_peek_does_not():
    cache = PrefixCache(2 * ENTRY_BYTES)
    cache.put(entry(1))
    cache.put(entry(2))
    cache.longest_match([1, 5], count=False)
    cache.put(entry(3))
    assert cache.get((1,)) is None  # the peek left (1,) least recently used
    cache.longest_match([2, 5])  # counted: (2,) becomes most recent
    cache.put(entry(4))
    assert cache.get((3,)) is None and cache.get((2,)) is not None


def test_entry_larger_than_the_bound_is_refused_without_evicting():
    cache = PrefixCache(ENTRY_BYTES + 10)
    assert cache.put(entry(1))
    assert cache.put(entry(2, floats=20)) is False
    assert cache.get((2,)) is None and cache.get((1,)) is not None
    assert cache.bytes == ENTRY_BYTES and len(cache) == 1
    assert PrefixCache(0).put(entry(1)) is False


def test_replacing_a_key_does_not_double_count_bytes():
    cache = PrefixCache(10_000)
    cache.put(entry(1, 2))
    cache.put(entry(1, 2, floats=20))
    assert len(cache) == 1 and cache.bytes == 180


# ---- through the engine -------------------------------------------------------------------------
def test_prefill_prefix_extends_a_shorter_cached_prefix(make_engine, decode_alone):
    prompt = [7, 50, 51, 52, 60, 61, 62, 63, 64, 70, 71]
    engine = make_engine()
    first = engine.prefill_prefix(prompt[:4])
    longer = engine.prefill_prefix(prompt[:9])  # built on top of the 4-token entry
    assert (first.length, longer.length) == (4, 9)
    assert engine.stats()["prefix_entries"] == 2
    assert engine.stats()["prefill_tokens"] == 9  # the 4 cached tokens were not recomputed
    [result] = engine.generate([GenerationRequest(prompt_ids=prompt, params=SamplingParams(max_tokens=12))])
    assert result.prefix_hit_tokens == 9
    assert result.token_ids == decode_alone(prompt, max_tokens=12).token_ids
    assert engine.stats()["prefix_hit_tokens"] == 9


def test_zero_byte_cache_disables_prefix_reuse(make_engine, decode_alone):
    prompt = [9, 20, 21, 22, 23, 24, 25]
    engine = make_engine(prefix_cache_bytes=0)
    engine.prefill_prefix(prompt[:5])
    [result] = engine.generate([GenerationRequest(prompt_ids=prompt, params=SamplingParams(max_tokens=6))])
    assert result.prefix_hit_tokens == 0
    assert result.token_ids == decode_alone(prompt, max_tokens=6).token_ids
    assert engine.stats()["prefix_entries"] == 0 and engine.stats()["prefix_misses"] == 1


def test_shared_prefix_len_caches_the_prefix_and_later_prompts_reuse_it(make_engine, decode_alone):
    from engine.types import GenerationRequest, SamplingParams

    prefix = [7 + (i * 13) % 240 for i in range(40)]
    first, second = prefix + [11, 12, 13], prefix + [21, 22]
    engine = make_engine()
    params = SamplingParams(max_tokens=6)
    out = engine.generate([GenerationRequest(id="a", prompt_ids=first, params=params, shared_prefix_len=len(prefix))])
    assert engine.export_prefix(prefix) is not None
    [again] = engine.generate([GenerationRequest(id="b", prompt_ids=second, params=params)])
    assert again.prefix_hit_tokens == len(prefix)
    assert out[0].token_ids == decode_alone(first, max_tokens=6).token_ids
    assert again.token_ids == decode_alone(second, max_tokens=6).token_ids


@pytest.mark.parametrize("whole_prompt", [False, True])
def test_a_shared_prefix_is_cached_as_its_prompt_is_prefilled_not_in_a_step_of_its_own(make_engine, whole_prompt):
    """The prefix's KV is taken from the request's own prefill: no token is computed twice, and the
    entry (KV and the logits after it) equals one computed on its own by prefill_prefix."""
    from engine.types import GenerationRequest, SamplingParams

    prefix = [5 + (i * 11) % 230 for i in range(24)]
    prompt = prefix if whole_prompt else prefix + [31, 32, 33]
    engine, reference = make_engine(), make_engine()
    calls, prefill = [], engine.runner.prefill
    engine.runner.prefill = lambda items: calls.append(len(items)) or prefill(items)
    engine.generate([GenerationRequest(prompt_ids=prompt, params=SamplingParams(max_tokens=3),
                                       shared_prefix_len=len(prefix))])
    assert calls == [1] and engine.stats()["prefill_tokens"] == len(prompt)
    reference.prefill_prefix(prefix)
    got, want = engine.export_prefix(prefix), reference.export_prefix(prefix)
    assert got is not None and got.token_ids == want.token_ids
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got.kv, want.kv))
    assert torch.allclose(got.last_logits, want.last_logits, atol=1e-4)


def test_a_prefix_exported_from_one_engine_serves_another(make_engine, decode_alone):
    from engine.types import GenerationRequest, SamplingParams

    prefix = [9 + (i * 7) % 230 for i in range(30)]
    source, target = make_engine(), make_engine()
    source.prefill_prefix(prefix)
    target.import_prefix(source.export_prefix(prefix))
    prompt = prefix + [40, 41, 42]
    [result] = target.generate([GenerationRequest(id="x", prompt_ids=prompt, params=SamplingParams(max_tokens=5))])
    assert result.prefix_hit_tokens == len(prefix)
    assert result.token_ids == decode_alone(prompt, max_tokens=5).token_ids
    assert target.stats()["prefill_tokens"] == 3  # only the prompt's own tail was computed


def test_requests_sharing_a_new_prefix_compute_it_once_even_when_they_arrive_together(make_engine, decode_alone):
    from engine.types import GenerationRequest, SamplingParams

    prefix = [9 + (i * 5) % 230 for i in range(32)]
    prompts = [prefix + [40 + i, 41] for i in range(3)]
    engine = make_engine(max_batch_size=4)
    results = engine.generate([GenerationRequest(prompt_ids=p, params=SamplingParams(max_tokens=4),
                                                 shared_prefix_len=len(prefix)) for p in prompts])
    assert engine.stats()["prefill_tokens"] == len(prefix) + 3 * 2  # the prefix once, then each tail
    assert [r.prefix_hit_tokens for r in results] == [0, len(prefix), len(prefix)]
    assert [r.token_ids for r in results] == [decode_alone(p, max_tokens=4).token_ids for p in prompts]


def test_an_entry_without_logits_serves_only_prompts_that_go_on_past_it():
    cache = PrefixCache(10_000)
    kept = PrefixEntry((1, 2, 3), (torch.zeros(10), torch.zeros(10)), None)
    assert kept.nbytes == 80 and kept.to("cpu").last_logits is None
    cache.put(entry(1, 2))
    cache.put(kept)
    assert cache.longest_match([1, 2, 3, 4]).token_ids == (1, 2, 3)
    assert cache.longest_match([1, 2, 3]).token_ids == (1, 2)  # no logits to sample the first token from


@pytest.mark.parametrize("stops", [True, False])
def test_a_kept_answer_serves_the_prompt_that_continues_its_conversation(make_engine, decode_alone, stops):
    prompt = [9 + (i * 7) % 230 for i in range(20)]
    engine = make_engine()
    own_stop = engine.stop_token_ids
    if stops:  # the tiny model never writes its end token: make the one it writes fourth end the answer
        engine.stop_token_ids = {decode_alone(prompt, max_tokens=4).token_ids[3]}
    [first] = engine.generate([GenerationRequest(prompt_ids=prompt, params=SamplingParams(max_tokens=12), keep_kv=True)])
    assert first.finish_reason.value == ("stop" if stops else "length")
    sequence = prompt + first.token_ids
    # an answer that ends by itself has KV for all its tokens; one cut at its limit not for the last
    assert first.kept_kv_tokens == len(sequence) - (0 if stops else 1)
    follow_up = sequence + [50, 51, 52]
    engine.stop_token_ids = own_stop
    before = engine.stats()["prefill_tokens"]
    [second] = engine.generate([GenerationRequest(prompt_ids=follow_up, params=SamplingParams(max_tokens=5))])
    assert second.prefix_hit_tokens == first.kept_kv_tokens
    assert engine.stats()["prefill_tokens"] - before == len(follow_up) - first.kept_kv_tokens
    assert second.token_ids == decode_alone(follow_up, max_tokens=5).token_ids


def test_an_answer_is_kept_only_when_asked(make_engine):
    prompt = [9 + (i * 3) % 230 for i in range(12)]
    engine = make_engine(cache_answers=False)
    [result] = engine.generate([GenerationRequest(prompt_ids=prompt, params=SamplingParams(max_tokens=4))])
    assert result.kept_kv_tokens == 0 and engine.stats()["prefix_entries"] == 0


def test_a_preamble_is_kept_as_its_prompt_is_prefilled_and_serves_prompts_of_other_requests(make_engine, decode_alone):
    """Node prompts of different questions share only their preamble: the first request's prefill
    leaves its KV cached beside the request's own shared prefix, the next request starts after it,
    and the answers are those of prompts decoded alone."""
    from engine.types import GenerationRequest, SamplingParams

    preamble = [6 + (i * 17) % 230 for i in range(36)]
    first, second = preamble + [11, 12, 13, 14], preamble + [21, 22, 23]
    engine = make_engine()
    params = SamplingParams(max_tokens=5)
    [one] = engine.generate([GenerationRequest(prompt_ids=first, params=params, preamble_len=len(preamble),
                                               shared_prefix_len=len(first) - 1)])
    entry = engine.export_prefix(preamble)
    assert entry is not None and entry.last_logits is None
    assert engine.export_prefix(first[:-1]) is not None  # the request's own shared prefix as well
    [two] = engine.generate([GenerationRequest(prompt_ids=second, params=params, preamble_len=len(preamble))])
    assert one.prefix_hit_tokens == 0 and two.prefix_hit_tokens == len(preamble)
    assert engine.stats()["prefill_tokens"] == len(first) + 3
    assert one.token_ids == decode_alone(first, max_tokens=5).token_ids
    assert two.token_ids == decode_alone(second, max_tokens=5).token_ids


def test_a_preamble_longer_than_the_prompt_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="preamble_len"):
        GenerationRequest(prompt_ids=[1, 2, 3], preamble_len=4)


def test_prompts_admitted_while_others_decode_prefill_in_their_pass_with_the_same_answers(make_engine):
    """With `mixed_batches`, a request admitted while others decode is prefilled in their decode pass,
    not in a pass of its own: caching a shared prefix and a preamble on the way, or starting from a
    cached whole prompt. Every answer, prefix hit and cache entry is the same as with the two passes."""
    preamble = [5 + (i * 3) % 200 for i in range(6)]
    prefix = preamble + [60 + (i * 7) % 150 for i in range(18)]
    requests = [  # (step to add it at, request)
        (0, GenerationRequest(id="long", prompt_ids=[9, 8, 7, 6, 5], params=SamplingParams(max_tokens=30))),
        (2, GenerationRequest(id="node1", prompt_ids=prefix + [11, 12], params=SamplingParams(max_tokens=8),
                              shared_prefix_len=len(prefix), preamble_len=len(preamble))),
        (2, GenerationRequest(id="other", prompt_ids=preamble + [40, 41, 42], preamble_len=len(preamble),
                              params=SamplingParams(max_tokens=6, temperature=0.9, seed=3))),
        (5, GenerationRequest(id="node2", prompt_ids=prefix + [21, 22, 23], params=SamplingParams(max_tokens=8),
                              shared_prefix_len=len(prefix))),
        (7, GenerationRequest(id="again", prompt_ids=list(prefix), params=SamplingParams(max_tokens=5))),
        (9, GenerationRequest(id="after_preamble", prompt_ids=preamble + [70, 71], params=SamplingParams(max_tokens=4))),
    ]

    def run(mixed: bool):
        engine = make_engine(max_batch_size=4, mixed_batches=mixed, cache_answers=False)  # the entries asked for only
        prefills, prefill = [], engine.runner.prefill
        engine.runner.prefill = lambda items: prefills.append(len(items)) or prefill(items)
        step = 0
        while step <= max(at for at, _ in requests) or engine.has_work():
            for at, request in requests:
                if at == step:
                    engine.add(request.model_copy())
            engine.step()
            step += 1
        results = {r.id: engine.pop_result(r.id) for _, r in requests}
        return engine, prefills, results

    mixed, mixed_prefills, got = run(True)
    apart, apart_prefills, want = run(False)
    for rid in want:
        assert got[rid].token_ids == want[rid].token_ids, rid
        assert got[rid].prefix_hit_tokens == want[rid].prefix_hit_tokens, rid
    assert got["node2"].prefix_hit_tokens == got["again"].prefix_hit_tokens == len(prefix)
    assert got["after_preamble"].prefix_hit_tokens == len(preamble)
    assert mixed_prefills == [1]  # only "long", which nothing ran beside
    assert apart_prefills == [1, 2, 1, 1]  # "again" needs none: its whole prompt is cached
    assert mixed.stats()["mixed_steps"] == 3 and apart.stats()["mixed_steps"] == 0
    assert mixed.stats()["prefill_tokens"] == apart.stats()["prefill_tokens"]
    assert mixed.stats()["prefix_entries"] == apart.stats()["prefix_entries"] == 2
    for key in (tuple(preamble), tuple(prefix)):
        a, b = mixed.prefix_cache.get(key), apart.prefix_cache.get(key)
        assert all(torch.equal(x, y) for x, y in zip(a.kv, b.kv))
        assert (a.last_logits is None) == (b.last_logits is None)
