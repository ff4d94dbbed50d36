"""`python -m bench plato`'s run machinery: the order variants take turns in, the kept answers a run
resumes from, the figures it reports, and a variant worker process on a real (tiny) model."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bench.plato_bench import VARIANTS, alone_summary, measure, part_checks, per_category, report, run
from bench.plato_store import PlatoRunStore, turns
from bench.plato_workers import VariantFailed, VariantWorker


def row(latency_s: float, tokens: int = 10, planned: bool = False, **extra) -> dict:
    base = {"latency_s": latency_s, "tokens": tokens, "planned": planned, "fallback": None, "plan_s": None,
            "prefix_hit_tokens": 0, "node_prompt_tokens": 0, "node_prompt_shareable_tokens": 0, "text": "t"}
    return {**base, **extra}


class FakeWorker:
    """Answers with a latency that tells which variant answered which question; logs every call."""

    def __init__(self, name: str, log: list, latency: dict[str, float]):
        self.name, self.log, self.latency = name, log, latency
        log.append(("start", name))

    def answer(self, question: str) -> dict:
        self.log.append(("answer", self.name, question))
        return row(self.latency[self.name], text=f"{self.name}:{question}")

    def together(self, questions: list[str]) -> tuple[list[dict], float]:
        self.log.append(("together", self.name, tuple(questions)))
        return [row(1.0) for _ in questions], 2.0 * len(questions)

    def close(self) -> None:
        self.log.append(("close", self.name))


QUESTIONS = [{"id": f"q{i}", "prompt": f"question {i}", "category": "generic" if i < 2 else "math"} for i in range(3)]


def test_turns_go_question_by_question_rotating_the_first_variant_and_skip_what_is_done():
    assert turns(["a", "b", "c"], ["x", "y"], {}) == [("a", "x"), ("a", "y"), ("b", "y"), ("b", "x"),
                                                    ("c", "x"), ("c", "y")]
    assert turns(["a", "b"], ["x", "y", "z"], {"y": {"a"}, "z": {"b"}}) == [("a", "x"), ("a", "z"), ("b", "y"),
                                                                           ("b", "x")]


def test_the_store_keeps_rows_by_question_skips_a_cut_line_and_matches_in_flight_runs_by_their_questions(tmp_path):
    store = PlatoRunStore(tmp_path, {"data": "vicuna80", "budget": 192})
    assert store.answered("ar") == {}
    store.add("ar", {"id": "q0", **row(1.5)})
    with (store.folder / "ar.jsonl").open("a") as f:
        f.write('{"id": "q1", "laten')  # a run killed mid-write
    again = PlatoRunStore(tmp_path, {"budget": 192, "data": "vicuna80"})  # same settings, any key order
    assert again.folder == store.folder
    assert list(again.answered("ar")) == ["q0"]
    assert PlatoRunStore(tmp_path, {"data": "vicuna80", "budget": 96}).folder != store.folder
    store.save_together("ar", ["q0", "q1"], [row(1.0), row(2.0)], 3.0)
    assert store.together("ar", ["q0", "q1"]) == ([row(1.0), row(2.0)], 3.0)
    assert store.together("ar", ["q0"]) is None and store.together("plato", ["q0", "q1"]) is None
    store.clear()  # --fresh
    assert store.answered("ar") == {} and store.together("ar", ["q0", "q1"]) is None
    assert (store.folder / "signature.json").exists()


def test_measure_interleaves_variants_per_question_and_a_second_run_resumes_without_asking_again(tmp_path):
    store, log = PlatoRunStore(tmp_path, {"s": 1}), []
    make = lambda name: FakeWorker(name, log, {"ar": 4.0, "plato": 2.0})  # noqa: E731
    answers, together = measure(QUESTIONS, ["ar", "plato"], store, 2, make)
    asked = [(e[1], e[2]) for e in log if e[0] == "answer"]
    assert asked == [("ar", "question 0"), ("plato", "question 0"), ("plato", "question 1"), ("ar", "question 1"),
                     ("ar", "question 2"), ("plato", "question 2")]
    # the in-flight runs on fresh workers, one at a time: no prefix cached while answering alone helps them
    assert log[-6:] == [("start", "ar"), ("together", "ar", ("question 0", "question 1")), ("close", "ar"),
                        ("start", "plato"), ("together", "plato", ("question 0", "question 1")), ("close", "plato")]
    assert [e[0] for e in log[:-6]].count("close") == 2
    assert [r["id"] for r in answers["plato"]] == ["q0", "q1", "q2"]
    assert answers["ar"][2]["text"] == "ar:question 2" and together["plato"] == ([row(1.0)] * 2, 4.0)

    log.clear()
    again, _ = measure(QUESTIONS, ["ar", "plato"], store, 2, make)
    assert log == [] and again == answers  # nothing asked, no process started

    answers, _ = measure(QUESTIONS, ["ar", "plato", "sot"], store, 2,
                         lambda name: FakeWorker(name, log, {"sot": 3.0}))
    assert {e[1] for e in log if e[0] == "start"} == {"sot"}
    assert [e[2] for e in log if e[0] == "answer"] == ["question 0", "question 1", "question 2"]


def test_measure_closes_every_started_worker_when_one_fails(tmp_path):
    log = []

    class Failing(FakeWorker):
        def answer(self, question):
            raise VariantFailed(f"{self.name}: broke")

    make = lambda name: (Failing if name == "plato" else FakeWorker)(name, log, {"ar": 1.0})  # noqa: E731
    with pytest.raises(VariantFailed, match="plato: broke"):
        measure(QUESTIONS, ["ar", "plato"], PlatoRunStore(tmp_path, {}), 2, make)
    assert sorted(e[1] for e in log if e[0] == "close") == ["ar", "plato"]
    assert list(PlatoRunStore(tmp_path, {}).answered("ar")) == ["q0"]  # what was made is kept


def test_the_report_computes_every_key_from_the_rows_overall_and_per_category():
    rows = [{**q, "sot_router_label": 1} for q in QUESTIONS]
    answers = {
        "ar": [row(8.0, tokens=192), row(6.0, tokens=100), row(4.0)],
        "plato": [row(2.0, planned=True, plan_s=1.0, node_prompt_tokens=100, prefix_hit_tokens=40,
                      node_prompt_shareable_tokens=50), row(3.0, planned=True, fallback="cycle"), row(4.0)],
        "plato-no-pipeline": [row(3.0), row(3.0), row(6.0)],
        "sot": [row(3.0), row(3.0), row(3.0)],
    }
    together = {name: ([row(1.0)] * 2, 60.0 if name == "ar" else 30.0) for name in answers}
    args = SimpleNamespace(data="vicuna80", quick=False, in_flight=2)
    result = report(args, rows, 192, answers, together)
    assert result["speedup_vs_ar"] == round(6.0 / 3.0, 2)
    assert result["pipeline_gain"] == 1.33 and result["throughput_vs_ar"] == 2.0
    assert result["speedup_vs_ar_where_ar_stopped"] == round(5.0 / 3.5, 2)  # q0 hit the 192 cap
    assert result["ar_hit_cap_share"] == round(1 / 3, 3)
    assert result["plan_valid_rate"] == 0.5 and result["kv_reuse_overhead_cut"] == 0.4
    assert result["kv_reuse_ceiling"] == 0.5 and result["draft_gain_ar"] is None
    generic, math = result["categories"]["generic"], result["categories"]["math"]
    assert (generic["questions"], math["questions"]) == (2, 1)
    assert generic["speedup_vs_ar"] == round(7.0 / 2.5, 2) and math["speedup_vs_ar"] == 1.0
    assert generic["speedup_vs_sot"] == 1.2 and generic["modes"]["plato"]["fallback_rate"] == 0.5
    assert result["answers"]["plato"][1] == {"id": "q1", "category": "generic", "latency_s": 3.0, "tokens": 10,
                                             "fallback": "cycle", "text": "t"}


def test_part_checks_count_empty_parts_and_parts_that_write_a_sub_question_out_again():
    text = ("**What is A?** A is a letter.\n\n"
            "**How is B used?** 1. What is A?\n2. How is B used?\n\n"
            "**Why C?** [not answered: the answer only repeated the question]\n\n"
            "**Enough light.** Enough light matters.")  # an outline point, not a question: restating it is fine
    assert part_checks(text) == (4, 1, 1, 1, 0)
    assert part_checks("a plain answer") == (0, 0, 0, 0, 0)
    cut = "**What is A?** A is a letter, and\n\n**Why B?** Because (so **it** is).\n\n**Why C?** Part.\n[cut short: late]"
    assert part_checks(cut) == (3, 0, 0, 0, 2)  # a paragraph cut at its budget, and one cut short


def test_the_part_rates_count_planned_answers_only():
    planned = row(2.0, planned=True, text="**What is A?** What is A? Indeed.\n\n**Why B?** Because.")
    fallen_back = row(2.0, planned=True, fallback="cycle", text="**What is A?** [not answered: no answer]")
    summary = alone_summary([planned, fallen_back, row(1.0)])
    assert summary["parts_copying_plan_rate"] == 0.5 and summary["parts_unanswered_rate"] == 0.0
    assert summary["parts_asking_rate"] == 0.5 and summary["parts_cut_rate"] == 0.0
    assert alone_summary([row(1.0)])["parts_copying_plan_rate"] is None


def test_per_category_counts_the_questions_routed_to_planning():
    rows = [{"id": "a", "category": "coding", "prompt": "Write a Python function that reverses a string."},
            {"id": "b", "category": "generic", "prompt": "How can I improve my time management skills?"}]
    out = per_category(rows, {"ar": [row(1.0), row(2.0)]})
    assert (out["coding"]["routed_to_plato"], out["generic"]["routed_to_plato"]) == (0, 1)
    assert out["coding"]["speedup_vs_ar"] is None and out["generic"]["modes"]["ar"] == alone_summary([row(2.0)])


@pytest.mark.parametrize("argv, message", [(["--variants", "ar,nope"], "--variants"), (["--variants", ","], "--variants"),
                                           (["--in-flight", "0"], "--in-flight")])
def test_bad_options_stop_the_bench_naming_the_option(argv, message):
    with pytest.raises(SystemExit, match=message):
        run(argv)


def test_every_variant_names_a_mode_the_orchestrator_has():
    from typing import get_args

    from graph.orchestrator import RequestMode

    assert {mode for mode, _, _ in VARIANTS.values()} == set(get_args(RequestMode))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tiny_model, tiny_tokenizer):
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def test_a_worker_answers_alone_and_all_at_once_in_its_own_process(tiny_model_dir):
    engine = {"model": str(tiny_model_dir), "max_batch_size": 4, "max_model_len": 256, "num_threads": 1}
    worker = VariantWorker("ar", "ar", {"max_tokens": 6}, engine)
    try:
        alone = worker.answer("baba babe")
        assert alone["tokens"] == 6 and not alone["planned"] and alone["latency_s"] > 0
        rows, wall = worker.together(["baba babe", "dada"])
        assert [r["tokens"] for r in rows] == [6, 6] and wall > 0
        assert rows[0]["text"] == alone["text"]  # greedy: the same answer alone or beside another
    finally:
        worker.close()
    json.dumps(alone)  # a row is plain data, as the store writes it


def test_a_worker_whose_engine_cannot_be_built_fails_naming_its_variant(tmp_path):
    with pytest.raises(VariantFailed, match="plato-no-drafts: .*"):
        VariantWorker("plato-no-drafts", "plato", {}, {"model": str(tmp_path / "missing")})
