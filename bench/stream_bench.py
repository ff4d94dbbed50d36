"""`python -m bench stream`: how soon a streamed planned answer's client reads text, on the embedded
model through the completion service (the planner's own), one question at a time, greedy.

A planned answer now goes out as it settles (a plan's paragraphs in plan order from its first line,
the next one token by token, a plain answer token by token); before, it went out whole at its end. For each of the
first `--limit` Vicuna questions the router sends to planning, `ar`, `sot` and `plato` take turns
(the order alternating by question). Per mode: seconds to the first text, and to the end, which is
when the whole answer used to arrive. `first_text_gain` is plato's mean seconds to the end over its
mean seconds to the first text; `first_text_vs_ar` is plato's first text against ar's.
Writes bench/results/stream.json."""
from __future__ import annotations

import argparse
import asyncio
import statistics

from bench.common import load_jsonl, machine, streamed_pieces, table, write_result
from deployments.completion_service import ApiLimits, CompletionService
from deployments.openai_schema import ChatCompletionRequest
from graph.orchestrator import AnswerConfig, EngineClient, Orchestrator
from graph.router import route

MODES = ("ar", "sot", "plato")


async def _streamed(service: CompletionService, question: str, mode: str, max_tokens: int) -> dict:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": question}], mode=mode, stream=True,
                                    max_tokens=max_tokens, temperature=0)
    pieces, first_s, end_s = await streamed_pieces(service, request)
    return {"first_text_s": round(first_s, 3), "end_s": round(end_s, 3), "pieces": len(pieces),
            "chars": sum(map(len, pieces))}


async def _in_turns(service: CompletionService, questions: list[str], max_tokens: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for i, question in enumerate(questions):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            out[mode].append(await _streamed(service, question, mode, max_tokens))
    return out


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench stream", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 questions, 96 tokens")
    parser.add_argument("--limit", type=int, default=8, help="planning-routed Vicuna questions")
    parser.add_argument("--max-tokens", type=int, default=192, help="each mode's answer budget")
    args = parser.parse_args(argv)
    limit, max_tokens = (2, 96) if args.quick else (args.limit, args.max_tokens)

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    questions = [r["prompt"] for r in load_jsonl("vicuna80.jsonl") if route(r["prompt"])[0] == "plato"][: limit + 1]
    engine = AsyncEngine(lambda: LLMEngine.from_config(EngineConfig(max_batch_size=8, max_model_len=2048)))
    service = CompletionService(engine, ApiLimits(), Orchestrator(EngineClient(engine), AnswerConfig()))
    try:
        asyncio.run(_in_turns(service, questions[:1], max_tokens))  # warms the engine up, untimed
        runs = asyncio.run(_in_turns(service, questions[1:], max_tokens))
    finally:
        engine.shutdown()
    means = {mode: {key: round(statistics.mean(r[key] for r in runs[mode]), 3) for key in ("first_text_s", "end_s")}
             for mode in MODES}
    payload = {
        "questions": limit, "max_tokens": max_tokens, "means": means,
        "first_text_gain": round(means["plato"]["end_s"] / means["plato"]["first_text_s"], 2),
        "first_text_vs_ar": round(means["plato"]["first_text_s"] / means["ar"]["first_text_s"], 2),
        "runs": runs, "machine": machine(),
    }
    print(table(["mode", "first text s", "end s (whole, as before)", "pieces"],
                [[m, means[m]["first_text_s"], means[m]["end_s"], round(statistics.mean(r["pieces"] for r in runs[m]), 1)]
                 for m in MODES]))
    print(f"first_text_gain {payload['first_text_gain']} (plato: end over first text), "
          f"first_text_vs_ar {payload['first_text_vs_ar']}")
    print(f"wrote {write_result('stream', payload)}")
    return payload
