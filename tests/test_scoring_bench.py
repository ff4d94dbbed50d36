"""`python -m bench scoring`: its questions, and its two sides run through the completion service on the
tiny engine."""
from __future__ import annotations

import asyncio

import pytest

from bench.scoring_bench import ENDING_WORDS, SIDES, _side_by_side, questions
from deployments.completion_service import ApiLimits, CompletionService
from engine.async_engine import AsyncEngine


def test_each_question_has_its_true_ending_first_and_three_others():
    items = questions(5)
    assert len(items) == 5
    for context, endings in items:
        assert len(endings) == 4 and len(set(endings)) == 4
        assert all(e.startswith(" ") and len(e.split()) == ENDING_WORDS for e in endings)
        assert len(context.split()) <= 300


def test_both_sides_score_alike_and_the_reusing_side_computes_less(make_engine, tiny_tokenizer):
    words = [tiny_tokenizer.decode([i]) for i in range(6, 250)]
    items = [(" ".join(words[q * 3 : q * 3 + 50]), [" " + " ".join(words[200 + q + k * 8 : 200 + q + k * 8 + 4])
                                                       for k in range(4)]) for q in range(3)]
    engine = AsyncEngine(make_engine(max_batch_size=4))
    try:
        sides = asyncio.run(_side_by_side(CompletionService(engine, ApiLimits()), items))
    finally:
        engine.shutdown()
    assert sides["reuse"]["picked"] == sides["recompute"]["picked"]
    for mine, theirs in zip(sides["reuse"]["scores"], sides["recompute"]["scores"]):
        assert mine == pytest.approx(theirs, abs=1e-3)
    reuse, recompute = (sum(sides[side]["prefill_tokens"]) for side in SIDES)
    assert recompute == 3 * 4 * (50 + 4)  # a raw completion prompt gets no BOS: 54 tokens each
    assert reuse == 3 * (54 + 3 * 5)  # the first whole, the others their ending and the last shared token
