"""What the continuous pair's latency ratio would be under other orders and prediction costs: a step
model of continuous batching, calibrated on a pair kept by `python -m bench schedule --in-turns
continuous,continuous+predicted` and replayed over the same requests' answer lengths.

    python -m bench schedule-sim [--pair FOLDER]   # writes bench/results/schedule_sim.json

The model: `slots` sequences decode together and a decode step costs `step_s` whatever the batch
holds; admitting a request whose prompt KV is not there yet costs its prompt tokens x `prefill_s`
first; a policy that predicts starts `upfront_s` late (every prompt is predicted before any is
ordered). `step_s` is read from the predicted run (its decode phase prefills nothing: wall over
steps), `prefill_s` from what `continuous` took beyond its own steps. The replay of the measured
pair is printed beside the measurement, so the model's error is in view; then what a pair cannot
tell: the ratio with the true lengths as the key (the ceiling of any predictor), and with the
prediction free (prefill costing little beside decoding, as on a GPU), and with the requests arriving
as a Poisson stream (`--rates`, as `python -m bench schedule --rate` serves them), those that arrive
to a queue predicted then. The pair it reads is a burst's (a stream's walls hold idle time); on
streams it has been optimistic (bench/RESULTS.md). A model, not a measurement.
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from bench.common import REPO, RESULTS, table, write_result
from bench.schedule_bench import poisson_arrivals, predictor_folder_name, predictor_signature
from bench.schedule_policies import PolicyRun
from predictor.labels import DEFAULT_OUT as DEFAULT_LABELS
from predictor.labels import read_labels
from predictor.metrics import rank_correlation
from predictor.predict import DEFAULT_ADAPTER

PAIR = "in_turns/continuous__continuous_predicted"
SLOTS = 16  # the benchmark's continuous engine (VANILLA_BATCH)


def continuous_latencies(answer_lengths: Sequence[int], prompt_lengths: Sequence[int], key: Sequence[float] | None,
                         slots: int = SLOTS, step_s: float = 1.0, prefill_s: float = 0.0, upfront_s: float = 0.0
                         ) -> list[float]:
    """Each request's finish time, all arriving at t=0: admitted smallest `key` first (ties and
    `key=None` in arrival order) into `slots`, one token a step per admitted request."""
    waiting = [(0.0 if key is None else key[i], i) for i in range(len(answer_lengths))]
    heapq.heapify(waiting)
    now, running, finished = upfront_s, {}, [0.0] * len(answer_lengths)
    while waiting or running:
        while len(running) < slots and waiting:
            _, i = heapq.heappop(waiting)
            now += prompt_lengths[i] * prefill_s
            running[i] = answer_lengths[i]
        now += step_s
        for i in list(running):
            running[i] -= 1
            if running[i] <= 0:
                finished[i] = now
                del running[i]
    return finished


def arriving_latencies(answer_lengths: Sequence[int], prompt_lengths: Sequence[int], arrivals: Sequence[float],
                       key: Sequence[float] | None = None, predict_s: Sequence[float] | None = None,
                       slots: int = SLOTS, step_s: float = 1.0, prefill_s: float = 0.0) -> list[float]:
    """Each request's latency from its arrival, the machine doing one thing at a time. Without `key`:
    admitted in arrival order, its prompt prefilled on admission (`prefill_s` a token). With `key`, as
    `continuous+predicted` does (bench.schedule_policies.continuous_turns): requests that arrive to a
    queue (not all of them find a free slot with nobody waiting) are predicted as they arrive
    (`predict_s[i]`, their prompts' KV made then) and the smallest key among those waiting is admitted
    first, with nothing to prefill; the others start at once, unpredicted, and are prefilled. Idle until
    the next arrival when nothing is there to decode."""
    coming = sorted(range(len(answer_lengths)), key=lambda i: arrivals[i])
    waiting: list[tuple[float, int]] = []
    prefilled = set(range(len(answer_lengths))) if key is None else set()
    now, running, finished, next_in = 0.0, {}, [0.0] * len(answer_lengths), 0
    while next_in < len(coming) or waiting or running:
        arrived = []
        while next_in < len(coming) and arrivals[coming[next_in]] <= now:
            arrived.append(coming[next_in])
            next_in += 1
        if key is None:
            for i in arrived:
                heapq.heappush(waiting, (arrivals[i], i))
        elif len(arrived) > slots - len(running) - len(waiting):
            for i in arrived:
                now += predict_s[i] if predict_s is not None else 0.0
                heapq.heappush(waiting, (key[i], i))
        else:  # they all start now: nothing to order them against
            prefilled.update(arrived)
            for i in arrived:
                heapq.heappush(waiting, (-math.inf, i))
        while len(running) < slots and waiting:
            _, i = heapq.heappop(waiting)
            now += prompt_lengths[i] * prefill_s if i in prefilled else 0.0
            running[i] = answer_lengths[i]
        if not running:
            now = max(now, arrivals[coming[next_in]])
            continue
        now += step_s
        for i in list(running):
            running[i] -= 1
            if running[i] <= 0:
                finished[i] = now - arrivals[i]
                del running[i]
    return finished


def steps_taken(answer_lengths: Sequence[int], key: Sequence[float] | None, slots: int = SLOTS) -> int:
    """Decode steps the model takes to answer them all."""
    return round(max(continuous_latencies(answer_lengths, [0] * len(answer_lengths), key, slots)))


def calibrate(continuous: PolicyRun, predicted: PolicyRun, answer_lengths: Sequence[int],
              prompt_lengths: Sequence[int], predicted_key: Sequence[float], slots: int = SLOTS
              ) -> tuple[float, float]:
    """(step_s, prefill_s) that make the model's walls those of the two runs: the predicted run's
    decode phase holds only steps (its prompts' KV came from the predictor), and `continuous` spent
    the rest of its wall prefilling its prompts."""
    step_s = predicted.wall_s / steps_taken(answer_lengths, predicted_key, slots)
    prefill_s = (continuous.wall_s - steps_taken(answer_lengths, None, slots) * step_s) / sum(prompt_lengths)
    return step_s, max(prefill_s, 0.0)


def what_if(answer_lengths: Sequence[int], keys: dict[str, Sequence[float]], arrival_mean_s: float,
            step_s: float, upfront_s: float, slots: int = SLOTS) -> dict[str, dict[str, float]]:
    """Mean latency of shortest-first by each key over arrival order's (`arrival_mean_s`, modelled),
    with the prediction's `upfront_s` as measured and free."""
    no_prefill = [0] * len(answer_lengths)  # the predicted policy starts from the predictor's prompt KV
    out = {}
    for name, key in keys.items():
        ratios = {}
        for label, upfront in (("prediction_as_measured", upfront_s), ("prediction_free", 0.0)):
            latency = continuous_latencies(answer_lengths, no_prefill, key, slots, step_s, 0.0, upfront)
            ratios[label] = statistics.mean(latency) / arrival_mean_s
        out[name] = {"rank_correlation": rank_correlation(key, answer_lengths), **ratios}
    return out


def workload_signature(pair: Path) -> dict:
    """The signature of the workload a kept pair served (empty where there is none)."""
    path = pair.parents[2] / "signature.json"
    return json.loads(path.read_text()) if path.exists() else {}


def is_stream(signature: dict) -> bool:
    """Whether a workload's requests arrived over time (`--rate`/`--load`: a rate in its signature):
    the model calibrates on a burst's walls, which a stream's idle time would distort."""
    return "rate" in signature


def default_pair(store: Path, adapter: Path = DEFAULT_ADAPTER) -> Path:
    """The burst pair (streams are left out, see `is_stream`) of `adapter`'s predictions on the most
    requests; of any adapter's, the newest, when it has none. Not by file time alone: a fresh clone
    gives every kept file the same."""
    pairs = {p: sig for p in store.glob(f"*/predictor-*/{PAIR}") if not is_stream(sig := workload_signature(p))}
    if not pairs:
        raise SystemExit(f"--pair: no kept continuous pair of a burst under {store}; run python -m bench schedule "
                         "--in-turns continuous,continuous+predicted (without --rate) first")
    name = predictor_folder_name(predictor_signature(adapter)) if (adapter / "settings.json").exists() else None
    if own := [p for p in pairs if p.parents[1].name == name]:
        return max(own, key=lambda p: pairs[p].get("n", 0))
    return max(pairs, key=lambda p: p.stat().st_mtime)


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench schedule-sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", type=Path, default=None,
                        help=f"a kept pair's folder (…/predictor-*/{PAIR}; default: the committed adapter's burst pair "
                        "on the most requests)")
    parser.add_argument("--store", type=Path, default=RESULTS / "schedule_runs")
    parser.add_argument("--labels", type=Path, default=DEFAULT_LABELS, help="folder of the label parts")
    parser.add_argument("--slots", type=int, default=SLOTS, help="sequences the continuous engine decodes together")
    parser.add_argument("--rates", default="0.3,0.35,0.4",
                        help="arrival rates (requests/s) for the what-if of requests arriving over time")
    parser.add_argument("--arrival-predict-s", type=float, default=None,
                        help="seconds the predictor takes per request when requests arrive one by one (default: "
                        "the pair's measured prediction time per request, made in chunks of 64); split by prompt length")
    args = parser.parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        rates = []
    if not rates or min(rates) <= 0:
        raise SystemExit(f"--rates: comma-separated positive requests a second, got {args.rates!r}")
    if args.arrival_predict_s is not None and args.arrival_predict_s < 0:
        raise SystemExit(f"--arrival-predict-s: seconds, at least 0, got {args.arrival_predict_s}")
    folder = args.pair or default_pair(args.store)
    if is_stream(workload_signature(folder)):
        raise SystemExit(f"--pair: {folder} served a stream (--rate); the model calibrates on a burst's pair")
    runs = {}
    for name in ("continuous", "continuous_predicted"):
        path = folder / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"--pair: {path} is missing")
        runs[name] = PolicyRun(**json.loads(path.read_text()))
    kept = {"predictions": folder.parents[1] / "predictions.json", "signature": folder.parents[2] / "signature.json"}
    if missing := [str(path) for path in kept.values() if not path.exists()]:
        raise SystemExit(f"--pair: not a pair kept by python -m bench schedule ({', '.join(missing)} missing)")
    predictions, signature = (json.loads(path.read_text()) for path in kept.values())
    prompt_tokens = {r["id"]: r["prompt_tokens"] for r in read_labels(args.labels)}
    ids = [f"r{i:05d}" for i in range(signature["n"])]
    answers = [len(runs["continuous"].answers[i]) for i in ids]
    prompts = [prompt_tokens[row] for row in signature["rows"]]
    keys = {"served length": predictions["predicted"], "true length": answers}
    if "expected" in predictions:
        keys["expected length"] = predictions["expected"]
    measured_key = keys.get("expected length", keys["served length"])  # what the run's folder sorted by
    cont, pred = runs["continuous"], runs["continuous_predicted"]
    shown = folder.resolve().relative_to(REPO) if folder.resolve().is_relative_to(REPO) else folder
    step_s, prefill_s = calibrate(cont, pred, answers, prompts, measured_key, args.slots)
    measured = (statistics.mean(pred.latency_s.values()) + pred.prediction_s) / statistics.mean(cont.latency_s.values())
    arrival = statistics.mean(continuous_latencies(answers, prompts, None, args.slots, step_s, prefill_s))
    replay = continuous_latencies(answers, prompts, measured_key, args.slots, step_s, 0.0, pred.prediction_s)
    result = {
        "pair": str(shown), "requests": len(ids), "step_s": step_s, "prefill_s_per_token": prefill_s,
        "prediction_s": pred.prediction_s, "measured_latency_vs_continuous": measured,
        "modelled_latency_vs_continuous": statistics.mean(replay) / arrival,
        "modelled_continuous_mean_s": arrival,
        "measured_continuous_mean_s": statistics.mean(cont.latency_s.values()),
        "what_if": what_if(answers, keys, arrival, step_s, pred.prediction_s, args.slots),
    }
    # arriving over time: the prediction time split over the requests by prompt length
    per_request = pred.prediction_s / len(ids) if args.arrival_predict_s is None else args.arrival_predict_s
    predict_s = [per_request * len(ids) * p / sum(prompts) for p in prompts]
    result["arrival_predict_s_per_request"] = per_request
    result["arriving"] = {}
    for rate in rates:
        arrivals = poisson_arrivals(len(ids), rate, seed=0)  # as python -m bench schedule --rate draws them
        plain = statistics.mean(arriving_latencies(answers, prompts, arrivals, None, None, args.slots, step_s, prefill_s))
        first = statistics.mean(arriving_latencies(answers, prompts, arrivals, measured_key, predict_s, args.slots,
                                                   step_s))
        result["arriving"][f"{rate:g}"] = {"continuous_mean_s": plain, "predicted_mean_s": first,
                                           "latency_vs_continuous": first / plain}
    print(f"{folder}: step {step_s * 1000:.0f} ms, prefill {prefill_s * 1000:.2f} ms a prompt token, "
          f"prediction {pred.prediction_s:.0f} s")
    print(f"latency_vs_continuous measured {measured:.3f}, modelled {result['modelled_latency_vs_continuous']:.3f} "
          f"(continuous mean {result['measured_continuous_mean_s']:.0f} s measured, "
          f"{result['modelled_continuous_mean_s']:.0f} s modelled)")
    print(table(["shortest first by", "rank r", "prediction as measured", "prediction free"],
                [[name, f"{v['rank_correlation']:.3f}", f"{v['prediction_as_measured']:.3f}",
                  f"{v['prediction_free']:.3f}"] for name, v in result["what_if"].items()]))
    print(table(["arrivals/s", "continuous mean s", "predicted on arrival mean s", "latency_vs_continuous"],
                [[rate, f"{v['continuous_mean_s']:.0f}", f"{v['predicted_mean_s']:.0f}", f"{v['latency_vs_continuous']:.3f}"]
                 for rate, v in result["arriving"].items()]))
    print(f"wrote {write_result('schedule_sim', result)}")
    return result
