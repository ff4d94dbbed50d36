"""The sampler's knobs beyond temperature and top_p: presence and frequency penalties (OpenAI's
semantics), and vLLM's top_k, min_p and repetition penalty."""
from __future__ import annotations

import torch

from engine.sampling import sample
from engine.types import SamplingParams


def logits_rows(n):
    row = torch.zeros(8)
    row[3], row[5] = 2.0, 1.0  # token 3 best by 1.0
    return torch.stack([row] * n)


def test_presence_penalty_counts_a_token_once_frequency_per_occurrence():
    params = [SamplingParams(presence_penalty=1.5), SamplingParams(presence_penalty=0.9),
              SamplingParams(frequency_penalty=0.6), SamplingParams(frequency_penalty=0.6), SamplingParams()]
    histories = [[3], [3, 3, 3], [3, 3], [3], [3, 3, 3]]
    chosen = sample(logits_rows(5), params, [None] * 5, None, histories)
    assert chosen == [5, 3, 5, 3, 3]


def test_penalties_leave_the_callers_logits_alone_and_apply_only_to_the_answer_so_far():
    logits = logits_rows(1)
    assert sample(logits, [SamplingParams(presence_penalty=2.0)], [None], None, [[]]) == [3]
    assert sample(logits, [SamplingParams(presence_penalty=2.0)], [None], None, [[3]]) == [5]
    assert logits[0, 3] == 2.0


def _draws(logits: torch.Tensor, params: SamplingParams, times: int = 200) -> set[int]:
    generator = torch.Generator().manual_seed(0)
    return {sample(logits, [params], [generator])[0] for _ in range(times)}


def test_top_k_samples_only_among_the_k_most_likely():
    logits = torch.tensor([[0.0, 1.0, 0.5, 2.0, 1.5, -1.0, 0.2, 0.9]])
    assert _draws(logits, SamplingParams(temperature=2.0)) == set(range(8))  # without it, every token comes up
    assert _draws(logits, SamplingParams(temperature=2.0, top_k=3)) == {1, 3, 4}
    assert _draws(logits, SamplingParams(temperature=2.0, top_k=1)) == {3}


def test_min_p_drops_tokens_less_likely_than_its_share_of_the_best():
    logits = torch.tensor([[0.0, 1.0, 0.5, 2.0, 1.5, -1.0, 0.2, 0.9]])
    probs = torch.softmax(logits[0], dim=-1)
    kept = {int(t) for t in torch.nonzero(probs >= 0.3 * probs.max())}
    assert kept == {1, 3, 4, 7}
    assert _draws(logits, SamplingParams(temperature=1.0, min_p=0.3)) == kept


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    row = torch.tensor([[-1.0, -0.5, 0.0, 2.0, 1.6, 0.0, 0.0, 0.0]])
    # token 3 (2.0) seen in the prompt: 2.0 / 1.5 = 1.33 < 1.6, so greedy takes 4
    assert sample(row, [SamplingParams(repetition_penalty=1.5)], [None], None, [[]], [[3]]) == [4]
    assert sample(row, [SamplingParams(repetition_penalty=1.2)], [None], None, [[]], [[3]]) == [3]  # 1.67 > 1.6
    assert sample(row, [SamplingParams(repetition_penalty=1.5)], [None], None, [[3, 4]], [[]]) == [3]  # 1.33 > 1.07
    negative = torch.tensor([[-1.0, -0.9, -5.0, -5.0, -5.0, -5.0, -5.0, -5.0]])
    assert sample(negative, [SamplingParams(repetition_penalty=2.0)], [None], None, [[]], [[1]]) == [0]  # -1.8 < -1
    assert row[0, 3] == 2.0  # the caller's logits are left alone


def test_logit_bias_adds_to_a_tokens_logit_greedy_or_sampled():
    logits = logits_rows(1)  # token 3 best, then 5
    assert sample(logits, [SamplingParams(logit_bias={3: -100.0})], [None]) == [5]
    assert sample(logits, [SamplingParams(logit_bias={6: 100.0})], [None]) == [6]
    assert sample(logits, [SamplingParams(logit_bias={3: -0.5})], [None]) == [3]  # 1.5 still beats 1.0
    assert _draws(logits, SamplingParams(temperature=1.0, logit_bias={i: -100.0 for i in range(8) if i != 4})) == {4}
    assert logits[0, 3] == 2.0  # the caller's logits are left alone
