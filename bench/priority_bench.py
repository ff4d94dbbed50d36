"""`python -m bench priority`: interactive requests while a batch job fills the engine, with the job at
priority 1 (the API's `priority`, lower goes first; `plato job submit --priority 1`) against every
request at the default 0, on the embedded model through the completion service.

The job: `--job` ShareGPT prompts (data/sharegpt_serve.jsonl), all sent at once, `--job-tokens` each,
more than the engine's slots hold, so most of them wait. The interactive requests: the next `--chats`
prompts, one every `--every` seconds from the first second on, streamed, `--chat-tokens` each. Both
sides decode greedily with the loop stop off, so they do the same work; they take turns (`--repeats`,
alternating which goes first). Per side: the interactive requests' time to first token and latency
(mean, p90), the job's whole time, output tokens/s. `ttft_gain` = the interactive mean time to first
token with every request at 0 over that with the job at 1.
Writes bench/results/priority.json."""
from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

from bench.common import load_jsonl, machine, table, write_result
from deployments.completion_service import ApiLimits, CompletionService
from deployments.openai_schema import ChatCompletionRequest
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine

SIDES = {"job at priority 1": 1, "all at priority 0": 0}


def _request(prompt: str, max_tokens: int, priority: int, stream: bool = False) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
                                 priority=priority, stream=stream, stream_options={"include_usage": True} if stream else None)


async def _chat(service: CompletionService, prompt: str, max_tokens: int, delay: float, started: float) -> dict:
    await asyncio.sleep(delay)
    sent, first, tokens = time.perf_counter(), None, 0
    async for chunk in service.stream(_request(prompt, max_tokens, 0, stream=True)):
        if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            first = time.perf_counter()
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    done = time.perf_counter()
    return {"sent_s": round(sent - started, 3), "ttft_s": round((first or done) - sent, 3),
            "latency_s": round(done - sent, 3), "tokens": tokens}


async def _job(service: CompletionService, prompts: list[str], max_tokens: int, priority: int) -> dict:
    started = time.perf_counter()
    answers = await asyncio.gather(*(service.complete(_request(p, max_tokens, priority)) for p in prompts))
    return {"seconds": round(time.perf_counter() - started, 3), "tokens": sum(a.usage.completion_tokens for a in answers)}


async def _side(service: CompletionService, job: list[str], chats: list[str], args, priority: int) -> dict:
    started = time.perf_counter()
    job_task = asyncio.create_task(_job(service, job, args.job_tokens, priority))
    interactive = await asyncio.gather(*(_chat(service, p, args.chat_tokens, 1.0 + i * args.every, started)
                                         for i, p in enumerate(chats)))
    job_result = await job_task
    wall = time.perf_counter() - started
    ttft, latency = [c["ttft_s"] for c in interactive], [c["latency_s"] for c in interactive]
    return {"chats": interactive, "job": job_result, "wall_s": round(wall, 2),
            "ttft_mean_s": round(float(np.mean(ttft)), 3), "ttft_p90_s": round(float(np.percentile(ttft, 90)), 3),
            "latency_mean_s": round(float(np.mean(latency)), 3),
            "latency_p90_s": round(float(np.percentile(latency, 90)), 3),
            "tokens_per_s": round((job_result["tokens"] + sum(c["tokens"] for c in interactive)) / wall, 1)}


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench priority", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a job of 24, 3 chats, 1 repeat")
    parser.add_argument("--job", type=int, default=64, help="job requests, sent at once")
    parser.add_argument("--job-tokens", type=int, default=48)
    parser.add_argument("--chats", type=int, default=6, help="interactive requests, one every --every seconds")
    parser.add_argument("--chat-tokens", type=int, default=32)
    parser.add_argument("--every", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--slots", type=int, default=16, help="the engine's max_batch_size")
    args = parser.parse_args(argv)
    if args.quick:
        args.job, args.chats, args.repeats = 24, 3, 1

    rows = [r["prompt"] for r in load_jsonl("sharegpt_serve.jsonl")]
    job, chats = rows[: args.job], rows[args.job : args.job + args.chats]
    config = EngineConfig(max_batch_size=args.slots, max_model_len=2048)
    engine = AsyncEngine(lambda: LLMEngine.from_config(config))
    service = CompletionService(engine, ApiLimits(stop_on_loop=False))
    runs = {side: [] for side in SIDES}
    try:
        asyncio.run(service.complete(_request(rows[-1], 4, 0)))  # warm up, untimed
        for repeat in range(args.repeats):
            order = list(SIDES) if repeat % 2 == 0 else list(SIDES)[::-1]
            for side in order:
                runs[side].append(asyncio.run(_side(service, job, chats, args, SIDES[side])))
    finally:
        engine.shutdown()
    summary = {side: {key: round(float(np.mean([r[key] for r in runs[side]])), 3)
                      for key in ("ttft_mean_s", "ttft_p90_s", "latency_mean_s", "latency_p90_s", "tokens_per_s")}
               | {"job_s": round(float(np.mean([r["job"]["seconds"] for r in runs[side]])), 2)} for side in SIDES}
    low, same = summary["job at priority 1"], summary["all at priority 0"]
    payload = {
        "job": args.job, "job_tokens": args.job_tokens, "chats": args.chats, "chat_tokens": args.chat_tokens,
        "every_s": args.every, "slots": args.slots, "repeats": args.repeats, "summary": summary, "runs": runs,
        "ttft_gain": round(same["ttft_mean_s"] / low["ttft_mean_s"], 2),
        "latency_gain": round(same["latency_mean_s"] / low["latency_mean_s"], 2),
        "job_time_ratio": round(low["job_s"] / same["job_s"], 3),
        "machine": machine(),
    }
    print(table(["side", "chat TTFT mean s", "p90", "chat latency mean s", "p90", "job s", "tokens/s"],
                [[side, s["ttft_mean_s"], s["ttft_p90_s"], s["latency_mean_s"], s["latency_p90_s"], s["job_s"],
                  s["tokens_per_s"]] for side, s in summary.items()]))
    print(f"ttft_gain {payload['ttft_gain']}, latency_gain {payload['latency_gain']}, job time with it at priority 1: "
          f"{payload['job_time_ratio']}x")
    print(f"wrote {write_result('priority', payload)}")
    return payload
