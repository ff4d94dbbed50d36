"""`python -m bench judge`: pairwise answer quality, judged by a model behind an OpenAI-compatible endpoint.

MT-bench's pairwise protocol: for each question and pair of modes (A, B), the judge compares the
two answers twice, A shown first and then B shown first, so that a judge that favours a position
cancels out. A wins a question if it wins both orders, or wins one and ties the other; it loses
symmetrically; anything else is a tie (the orders disagree, or both tie). Unparseable replies count
as ties and are reported. Two answers that are the same text are a tie without asking.

Reads the answers `python -m bench plato` wrote; writes bench/results/judge.json. Without
--base-url the judge is this project's embedded model, served in-process by the same
OpenAI-compatible app the server runs and called through the same client; it is a weak judge.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from pathlib import Path
from typing import Literal

import httpx
import openai
from pydantic import BaseModel, ConfigDict, Field

from bench.common import REPO, RESULTS, load_jsonl, table
from bench.judge_prompts import Verdict, judge_messages, parse_verdict

Outcome = Literal["win", "tie", "loss"]
EMBEDDED_URL = "http://embedded-judge/v1"
QUICK_QUESTIONS = 8


class JudgeConfig(BaseModel):
    """Which model judges, where it is served, and how it is asked."""

    model_config = ConfigDict(extra="forbid")

    base_url: str | None = Field(
        None, description="OpenAI-compatible endpoint, e.g. http://host:8000/v1; None: the embedded model in-process."
    )
    model: str | None = Field(None, description="The judge model; default: the first model the endpoint lists.")
    max_tokens: int = Field(512, ge=16, description="Longest judge reply; the verdict comes last, so not too short.")
    temperature: float = Field(0.0, ge=0.0, description="Judge sampling temperature; 0 is greedy and repeatable.")
    concurrency: int = Field(8, ge=1, description="Judge requests in flight at once (and the embedded batch size).")


def order_outcome(verdict: Verdict | None, a_shown_first: bool) -> Outcome:
    """A's outcome in one order; `a_shown_first` says whether A's answer was labelled Assistant A."""
    if verdict in (None, "tie"):
        return "tie"
    return "win" if (verdict == "A") == a_shown_first else "loss"


def combine(first: Outcome, second: Outcome) -> Outcome:
    """A question's outcome from its two orders: a decisive order stands unless the other contradicts it."""
    decisive = {first, second} - {"tie"}
    return decisive.pop() if len(decisive) == 1 else "tie"


def tally(outcomes: list[Outcome]) -> dict:
    """Counts and rates of wins, ties and losses; net win rate = (wins - losses) / n."""
    n = len(outcomes)
    wins, ties, losses = (outcomes.count(o) for o in ("win", "tie", "loss"))
    rate = lambda k: round(k / n, 3) if n else None  # noqa: E731
    return {"n": n, "wins": wins, "ties": ties, "losses": losses, "win_rate": rate(wins), "tie_rate": rate(ties),
            "loss_rate": rate(losses), "net_win_rate": rate(wins - losses)}


def summarize(records: list[dict]) -> dict:
    """Overall and per-category tallies of one pair's questions, and how the judge behaved: replies
    it could not parse, questions whose two orders contradicted each other, and how often a
    decisive verdict picked the answer shown first (0.5 for a judge without position bias)."""
    categories: dict[str, list[Outcome]] = {}
    for record in records:
        categories.setdefault(record["category"], []).append(record["outcome"])
    replies = [order for record in records for order in record["orders"]]
    decisive = [order["verdict"] for order in replies if order["verdict"] in ("A", "B")]
    return {
        "overall": tally([record["outcome"] for record in records]),
        "categories": {name: tally(outcomes) for name, outcomes in categories.items()},
        "judge_replies": len(replies),
        "unparsed": sum(order["verdict"] is None for order in replies),
        "identical_answers": sum(not record["orders"] for record in records),
        "orders_contradict": sum({o["outcome"] for o in record["orders"]} == {"win", "loss"} for record in records),
        "first_shown_picked": round(decisive.count("A") / len(decisive), 3) if decisive else None,
    }


async def _ask(client: openai.AsyncOpenAI, config: JudgeConfig, gate: asyncio.Semaphore, messages: list[dict]) -> str:
    async with gate:
        response = await client.chat.completions.create(
            model=config.model, messages=messages, max_tokens=config.max_tokens, temperature=config.temperature
        )
    return response.choices[0].message.content or ""


async def _judge_question(client, config: JudgeConfig, gate, item: dict) -> dict:
    a, b = item["a"].strip(), item["b"].strip()
    record = {"id": item["id"], "category": item["category"], "outcome": "tie", "orders": []}
    if a == b:
        return record
    replies = await asyncio.gather(
        _ask(client, config, gate, judge_messages(item["question"], a, b)),
        _ask(client, config, gate, judge_messages(item["question"], b, a)),
    )
    for reply, a_first in zip(replies, (True, False)):
        verdict = parse_verdict(reply)
        record["orders"].append({"a_shown_first": a_first, "verdict": verdict,
                                 "outcome": order_outcome(verdict, a_first), "reply": reply})
    record["outcome"] = combine(*(order["outcome"] for order in record["orders"]))
    return record


