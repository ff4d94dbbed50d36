"""The scheduling benchmark's policies and counts, on the tiny random model with stand-in labels and
predictions: every policy gives every request its one greedy answer, padded batches cost rows x
steps, caps cut only overruns and the recompute is counted, and the reported ratios are the measured
ones."""
from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch

from bench.schedule_bench import (HEADLINE, PREDICTED, compare, draw_workload, issue_keys, policy_configs,
                                  policy_table, policy_turns, predict_sharing_kv, print_progress, run,
                                  run_pair_in_turns, run_policies)
from bench.schedule_policies import (Job, PolicyClock, PolicyRun, box_speed, drain, run_continuous, run_in_turns,
                                     run_static, running_clock, summarize)
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.types import FinishReason, GenerationRequest, SamplingParams
from predictor.bins import LengthBins

MAX_TOKENS = 40
EDGES = [8, 16, 32]
STOP_IDS = set(range(6, 20))  # the tiny model never picks its EOS: these end answers at varied lengths
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, stop_on_loop=True)
PREDICTION_S = 0.25


def engine(tiny_model, tiny_tokenizer, **config) -> LLMEngine:
    built = LLMEngine(tiny_model, tiny_tokenizer, EngineConfig(max_model_len=256, cache_answers=False, preempt_for_priority=False,
                                                                **config))
    built.stop_token_ids = STOP_IDS
    return built


