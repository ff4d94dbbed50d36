"""Items' attention in padded groups (engine.item_attention, the runner's path off the CPU): the same
logits and KV as item by item, and the same answers through an engine."""
from __future__ import annotations

import random

import torch

from engine.item_attention import ItemAttention
from engine.llama import LlamaRunner, PrefillItem, row_ranges
from engine.types import GenerationRequest, SamplingParams


def _runners(model, batched_too=True):
    plain = LlamaRunner(model, max_slots=6, max_len=128)
    batched = LlamaRunner(model, max_slots=6, max_len=128)
    batched.batched_item_attention = True
    return plain, batched


def _ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(6, 256) for _ in range(n)]


def test_items_are_grouped_by_length_and_keep_their_rows():
    items = [PrefillItem(0, _ids(30, 1), 0), PrefillItem(1, _ids(2, 2), 5), PrefillItem(2, _ids(12, 3), 0),
             PrefillItem(3, _ids(3, 4), 40)]
    plan = ItemAttention(items, row_ranges(items, 4), torch.device("cpu"))
    assert [g.items for g in plan.groups] == [2, 1, 1]  # 2 and 3 tokens; 12; 30
    assert [(g.longest, g.span) for g in plan.groups] == [(3, 43), (12, 12), (30, 30)]
    assert plan.first_row == 4 and plan.token_rows.tolist() == list(range(4, 4 + 47))
    assert plan.token_positions.tolist()[30:32] == [5, 6] and plan.token_slots.tolist()[30:32] == [1, 1]


def test_prefill_gives_the_per_item_logits_and_kv(tiny_model):
    plain, batched = _runners(tiny_model)
    first = [PrefillItem(0, _ids(20, 1), 0), PrefillItem(1, _ids(9, 2), 0, prefix_end=4)]
    later = [PrefillItem(0, _ids(3, 3), 20), PrefillItem(1, _ids(30, 4), 9), PrefillItem(2, _ids(1, 5), 0),
             PrefillItem(3, _ids(50, 6), 0, prefix_end=17)]
    for items in (first, later):  # the second pass's items go on from the first's KV, or start afresh
        torch.testing.assert_close(batched.prefill(items), plain.prefill(items), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched.k_cache[:, :4, :, :50], plain.k_cache[:, :4, :, :50], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched.v_cache[:, :4, :, :50], plain.v_cache[:, :4, :, :50], rtol=1e-5, atol=1e-5)


def test_decode_with_extra_tokens_and_prompts_gives_the_per_item_logits(tiny_model):
    plain, batched = _runners(tiny_model)
    for runner in (plain, batched):
        runner.prefill([PrefillItem(0, _ids(10, 1), 0), PrefillItem(1, _ids(25, 2), 0)])
    tokens, positions = torch.tensor([7, 8]), torch.tensor([10, 25])
    extend = [PrefillItem(0, [9, 10, 11], 11, logit_rows=3),  # drafted tokens after slot 0's decode token
              PrefillItem(3, _ids(40, 3), 0, prefix_end=12)]  # a prompt prefilled beside the decodes
    want = plain.decode(tokens, positions, extend)
    got = batched.decode(tokens, positions, extend)
    assert got.shape == want.shape == (2 + 3 + 1 + 1, want.shape[1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _answers(engine, prompts):
    for i, prompt in enumerate(prompts):
        engine.add(GenerationRequest(id=f"r{i}", prompt_ids=prompt, params=SamplingParams(max_tokens=30 + 7 * i)))
    while engine.has_work():
        engine.step()
    return [engine.pop_result(f"r{i}").token_ids for i in range(len(prompts))]


def test_the_engine_answers_the_same_with_grouped_attention(make_engine):
    phrase = _ids(6, 9)
    prompts = [_ids(5, 1), _ids(60, 2), [1, 2, 3] + phrase * 4, _ids(17, 4), _ids(33, 5), _ids(2, 6)]
    config = {"max_batch_size": 3, "speculative_tokens": 4, "speculative_min_ngram": 1}
    want = _answers(make_engine(**config), prompts)
    engine = make_engine(**config)
    engine.runner.batched_item_attention = True
    assert _answers(engine, prompts) == want
    stats = engine.stats()
    assert stats["mixed_steps"] > 0 and stats["accepted_draft_tokens"] > 0  # both kinds of item went through it
