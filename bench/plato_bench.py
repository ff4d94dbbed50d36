"""`python -m bench plato`: plain decoding against Skeleton-of-Thought and plan-then-decode, in one run.

Every mode answers the same questions on the same engine settings with the same answer-token
budget: `ar`, `sot`, `plato`, and `plato` without pipelining, without KV reuse and without the
engine's jump-forward over the plan grammar's forced tokens; `ar` and `plato` also without the
engine's prompt-lookup drafts. Each variant has an engine of its own in a process of its own
(bench/plato_workers.py). Latency is measured one question at a time, the variants taking turns
question by question (bench/plato_store.py), so a ratio between two variants compares the same
minutes of this machine; throughput with the first `--in-flight` questions sent at once. Answers
are kept as they are made (`--store`), and a run with the same settings resumes. Writes
bench/results/plato.json (overall, per category, every answer) and plato.png (plato_<set>.json and .png
for a set other than Vicuna-80).
"""
from __future__ import annotations

import argparse
import re
import statistics
from collections.abc import Callable
from pathlib import Path

from bench.common import REPO, RESULTS, device_signature, load_jsonl, machine, table, write_result
from bench.plato_store import PlatoRunStore, turns
from bench.plato_workers import VariantWorker
from engine.config import EngineConfig
from engine.loader import select_device_and_dtype
from graph.orchestrator import AnswerConfig
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
    # nodes free to write the plan's sub-questions out again (AnswerConfig.plan_copy_tokens)
    "plato-no-copy-guard": ("plato", {"plan_copy_tokens": None}, {}),
    # node answers free to open a line with "What", "How", ... (AnswerConfig.node_no_openings)
    "plato-no-opening-guard": ("plato", {"node_no_openings": []}, {}),
    # a node admitted while the plan (or other nodes) decodes prefilled in a pass of its own
    "plato-no-mixed-batches": ("plato", {}, {"mixed_batches": False}),
    # a node that starts earlier takes a larger share of the budget (AnswerConfig.node_budget_stagger)
    "plato-staggered": ("plato", {"node_budget_stagger": 12}, {}),
    # nodes run to the end of their share, not wrapping up at a sentence end (AnswerConfig.node_wrap_up_tokens)
    "plato-no-wrap-up": ("plato", {"node_wrap_up_tokens": None}, {}),
    # the router's mode for each question, answered as such (the report otherwise takes each question's
    # latency from the variant of its routed mode)
    "auto": ("auto", {}, {}),
}
# Each variant's process holds an engine of its own, about 2.6 GB here (the model, and a KV cache for
# 32 sequences of 1,024 tokens): nine did not fit in this box's 24 GB (the page cache thrashed and
# every variant slowed), so the default is eight and `--variants` names the others.
OPTIONAL_VARIANTS = ("plato-no-copy-guard", "plato-no-opening-guard", "plato-no-mixed-batches", "plato-staggered",
                     "plato-no-wrap-up", "auto")
DEFAULT_VARIANTS = [name for name in VARIANTS if name not in OPTIONAL_VARIANTS]
# Part of a run's settings: raised when a change to the code (not to a setting) alters the answers or
# their timing, so that a resumed run never mixes answers made before it with answers made after.
# 2: node prompts name their preamble, whose KV serves the first node of every later question.
# 3: prompts admitted while others decode are prefilled in their decode pass (EngineConfig.mixed_batches).
# 4: nodes' answers open no line with a question word (AnswerConfig.node_no_openings; the engine's no_openings).
ANSWER_REVISION = 4
PARAGRAPH = re.compile(r"\*\*(.+?)\*\* (.*?)(?=\n\n\*\*|\Z)", re.S)
SENTENCE_ENDED = re.compile(r"[.!?][\"')\]*]*\s*$")


def _p90(values: list[float]) -> float:
    return sorted(values)[max(0, round(0.9 * len(values)) - 1)]


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def part_checks(text: str) -> tuple[int, int, int, int, int]:
    """Of an answer assembled from parts (plato's nodes, sot's points: '**sub-question** answer'
    paragraphs): how many parts, how many are marked not answered, how many answers write out one of
    the answer's sub-questions again (a heading ending in '?', as plan nodes do; an outline's short
    points are not questions, and restating a point is how its answer begins), how many answers
    ask questions themselves (a '?': mostly a list of questions in place of an answer), and how many
    answers stop in the middle of a sentence (cut at their share of the budget)."""
    parts = PARAGRAPH.findall(text)
    questions = [heading.rstrip("?") for heading, _ in parts if heading.endswith("?")]
    answered = [body for _, body in parts if not body.startswith("[not answered")]
    copying = sum(any(q in body for q in questions) for body in answered)
    cut = sum(not SENTENCE_ENDED.search(body) for body in answered)
    return len(parts), len(parts) - len(answered), copying, sum("?" in body for body in answered), cut


