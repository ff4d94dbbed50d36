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
Writes bench/results/priority.json (`--http`: priority_http.json)."""
from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable

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


# the two ways a side asks: chat(prompt, max_tokens) -> (seconds to first text, latency, tokens) streamed;
# job(prompt, max_tokens, priority) -> tokens
Chat = Callable[[str, int], Awaitable[tuple[float, float, int]]]
Job = Callable[[str, int, int], Awaitable[int]]


def in_process(service: CompletionService) -> tuple[Chat, Job]:
    async def chat(prompt: str, max_tokens: int) -> tuple[float, float, int]:
        sent, first, tokens = time.perf_counter(), None, 0
        async for chunk in service.stream(_request(prompt, max_tokens, 0, stream=True)):
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
        done = time.perf_counter()
        return (first or done) - sent, done - sent, tokens

    async def job(prompt: str, max_tokens: int, priority: int) -> int:
        return (await service.complete(_request(prompt, max_tokens, priority))).usage.completion_tokens

    return chat, job


def over_http(session) -> tuple[Chat, Job]:
    """The same asks to the Serve application over HTTP (`session`: bench.serve_bench.http_session)."""
    from bench.serve_bench import _text_lines, read_sse

    def body(prompt: str, max_tokens: int, priority: int, stream: bool) -> dict:
        asked = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
                 "priority": priority}
        return asked | ({"stream": True, "stream_options": {"include_usage": True}} if stream else {})

    async def chat(prompt: str, max_tokens: int) -> tuple[float, float, int]:
        started = time.perf_counter()
        async with session.post("/v1/chat/completions", json=body(prompt, max_tokens, 0, True)) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
            record = await read_sse(_text_lines(response.content), started)
        if record.error:
            raise RuntimeError(record.error)
        return record.ttft_s or record.latency_s, record.latency_s, record.tokens

    async def job(prompt: str, max_tokens: int, priority: int) -> int:
        async with session.post("/v1/chat/completions", json=body(prompt, max_tokens, priority, False)) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
            return (await response.json())["usage"]["completion_tokens"]

    return chat, job


async def _timed_chat(chat: Chat, prompt: str, max_tokens: int, delay: float, started: float) -> dict:
    await asyncio.sleep(delay)
    sent = time.perf_counter()
    ttft, latency, tokens = await chat(prompt, max_tokens)
    return {"sent_s": round(sent - started, 3), "ttft_s": round(ttft, 3), "latency_s": round(latency, 3),
            "tokens": tokens}


async def _job(job: Job, prompts: list[str], max_tokens: int, priority: int) -> dict:
    started = time.perf_counter()
    tokens = await asyncio.gather(*(job(p, max_tokens, priority) for p in prompts))
    return {"seconds": round(time.perf_counter() - started, 3), "tokens": sum(tokens)}


async def _side(asks: tuple[Chat, Job], job: list[str], chats: list[str], args, priority: int) -> dict:
    chat_with, job_with = asks
    started = time.perf_counter()
    job_task = asyncio.create_task(_job(job_with, job, args.job_tokens, priority))
    interactive = await asyncio.gather(*(_timed_chat(chat_with, p, args.chat_tokens, 1.0 + i * args.every, started)
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
    parser.add_argument("--slots", type=int, default=16, help="the engine's max_batch_size (in process)")
    parser.add_argument("--http", action="store_true", help="through the Serve application of cluster/local.yaml "
                        "over HTTP (its batcher, its 32-slot decoder, its loop stop), not one engine in process")
    args = parser.parse_args(argv)
    if args.quick:
        args.job, args.chats, args.repeats = 24, 3, 1

    rows = [r["prompt"] for r in load_jsonl("sharegpt_serve.jsonl")]
    job, chats = rows[: args.job], rows[args.job : args.job + args.chats]

    async def sides(asks: tuple[Chat, Job]) -> dict:
        await asyncio.gather(*(asks[1](p, 8, 0) for p in rows[-8:]))  # warm up (a batch, not one), untimed
        runs = {side: [] for side in SIDES}
        for repeat in range(args.repeats):
            for side in list(SIDES) if repeat % 2 == 0 else list(SIDES)[::-1]:
                runs[side].append(await _side(asks, job, chats, args, SIDES[side]))
        return runs

    if args.http:
        from bench.serve_bench import app_args, http_session, serve_app

        served = app_args(predictor=False)
        args.slots = served["engine"]["max_batch_size"]

        async def over_the_app(base_url: str) -> dict:
            async with http_session(base_url) as session:
                return await sides(over_http(session))

        with serve_app(served) as base_url:
            runs = asyncio.run(over_the_app(base_url))
    else:
        config = EngineConfig(max_batch_size=args.slots, max_model_len=2048)
        engine = AsyncEngine(lambda: LLMEngine.from_config(config))
        try:
            runs = asyncio.run(sides(in_process(CompletionService(engine, ApiLimits(stop_on_loop=False)))))
        finally:
            engine.shutdown()
    summary = {side: {key: round(float(np.mean([r[key] for r in runs[side]])), 3)
                      for key in ("ttft_mean_s", "ttft_p90_s", "latency_mean_s", "latency_p90_s", "tokens_per_s")}
               | {"job_s": round(float(np.mean([r["job"]["seconds"] for r in runs[side]])), 2)} for side in SIDES}
    low, same = summary["job at priority 1"], summary["all at priority 0"]
    payload = {
        "job": args.job, "job_tokens": args.job_tokens, "chats": args.chats, "chat_tokens": args.chat_tokens,
        "every_s": args.every, "slots": args.slots, "repeats": args.repeats, "http": args.http,
        "summary": summary, "runs": runs,
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
    print(f"wrote {write_result('priority_http' if args.http else 'priority', payload)}")
    return payload
