"""`python -m bench stream`: every mode streamed in turns on the tiny engine through the service."""
from __future__ import annotations

import asyncio

from bench.stream_bench import MODES, _in_turns
from deployments.completion_service import ApiLimits, CompletionService
from engine.async_engine import AsyncEngine
from graph.orchestrator import AnswerConfig, EngineClient, Orchestrator


def test_each_mode_streams_each_question_and_its_first_text_comes_by_its_end(make_engine):
    engine = AsyncEngine(make_engine(max_batch_size=4, max_model_len=512))
    config = AnswerConfig(max_tokens=16, plan_max_tokens=16, node_max_tokens=4, plan_constraint=None)
    service = CompletionService(engine, ApiLimits(), Orchestrator(EngineClient(engine), config))
    try:
        runs = asyncio.run(_in_turns(service, ["baba babe bobo?", "dada dade?"], max_tokens=16))
    finally:
        engine.shutdown()
    assert set(runs) == set(MODES) and all(len(runs[mode]) == 2 for mode in MODES)
    for run in (r for mode in MODES for r in runs[mode]):
        assert run["pieces"] >= 1 and run["chars"] > 0 and 0 < run["first_text_s"] <= run["end_s"]
    assert all(r["pieces"] > 1 for r in runs["ar"])  # token by token
