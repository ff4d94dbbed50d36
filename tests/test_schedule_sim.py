"""The step model of continuous batching behind `python -m bench schedule-sim`: exact finish times on
small cases, shortest-first optimal on one slot, calibration that recovers the costs it was given,
and the command on a kept pair."""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import statistics
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.schedule_policies import PolicyRun
from bench.schedule_sim import PAIR, arriving_latencies, calibrate, continuous_latencies, run, steps_taken


def test_finish_times_follow_the_slots_arrival_order_and_costs():
    assert continuous_latencies([3, 1, 2], [0, 0, 0], None, slots=2) == [3, 1, 3]
    # 10 s predicting first, 0.5 s a prompt token on admission: 0 and 1 admitted (12), 1 done at 13,
    # 2 admitted (14), then 0 and 2 done at 16
    assert continuous_latencies([3, 1, 2], [2, 2, 2], None, slots=2, prefill_s=0.5, upfront_s=10) == [16, 13, 16]
    assert continuous_latencies([3, 1, 2], [0, 0, 0], [3.0, 1.0, 2.0], slots=1) == [6, 1, 3]
    assert continuous_latencies([2, 2], [0, 0], [1.0, 1.0], slots=1) == [2, 4]  # a tie goes in arrival order


def test_shortest_first_on_one_slot_gives_the_least_mean_latency_of_any_order():
    rng = random.Random(3)
    lengths = [rng.randrange(1, 40) for _ in range(6)]
    best = min(statistics.mean(itertools.accumulate(lengths[i] for i in order))
               for order in itertools.permutations(range(6)))
    assert statistics.mean(continuous_latencies(lengths, [0] * 6, lengths, slots=1)) == best
    assert statistics.mean(continuous_latencies(lengths, [0] * 6, None, slots=1)) > best


def test_arriving_requests_wait_only_from_their_arrival_and_pay_prediction_or_prefill():
    # one slot, a step a second: 0 arrives at 0 (2 tokens), 1 at 10 (3 tokens), the box idle between
    assert arriving_latencies([2, 3], [0, 0], [0, 10], slots=1) == [2, 3]
    assert arriving_latencies([2, 3], [4, 4], [0, 10], slots=1, prefill_s=0.25) == [3, 4]  # a 1 s prefill each
    # each arrives to a free slot: started at once, unpredicted, prefilled as without a key
    assert arriving_latencies([2, 3], [4, 4], [0, 10], key=[2, 3], predict_s=[0.5, 0.5], slots=1,
                              prefill_s=0.25) == [3, 4]
    # both at once on one slot: both predicted on arrival (1 s), nothing prefilled; against 3, 7 in arrival order
    assert arriving_latencies([2, 3], [4, 4], [0, 0], key=[2, 3], predict_s=[0.5, 0.5], slots=1,
                              prefill_s=0.25) == [3, 6]
    assert arriving_latencies([2, 3], [4, 4], [0, 0], slots=1, prefill_s=0.25) == [3, 7]
    # three at once, shortest first by the key: done at 1, 3, 6 (arrival order: 3, 4, 6)
    assert arriving_latencies([3, 1, 2], [0] * 3, [0, 0, 0], key=[3, 1, 2], slots=1) == [6, 1, 3]
    assert arriving_latencies([3, 1, 2], [0] * 3, [0, 0, 0], slots=1) == [3, 4, 6]
    # all at t=0 with no costs: the burst model's finish times
    assert arriving_latencies([3, 1, 2], [0] * 3, [0] * 3, key=[3.0, 1.0, 2.0], slots=2) == \
        continuous_latencies([3, 1, 2], [0] * 3, [3.0, 1.0, 2.0], slots=2)


def _pair(answers, prompts, key, step_s, prefill_s, prediction_s):
    """Runs as the model would measure them."""
    ids = [f"r{i:05d}" for i in range(len(answers))]

    def as_run(latencies, prediction=0.0):
        return PolicyRun(answers={i: [7] * n for i, n in zip(ids, answers)}, latency_s=dict(zip(ids, latencies)),
                         wall_s=max(latencies), prediction_s=prediction)

    cont = as_run(continuous_latencies(answers, prompts, None, 4, step_s, prefill_s))
    pred = as_run(continuous_latencies(answers, prompts, key, 4, step_s), prediction_s)
    return cont, pred


def test_calibration_recovers_the_step_and_prefill_costs_that_made_the_runs():
    rng = random.Random(5)
    answers = [rng.randrange(1, 60) for _ in range(40)]
    prompts = [rng.randrange(5, 90) for _ in range(40)]
    key = [a + rng.uniform(-20, 20) for a in answers]
    cont, pred = _pair(answers, prompts, key, 0.2, 0.004, 30.0)
    assert steps_taken(answers, key, 4) == pytest.approx(pred.wall_s / 0.2)
    assert calibrate(cont, pred, answers, prompts, key, slots=4) == pytest.approx((0.2, 0.004))