def alone_summary(rows: list[dict]) -> dict:
    """Per-question figures of one variant, from its questions answered one at a time."""
    latencies = [r["latency_s"] for r in rows]
    prompt_tokens = sum(r["node_prompt_tokens"] for r in rows)
    planned = [r for r in rows if r["planned"]]
    plan_s = [r["plan_s"] for r in rows if r["plan_s"]]
    checks = [part_checks(r["text"]) for r in planned if not r["fallback"]]
    parts = sum(c[0] for c in checks)
    return {
        "questions": len(rows),
        "latency_mean_s": round(statistics.mean(latencies), 2),
        "latency_p90_s": round(_p90(latencies), 2),
        "completion_tokens_mean": round(statistics.mean(r["tokens"] for r in rows), 1),
        "answer_tok_s_alone": round(sum(r["tokens"] for r in rows) / sum(latencies), 1),
        "plan_s_mean": round(statistics.mean(plan_s), 2) if plan_s else 0.0,
        "fallback_rate": round(sum(bool(r["fallback"]) for r in planned) / len(planned), 3) if planned else None,
        "prefix_hit_rate": round(sum(r["prefix_hit_tokens"] for r in rows) / prompt_tokens, 3) if prompt_tokens else None,
        # the most any prefix cache could serve with these prompts: what earlier nodes had computed
        "prefix_shareable_rate": round(sum(r["node_prompt_shareable_tokens"] for r in rows) / prompt_tokens, 3)
        if prompt_tokens else None,
        # answer quality a judge is not needed for: parts left empty, and parts that copied the plan
        "parts_unanswered_rate": round(sum(c[1] for c in checks) / parts, 3) if parts else None,
        "parts_copying_plan_rate": round(sum(c[2] for c in checks) / parts, 3) if parts else None,
        "parts_asking_rate": round(sum(c[3] for c in checks) / parts, 3) if parts else None,
        "parts_cut_rate": round(sum(c[4] for c in checks) / parts, 3) if parts else None,
    }


def together_summary(rows: list[dict], wall_s: float) -> dict:
    """Throughput of one variant with its in-flight questions all sent at once."""
    return {"in_flight": len(rows), "answers_per_min": round(60 * len(rows) / wall_s, 2),
            "answer_tok_s": round(sum(r["tokens"] for r in rows) / wall_s, 1)}


def per_category(rows: list[dict], answers: dict[str, list[dict]]) -> dict:
    """Every variant's per-question figures within each category (file order), with plato's speed-up
    over ar and over sot there and how many of its questions the router sends to planning."""
    out = {}
    for category in dict.fromkeys(r["category"] for r in rows):
        index = [i for i, r in enumerate(rows) if r["category"] == category]
        modes = {name: alone_summary([kept[i] for i in index]) for name, kept in answers.items()}
        latency = {name: m["latency_mean_s"] for name, m in modes.items()}
        out[category] = {
            "questions": len(index),
            "routed_to_plato": sum(route(rows[i]["prompt"])[0] == "plato" for i in index),
            "speedup_vs_ar": _ratio(latency.get("ar"), latency.get("plato")),
            "speedup_vs_sot": _ratio(latency.get("sot"), latency.get("plato")),
            "modes": modes,
        }
    return out


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


# prefix reuse is what the orchestrator marks (off in the no-KV-reuse variant), nothing automatic beside it
ENGINE = {"max_batch_size": 32, "max_model_len": 1024, "cache_answers": False}