def load_items(answers_path: Path, pairs: list[tuple[str, str]], count: int | None) -> tuple[dict, dict]:
    """The answers file, and per pair the questions both modes answered (file order, the first
    `count`), each with its prompt and the two answers."""
    answers = json.loads(answers_path.read_text())
    modes = answers["answers"]
    prompts = {row["id"]: row["prompt"] for row in load_jsonl(f"{answers.get('data', 'vicuna80')}.jsonl")}
    items = {}
    for a, b in pairs:
        missing = [m for m in (a, b) if m not in modes]
        if missing:
            raise SystemExit(f"--pairs: {answers_path} has no answers for {missing}; it has {sorted(modes)}")
        b_text = {row["id"]: row["text"] for row in modes[b]}
        both = [row for row in modes[a] if row["id"] in b_text][:count]
        if not both:
            raise SystemExit(f"--pairs: {a} and {b} answered no question in common in {answers_path}")
        items[f"{a}:{b}"] = [{"id": row["id"], "category": row["category"], "question": prompts[row["id"]],
                              "a": row["text"], "b": b_text[row["id"]]} for row in both]
    return answers, items


def embedded_transport(engine, concurrency: int) -> httpx.ASGITransport:
    """This project's OpenAI-compatible app over `engine` (an AsyncEngine), reached in-process."""
    from deployments.api import create_app
    from deployments.completion_service import ApiLimits, CompletionService

    service = CompletionService(engine, ApiLimits())
    return httpx.ASGITransport(app=create_app(service, api_key=None, max_in_flight=concurrency))


async def _judge_all(config: JudgeConfig, api_key: str | None, transport, items: dict) -> tuple[str, dict]:
    http = httpx.AsyncClient(transport=transport) if transport is not None else None
    client = openai.AsyncOpenAI(base_url=config.base_url or EMBEDDED_URL, api_key=api_key or "unused",
                                http_client=http, timeout=600.0)
    async with client:
        model = config.model or (await client.models.list()).data[0].id
        config = config.model_copy(update={"model": model})
        gate = asyncio.Semaphore(config.concurrency)
        pairs = list(items)
        judged = await asyncio.gather(*(
            asyncio.gather(*(_judge_question(client, config, gate, item) for item in items[pair])) for pair in pairs))
    return model, dict(zip(pairs, judged))


def _judge(config: JudgeConfig, api_key: str | None, transport, items: dict) -> tuple[str, dict]:
    """Run every judge request: against `transport` when given (in-process), else `config.base_url`,
    else the embedded model started here."""
    with contextlib.ExitStack() as stack:
        if transport is None and config.base_url is None:
            from engine.async_engine import AsyncEngine
            from engine.config import EngineConfig
            from engine.engine import LLMEngine

            engine = AsyncEngine(lambda: LLMEngine.from_config(EngineConfig(max_batch_size=config.concurrency)))
            stack.callback(engine.shutdown)
            transport = embedded_transport(engine, config.concurrency)
        try:
            return asyncio.run(_judge_all(config, api_key, transport, items))
        except (openai.APIConnectionError, openai.APIStatusError) as error:
            where = config.base_url or "the embedded judge"
            raise SystemExit(f"judge at {where} failed: {error}; check --base-url, --model and --api-key") from error


def _repo_path(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _report(results: dict) -> None:
    rows = []
    for pair, result in results.items():
        a, b = pair.split(":")
        o = result["overall"]
        print(f"{a} vs {b}: win {o['win_rate']:.2f} tie {o['tie_rate']:.2f} loss {o['loss_rate']:.2f} "
              f"net {o['net_win_rate']:+.2f} (n={o['n']}, unparsed {result['unparsed']} of "
              f"{result['judge_replies']} replies, orders contradict {result['orders_contradict']})")
        rows += [[pair, name, t["n"], t["wins"], t["ties"], t["losses"], f"{t['net_win_rate']:+.2f}"]
                 for name, t in [*result["categories"].items(), ("all", o)]]
    print(table(["pair", "category", "n", "win", "tie", "loss", "net"], rows))


def run(argv: list[str], transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """The scenario. `transport`, for tests: where the judge's HTTP requests go instead of the
    network (an in-process app); without --base-url it stands for the embedded judge."""
    parser = argparse.ArgumentParser(prog="python -m bench judge", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--answers", type=Path, default=RESULTS / "plato.json", help="answers from `bench plato`")
    parser.add_argument("--pairs", default="plato:ar,plato:sot", help="comma-separated A:B mode pairs")
    parser.add_argument("--base-url", default=None, help="OpenAI-compatible judge endpoint (default: embedded)")
    parser.add_argument("--model", default=None, help="judge model (default: the endpoint's first model)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    parser.add_argument("--limit", type=int, default=None, help="first N questions (default: all)")
    parser.add_argument("--quick", action="store_true", help=f"first {QUICK_QUESTIONS} questions")
    parser.add_argument("--concurrency", type=int, default=JudgeConfig.model_fields["concurrency"].default)
    parser.add_argument("--max-tokens", type=int, default=JudgeConfig.model_fields["max_tokens"].default)
    parser.add_argument("--out", type=Path, default=RESULTS / "judge.json")
    args = parser.parse_args(argv)
    config = JudgeConfig(base_url=args.base_url, model=args.model, max_tokens=args.max_tokens,
                         concurrency=args.concurrency)
    pairs = [tuple(pair.split(":")) for pair in args.pairs.split(",")]
    if any(len(pair) != 2 for pair in pairs):
        raise SystemExit(f"--pairs: expected A:B[,A:B...], got {args.pairs!r}")
    answers, items = load_items(args.answers, pairs, args.limit or (QUICK_QUESTIONS if args.quick else None))

    model, judged = _judge(config, args.api_key, transport, items)
    results = {pair: {**summarize(records), "questions": records} for pair, records in judged.items()}
    payload = {
        "judge": config.model_copy(update={"model": model}).model_dump(),
        "answers": _repo_path(args.answers), "data": answers.get("data"), "answers_budget": answers.get("budget"),
        "quick": args.quick, "limit": args.limit, "pairs": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    _report(results)
    print(f"wrote {args.out}")
    return payload