def test_the_command_replays_a_kept_pair_and_reports_each_key(tmp_path, monkeypatch):
    import bench.schedule_sim as sim

    monkeypatch.setattr(sim, "write_result", lambda name, payload: tmp_path / f"{name}.json")
    rng = random.Random(9)
    n = 30
    answers = [rng.choice([rng.randrange(1, 20), 60]) for _ in range(n)]
    prompts = [rng.randrange(5, 50) for _ in range(n)]
    served = [60 if a == 60 or i % 2 else a for i, a in enumerate(answers)]  # half the short ones read as cut
    expected = [a + 0.5 for a in answers]
    cont, pred = _pair(answers, prompts, expected, 0.2, 0.004, 12.0)
    rows = [f"p{i}" for i in range(n)]
    store = tmp_path / "store"
    folder = store / "w" / "predictor-x" / PAIR
    folder.mkdir(parents=True)
    (store / "w" / "signature.json").write_text(json.dumps({"n": n, "rows": rows}))
    (store / "w" / "predictor-x" / "predictions.json").write_text(
        json.dumps({"predicted": served, "expected": expected, "seconds": 12.0}))
    for name, r in (("continuous", cont), ("continuous_predicted", pred)):
        (folder / f"{name}.json").write_text(json.dumps(dataclasses.asdict(r)))
    labels = tmp_path / "labels"
    labels.mkdir()
    pq.write_table(pa.Table.from_pylist([{"id": r, "prompt_tokens": p} for r, p in zip(rows, prompts)]),
                   labels / "part-00000.parquet")

    result = run(["--store", str(store), "--labels", str(labels), "--slots", "4"])
    assert result["pair"] == str(folder)
    assert result["step_s"] == pytest.approx(0.2) and result["prefill_s_per_token"] == pytest.approx(0.004)
    assert result["modelled_latency_vs_continuous"] == pytest.approx(result["measured_latency_vs_continuous"])
    what_if = result["what_if"]
    assert set(what_if) == {"served length", "expected length", "true length"}
    assert what_if["true length"]["rank_correlation"] == 1.0 > what_if["served length"]["rank_correlation"]
    assert what_if["expected length"]["prediction_free"] == pytest.approx(what_if["true length"]["prediction_free"])
    assert what_if["served length"]["prediction_free"] > what_if["true length"]["prediction_free"]
    for ratios in what_if.values():
        assert ratios["prediction_free"] < ratios["prediction_as_measured"]
    assert set(result["arriving"]) == {"0.3", "0.35", "0.4"}
    for arriving in result["arriving"].values():
        assert arriving["latency_vs_continuous"] == pytest.approx(
            arriving["predicted_mean_s"] / arriving["continuous_mean_s"])
    faster = run(["--store", str(store), "--labels", str(labels), "--slots", "4", "--rates", "0.5,50"])["arriving"]
    assert faster["50"]["continuous_mean_s"] > faster["0.5"]["continuous_mean_s"]  # a queue builds
    dearer = run(["--store", str(store), "--labels", str(labels), "--slots", "4", "--arrival-predict-s", "2"])
    assert dearer["arrival_predict_s_per_request"] == 2 and result["arrival_predict_s_per_request"] == 12.0 / n
    for rate, arriving in dearer["arriving"].items():
        assert arriving["predicted_mean_s"] > result["arriving"][rate]["predicted_mean_s"]
        assert arriving["continuous_mean_s"] == result["arriving"][rate]["continuous_mean_s"]
    # a stream's pair, kept later, is neither the default nor accepted: its walls hold idle time
    stream = store / "s" / "predictor-x" / PAIR
    stream.mkdir(parents=True)
    (store / "s" / "signature.json").write_text(json.dumps({"n": n, "rows": rows, "rate": 0.5}))
    for name, r in (("continuous", cont), ("continuous_predicted", pred)):
        (stream / f"{name}.json").write_text(json.dumps(dataclasses.asdict(r)))
    assert run(["--store", str(store), "--labels", str(labels), "--slots", "4"])["pair"] == str(folder)
    with pytest.raises(SystemExit, match="--pair: .* served a stream"):
        run(["--pair", str(stream), "--labels", str(labels)])
    with pytest.raises(SystemExit, match="--rates"):
        run(["--store", str(store), "--labels", str(labels), "--rates", "fast"])
    with pytest.raises(SystemExit, match="--arrival-predict-s"):
        run(["--store", str(store), "--labels", str(labels), "--arrival-predict-s", "-1"])


def test_the_default_pair_is_the_adapters_burst_on_the_most_requests_never_a_stream(tmp_path):
    from bench.schedule_bench import predictor_folder_name, predictor_signature
    from bench.schedule_sim import default_pair

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "settings.json").write_text("{}")
    store = tmp_path / "store"

    def keep(workload, predictor, signature):
        folder = store / workload / predictor / PAIR
        folder.mkdir(parents=True)
        (store / workload / "signature.json").write_text(json.dumps(signature))
        return folder

    own = predictor_folder_name(predictor_signature(adapter))
    small = keep("a", own, {"n": 10})
    large = keep("b", own, {"n": 30})
    keep("c", own, {"n": 99, "rate": 0.5})  # a stream
    other = keep("d", "predictor-other", {"n": 50})  # another adapter's, kept last
    os.utime(other, (time.time() + 60, time.time() + 60))
    assert default_pair(store, adapter) == large
    assert default_pair(store, tmp_path / "no-adapter") == other  # none of its own: the newest
    os.utime(small, (time.time() + 120, time.time() + 120))  # newer, but on fewer requests
    assert default_pair(store, adapter) == large


def test_the_command_without_a_kept_pair_says_how_to_make_one(tmp_path):
    with pytest.raises(SystemExit, match="--in-turns continuous,continuous\\+predicted"):
        run(["--store", str(tmp_path)])
    lone = tmp_path / "a" / "b" / "c" / "pair"
    lone.mkdir(parents=True)
    for name in ("continuous", "continuous_predicted"):
        (lone / f"{name}.json").write_text(json.dumps(dataclasses.asdict(PolicyRun())))
    with pytest.raises(SystemExit, match="--pair: not a pair kept by python -m bench schedule"):
        run(["--pair", str(lone)])
