"""`python -m bench scoring`: multiple-choice loglikelihoods as lm-evaluation-harness asks them of
`local-completions` (`/v1/completions`, `echo` with `logprobs` 1, `max_tokens` 0 or 1), with scored
prompts reusing each other's KV and scores (`EngineConfig.reuse_scored_prompts`) against each prompt
computed whole, on the embedded model through the completion service.

Each question is the first three quarters of a ShareGPT prompt (data/sharegpt_serve.jsonl, the
longest first); its four endings are the next eight words and eight words from three other prompts,
all four scored in one request, as lm-eval scores a question's choices. The sides take turns question
by question, the prefix cache emptied before each, so neither finds the other's work. Both sides'
scores are compared: the chosen ending (the most likely, as lm-eval's `acc`) must be the same.
Writes bench/results/scoring.json."""
from __future__ import annotations

import argparse
import asyncio
import time

from bench.common import load_jsonl, machine, table, write_result
from deployments.completion_service import ApiLimits, CompletionService
from deployments.openai_schema import CompletionRequest, TokenizeRequest
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine

ENDING_WORDS = 8
SIDES = ("reuse", "recompute")


def questions(count: int, choices: int = 4) -> list[tuple[str, list[str]]]:
    """(context, endings) pairs, the true ending first."""
    rows = sorted(load_jsonl("sharegpt_serve.jsonl"), key=lambda r: -len(r["prompt"]))
    texts = [r["prompt"].split() for r in rows if len(r["prompt"].split()) >= 4 * ENDING_WORDS][: count + choices]
    out = []
    for i, words in enumerate(texts[:count]):
        cut = min(len(words) * 3 // 4, 300)
        context = " ".join(words[:cut])
        others = [texts[(i + k) % len(texts)] for k in range(1, choices)]
        endings = [" " + " ".join(words[cut : cut + ENDING_WORDS])]
        endings += [" " + " ".join(other[: ENDING_WORDS]) for other in others]
        out.append((context, endings))
    return out


def _ending_score(choice, context_tokens: int) -> float:
    """The ending's summed log probability: the echoed prompt's entries after the context's (lm-eval's
    `token_logprobs[ctxlen:-1]`)."""
    return sum(choice.logprobs["token_logprobs"][context_tokens:-1])


async def _side_by_side(service: CompletionService, items: list[tuple[str, list[str]]]) -> dict:
    engine = service.engine
    out = {side: {"seconds": [], "prefill_tokens": [], "picked": [], "scores": []} for side in SIDES}
    for i, (context, endings) in enumerate(items):
        context_tokens = (await service.tokenize(TokenizeRequest(prompt=context)))["count"]
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            await engine.call(lambda e: (e.prefix_cache.clear(), setattr(e, "reuse_scored_prompts", side == "reuse")))
            request = CompletionRequest(prompt=[context + ending for ending in endings], echo=True, logprobs=1,
                                        max_tokens=1)
            before = (await engine.call(lambda e: e.stats()))["prefill_tokens"]
            started = time.perf_counter()
            response = await service.complete(request)
            out[side]["seconds"].append(round(time.perf_counter() - started, 3))
            out[side]["prefill_tokens"].append((await engine.call(lambda e: e.stats()))["prefill_tokens"] - before)
            scores = [_ending_score(c, context_tokens) for c in sorted(response.choices, key=lambda c: c.index)]
            out[side]["scores"].append([round(s, 5) for s in scores])
            out[side]["picked"].append(max(range(len(scores)), key=scores.__getitem__))
    return out


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench scoring", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 questions")
    parser.add_argument("--questions", type=int, default=24)
    args = parser.parse_args(argv)
    count = 3 if args.quick else args.questions

    items = questions(count + 1)  # the first warms the engine up, untimed
    config = EngineConfig(max_batch_size=8, max_model_len=1024, speculative_tokens=0)
    engine = AsyncEngine(lambda: LLMEngine.from_config(config))
    service = CompletionService(engine, ApiLimits())
    try:
        asyncio.run(_side_by_side(service, items[:1]))
        sides = asyncio.run(_side_by_side(service, items[1:]))
        restored = config.reuse_scored_prompts
        asyncio.run(engine.call(lambda e: setattr(e, "reuse_scored_prompts", restored)))
    finally:
        engine.shutdown()
    seconds = {side: sum(sides[side]["seconds"]) for side in SIDES}
    prefill = {side: sum(sides[side]["prefill_tokens"]) for side in SIDES}
    differences = [abs(a - b) for qa, qb in zip(sides["reuse"]["scores"], sides["recompute"]["scores"])
                   for a, b in zip(qa, qb)]
    payload = {
        "questions": count, "choices": len(items[0][1]), "sides": sides,
        "seconds": {side: round(s, 2) for side, s in seconds.items()}, "prefill_tokens": prefill,
        "speedup_scored_reuse": round(seconds["recompute"] / seconds["reuse"], 2),
        "prefill_saved": round(1 - prefill["reuse"] / prefill["recompute"], 3),
        "max_score_difference": max(differences),
        "same_choice": sum(a == b for a, b in zip(sides["reuse"]["picked"], sides["recompute"]["picked"])),
        "true_ending_chosen": {side: sum(p == 0 for p in sides[side]["picked"]) for side in SIDES},
        "machine": machine(),
    }
    print(table(["side", "seconds", "prefill tokens", "true ending chosen"],
                [[side, round(seconds[side], 2), prefill[side], payload["true_ending_chosen"][side]] for side in SIDES]))
    print(f"speedup_scored_reuse {payload['speedup_scored_reuse']}, prefill_saved {payload['prefill_saved']}, "
          f"same choice {payload['same_choice']}/{count}, largest score difference {payload['max_score_difference']:.2g}")
    print(f"wrote {write_result('scoring', payload)}")
    return payload
