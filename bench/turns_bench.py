"""`python -m bench turns`: multi-turn conversations with automatic prefix caching
(`EngineConfig.cache_answers`: each answer's KV kept, so the next turn prefills only its new message)
against each turn prefilling the whole conversation, on the embedded model through the completion
service (its chat template). Each conversation's user turns are short ShareGPT prompts
(data/sharegpt_serve.jsonl); each answer streams, greedy, `--max-tokens` long. The sides take turns
conversation by conversation, the cache emptied before each, so neither finds the other's work; both
give the same answers. Per side and turn: time to first token (first text) and prefill tokens.
`ttft_gain` = mean time to first token of the later turns (all but the first) without over with.
Writes bench/results/turns.json."""
from __future__ import annotations

import argparse
import asyncio

import numpy as np

from bench.common import load_jsonl, machine, streamed_pieces, table, write_result
from deployments.completion_service import ApiLimits, CompletionService
from deployments.openai_schema import ChatCompletionRequest
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine

SIDES = ("cached", "whole")
MAX_MESSAGE_CHARS = 300


def conversations(count: int, turns: int) -> list[list[str]]:
    """`count` conversations of `turns` user messages each, the short ShareGPT prompts in file order."""
    short = [r["prompt"] for r in load_jsonl("sharegpt_serve.jsonl") if len(r["prompt"]) <= MAX_MESSAGE_CHARS]
    return [short[i * turns : (i + 1) * turns] for i in range(count)]


async def _turn(service: CompletionService, messages: list[dict], max_tokens: int) -> tuple[str, float]:
    request = ChatCompletionRequest(messages=messages, max_tokens=max_tokens, temperature=0, stream=True)
    pieces, first_s, _ = await streamed_pieces(service, request)
    return "".join(pieces), first_s


async def _side_by_side(service: CompletionService, talks: list[list[str]], max_tokens: int) -> dict:
    engine = service.engine
    out = {side: {"ttft_s": [], "prefill_tokens": [], "answers": []} for side in SIDES}
    for i, talk in enumerate(talks):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            await engine.call(lambda e: (e.prefix_cache.clear(), setattr(e, "cache_answers", side == "cached")))
            messages, ttfts, prefills, answers = [], [], [], []
            for user in talk:
                messages.append({"role": "user", "content": user})
                before = (await engine.call(lambda e: e.stats()))["prefill_tokens"]
                answer, ttft = await _turn(service, messages, max_tokens)
                prefills.append((await engine.call(lambda e: e.stats()))["prefill_tokens"] - before)
                ttfts.append(round(ttft, 4))
                answers.append(answer)
                messages.append({"role": "assistant", "content": answer})
            out[side]["ttft_s"].append(ttfts)
            out[side]["prefill_tokens"].append(prefills)
            out[side]["answers"].append(answers)
    return out


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench turns", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 conversations of 3 turns, 24 tokens")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    count, turns, max_tokens = (2, 3, 24) if args.quick else (args.conversations, args.turns, args.max_tokens)

    talks = conversations(count + 1, turns)  # the first warms the engine up, untimed
    config = EngineConfig(max_batch_size=8, max_model_len=2048)
    engine = AsyncEngine(lambda: LLMEngine.from_config(config))
    service = CompletionService(engine, ApiLimits())
    try:
        asyncio.run(_side_by_side(service, talks[:1], max_tokens))
        sides = asyncio.run(_side_by_side(service, talks[1:], max_tokens))
    finally:
        engine.shutdown()
    per_turn = {side: {"ttft_s": [round(float(np.mean(col)), 3) for col in zip(*sides[side]["ttft_s"])],
                       "prefill_tokens": [round(float(np.mean(col)), 1) for col in zip(*sides[side]["prefill_tokens"])]}
                for side in SIDES}
    later = {side: float(np.mean([t for talk in sides[side]["ttft_s"] for t in talk[1:]])) for side in SIDES}
    prefill = {side: int(sum(map(sum, sides[side]["prefill_tokens"]))) for side in SIDES}
    payload = {
        "conversations": count, "turns": turns, "max_tokens": max_tokens, "per_turn": per_turn,
        "later_turns_ttft_s": {side: round(v, 3) for side, v in later.items()},
        "ttft_gain": round(later["whole"] / later["cached"], 2),
        "prefill_tokens": prefill, "prefill_saved": round(1 - prefill["cached"] / prefill["whole"], 3),
        "same_answers": sum(a == b for a, b in zip(sides["cached"]["answers"], sides["whole"]["answers"])),
        "sides": sides, "machine": machine(),
    }
    print(table(["side", *(f"turn {t + 1} TTFT s" for t in range(turns)), "prefill tokens"],
                [[side, *per_turn[side]["ttft_s"], prefill[side]] for side in SIDES]))
    print(f"ttft_gain {payload['ttft_gain']} (turns after the first), prefill_saved {payload['prefill_saved']}, "
          f"same answers in {payload['same_answers']} of {count} conversations")
    print(f"wrote {write_result('turns', payload)}")
    return payload
