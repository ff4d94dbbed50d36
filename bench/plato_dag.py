"""`python -m bench plato --given-plans`: node prompts on plans with dependencies.

The embedded 135M model writes plans whose nodes are all independent, so the main run never decodes
a node with parents. Here the plans are given (data/dag_plans.jsonl: the first eight planning-routed
Vicuna questions, each with a plan of four nodes with dependencies, written for this benchmark),
streamed a line at a time at `--line-delay` seconds a line (about the embedded model's own pace), and
the real engine decodes the nodes. Variants, each on a fresh engine:
- `plato`: a node with parents continues its lead parent's conversation, whose KV the engine kept;
- `plato-no-follow-up`: every node quotes its parents' answers after the shared plan prefix;
- `plato-no-kv-reuse`: the `plato` prompts, nothing reused.
Per variant: latency one question at a time, answers per minute with all in flight, node prompt
tokens, prefill tokens the engine computed for the nodes, prefix hit rate and the shareable rate
(the most any prefix cache could serve with those prompts). Writes bench/results/plato_dag.json.
"""
from __future__ import annotations

import asyncio
import statistics
import time

from bench.common import load_jsonl, machine, table, write_result
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.types import FinishReason, Result, TokenEvent
from graph.orchestrator import AnswerConfig, EngineClient, Orchestrator

VARIANTS = {
    "plato": {},
    "plato-no-follow-up": {"follow_up_prompts": False},
    "plato-no-kv-reuse": {"kv_reuse": False},
}


class GivenPlanClient(EngineClient):
    """An EngineClient whose plan stream is the given plan of the question in the prompt, a line
    every `line_delay` seconds; node requests go to the engine."""

    def __init__(self, engine: AsyncEngine, plans: dict[str, str], line_delay: float):
        super().__init__(engine)
        self.plans, self.line_delay = plans, line_delay

    async def stream(self, request):
        prompt = await self.engine.call(lambda e: e.tokenizer.decode(request.prompt_ids))
        question = max((q for q in self.plans if q in prompt), key=len)
        plan = self.plans[question] + "\n\n"
        for line in plan.splitlines(keepends=True):
            await asyncio.sleep(self.line_delay)
            yield TokenEvent(request_id=request.id, token_ids=[], text=line)
        ids = await self.engine.call(lambda e: e.tokenizer.encode(plan, add_special_tokens=False))
        yield Result(request_id=request.id, prompt_tokens=len(request.prompt_ids), token_ids=ids, text=plan,
                     finish_reason=FinishReason.STOP, ttft_s=self.line_delay, latency_s=0.0)


async def _run_variant(engine: AsyncEngine, plans: dict[str, str], config: AnswerConfig, line_delay: float) -> dict:
    orchestrator = Orchestrator(GivenPlanClient(engine, plans, line_delay), config)
    before = (await engine.call(lambda e: e.stats()))["prefill_tokens"]
    answers = [await orchestrator.answer(q, "plato") for q in plans]
    computed = (await engine.call(lambda e: e.stats()))["prefill_tokens"] - before
    started = time.perf_counter()
    together = await asyncio.gather(*(orchestrator.answer(q, "plato") for q in plans))
    wall = time.perf_counter() - started
    prompt_tokens = sum(a.node_prompt_tokens for a in answers)
    return {
        "summary": {
            "latency_mean_s": round(statistics.mean(a.latency_s for a in answers), 2),
            "answers_per_min": round(60 * len(together) / wall, 2),
            "answer_tokens_mean": round(statistics.mean(a.completion_tokens for a in answers), 1),  # plan included
            "node_prompt_tokens": prompt_tokens,
            "node_prefill_computed": computed,
            "prefix_hit_rate": round(sum(a.prefix_hit_tokens for a in answers) / prompt_tokens, 3),
            "prefix_shareable_rate": round(sum(a.node_prompt_shareable_tokens for a in answers) / prompt_tokens, 3),
            "nodes_done": sum(n.status.value == "done" for a in answers for n in a.nodes),
            "nodes": sum(len(a.nodes) for a in answers),
        },
        "answers": [{"prompt": q, "text": a.text} for q, a in zip(plans, answers)],
    }


def run_given_plans(budget: int, line_delay: float, limit: int | None) -> dict:
    rows = load_jsonl("dag_plans.jsonl")[:limit]
    plans = {r["prompt"]: r["plan"] for r in rows}
    base = AnswerConfig(max_tokens=budget, node_max_tokens=budget, plan_max_tokens=96)
    summary, raw = {}, {}
    for name, overrides in VARIANTS.items():
        engine = AsyncEngine(lambda: LLMEngine.from_config(EngineConfig(max_batch_size=32, max_model_len=1024, cache_answers=False)))
        try:
            out = asyncio.run(_run_variant(engine, plans, base.model_copy(update=overrides), line_delay))
        finally:
            engine.shutdown()
        summary[name], raw[name] = out["summary"], out["answers"]
        print(f"{name}: {summary[name]}", flush=True)
    plato, quoting = summary["plato"], summary["plato-no-follow-up"]
    result = {
        "data": "dag_plans", "questions": len(rows), "budget": budget, "line_delay_s": line_delay, "modes": summary,
        "kv_reuse_overhead_cut": plato["prefix_hit_rate"],
        "kv_reuse_ceiling": plato["prefix_shareable_rate"],
        "prefill_vs_quoting": round(plato["node_prefill_computed"] / quoting["node_prefill_computed"], 3),
        "prefill_vs_no_reuse": round(plato["node_prefill_computed"] / summary["plato-no-kv-reuse"]["node_prefill_computed"], 3),
        "answers": raw, "machine": machine(),
    }
    path = write_result("plato_dag", result)
    print(table(["variant", "latency mean s", "answers/min", "node prompt tok", "prefill computed", "prefix hit", "shareable"],
                [[n, s["latency_mean_s"], s["answers_per_min"], s["node_prompt_tokens"], s["node_prefill_computed"],
                  s["prefix_hit_rate"], s["prefix_shareable_rate"]] for n, s in summary.items()]))
    print({k: result[k] for k in ("kv_reuse_overhead_cut", "kv_reuse_ceiling", "prefill_vs_quoting", "prefill_vs_no_reuse")})
    print(f"wrote {path}")
    return result
