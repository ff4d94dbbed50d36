"""`python -m bench choices`: OpenAI's `n` (several sampled answers to one prompt) on the embedded
model's engine, the choices built as the completion service builds them, with the prompt marked
shared so the engine computes it once (as served), against the same choices each prefilling the
whole prompt. The prompts are the longest ShareGPT prompts of data/sharegpt_serve.jsonl, each used
once (the prefix cache would otherwise serve a repeated prompt to both sides); the sides take turns
prompt by prompt.
Writes bench/results/choices.json."""
from __future__ import annotations

import argparse
import asyncio
import time

from bench.common import load_jsonl, machine, table, write_result
from deployments.completion_service import ApiLimits, CompletionService, choice_requests
from deployments.openai_schema import ChatCompletionRequest
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine


async def _side_by_side(service: CompletionService, prompts: list[str], n: int, max_tokens: int) -> dict:
    """Each prompt's n choices as served (`choice_requests`) and with every choice prefilling its prompt."""
    engine = service.engine
    out = {name: {"seconds": [], "prefill_tokens": []} for name in ("shared", "unshared")}
    for i, prompt in enumerate(prompts):
        for name in ("shared", "unshared") if i % 2 == 0 else ("unshared", "shared"):
            request = ChatCompletionRequest(messages=[{"role": "user", "content": f"({name}) {prompt}"}], n=n,
                                            max_tokens=max_tokens, temperature=0.8, seed=i)
            choices = choice_requests((await service.to_engine_requests(request))[0], n)
            if name == "unshared":
                choices = [c.model_copy(update={"shared_prefix_len": 0}) for c in choices]
            before = (await engine.call(lambda e: e.stats()))["prefill_tokens"]
            started = time.perf_counter()
            await asyncio.gather(*(engine.generate(c) for c in choices))
            out[name]["seconds"].append(round(time.perf_counter() - started, 3))
            out[name]["prefill_tokens"].append((await engine.call(lambda e: e.stats()))["prefill_tokens"] - before)
    return out


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench choices", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 prompts, n 4, 16 tokens")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("-n", type=int, default=4, help="choices per request")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    count, max_tokens = (3, 16) if args.quick else (args.prompts, args.max_tokens)

    rows = sorted(load_jsonl("sharegpt_serve.jsonl"), key=lambda r: -len(r["prompt"]))
    prompts = [r["prompt"] for r in rows[: count + 1]]  # the first warms the engine up, untimed
    config = EngineConfig(max_batch_size=max(8, args.n), max_model_len=1024, speculative_tokens=0)
    engine = AsyncEngine(lambda: LLMEngine.from_config(config))
    service = CompletionService(engine, ApiLimits(max_choices=args.n))
    try:
        asyncio.run(_side_by_side(service, prompts[:1], args.n, max_tokens))
        sides = asyncio.run(_side_by_side(service, prompts[1:], args.n, max_tokens))
    finally:
        engine.shutdown()
    shared, unshared = (sum(sides[s]["seconds"]) for s in ("shared", "unshared"))
    payload = {
        "n": args.n, "max_tokens": max_tokens, "prompts": count, "sides": sides,
        "shared_s": round(shared, 2), "unshared_s": round(unshared, 2),
        "speedup_shared_prompt": round(unshared / shared, 2),
        "prefill_tokens": {s: sum(sides[s]["prefill_tokens"]) for s in sides}, "machine": machine(),
    }
    print(table(["side", "seconds", "prefill tokens"],
                [[s, round(sum(sides[s]["seconds"]), 2), payload["prefill_tokens"][s]] for s in sides]))
    print(f"speedup_shared_prompt {payload['speedup_shared_prompt']} (n {args.n}, {count} prompts, {max_tokens} tokens a choice)")
    print(f"wrote {write_result('choices', payload)}")
    return payload
