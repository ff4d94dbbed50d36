"""`python -m bench priority`: one side of it on the tiny engine, every request answered and counted."""
from __future__ import annotations

import argparse
import asyncio

from bench.priority_bench import _side, in_process
from deployments.completion_service import ApiLimits, CompletionService
from engine.async_engine import AsyncEngine
from test_api import WORDS


def test_a_side_answers_the_job_and_every_chat_and_counts_their_tokens(make_engine):
    engine = AsyncEngine(make_engine(max_batch_size=2))
    args = argparse.Namespace(job_tokens=6, chat_tokens=4, every=0.05)
    try:
        asks = in_process(CompletionService(engine, ApiLimits(stop_on_loop=False)))
        side = asyncio.run(_side(asks, [WORDS] * 5, ["baba", "babe"], args, priority=1))
    finally:
        engine.shutdown()
    assert side["job"]["tokens"] == 5 * 6  # the tiny model never stops by itself: every answer runs to its budget
    assert [c["tokens"] for c in side["chats"]] == [4, 4]
    assert all(0 < c["ttft_s"] <= c["latency_s"] for c in side["chats"])
    assert side["chats"][0]["sent_s"] >= 1.0  # the first chat comes a second in, the job already waiting
