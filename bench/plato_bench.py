"""`python -m bench plato`: plain decoding against Skeleton-of-Thought and plan-then-decode, in one run.

Every mode answers the same questions on the same engine with the same answer-token budget:
`ar`, `sot`, `plato`, and `plato` without pipelining, without KV reuse and without the engine's
jump-forward over the plan grammar's forced tokens; `ar` and `plato` also without the engine's
prompt-lookup drafts. Latency is measured
one question at a time; throughput with all questions in flight at once. Writes
bench/results/plato.json and plato.png.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from bench.common import RESULTS, load_jsonl, machine, table, write_result
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine
from graph.orchestrator import Answer, AnswerConfig, EngineClient, Orchestrator
from graph.router import route

VARIANTS = {  # name: (mode, AnswerConfig overrides, EngineConfig overrides)
    "ar": ("ar", {}, {}),
    "sot": ("sot", {}, {}),
    "plato": ("plato", {}, {}),
    "plato-no-pipeline": ("plato", {"pipelining": False}, {}),
    "plato-no-kv-reuse": ("plato", {"kv_reuse": False}, {}),
    # the plan's forced tokens (`needs:`, `]`, the next line's number) decoded one step each
    "plato-no-jump-forward": ("plato", {}, {"jump_forward": False}),
    # every token a step of its own: what the engine's drafts (`speculative_tokens`) gain each mode
    "ar-no-drafts": ("ar", {}, {"speculative_tokens": 0}),
    "plato-no-drafts": ("plato", {}, {"speculative_tokens": 0}),
}


def _p90(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.9 * len(values)) - 1)]


async def _run_variant(engine: AsyncEngine, mode: str, config: AnswerConfig, questions: list[str]):
    orchestrator = Orchestrator(EngineClient(engine), config)
    one_by_one = [await orchestrator.answer(q, mode) for q in questions]
    started = time.perf_counter()
    together = await asyncio.gather(*(orchestrator.answer(q, mode) for q in questions))
    return one_by_one, together, time.perf_counter() - started


def _summary(answers: list[Answer], together: list[Answer], wall_s: float) -> dict:
    latencies = [a.latency_s for a in answers]
    prompt_tokens = sum(a.node_prompt_tokens for a in answers)
    planned = [a for a in answers if a.plan is not None or a.fallback]
    return {
        "latency_mean_s": round(statistics.mean(latencies), 2),
        "latency_p90_s": round(_p90(latencies), 2),
        "answers_per_min": round(60 * len(together) / wall_s, 2),
        "answer_tok_s": round(sum(a.completion_tokens for a in together) / wall_s, 1),
        "completion_tokens_mean": round(statistics.mean(a.completion_tokens for a in answers), 1),
        "plan_s_mean": round(statistics.mean([a.plan_s for a in answers if a.plan_s] or [0.0]), 2),
        "fallback_rate": round(sum(bool(a.fallback) for a in planned) / len(planned), 3) if planned else None,
        "prefix_hit_rate": round(sum(a.prefix_hit_tokens for a in answers) / prompt_tokens, 3) if prompt_tokens else None,
        # the most any prefix cache could serve with these prompts: what earlier nodes had computed
        "prefix_shareable_rate": round(sum(a.node_prompt_shareable_tokens for a in answers) / prompt_tokens, 3)
        if prompt_tokens else None,
    }


def _chart(summary: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(names, [summary[n]["latency_mean_s"] for n in names], color="tab:blue")
    axes[0].set_title("mean latency per question (s), one at a time")
    axes[1].bar(names, [summary[n]["answers_per_min"] for n in names], color="tab:green")
    axes[1].set_title("answers per minute, all questions in flight")
    for ax in axes:
        ax.tick_params(axis="x", rotation=25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench plato", description=__doc__)
    parser.add_argument("--data", default="vicuna80", choices=["vicuna80", "mtbench80"])
    parser.add_argument("--limit", type=int, default=None, help="first N questions (default: all; --quick: 4)")
    parser.add_argument("--quick", action="store_true", help="4 questions, smaller budgets")
    parser.add_argument("--budget", type=int, default=None, help="answer-token budget of every mode")
    parser.add_argument("--planning-only", action="store_true", help="only the questions the router sends to plato")
    parser.add_argument("--given-plans", action="store_true",
                        help="plans with dependencies given (data/dag_plans.jsonl), nodes decoded: see bench/plato_dag.py")
    parser.add_argument("--line-delay", type=float, default=1.5, help="with --given-plans: seconds per plan line")
    args = parser.parse_args(argv)
    budget = args.budget or (96 if args.quick else 192)
    if args.given_plans:
        from bench.plato_dag import run_given_plans

        return run_given_plans(budget, args.line_delay, args.limit or (2 if args.quick else None))
    rows = load_jsonl(f"{args.data}.jsonl")
    if args.planning_only:
        rows = [r for r in rows if route(r["prompt"])[0] == "plato"]
    rows = rows[: args.limit or (4 if args.quick else len(rows))]
    questions = [r["prompt"] for r in rows]

    # nodes and outline points share the budget (AnswerConfig.nodes_per_budget): budget // 4 each
    base = AnswerConfig(max_tokens=budget, node_max_tokens=budget, plan_max_tokens=96)
    summary, raw = {}, {}
    for name, (mode, overrides, engine_overrides) in VARIANTS.items():
        # a fresh engine per variant: no prefix cached by an earlier variant can help a later one
        engine_config = EngineConfig(max_batch_size=32, max_model_len=1024, **engine_overrides)
        engine = AsyncEngine(lambda: LLMEngine.from_config(engine_config))
        try:
            config = base.model_copy(update=overrides)
            one_by_one, together, wall = asyncio.run(_run_variant(engine, mode, config, questions))
        finally:
            engine.shutdown()
        summary[name] = _summary(one_by_one, together, wall)
        raw[name] = [{"id": r["id"], "category": r["category"], "latency_s": round(a.latency_s, 2),
                      "tokens": a.completion_tokens, "fallback": a.fallback, "text": a.text}
                     for r, a in zip(rows, one_by_one)]
        print(f"{name}: {summary[name]}", flush=True)

    ar, plato = summary["ar"], summary["plato"]
    # An ar answer that loops to the budget makes every shorter mode look fast: also compare
    # only where ar stopped by itself.
    stopped = [i for i, a in enumerate(raw["ar"]) if a["tokens"] < budget]
    mean_over = lambda name, ids: statistics.mean(raw[name][i]["latency_s"] for i in ids)  # noqa: E731
    labels = [r.get("sot_router_label") for r in rows]
    # `auto` runs exactly the routed mode, so its latency per question is that mode's, measured above
    routed = [route(r["prompt"])[0] for r in rows]
    auto_latency = [raw[mode][i]["latency_s"] for i, mode in enumerate(routed)]
    planned = [i for i, mode in enumerate(routed) if mode == "plato"]
    result = {
        "data": args.data, "questions": len(rows), "budget": budget, "quick": args.quick, "modes": summary,
        "speedup_vs_ar": round(ar["latency_mean_s"] / plato["latency_mean_s"], 2),
        "speedup_vs_ar_planned": round(mean_over("ar", planned) / mean_over("plato", planned), 2) if planned else None,
        "speedup_vs_ar_auto": round(ar["latency_mean_s"] / statistics.mean(auto_latency), 2),
        "ar_hit_cap_share": round(1 - len(stopped) / len(rows), 3),
        "speedup_vs_ar_where_ar_stopped": round(mean_over("ar", stopped) / mean_over("plato", stopped), 2) if stopped else None,
        "throughput_vs_ar": round(plato["answers_per_min"] / ar["answers_per_min"], 2),
        "pipeline_gain": round(summary["plato-no-pipeline"]["latency_mean_s"] / plato["latency_mean_s"], 2),
        "jump_forward_gain": round(summary["plato-no-jump-forward"]["latency_mean_s"] / plato["latency_mean_s"], 2),
        "draft_gain_ar": round(summary["ar-no-drafts"]["latency_mean_s"] / ar["latency_mean_s"], 2),
        "draft_gain_plato": round(summary["plato-no-drafts"]["latency_mean_s"] / plato["latency_mean_s"], 2),
        "speedup_vs_ar_without_drafts": round(summary["ar-no-drafts"]["latency_mean_s"]
                                              / summary["plato-no-drafts"]["latency_mean_s"], 2),
        "kv_reuse_overhead_cut": plato["prefix_hit_rate"],
        "kv_reuse_ceiling": plato["prefix_shareable_rate"],
        "plan_valid_rate": round(1 - (plato["fallback_rate"] or 0.0), 3),
        "router_accuracy": round(statistics.mean(
            (route(r["prompt"])[0] == "plato") == bool(lab) for r, lab in zip(rows, labels)), 3)
        if None not in labels else None,
        "answers": raw, "machine": machine(),
    }
    path = write_result("plato", result)
    _chart(summary, RESULTS / "plato.png")
    print(table(["mode", "latency mean s", "p90 s", "answers/min", "tok/s", "fallback", "prefix hit", "shareable"],
                [[n, s["latency_mean_s"], s["latency_p90_s"], s["answers_per_min"], s["answer_tok_s"],
                  s["fallback_rate"], s["prefix_hit_rate"], s["prefix_shareable_rate"]] for n, s in summary.items()]))
    print({k: result[k] for k in ("speedup_vs_ar", "speedup_vs_ar_planned", "speedup_vs_ar_auto", "throughput_vs_ar", "pipeline_gain", "jump_forward_gain",
                                  "draft_gain_ar", "draft_gain_plato", "speedup_vs_ar_without_drafts",
                                  "kv_reuse_overhead_cut", "kv_reuse_ceiling",
                                  "plan_valid_rate", "router_accuracy")})
    print(f"wrote {path}")
    return result
