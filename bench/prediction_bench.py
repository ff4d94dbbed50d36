"""`python -m bench prediction`: OpenAI's predicted outputs on the embedded model, through the completion
service (the API's request path without HTTP). Each row of data/edits.jsonl asks for a text written again
with a small change (a renamed variable, a fixed spelling, a changed port), the text in the prompt; it is
answered greedily as

- `plain`: no drafts at all (the engine's prompt lookup off): one token a step;
- `lookup`: the engine's default, prompt-lookup drafts (up to 4 tokens, while at most 4 sequences decode);
- `prediction`: the default engine with the text itself as the request's `prediction`: up to 16 of its
  tokens checked a step, at any batch size.

Greedy answers are the same text under all three (checked and reported: drafts are kept only where the
model would have written them). Each variant has an engine of its own (no prompt is cached by another's
answer); they take turns row by row (the order rotating), one request at a time; then all rows at once
per variant ("together": more than 4 sequences, so no lookup drafts), on the same engines: the second
time a prompt is seen, so its KV is cached for every variant alike.
Reported per variant: seconds, answer tokens, tokens a second, the prediction tokens accepted and
rejected; `prediction_speedup` is plain's seconds over prediction's, `prediction_vs_lookup` lookup's
over prediction's. Writes bench/results/prediction.json."""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench.common import load_jsonl, machine, table, write_result
from deployments.completion_service import ApiLimits, CompletionService
from deployments.openai_schema import ChatCompletionRequest

VARIANTS = ("plain", "lookup", "prediction")


def edit_request(row: dict, max_tokens: int, predicted: bool) -> ChatCompletionRequest:
    prompt = f"{row['instruction']} Write the whole text again with the change, and nothing else.\n\n{row['text']}"
    fields = {"prediction": {"type": "content", "content": row["text"]}} if predicted else {}
    return ChatCompletionRequest(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                 temperature=0, **fields)


async def _answer(service: CompletionService, row: dict, max_tokens: int, predicted: bool) -> dict:
    started = time.perf_counter()
    response = await service.complete(edit_request(row, max_tokens, predicted))
    seconds = time.perf_counter() - started
    details = response.usage.completion_tokens_details
    return {"seconds": round(seconds, 3), "tokens": response.usage.completion_tokens,
            "text": response.choices[0].message.content,
            "accepted": details.accepted_prediction_tokens if details else 0,
            "rejected": details.rejected_prediction_tokens if details else 0}


async def _in_turns(services: dict, rows: list[dict], max_tokens: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for i, row in enumerate(rows):
        for name in VARIANTS[i % 3:] + VARIANTS[:i % 3]:
            out[name].append(await _answer(services[name], row, max_tokens, name == "prediction"))
    return out


async def _together(service: CompletionService, rows: list[dict], max_tokens: int, predicted: bool) -> dict:
    started = time.perf_counter()
    answers = await asyncio.gather(*(_answer(service, row, max_tokens, predicted) for row in rows))
    seconds = time.perf_counter() - started
    return {"seconds": round(seconds, 3), "tokens": sum(a["tokens"] for a in answers),
            "accepted": sum(a["accepted"] for a in answers), "rejected": sum(a["rejected"] for a in answers),
            "texts": [a["text"] for a in answers]}


def summary(runs: list[dict]) -> dict:
    seconds, tokens = sum(r["seconds"] for r in runs), sum(r["tokens"] for r in runs)
    return {"seconds_mean": round(statistics.mean(r["seconds"] for r in runs), 3), "tokens": tokens,
            "tok_s": round(tokens / seconds, 1), "accepted": sum(r["accepted"] for r in runs),
            "rejected": sum(r["rejected"] for r in runs)}


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench prediction", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rows, 64 tokens")
    parser.add_argument("--limit", type=int, default=None, help="the first N rows of data/edits.jsonl")
    parser.add_argument("--max-tokens", type=int, default=192, help="each answer's budget")
    args = parser.parse_args(argv)
    rows = load_jsonl("edits.jsonl")
    limit, max_tokens = (2, 64) if args.quick else (args.limit or len(rows), args.max_tokens)
    rows = rows[:limit]

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    # an engine each, so that no variant finds a row's prompt in the prefix cache another variant left
    engines = {name: AsyncEngine(lambda name=name: LLMEngine.from_config(
        EngineConfig(max_batch_size=8, speculative_tokens=0 if name == "plain" else None))) for name in VARIANTS}
    services = {name: CompletionService(engine, ApiLimits(max_tokens_limit=max_tokens))
                for name, engine in engines.items()}
    try:
        asyncio.run(_in_turns(services, rows[:1], 16))  # warms both engines up, untimed
        runs = asyncio.run(_in_turns(services, rows, max_tokens))
        together = {name: asyncio.run(_together(services[name], rows, max_tokens, name == "prediction"))
                    for name in VARIANTS}
    finally:
        for engine in engines.values():
            engine.shutdown()
    alone = {name: summary(runs[name]) for name in VARIANTS}
    same = {name: sum(a["text"] == b["text"] for a, b in zip(runs[name], runs["plain"])) for name in VARIANTS}
    payload = {
        "rows": len(rows), "max_tokens": max_tokens, "alone": alone,
        "together": {name: {k: v for k, v in t.items() if k != "texts"} for name, t in together.items()},
        "same_text_as_plain": same,
        "same_text_together": {name: sum(a == b for a, b in zip(t["texts"], together["plain"]["texts"]))
                               for name, t in together.items()},
        "prediction_speedup": round(alone["plain"]["seconds_mean"] / alone["prediction"]["seconds_mean"], 2),
        "prediction_vs_lookup": round(alone["lookup"]["seconds_mean"] / alone["prediction"]["seconds_mean"], 2),
        "prediction_speedup_together": round(together["plain"]["seconds"] / together["prediction"]["seconds"], 2),
        "prediction_vs_lookup_together": round(together["lookup"]["seconds"] / together["prediction"]["seconds"], 2),
        "runs": runs, "machine": machine(),
    }
    print(table(["variant", "seconds (mean, alone)", "tokens", "tok/s alone", "accepted", "rejected",
                 f"all {len(rows)} at once s", "same text as plain"],
                [[name, alone[name]["seconds_mean"], alone[name]["tokens"], alone[name]["tok_s"], alone[name]["accepted"],
                  alone[name]["rejected"], together[name]["seconds"], f"{same[name]}/{len(rows)}"] for name in VARIANTS]))
    print(f"prediction_speedup {payload['prediction_speedup']} (together {payload['prediction_speedup_together']}), "
          f"prediction_vs_lookup {payload['prediction_vs_lookup']} (together {payload['prediction_vs_lookup_together']})")
    print(f"wrote {write_result('prediction', payload)}")
    return payload