def measure(rows: list[dict], variants: list[str], store: PlatoRunStore, in_flight: int,
            make_worker: Callable[[str], VariantWorker]) -> tuple[dict[str, list[dict]], dict[str, tuple]]:
    """Every variant's answer to every question alone, question by question (`turns`), then each
    variant's first `in_flight` questions all at once; whatever `store` already holds is taken from
    it and the rest kept there as it is made. Returns (rows per variant in question order, (rows,
    wall seconds) of the in-flight run per variant). Workers are started only for variants with
    work left; each in-flight run gets a fresh one, closed when it is done."""
    ids = [r["id"] for r in rows]
    prompt = {r["id"]: r["prompt"] for r in rows}
    kept = {name: store.answered(name) for name in variants}
    todo = turns(ids, variants, {name: set(k) for name, k in kept.items()})
    flight_ids = ids[:in_flight]
    workers: dict[str, VariantWorker] = {}

    def worker(name: str) -> VariantWorker:
        if name not in workers:
            workers[name] = make_worker(name)
        return workers[name]

    try:
        for n, (qid, name) in enumerate(todo, 1):
            row = {"id": qid, **worker(name).answer(prompt[qid])}
            store.add(name, row)
            kept[name][qid] = row
            print(f"[{n}/{len(todo)}] {qid} {name}: {row['latency_s']:.1f} s, {row['tokens']} tokens", flush=True)
    finally:
        for w in workers.values():
            w.close()
    together = {}
    for name in variants:
        together[name] = store.together(name, flight_ids)
        if together[name] is not None:
            continue
        # a fresh engine: one that has just answered these questions alone holds their prompts' and
        # plans' KV in its prefix cache, which new questions would not find there
        fresh = make_worker(name)
        try:
            together[name] = fresh.together([prompt[i] for i in flight_ids])
        finally:
            fresh.close()
        store.save_together(name, flight_ids, *together[name])
        print(f"{name}, {len(flight_ids)} in flight: {together[name][1]:.1f} s", flush=True)
    return {name: [kept[name][i] for i in ids] for name in variants}, together


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench plato", description=__doc__)
    parser.add_argument("--data", default="vicuna80", choices=["vicuna80", "mtbench80"])
    parser.add_argument("--limit", type=int, default=None, help="first N questions (default: all; --quick: 4)")
    parser.add_argument("--quick", action="store_true", help="4 questions, smaller budgets")
    parser.add_argument("--budget", type=int, default=None, help="answer-token budget of every mode")
    parser.add_argument("--planning-only", action="store_true", help="only the questions the router sends to plato")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)} (default: all but "
                        f"{', '.join(OPTIONAL_VARIANTS)}; ar and plato give the keys)")
    parser.add_argument("--in-flight", type=int, default=16,
                        help="how many of the questions (the first) are sent at once for the throughput figures")
    parser.add_argument("--store", type=Path, default=RESULTS / "plato_runs",
                        help="where answers are kept as they are made; a run with the same settings resumes")
    parser.add_argument("--fresh", action="store_true", help="answer everything again (drop the kept answers)")
    parser.add_argument("--name", default=None,
                        help="results file name under bench/results (default: plato, or plato_<data> for another set)")
    parser.add_argument("--given-plans", action="store_true",
                        help="plans with dependencies given (data/dag_plans.jsonl), nodes decoded: see bench/plato_dag.py")
    parser.add_argument("--line-delay", type=float, default=1.5, help="with --given-plans: seconds per plan line")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise SystemExit(f"--variants: comma-separated names of {', '.join(VARIANTS)}; got {args.variants!r}")
    if args.in_flight < 1:
        raise SystemExit(f"--in-flight: at least 1, got {args.in_flight}")
    budget = args.budget or (96 if args.quick else 192)
    if args.given_plans:
        from bench.plato_dag import run_given_plans

        return run_given_plans(budget, args.line_delay, args.limit or (2 if args.quick else None))
    rows = load_jsonl(f"{args.data}.jsonl")
    if args.planning_only:
        rows = [r for r in rows if route(r["prompt"])[0] == "plato"]
    rows = rows[: args.limit or (4 if args.quick else len(rows))]

    # nodes and outline points share the budget (AnswerConfig.nodes_per_budget): budget // 4 each
    base = AnswerConfig(max_tokens=budget, node_max_tokens=budget, plan_max_tokens=96)
    signature = {"data": args.data, "answer": base.model_dump(), "engine": EngineConfig(**ENGINE).model_dump(),
                 "revision": ANSWER_REVISION, **device_signature(*select_device_and_dtype(EngineConfig(**ENGINE)))}
    store = PlatoRunStore(args.store, signature)
    if args.fresh:
        store.clear()
    print(f"answers kept in {store.folder}", flush=True)

    def make_worker(name: str) -> VariantWorker:
        mode, overrides, engine_overrides = VARIANTS[name]
        # an engine per variant: no prefix cached by one variant can help another
        return VariantWorker(name, mode, base.model_copy(update=overrides).model_dump(),
                             {**ENGINE, **engine_overrides})

    answers, together = measure(rows, variants, store, args.in_flight, make_worker)
    result = report(args, rows, budget, answers, together)
    result["store"] = str(store.folder.relative_to(REPO)) if store.folder.is_relative_to(REPO) else str(store.folder)
    # Vicuna-80 is the headline set; another set's figures sit beside it rather than replacing it
    name = args.name or ("plato" if args.data == "vicuna80" else f"plato_{args.data}")
    path = write_result(name, result)
    _chart(result["modes"], RESULTS / f"{name}.png")
    print(f"wrote {path}")
    return result


