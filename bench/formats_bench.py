"""`python -m bench formats`: structured outputs on the embedded model, through the completion service
(the API's request path without HTTP). Each question of data/formats.jsonl asks for JSON and carries
a JSON Schema; it is answered greedily as

- `plain`: no format (the answer counts if its text, stripped, parses and validates);
- `json_object`: OpenAI's JSON mode; `json_schema`: structured outputs under the question's schema;
- each of those two also with the loop stop off for constrained answers (`... no wrap-up`), as this
  server ran them before: an answer that loops inside its JSON then runs to max_tokens unclosed, where
  now its constraint closes it the shortest way the grammar allows (`GrammarConstraint.wrap_up`).

- `json_schema, refined`: structured outputs under the question's schema refined as a user who knows
  the values' form would (the row's `refine`): numbers given plausible ranges (a dog's legs 0-8), strings
  a `format` (date, email, ...) or a `pattern` (a zip code's five digits).

Every variant answers all questions at once (one batch), variants one after another. Reported per
variant: answers that parse as a JSON object, answers that validate against the question's schema,
answers that also validate against the refined schema, formats checked (`refined_valid`), finish reasons, answer tokens, seconds. Writes bench/results/formats.json."""
from __future__ import annotations

import argparse
import asyncio
import copy
import datetime
import json
import time

import jsonschema
import pydantic

from bench.common import load_jsonl, machine, table, write_result
from deployments.completion_service import ApiLimits, CompletionService
from deployments.openai_schema import ChatCompletionRequest
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine

VARIANTS = {  # name -> (response_format kind, loop stop on for constrained answers, the refined schema)
    "plain": (None, True, False),
    "json_object": ("json_object", True, False),
    "json_object, no wrap-up": ("json_object", False, False),
    "json_schema": ("json_schema", True, False),
    "json_schema, no wrap-up": ("json_schema", False, False),
    "json_schema, refined": ("json_schema", True, True),
}


def refined_schema(row: dict) -> dict:
    """The row's schema with each of its `refine` ({property: keywords}) added to that property: what a
    user who knows a value's range or form would send."""
    schema = copy.deepcopy(row["schema"])
    for name, keywords in row.get("refine", {}).items():
        schema["properties"][name].update(keywords)
    return schema


def response_format(kind: str | None, schema: dict) -> dict | None:
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    return {"type": kind} if kind else None


FORMAT_CHECKER = jsonschema.FormatChecker()  # jsonschema's own, and duration, which it checks only with isoduration
_TIMEDELTA = pydantic.TypeAdapter(datetime.timedelta)


@FORMAT_CHECKER.checks("duration", raises=pydantic.ValidationError)
def _is_duration(value) -> bool:
    return not isinstance(value, str) or _TIMEDELTA.validate_python(value) is not None


def judge(text: str, schema: dict) -> tuple[bool, bool]:
    """(parses as a JSON object, validates against `schema`) for an answer's text."""
    try:
        value = json.loads(text.strip())
    except ValueError:
        return False, False
    if not isinstance(value, dict):
        return False, False
    try:
        jsonschema.validate(value, schema, format_checker=FORMAT_CHECKER)
    except jsonschema.ValidationError:
        return True, False
    return True, True


async def _variant(services: dict[bool, CompletionService], rows: list[dict], kind: str | None, wrap_up: bool,
                   refined: bool, max_tokens: int) -> dict:
    service = services[wrap_up]
    requests = [ChatCompletionRequest(messages=[{"role": "user", "content": row["question"]}], max_tokens=max_tokens,
                                      temperature=0.0, response_format=response_format(
                                          kind, refined_schema(row) if refined else row["schema"]))
                for row in rows]
    started = time.perf_counter()
    responses = await asyncio.gather(*(service.complete(r) for r in requests))
    seconds = time.perf_counter() - started
    answers = []
    for row, response in zip(rows, responses):
        choice = response.choices[0]
        parses, valid = judge(choice.message.content or "", row["schema"])
        refined_valid = judge(choice.message.content or "", refined_schema(row))[1]
        answers.append({"question": row["question"], "text": choice.message.content, "finish": choice.finish_reason,
                        "tokens": response.usage.completion_tokens, "parses": parses, "valid": valid,
                        "refined_valid": refined_valid})
    return {"seconds": round(seconds, 2), "answers": answers}


def summary(result: dict) -> dict:
    answers = result["answers"]
    finishes = {}
    for a in answers:
        finishes[a["finish"]] = finishes.get(a["finish"], 0) + 1
    return {"objects": sum(a["parses"] for a in answers), "valid": sum(a["valid"] for a in answers),
            "refined_valid": sum(a["refined_valid"] for a in answers), "answers": len(answers), "finish": finishes, "tokens": sum(a["tokens"] for a in answers),
            "seconds": result["seconds"]}


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench formats", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the first 4 questions")
    parser.add_argument("--limit", type=int, default=None, help="the first N questions")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    rows = load_jsonl("formats.jsonl")[: 4 if args.quick else args.limit]

    config = EngineConfig(max_batch_size=max(8, len(rows)), max_model_len=1024)
    engine = AsyncEngine(lambda: LLMEngine.from_config(config))
    services = {wrap: CompletionService(engine, ApiLimits(stop_on_loop=wrap)) for wrap in (True, False)}
    try:
        asyncio.run(_variant(services, rows[:1], "json_schema", True, False, 8))  # builds the vocabulary index, untimed
        results = {name: asyncio.run(_variant(services, rows, kind, wrap, refined, args.max_tokens))
                   for name, (kind, wrap, refined) in VARIANTS.items()}
    finally:
        engine.shutdown()
    summaries = {name: summary(r) for name, r in results.items()}
    n = len(rows)
    payload = {
        "questions": n, "max_tokens": args.max_tokens, "summary": summaries,
        "schema_valid_rate": round(summaries["json_schema"]["valid"] / n, 3),
        "json_object_rate": round(summaries["json_object"]["objects"] / n, 3),
        "plain_valid_rate": round(summaries["plain"]["valid"] / n, 3),
        "refined_valid_rate": {name: round(summaries[name]["refined_valid"] / n, 3)
                               for name in ("json_schema", "json_schema, refined")},
        "wrap_up_objects": {kind: [summaries[kind]["objects"], summaries[f"{kind}, no wrap-up"]["objects"]]
                            for kind in ("json_object", "json_schema")},
        "wrap_up_token_ratio": {kind: round(summaries[kind]["tokens"] / summaries[f"{kind}, no wrap-up"]["tokens"], 3)
                                for kind in ("json_object", "json_schema")},
        "variants": results, "machine": machine(),
    }
    print(table(["variant", "JSON objects", "valid", "refined valid", "finish", "answer tokens", "seconds"],
                [[name, f"{s['objects']}/{n}", f"{s['valid']}/{n}", f"{s['refined_valid']}/{n}", json.dumps(s["finish"]),
                  s["tokens"], s["seconds"]]
                 for name, s in summaries.items()]))
    print(f"schema_valid_rate {payload['schema_valid_rate']}, json_object_rate {payload['json_object_rate']}, "
          f"plain_valid_rate {payload['plain_valid_rate']}, refined_valid_rate {payload['refined_valid_rate']}; with / without wrap-up, objects "
          f"{payload['wrap_up_objects']}, answer tokens {payload['wrap_up_token_ratio']}")
    print(f"wrote {write_result('formats', payload)}")
    return payload
