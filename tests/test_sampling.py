"""Presence and frequency penalties (OpenAI's semantics) in the sampler."""
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