def report(args, rows: list[dict], budget: int, answers: dict[str, list[dict]], together: dict[str, tuple]) -> dict:
    """The issue's keys and the tables, from every variant's rows."""
    summary = {name: {**alone_summary(kept), **together_summary(*together[name])} for name, kept in answers.items()}
    latency = lambda name: summary[name]["latency_mean_s"] if name in summary else None  # noqa: E731
    per_minute = lambda name: summary[name]["answers_per_min"] if name in summary else None  # noqa: E731
    plato = summary.get("plato", {})
    # An ar answer that loops to the budget makes every shorter mode look fast: also compare
    # only where ar stopped by itself.
    stopped = [i for i, a in enumerate(answers["ar"]) if a["tokens"] < budget] if "ar" in answers else []
    routed = [route(r["prompt"])[0] for r in rows]
    planned = [i for i, mode in enumerate(routed) if mode == "plato"]

    def mean_over(name: str, index: list[int]) -> float | None:
        return statistics.mean(answers[name][i]["latency_s"] for i in index) if name in answers and index else None

    # `auto` runs exactly the routed mode, so its latency per question is that mode's, measured above
    auto = (statistics.mean(answers[mode][i]["latency_s"] for i, mode in enumerate(routed))
            if {"ar", "plato"} <= set(answers) else None)
    labels = [r.get("sot_router_label") for r in rows]
    result = {
        "data": args.data, "questions": len(rows), "budget": budget, "quick": args.quick,
        "in_flight": min(args.in_flight, len(rows)), "variants_in_turns": True, "modes": summary,
        "speedup_vs_ar": _ratio(latency("ar"), latency("plato")),
        "speedup_vs_ar_planned": _ratio(mean_over("ar", planned), mean_over("plato", planned)),
        "speedup_vs_ar_auto": _ratio(latency("ar"), auto),
        "ar_hit_cap_share": round(1 - len(stopped) / len(rows), 3) if "ar" in answers else None,
        "speedup_vs_ar_where_ar_stopped": _ratio(mean_over("ar", stopped), mean_over("plato", stopped)),
        "throughput_vs_ar": _ratio(per_minute("plato"), per_minute("ar")),
        "pipeline_gain": _ratio(latency("plato-no-pipeline"), latency("plato")),
        "jump_forward_gain": _ratio(latency("plato-no-jump-forward"), latency("plato")),
        "mixed_batch_gain": _ratio(latency("plato-no-mixed-batches"), latency("plato")),
        "draft_gain_ar": _ratio(latency("ar-no-drafts"), latency("ar")),
        "draft_gain_plato": _ratio(latency("plato-no-drafts"), latency("plato")),
        "speedup_vs_ar_without_drafts": _ratio(latency("ar-no-drafts"), latency("plato-no-drafts")),
        "kv_reuse_overhead_cut": plato.get("prefix_hit_rate"),
        "kv_reuse_ceiling": plato.get("prefix_shareable_rate"),
        "plan_valid_rate": round(1 - (plato.get("fallback_rate") or 0.0), 3) if plato else None,
        "router_accuracy": round(statistics.mean(
            (mode == "plato") == bool(lab) for mode, lab in zip(routed, labels)), 3) if None not in labels else None,
        "categories": per_category(rows, answers),
        "answers": {name: [{"id": r["id"], "category": r["category"], "latency_s": round(a["latency_s"], 2),
                            "tokens": a["tokens"], "fallback": a["fallback"], "text": a["text"]}
                           for r, a in zip(rows, kept)] for name, kept in answers.items()},
        "machine": machine(),
    }
    print(table(["mode", "latency mean s", "p90 s", "answers/min", "tok/s", "fallback", "prefix hit", "shareable",
                 "parts unanswered", "parts copying plan", "parts asking", "parts cut"],
                [[n, s["latency_mean_s"], s["latency_p90_s"], s["answers_per_min"], s["answer_tok_s"],
                  s["fallback_rate"], s["prefix_hit_rate"], s["prefix_shareable_rate"], s["parts_unanswered_rate"],
                  s["parts_copying_plan_rate"], s["parts_asking_rate"], s["parts_cut_rate"]] for n, s in summary.items()]))
    shown = [name for name in ("ar", "sot", "plato") if name in answers]
    print(table(["category", "questions", "routed to plato", *(f"{n} s" for n in shown), "plato vs ar", "plato vs sot"],
                [[c, v["questions"], v["routed_to_plato"], *(v["modes"][n]["latency_mean_s"] for n in shown),
                  v["speedup_vs_ar"], v["speedup_vs_sot"]] for c, v in result["categories"].items()]))
    print({k: result[k] for k in ("speedup_vs_ar", "speedup_vs_ar_planned", "speedup_vs_ar_auto", "throughput_vs_ar",
                                  "pipeline_gain", "jump_forward_gain", "mixed_batch_gain", "draft_gain_ar",
                                  "draft_gain_plato",
                                  "speedup_vs_ar_without_drafts", "kv_reuse_overhead_cut", "kv_reuse_ceiling",
                                  "plan_valid_rate", "router_accuracy")})
    return result