@pytest.fixture(scope="module")
def workload(tiny_model, tiny_tokenizer):
    """40 jobs labelled by decoding them on their own engine; a third under-predicted (to be cut),
    the rest over-predicted; then every policy run once."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rng = random.Random(7)
    prompts = [[rng.randrange(20, 256) for _ in range(rng.randrange(3, 20))] for _ in range(40)]
    reference = engine(tiny_model, tiny_tokenizer, max_batch_size=16).generate(
        [GenerationRequest(id=f"j{i}", prompt_ids=p, params=PARAMS) for i, p in enumerate(prompts)])
    jobs = [Job(id=r.request_id, prompt_ids=p, label=r.completion_tokens,
                predicted=max(1, r.completion_tokens // 3) if i % 3 == 0 else r.completion_tokens + 3,
                expected=r.completion_tokens + 0.5)
            for i, (p, r) in enumerate(zip(prompts, reference))]
    static = engine(tiny_model, tiny_tokenizer, max_batch_size=64, max_prefill_tokens=8192)
    continuous = engine(tiny_model, tiny_tokenizer, max_batch_size=16)
    runs = run_policies(static, continuous, jobs, PARAMS, EDGES, PREDICTION_S)
    torch.set_num_threads(threads)
    return jobs, {r.request_id: r for r in reference}, runs


def test_lengths_vary_and_some_answers_overrun_their_prediction(workload):
    jobs, reference, _ = workload
    assert len({j.label for j in jobs}) > 10 and any(j.label == MAX_TOKENS for j in jobs)
    assert sum(LengthBins(edges=EDGES + [MAX_TOKENS]).bin_of(j.predicted) <
               LengthBins(edges=EDGES + [MAX_TOKENS]).bin_of(j.label) for j in jobs) >= 5


def test_every_policy_answers_every_request_once_with_its_greedy_answer(workload):
    jobs, reference, runs = workload
    assert list(runs) == ["continuous", "vanilla", "predicted", HEADLINE, "oracle", "continuous+predicted"]
    for name, policy in runs.items():
        assert sorted(policy.answers) == sorted(j.id for j in jobs), name
        assert all(policy.answers[j.id] == reference[j.id].token_ids for j in jobs), name
        assert set(policy.latency_s) == set(policy.answers) and policy.wall_s > 0


def _sampled(result) -> int:
    """Answer positions a request needs: its tokens, plus the end token it sampled if it stopped."""
    return result.completion_tokens + (result.finish_reason == FinishReason.STOP)


def test_vanilla_runs_batches_of_16_in_arrival_order_each_padded_to_its_longest(workload):
    jobs, reference, runs = workload
    vanilla = runs["vanilla"]
    chunks = [jobs[i : i + 16] for i in range(0, len(jobs), 16)]
    assert vanilla.batch_sizes == [16, 16, 8]
    assert vanilla.decode_tokens == sum(len(c) * max(_sampled(reference[j.id]) for j in c) for c in chunks)
    assert vanilla.recompute_tokens == 0
    finished_in_order = sorted(vanilla.latency_s, key=vanilla.latency_s.get)
    assert set(finished_in_order[:16]) == {j.id for j in chunks[0]}


def test_continuous_computes_only_what_the_answers_need(workload):
    jobs, reference, runs = workload
    assert runs["continuous"].decode_tokens == sum(_sampled(reference[j.id]) for j in jobs)
    assert runs["continuous"].prefill_tokens == sum(len(j.prompt_ids) for j in jobs)


def test_oracle_never_recomputes_and_each_cut_is_counted_once_per_resume(workload):
    jobs, _, runs = workload
    assert runs["oracle"].recompute_tokens == 0 and runs["predicted"].recompute_tokens == 0
    bins = LengthBins(edges=EDGES + [MAX_TOKENS])
    expected = 0
    for job in jobs:  # cut at each cap below the answer's length, keeping cap + 1 tokens, resumed a bin up
        b = bins.bin_of(job.predicted)
        while bins.cap(b) < job.label and bins.cap(b) < MAX_TOKENS:
            expected += len(job.prompt_ids) + bins.cap(b) + 1
            b = bins.next_bin(b)
    fcr = runs[HEADLINE]
    assert expected > 0 and fcr.recompute_tokens == expected
    assert fcr.prefill_tokens == sum(len(j.prompt_ids) for j in jobs) + expected


def test_binned_policies_batch_by_predicted_bin_and_vbs_packs_short_bins_larger(workload):
    _, _, runs = workload
    assert max(runs["predicted"].batch_sizes) <= 16
    assert max(runs[HEADLINE].batch_sizes) > 16  # the budget of 16 full-length requests fits more short ones


def test_the_cap_cuts_only_an_answer_longer_than_it(tiny_model, tiny_tokenizer, workload):
    jobs, reference, _ = workload
    job = next(j for j in jobs if 5 < j.label < MAX_TOKENS)
    static = engine(tiny_model, tiny_tokenizer, max_batch_size=4)
    request = lambda rid, cap: GenerationRequest(  # noqa: E731
        id=rid, prompt_ids=job.prompt_ids, params=PARAMS.model_copy(update={"length_cap": cap}))
    (exact, over), computed = run_static(static, [request("exact", job.label), request("over", job.label - 1)])
    assert exact.finish_reason == FinishReason.STOP and exact.token_ids == reference[job.id].token_ids
    assert over.finish_reason == FinishReason.CUT and over.token_ids == reference[job.id].token_ids
    assert computed == 2 * (job.label + 1)  # both rows pad until the last member sampled its end token
    assert not static.has_work()


def test_continuous_predicted_admits_the_shortest_predicted_first(tiny_model, tiny_tokenizer, workload):
    jobs, _, _ = workload
    distinct = list({j.label: j for j in jobs}.values())[:6]
    two_slots = engine(tiny_model, tiny_tokenizer, max_batch_size=2)
    policy = run_continuous(two_slots, distinct, PARAMS, [j.label for j in distinct])
    first_two = sorted(policy.latency_s, key=policy.latency_s.get)[:2]
    assert set(first_two) == {j.id for j in sorted(distinct, key=lambda j: j.label)[:2]}


def test_continuous_predicted_orders_by_the_expected_length_not_the_binned_one(tiny_model, tiny_tokenizer, workload):
    jobs, _, _ = workload
    distinct = list({j.label: j for j in jobs}.values())[:6]
    # the binned length says the reverse of the truth, the expected length says the truth
    reordered = [dataclasses.replace(j, predicted=MAX_TOKENS + 1 - j.label, expected=j.label + 0.25) for j in distinct]
    two_slots = engine(tiny_model, tiny_tokenizer, max_batch_size=2)
    policy = PolicyRun()
    drain(policy_turns(reordered, PARAMS, EDGES)("continuous+predicted", two_slots, policy, running_clock()))
    first_two = sorted(policy.latency_s, key=policy.latency_s.get)[:2]
    assert set(first_two) == {j.id for j in sorted(distinct, key=lambda j: j.label)[:2]}


def test_reported_ratios_are_the_measured_ones(workload):
    jobs, _, runs = workload
    result = compare(runs, jobs)
    s = {name: summarize(policy) for name, policy in runs.items()}
    head = runs[HEADLINE]
    useful = sum(len(a) for a in head.answers.values())
    assert result["effective_token_ratio"] == useful / head.decode_tokens
    assert result["recompute_ratio"] == head.recompute_tokens / (head.decode_tokens + head.prefill_tokens)
    assert result["speedup_vs_vanilla"] == (len(jobs) / (head.wall_s + PREDICTION_S)) / (len(jobs) / runs["vanilla"].wall_s)
    assert result["latency_vs_continuous"] == s["continuous+predicted"]["latency_mean_s"] / s["continuous"]["latency_mean_s"]
    assert s["continuous+predicted"]["latency_mean_s"] == pytest.approx(
        sum(runs["continuous+predicted"].latency_s.values()) / len(jobs) + PREDICTION_S)
    assert result["label_agreement"] == 1.0 and set(result["same_answers_as_continuous"].values()) == {1.0}
    assert set(result["targets_met"]) == {"speedup_vs_vanilla", "effective_token_ratio", "recompute_ratio",
                                          "latency_vs_continuous"}
    for summary in s.values():
        assert {"samples_per_s", "tokens_per_s", "effective_token_ratio", "recompute_ratio", "latency_mean_s",
                "latency_p99_s"} <= set(summary)


def test_vanilla_is_one_bin_of_fixed_batches_and_oracle_shares_the_vbs_config():
    configs = policy_configs([32, 64, 128, 256], 256, 10_000)
    assert configs["vanilla"].bins.edges == [256] and not configs["vanilla"].failure_recompute
    assert configs["predicted"].bins.edges == [32, 64, 128, 256] and not configs["predicted"].variable_batch_size
    assert configs["oracle"] is configs[HEADLINE] and configs[HEADLINE].failure_recompute


def test_workload_is_held_out_seeded_and_repeats_only_when_short():
    rows = [{"id": str(i), "split": "val" if i % 4 == 0 else "train"} for i in range(40)]
    few = draw_workload(rows, 5, seed=0)
    assert all(r["split"] == "val" for r in few) and len({r["id"] for r in few}) == 5
    assert few == draw_workload(rows, 5, seed=0) and few != draw_workload(rows, 5, seed=1)
    many = draw_workload(rows, 25, seed=0)
    assert len(many) == 25 and len({r["id"] for r in many}) <= 10
    with pytest.raises(ValueError, match="val"):
        draw_workload([{"id": "a", "split": "train"}], 3, seed=0)


def test_a_missing_adapter_stops_the_bench_naming_the_option(tmp_path):
    with pytest.raises(SystemExit, match="--adapter"):
        run(["--adapter", str(tmp_path), "-n", "4"])


def test_policy_runs_are_kept_and_a_later_invocation_runs_only_what_is_missing(workload, tmp_path):
    from bench.schedule_bench import POLICIES, RunStore

    jobs, _, runs = workload
    store = RunStore(tmp_path, {"n": len(jobs)})
    for name in ("vanilla", "oracle"):
        store.save(name, runs[name])

    class NoEngine:  # any policy actually run would touch the engine and fail here
        def __getattr__(self, name):
            raise AssertionError(f"engine used: {name}")

    kept = run_policies(NoEngine(), NoEngine(), jobs, PARAMS, EDGES, PREDICTION_S, store=store, only=set())
    assert set(kept) == {"vanilla", "oracle"}
    assert kept["vanilla"] == runs["vanilla"] and kept["oracle"].answers == runs["oracle"].answers
    assert RunStore(tmp_path, {"n": len(jobs)}).folder == store.folder  # same workload, same folder
    assert RunStore(tmp_path, {"n": len(jobs) + 1}).folder != store.folder
    assert set(POLICIES) == set(runs)


def test_a_new_adapter_reruns_only_the_policies_that_read_predictions(workload, tmp_path):
    from bench.schedule_bench import POLICIES, PREDICTED, RunStore

    jobs, _, runs = workload
    old = RunStore(tmp_path, {"n": len(jobs)}, predictor="adapter-a")
    for name in POLICIES:
        old.save(name, runs[name])
    new = RunStore(tmp_path, {"n": len(jobs)}, predictor="adapter-b")
    kept = {name for name in POLICIES if new.load(name) is not None}
    assert kept == set(POLICIES) - set(PREDICTED) == {"continuous", "vanilla", "oracle"}
    assert new.predictions != old.predictions


def test_an_unknown_policy_name_stops_the_bench_naming_the_option():
    with pytest.raises(SystemExit, match="--policies: unknown"):
        run(["--policies", "vanilla,fastest"])


def test_a_policy_run_reports_progress_each_tenth_of_the_requests(capsys):
    report = print_progress("vanilla", 25)
    for answered in range(1, 26):
        report(answered, answered * 1.5)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "  vanilla: 2/25 answered, 3 s"
    assert len(lines) == 13 and lines[-1] == "  vanilla: 25/25 answered, 38 s"


def test_policies_that_read_predictions_start_after_the_predictors_prompt_kv_and_answer_the_same(
        tiny_model, tiny_tokenizer, workload):
    jobs, _, runs = workload
    source = engine(tiny_model, tiny_tokenizer, max_batch_size=4)
    prompt_kv = []
    for prompt in {tuple(j.prompt_ids) for j in jobs}:  # the predictor's entries: the plain model's prompt KV
        source.prefill_prefix(list(prompt))
        prompt_kv.append(source.export_prefix(list(prompt)))
    static = engine(tiny_model, tiny_tokenizer, max_batch_size=64, max_prefill_tokens=8192, prefix_cache_bytes=1024)
    continuous = engine(tiny_model, tiny_tokenizer, max_batch_size=16, prefix_cache_bytes=1024)
    shared = run_policies(static, continuous, jobs, PARAMS, EDGES, PREDICTION_S,
                          only={"vanilla", *PREDICTED}, prompt_kv=prompt_kv)
    for name, run_ in shared.items():
        assert run_.answers == runs[name].answers, name
    assert shared["vanilla"].prefill_tokens == runs["vanilla"].prefill_tokens > 0  # it did not read them: no KV
    assert shared["continuous+predicted"].prefill_tokens == 0  # every prompt whole from the predictor
    assert shared["predicted"].prefill_tokens == 0
    # a cut answer resumes after its prompt's KV: only its kept tokens are prefilled again, not its prompt
    assert 0 < shared[HEADLINE].prefill_tokens < shared[HEADLINE].recompute_tokens == runs[HEADLINE].recompute_tokens
    for built in (static, continuous):  # held only while those policies ran, within a bound given back
        assert len(built.prefix_cache) == 0 and built.prefix_cache.max_bytes == 1024


def test_predicting_with_kv_keeps_one_entry_per_distinct_prompt_and_times_every_prediction():
    from types import SimpleNamespace

    class Predictor:
        seconds = 1.5  # from earlier calls: not this run's
        calls = []

        def estimate_with_kv(self, prompts):
            self.seconds += 0.25
            self.calls.append(prompts)
            return ([10 * len(p) + p[0] for p in prompts], [len(p) + 0.5 for p in prompts],
                    [SimpleNamespace(token_ids=tuple(p)) for p in prompts])

    ids = [[1, 2], [3], [1, 2], [4, 5, 6], [3]]
    predictor = Predictor()
    lengths, expected, entries, seconds = predict_sharing_kv(predictor, ids, chunk=2)
    assert lengths == [21, 13, 21, 34, 13] and seconds == 0.75  # three chunks, each answer in its request's place
    assert expected == [2.5, 1.5, 2.5, 3.5, 1.5]
    assert predictor.calls == [[[3], [3]], [[1, 2], [1, 2]], [[4, 5, 6]]]  # similar lengths together
    assert sorted(e.token_ids for e in entries) == [(1, 2), (3,), (4, 5, 6)]


def test_the_table_shows_any_policies_and_the_ratio_to_vanilla_only_when_given(workload):
    _, _, runs = workload
    partial = policy_table({name: summarize(runs[name]) for name in ("continuous", "continuous+predicted")})
    lines = partial.splitlines()
    assert len(lines) == 4 and "vs vanilla" not in lines[0]
    assert lines[2].split("|")[1].strip() == "continuous" and lines[3].split("|")[1].strip() == "continuous+predicted"
    full = compare(runs, workload[0])
    assert "| vs vanilla |" in policy_table(full["policies"], full["samples_per_s_vs_vanilla"]).splitlines()[0]


def test_the_box_speed_probe_decodes_a_fixed_batch_and_leaves_the_engine_as_it_was(tiny_model, tiny_tokenizer):
    built = engine(tiny_model, tiny_tokenizer, max_batch_size=16)
    before = built.stats()
    assert box_speed(built, [30, 31, 32], rows=4, steps=5) > 0
    after = built.stats()
    assert not built.has_work() and len(built.prefix_cache) == 0
    assert after["prefill_tokens"] - before["prefill_tokens"] == 4 * 3


def test_every_policy_run_records_the_box_speed_before_and_after_it(workload):
    _, _, runs = workload
    for name, policy in runs.items():
        assert len(policy.box_tok_s) == 2 and min(policy.box_tok_s) > 0, name
        assert summarize(policy)["box_tok_s"] == sum(policy.box_tok_s) / 2
    assert summarize(dataclasses.replace(runs["vanilla"], box_tok_s=[]))["box_tok_s"] is None  # kept from before


def test_issue_keys_are_given_as_soon_as_the_runs_they_compare_are_there(workload):
    jobs, _, runs = workload
    s = {name: summarize(policy) for name, policy in runs.items()}
    full = compare(runs, jobs)
    assert issue_keys(s) == {key: full[key] for key in ("speedup_vs_vanilla", "effective_token_ratio",
                                                         "recompute_ratio", "latency_vs_continuous")}
    assert set(issue_keys({name: s[name] for name in ("vanilla", HEADLINE)})) == {
        "speedup_vs_vanilla", "effective_token_ratio", "recompute_ratio"}
    assert set(issue_keys({name: s[name] for name in ("continuous", "continuous+predicted")})) == {
        "latency_vs_continuous"}
    assert issue_keys({"vanilla": s["vanilla"], "oracle": s["oracle"]}) == {}


def test_a_policy_clock_counts_only_the_time_between_resume_and_pause():
    clock = PolicyClock()
    assert clock() == 0.0
    clock.resume()
    time.sleep(0.05)
    clock.pause()
    time.sleep(0.2)  # another policy's turn
    assert 0.05 <= clock() < 0.2
    clock.resume()
    time.sleep(0.05)
    assert 0.1 <= clock() < 0.3  # read while running: includes the current turn


def test_turns_go_to_the_policy_that_has_run_least_until_both_are_done():
    def turns(seconds: float, count: int):
        for _ in range(count):
            time.sleep(seconds)
            yield

    clocks = {"a": PolicyClock(), "b": PolicyClock()}
    order = run_in_turns({"a": turns(0.1, 3), "b": turns(0.25, 2)}, clocks)
    # a 0.1, b 0.25, a 0.2, a 0.3 (b has 0.25 < 0.3), b 0.5, then each finds its end in one more turn
    assert order == ["a", "b", "a", "a", "b", "a", "b"]
    assert 0.3 <= clocks["a"]() < 0.4 and 0.5 <= clocks["b"]() < 0.6


def _prompt_kv(tiny_model, tiny_tokenizer, jobs):
    source = engine(tiny_model, tiny_tokenizer, max_batch_size=4)
    entries = []
    for prompt in {tuple(j.prompt_ids) for j in jobs}:  # the predictor's entries: the plain model's prompt KV
        source.prefill_prefix(list(prompt))
        entries.append(source.export_prefix(list(prompt)))
    return entries


def _predicting(entries, turns: int = 3, seconds: float = 0.02):
    """Stands in for `prediction_turns`: a few timed turns, then the prompt KV (lengths come from the jobs)."""
    for _ in range(turns):
        time.sleep(seconds)
        yield
    return None, None, entries


@pytest.mark.parametrize("pair", [("continuous", "continuous+predicted"), ("vanilla", HEADLINE)])
def test_two_policies_in_turns_answer_and_count_as_each_does_alone_on_its_own_engine(
        tiny_model, tiny_tokenizer, workload, pair):
    jobs, _, runs = workload
    engines = {}

    def engine_for(name):
        config = {"max_batch_size": 16} if name.startswith("continuous") else {"max_batch_size": 64,
                                                                               "max_prefill_tokens": 8192}
        engines[name] = engine(tiny_model, tiny_tokenizer, prefix_cache_bytes=1024, **config)
        return engines[name]

    started = time.perf_counter()
    paired = run_pair_in_turns(pair, engine_for, jobs, PARAMS, EDGES,
                               _predicting(_prompt_kv(tiny_model, tiny_tokenizer, jobs)),
                               probe=engine(tiny_model, tiny_tokenizer, max_batch_size=16))
    elapsed = time.perf_counter() - started
    alone, reads = pair
    assert paired[alone].answers == runs[alone].answers and paired[reads].answers == runs[reads].answers
    assert paired[alone].decode_tokens == runs[alone].decode_tokens
    assert paired[reads].decode_tokens == runs[reads].decode_tokens
    assert paired[reads].recompute_tokens == runs[reads].recompute_tokens
    assert paired[alone].prefill_tokens == runs[alone].prefill_tokens > 0  # no KV from the predictor
    assert paired[reads].prefill_tokens < paired[reads].recompute_tokens or paired[reads].prefill_tokens == 0
    assert paired[alone].prediction_s == 0 and paired[reads].prediction_s >= 0.06  # its three turns, its clock
    # each timed on its own clock: together they fit in the pair's elapsed time, each alone well within
    assert paired[alone].wall_s + paired[reads].wall_s + paired[reads].prediction_s <= elapsed
    assert max(paired[alone].latency_s.values()) <= paired[alone].wall_s
    assert paired[alone].box_tok_s == paired[reads].box_tok_s and len(paired[alone].box_tok_s) == 2
    assert len(engines[reads].prefix_cache) == 0 and engines[reads].prefix_cache.max_bytes == 1024  # given back


def test_a_pair_in_turns_is_two_different_policies_and_reads_predictions_only_with_the_predictor():
    with pytest.raises(ValueError, match="two different policies"):
        run_pair_in_turns(("vanilla", "vanilla"), None, [], PARAMS, EDGES)
    with pytest.raises(ValueError, match="at most one policy that reads predictions"):
        run_pair_in_turns(("predicted", HEADLINE), None, [], PARAMS, EDGES, _predicting([]))
    with pytest.raises(ValueError, match="the predictor's turns are needed"):
        run_pair_in_turns(("vanilla", HEADLINE), None, [], PARAMS, EDGES)
    for bad in ("vanilla", "vanilla,vanilla", "vanilla,fastest", "predicted,continuous+predicted"):
        with pytest.raises(SystemExit, match="--in-turns"):
            run(["--in-turns", bad])


def test_a_pair_in_turns_is_kept_reported_with_its_keys_and_read_back_without_running(
        workload, tmp_path, monkeypatch, capsys):
    import json

    import bench.schedule_bench as schedule_bench
    from bench.schedule_bench import RunStore, report_pair

    jobs, _, runs = workload
    monkeypatch.setattr(schedule_bench, "RESULTS", tmp_path)
    store = RunStore(tmp_path / "runs", {"n": len(jobs)}, predictor="adapter")
    pair = ("vanilla", HEADLINE)
    entry = report_pair(pair, store, lambda: {name: runs[name] for name in pair}, len(jobs))
    s = {name: summarize(runs[name]) for name in pair}
    assert entry["speedup_vs_vanilla"] == round(s[HEADLINE]["samples_per_s"] / s["vanilla"]["samples_per_s"], 4)
    assert entry["samples_per_s_ratio"] == entry["speedup_vs_vanilla"] and entry["same_answers"] == 1
    assert "latency_vs_continuous" not in entry
    assert store.pair_folder(pair).parent.parent == store.predicted_folder

    def no_run():
        raise AssertionError("a kept pair was run again")

    again = report_pair(pair, store, no_run, len(jobs))
    assert again["policies"] == entry["policies"]
    kept = json.loads((tmp_path / "schedule_in_turns.json").read_text())
    assert list(kept) == [f"vanilla + {HEADLINE}"] and f"{HEADLINE} over vanilla" in capsys.readouterr().out


# ---- requests that arrive over time (--rate) ---------------------------------------------------------
def test_poisson_arrivals_start_at_zero_never_go_back_and_average_one_over_the_rate():
    from bench.schedule_bench import poisson_arrivals

    times = poisson_arrivals(4000, 4.0, seed=0)
    assert len(times) == 4000 and times[0] == 0.0
    assert all(b >= a for a, b in zip(times, times[1:]))
    assert times[-1] / (len(times) - 1) == pytest.approx(0.25, rel=0.05)
    assert poisson_arrivals(50, 4.0, seed=0) == times[:50] and poisson_arrivals(50, 4.0, seed=1) != times[:50]


def _arriving(jobs, late_s: float = 1000.0):
    """The first half at t=0, the second half `late_s` later."""
    half = len(jobs) // 2
    return [dataclasses.replace(j, arrival_s=0.0 if i < half else late_s) for i, j in enumerate(jobs)]


def test_continuous_admits_a_request_when_it_arrives_and_times_it_from_then(tiny_model, tiny_tokenizer, workload):
    from bench.schedule_policies import continuous_turns

    jobs, reference, _ = workload
    arriving = _arriving(jobs[:8])
    run_ = PolicyRun()
    started = time.perf_counter()
    drain(continuous_turns(engine(tiny_model, tiny_tokenizer, max_batch_size=16), arriving, PARAMS, None, run_,
                           running_clock()))
    assert time.perf_counter() - started < 100  # the 1,000 s until the late half arrives were skipped
    assert run_.wall_s >= 1000
    assert all(run_.answers[j.id] == reference[j.id].token_ids for j in arriving)
    early, late = [run_.latency_s[j.id] for j in arriving[:4]], [run_.latency_s[j.id] for j in arriving[4:]]
    assert max(early) < 100 and 0 < min(late) and max(late) <= run_.wall_s - 1000  # late ones: from their arrival


def test_requests_predicted_on_arrival_go_shortest_first_among_those_that_have_arrived(
        tiny_model, tiny_tokenizer, workload):
    from bench.schedule_policies import continuous_turns

    jobs, reference, _ = workload
    arriving = _arriving(jobs[:6])
    keys = {j.id: k for j, k in zip(arriving, [30.0, 10.0, 20.0, 5.0, 25.0, 15.0])}
    calls = []

    def predict(arrived):
        calls.append([j.id for j in arrived])
        return [keys[j.id] for j in arrived]

    run_ = PolicyRun()
    one_slot = engine(tiny_model, tiny_tokenizer, max_batch_size=1)  # admitted order = finished order
    drain(continuous_turns(one_slot, arriving, PARAMS, None, run_, running_clock(), predict=predict))
    assert calls == [[j.id for j in arriving[:3]], [j.id for j in arriving[3:]]]  # each once, when it arrives
    finished = sorted(run_.answers, key=lambda rid: run_.latency_s[rid] + next(j.arrival_s for j in arriving if j.id == rid))
    assert finished == [arriving[i].id for i in (1, 2, 0, 3, 5, 4)]  # by key within each arrival, not across
    assert all(run_.answers[j.id] == reference[j.id].token_ids for j in arriving)


def test_a_request_that_can_start_at_once_is_not_predicted_and_one_that_queues_is(
        tiny_model, tiny_tokenizer, workload):
    from bench.schedule_policies import continuous_turns

    jobs, reference, _ = workload
    calls = []

    def predict(arrived):
        calls.append([j.id for j in arrived])
        return [float(len(calls))] * len(arrived)

    roomy = _arriving(jobs[:8])  # four at t=0, four 1,000 s later, on 16 slots: never a queue
    run_ = PolicyRun()
    drain(continuous_turns(engine(tiny_model, tiny_tokenizer, max_batch_size=16), roomy, PARAMS, None, run_,
                           running_clock(), predict=predict))
    assert calls == [] and run_.prefill_tokens == sum(len(j.prompt_ids) for j in roomy)  # the engine prefilled all
    assert all(run_.answers[j.id] == reference[j.id].token_ids for j in roomy)

    # two slots, a clock that moves a second a step: three at t=0 (one must wait), a fourth at 0.5 s,
    # when both slots are still busy (answers of several tokens) and the third still waits
    calls.clear()
    long_ones = [j for j in jobs if len(reference[j.id].token_ids) >= 4][:4]
    queued = [dataclasses.replace(j, arrival_s=0.0 if i < 3 else 0.5) for i, j in enumerate(long_ones)]
    two_slots, now = engine(tiny_model, tiny_tokenizer, max_batch_size=2), [0.0]
    step = two_slots.step

    def stepping():
        now[0] += 1.0
        return step()

    class StepClock:
        def __call__(self):
            return now[0]

        def skip(self, seconds):
            now[0] += max(0.0, seconds)

    two_slots.step = stepping
    run_ = PolicyRun()
    drain(continuous_turns(two_slots, queued, PARAMS, None, run_, StepClock(), predict=predict))
    assert calls == [[j.id for j in queued[:3]], [queued[3].id]]
    assert all(run_.answers[j.id] == reference[j.id].token_ids for j in queued)


class _StandInPredictor:
    """`LengthPredictor.estimate_with_kv` from given expected lengths and prompt KV; 10 ms a call."""

    def __init__(self, entries, expected: dict[tuple, float]):
        self.entries = {tuple(e.token_ids): e for e in entries}
        self.expected, self.seconds, self.calls = expected, 0.0, []

    def estimate_with_kv(self, prompts):
        self.calls.append(len(prompts))
        time.sleep(0.01)
        self.seconds += 0.01
        keys = [self.expected[tuple(p)] for p in prompts]
        return [round(k) for k in keys], keys, [self.entries[tuple(p)] for p in prompts]


def test_predicting_on_arrival_returns_expected_lengths_and_hands_each_prompt_kv_to_the_engine_once(
        tiny_model, tiny_tokenizer, workload):
    from bench.schedule_bench import PredictOnArrival

    jobs, _, _ = workload
    some = jobs[:4] + jobs[:1]  # a repeated prompt
    predictor = _StandInPredictor(_prompt_kv(tiny_model, tiny_tokenizer, some),
                                  {tuple(j.prompt_ids): float(i) for i, j in enumerate(jobs[:4])})
    target = engine(tiny_model, tiny_tokenizer, max_batch_size=4, prefix_cache_bytes=1)
    predict = PredictOnArrival(predictor, target, chunk=2)
    assert predict(some) == [0.0, 1.0, 2.0, 3.0, 0.0] and predictor.calls == [2, 2, 1]
    assert len(target.prefix_cache) == 4 and target.prefix_cache.max_bytes > 1  # room made for the four
    assert all(target.export_prefix(j.prompt_ids) is not None for j in jobs[:4])
    assert predict.seconds == pytest.approx(0.03)


def test_a_pair_arriving_over_time_predicts_on_arrival_and_answers_as_in_a_burst(tiny_model, tiny_tokenizer, workload):
    jobs, _, runs = workload
    arriving = _arriving(jobs, late_s=5.0)
    predictor = _StandInPredictor(_prompt_kv(tiny_model, tiny_tokenizer, jobs),
                                  {tuple(j.prompt_ids): j.expected for j in jobs})
    engines = {}

    def engine_for(name):
        engines[name] = engine(tiny_model, tiny_tokenizer, max_batch_size=16, prefix_cache_bytes=1024)
        return engines[name]

    pair = ("continuous", "continuous+predicted")
    paired = run_pair_in_turns(pair, engine_for, arriving, PARAMS, EDGES, predictor=predictor)
    for name in pair:
        assert paired[name].answers == runs[name].answers and paired[name].wall_s >= 5
    reads = paired["continuous+predicted"]
    assert reads.prediction_s == 0 and predictor.seconds > 0
    assert reads.prediction_in_run_s == pytest.approx(predictor.seconds)
    assert reads.prefill_tokens < paired["continuous"].prefill_tokens  # prompts came with the predictor's KV
    assert summarize(reads)["latency_mean_s"] == pytest.approx(sum(reads.latency_s.values()) / len(jobs))
    assert len(engines["continuous+predicted"].prefix_cache) == 0  # given back after the run
    with pytest.raises(ValueError, match="continuous policies only"):
        run_pair_in_turns(("vanilla", HEADLINE), None, arriving, PARAMS, EDGES, predictor=predictor)
    with pytest.raises(ValueError, match="the predictor is needed"):
        run_pair_in_turns(pair, None, arriving, PARAMS, EDGES)


@pytest.mark.parametrize("argv", [["--rate", "0.5"], ["--rate", "0", "--in-turns", "continuous,continuous+predicted"],
                                  ["--rate", "1", "--in-turns", f"vanilla,{HEADLINE}"]])
def test_a_rate_needs_the_continuous_pair_and_must_be_positive(argv):
    with pytest.raises(SystemExit, match="--rate"):
        run(argv)


@pytest.mark.parametrize("argv", [["--load", "1"], ["--load", "-1", "--in-turns", "continuous,continuous+predicted"],
                                  ["--load", "1", "--in-turns", f"vanilla,{HEADLINE}"],
                                  ["--load", "1", "--rate", "0.3", "--in-turns", "continuous,continuous+predicted"]])
def test_a_load_needs_the_continuous_pair_must_be_positive_and_excludes_a_rate(argv):
    with pytest.raises(SystemExit, match="--load"):
        run(argv)


def test_capacity_is_the_probed_speed_over_a_requests_answer_and_prompt_tokens():
    from bench.schedule_bench import capacity_per_s

    # the calibration it states: the kept burst's probe and mean lengths give the rate it answered
    assert capacity_per_s(98.0, [183] * 4, [88] * 4) == pytest.approx(0.360, abs=0.002)
    assert capacity_per_s(196.0, [100, 300], [50, 150]) == pytest.approx(2 * capacity_per_s(98.0, [200], [100]))


def test_a_pair_at_a_load_is_kept_under_its_rate_and_load(workload, tmp_path, monkeypatch):
    import json

    import bench.schedule_bench as schedule_bench
    from bench.schedule_bench import RunStore, report_pair

    jobs, _, runs = workload
    monkeypatch.setattr(schedule_bench, "RESULTS", tmp_path)
    pair = ("continuous", "continuous+predicted")
    store = RunStore(tmp_path / "runs", {"n": len(jobs), "rate": 0.412}, predictor="adapter")
    entry = report_pair(pair, store, lambda: {name: runs[name] for name in pair}, len(jobs), 0.412, 1.0)
    assert entry["arrivals_per_s"] == 0.412 and entry["load"] == 1.0
    kept = json.loads((tmp_path / "schedule_in_turns.json").read_text())
    assert list(kept) == ["continuous + continuous+predicted at 0.412/s (load 1), predicting only arrivals that queue"]
