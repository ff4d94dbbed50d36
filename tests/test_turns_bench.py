"""`python -m bench turns`: its conversations, and both sides on the tiny engine through the service."""
from __future__ import annotations

import asyncio

from bench.turns_bench import MAX_MESSAGE_CHARS, _side_by_side, conversations
from deployments.completion_service import ApiLimits, CompletionService
from engine.async_engine import AsyncEngine


def test_conversations_are_short_distinct_prompts():
    talks = conversations(3, 4)
    assert [len(t) for t in talks] == [4, 4, 4]
    messages = [m for t in talks for m in t]
    assert len(set(messages)) == 12 and all(len(m) <= MAX_MESSAGE_CHARS for m in messages)


def test_the_cached_side_prefills_each_turns_new_part_only_and_answers_the_same(make_engine):
    engine = AsyncEngine(make_engine(max_batch_size=2, max_model_len=512))
    talks = [["baba babe", "babi bobo", "bada bade"], ["dada dade", "dadi dado", "bobo baba"]]
    try:
        sides = asyncio.run(_side_by_side(CompletionService(engine, ApiLimits()), talks, max_tokens=5))
    finally:
        engine.shutdown()
    assert sides["cached"]["answers"] == sides["whole"]["answers"]
    for cached, whole in zip(sides["cached"]["prefill_tokens"], sides["whole"]["prefill_tokens"]):
        assert cached[0] == whole[0]  # the cache is emptied before each conversation
        assert all(c < w for c, w in zip(cached[1:], whole[1:]))
        assert whole == sorted(whole)  # the whole conversation, longer each turn
