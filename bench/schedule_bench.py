"""`python -m bench schedule`: length-aware scheduling (Zheng et al., 2023) against first come first
served and against continuous batching, on one workload, in one run.

The workload: `-n` requests (default 1024; --quick 32) drawn with a fixed seed, with replacement
when there are fewer, from the held-out (`val`) prompts of the length labels, all arriving at t=0
(offline throughput, as in the paper); greedy, the labels' max_tokens and loop stop, so with this
batch-invariant engine a request's true length is its label (the run reports how often it is).
Policies (bench/schedule_policies.py says how each is run and counted):

- `vanilla`: batches of 16 in arrival order, each a padded batch run to its longest answer;
- `predicted`: the same batches of 16, taken from length bins of the predicted length;
- `predicted+vbs+fcr`: bins, batches sized to the KV tokens a vanilla batch of 16 reserves
  (variable batch size), answers capped at their bin's edge and resumed a bin up (failure
  collection and recomputation);
- `oracle`: the same with the true lengths as predictions: the ceiling;
- `continuous`: this engine's continuous batching, 16 slots, arrival order (the modern baseline);
- `continuous+predicted`: the same, admitting the shortest first by the expected predicted length.

Predictions come from the trained adapter (`--adapter`), run as the service runs it: the prompt
through the plain model, then the length question with the adapter on, and the prompt's KV handed to
the decoder, whose prefill then starts after it (the service's predictor publishes it to the context
cache). So the policies that use predictions hold every prompt's KV from the predictor while they
run, and the whole prediction time (prompt passes included) counts against them. Writes
bench/results/schedule.json and schedule.png.

Each policy's run is kept in `--store` (bench/results/schedule_runs/<workload signature>/, those
that read predictions in a subfolder per adapter) as it finishes, with the predictions, so the full
run (1,024 requests, half an hour to an hour per policy on a 2-core CPU) can be done a few policies at a
time (`--policies`) and resumes after an interruption; the comparison is written when all six are
there.

Run one after another, two policies meet this 2-core machine at different hours, and its speed moves
by a quarter between them. `--in-turns A,B` serves just two policies in turns in one process instead
(a micro-batch, or 16 steps of continuous batching, at a time; the one that has run least goes next),
each on its own engine and timed on its own clock, prediction included for the one that reads
predictions: their ratio is then free of the machine's drift. Those pairs are kept in the store and
in bench/results/schedule_in_turns.json.

`--rate R` (with `--in-turns continuous,continuous+predicted`) has the requests arrive as a Poisson
stream of R a second (seeded) instead of all at t=0, as a service meets them: those that arrive
to a queue (not all of them find a free slot with nobody waiting) are predicted when they arrive, on
their policy's clock, and wait among those that have arrived; the others start at once, unpredicted.
Latency counts from arrival. `--load F` sets that rate to F times what continuous batching can answer on this box
at the start (its speed probed), since the box's speed, and so what a fixed rate asks of it, moves by
2x within a day. The binned policies keep the paper's offline setting.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import operator
import random
import statistics
from collections.abc import Callable, Generator, Iterator
from pathlib import Path

from bench.common import RESULTS, device_signature, machine, table, write_result
from bench.schedule_policies import (Job, PolicyClock, PolicyRun, binned_turns, box_speed, continuous_turns,
                                     drain, run_in_turns, running_clock, summarize)
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.loader import load_hf_model, resolve_model_dir, select_device_and_dtype
from engine.prefix_cache import PrefixEntry
from engine.types import GenerationRequest, SamplingParams
from predictor.batcher import BatcherConfig
from predictor.bins import LengthBins
from predictor.labels import DEFAULT_OUT as DEFAULT_LABELS
from predictor.labels import read_labels
from predictor.metrics import length_metrics
from predictor.predict import DEFAULT_ADAPTER, LengthPredictor, PredictorConfig
from predictor.prompt import MAX_PROMPT_TOKENS

EDGES = [32, 64, 128, 256]
VANILLA_BATCH = 16
VBS_MAX_BATCH = 64
HEADLINE = "predicted+vbs+fcr"
TARGETS = {  # key: (comparison, target), from the issue; 1.86 is the paper's figure
    "speedup_vs_vanilla": (operator.ge, 1.86),
    "effective_token_ratio": (operator.ge, 0.6),
    "recompute_ratio": (operator.le, 0.1),
    "latency_vs_continuous": (operator.le, 0.8),
}
CHART = [("samples_per_s", "samples/s"), ("tokens_per_s", "answer tokens/s"),
         ("effective_token_ratio", "useful share of computed answer tokens"),
         ("recompute_ratio", "recomputed share of computed tokens"),
         ("latency_mean_s", "mean request latency (s)"), ("latency_p99_s", "p99 request latency (s)")]


def draw_workload(rows: list[dict], n: int, seed: int) -> list[dict]:
    """`n` held-out rows, seeded; drawn with replacement only when there are fewer than `n`."""
    held_out = [r for r in rows if r["split"] == "val"]
    if not held_out:
        raise ValueError("labels: no rows in the val split to draw the workload from")
    rng = random.Random(seed)
    return rng.sample(held_out, n) if n <= len(held_out) else [rng.choice(held_out) for _ in range(n)]


def prompt_ids(engine: LLMEngine, prompt: str) -> list[int]:
    """The prompt as the labels decoded it: cut to MAX_PROMPT_TOKENS, in the chat template."""
    text = engine.tokenizer.decode(engine.encode(prompt)[:MAX_PROMPT_TOKENS])
    return engine.encode_chat([{"role": "user", "content": text}])


def policy_configs(edges: list[int], max_tokens: int, token_budget: int) -> dict[str, BatcherConfig]:
    fixed = {"variable_batch_size": False, "failure_recompute": False, "max_batch_size": VANILLA_BATCH}
    bins = LengthBins(edges=[e for e in edges if e < max_tokens] + [max_tokens])
    vbs = BatcherConfig(bins=bins, token_budget=token_budget, max_batch_size=VBS_MAX_BATCH,
                        variable_batch_size=True, failure_recompute=True)
    return {
        "vanilla": BatcherConfig(bins=LengthBins(edges=[max_tokens]), **fixed),  # one bin: arrival order
        "predicted": BatcherConfig(bins=bins, **fixed),
        HEADLINE: vbs,
        "oracle": vbs,
    }


# what each policy schedules by: the binned policies cap and bin by the predicted length; continuous
# batching, which neither caps nor bins, admits shortest first by the expected length, which orders
# answers better (predictor/model.py BucketReadout.expected)
LENGTHS_READ = {"continuous": None, "vanilla": None, "predicted": "predicted", HEADLINE: "predicted",
                "oracle": "labels", "continuous+predicted": "expected"}
POLICIES = tuple(LENGTHS_READ)
# how predictions are made and read, part of their runs' folder name (runs kept before the lean prompt
# pass are under the first string alone, before the expected length under the first two)
PREDICTION = "prompt KV shared with the decoder:lean prompt pass:expected length orders continuous:"
# the stream's predicted policy asks the predictor only for arrivals that cannot all start at once
# (bench.schedule_policies.continuous_turns); part of a stream's signature and of its pair's name
PREDICTS_A_QUEUE = "only arrivals that queue"
PREDICTED = tuple(name for name, read in LENGTHS_READ.items() if read in ("predicted", "expected"))


class RunStore:
    """Finished policy runs of one workload, one JSON file each, so that a run of all six policies
    on 1,024 requests (hours on a 2-core CPU) can be split across invocations (`--policies`) and
    survive an interruption. The folder is named by a signature of everything a run depends on;
    the runs that read predictions (and the predictions) sit in a subfolder named by the predictor,
    so a retrained adapter reruns only those, not `vanilla`, `oracle` and `continuous`."""

    def __init__(self, root: Path, signature: dict, predictor: str = ""):
        self.folder = root / _digest(signature)
        self.predicted_folder = self.folder / predictor_folder_name(predictor)
        self.predicted_folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "signature.json").write_text(json.dumps(signature, indent=1, sort_keys=True))

    def _path(self, name: str) -> Path:
        folder = self.predicted_folder if name in PREDICTED else self.folder
        return folder / f"{name.replace('+', '_')}.json"

    @property
    def predictions(self) -> Path:
        return self.predicted_folder / "predictions.json"

    def has(self, name: str) -> bool:
        return self._path(name).exists()

    def pair_folder(self, pair: tuple[str, str]) -> Path:
        """Where the two runs of `pair` served in turns (`--in-turns`) are kept: apart from the runs
        made alone, under the predictor's folder if either reads predictions."""
        base = self.predicted_folder if set(pair) & set(PREDICTED) else self.folder
        return base / "in_turns" / "__".join(name.replace("+", "_") for name in pair)

    def load(self, name: str) -> PolicyRun | None:
        path = self._path(name)
        return PolicyRun(**json.loads(path.read_text())) if path.exists() else None

    def save(self, name: str, run: PolicyRun) -> None:
        tmp = self._path(name).with_suffix(".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(run)))
        tmp.replace(self._path(name))


def predictor_signature(adapter: Path) -> str:
    """What names the runs that read an adapter's predictions (their `predictor-<digest>` folder): how
    predictions are made (`PREDICTION`) and the adapter's files."""
    return PREDICTION + hashlib.sha256(b"".join(f.read_bytes() for f in sorted(adapter.iterdir())
                                                if f.is_file())).hexdigest()


def predictor_folder_name(predictor: str) -> str:
    """The folder, under a workload's, of the runs that read the predictions of `predictor` (a
    `predictor_signature`)."""
    return f"predictor-{_digest(predictor)}"


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def prediction_turns(predictor: LengthPredictor, ids: list[list[int]], chunk: int = 64
                     ) -> Generator[None, None, tuple[list[int], list[float], list[PrefixEntry]]]:
    """Every request's predicted and expected length and each distinct prompt's KV from the predictor's
    prompt pass (what the service's predictor hands the decoder), returned at the end; yields after each
    chunk. Chunks hold prompts of similar length (as one call would sort them: little padding), and
    one KV is kept per distinct prompt, so a workload with repeats does not hold each again."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    lengths, expected, entries = [0] * len(ids), [0.0] * len(ids), {}
    for first in range(0, len(order), chunk):
        group = order[first : first + chunk]
        got, means, kv = predictor.estimate_with_kv([ids[i] for i in group])
        for i, length, mean, entry in zip(group, got, means, kv):
            lengths[i], expected[i] = length, mean
            entries.setdefault(entry.token_ids, entry)
        yield
    return lengths, expected, list(entries.values())


def predict_sharing_kv(predictor: LengthPredictor, ids: list[list[int]], chunk: int = 64
                       ) -> tuple[list[int], list[float], list[PrefixEntry], float]:
    """`prediction_turns` run to the end, with the seconds the predictor spent."""
    started = predictor.seconds
    lengths, expected, entries = drain(prediction_turns(predictor, ids, chunk))
    return lengths, expected, entries, predictor.seconds - started


@contextlib.contextmanager
def holding(engine: LLMEngine, entries: list[PrefixEntry] | None):
    """The engine's prefix cache holds `entries` (the predictor's prompt KV), and only them, while
    a policy that read the predictions runs; it is emptied again after, so no other policy gains."""
    cache = engine.prefix_cache
    bound = cache.max_bytes
    cache.clear()
    if entries:
        cache.max_bytes = max(bound, sum(e.nbytes for e in entries))
        for entry in entries:
            engine.import_prefix(entry)
    try:
        yield
    finally:
        cache.clear()
        cache.max_bytes = bound


class PredictOnArrival:
    """`predict(jobs)` for a policy whose requests arrive over time: the expected lengths of the jobs
    that just arrived to a queue, from the predictor's pass over their prompts (`predict_sharing_kv`), with each distinct
    prompt's KV put into `engine`'s prefix cache (room made for it), as the service's predictor
    hands it to the decoder. `seconds`: the predictor's time, spent inside the policy's run."""

    def __init__(self, predictor: LengthPredictor, engine: LLMEngine, chunk: int = 64):
        self.predictor, self.engine, self.chunk = predictor, engine, chunk
        self.seconds, self._held, self._bytes = 0.0, set(), 0

    def __call__(self, jobs: list[Job]) -> list[float]:
        _, expected, entries, seconds = predict_sharing_kv(self.predictor, [j.prompt_ids for j in jobs], self.chunk)
        self.seconds += seconds
        for entry in entries:
            if entry.token_ids not in self._held:
                self._held.add(entry.token_ids)
                self._bytes += entry.nbytes
                cache = self.engine.prefix_cache
                cache.max_bytes = max(cache.max_bytes, self._bytes)
                self.engine.import_prefix(entry)
        return expected


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """`n` arrival times (s) of a Poisson stream of `rate` requests a second, from t=0, seeded."""
    rng, now, times = random.Random(f"arrivals:{seed}"), 0.0, []
    for _ in range(n):
        times.append(now)
        now += rng.expovariate(rate)
    return times


def capacity_per_s(box_tok_s: float, answer_tokens: list[int], prompt_tokens: list[int]) -> float:
    """Requests a second that continuous batching answers on this box now, from its speed probe
    (`box_speed`, tokens/s of a batch of 16): a request costs about its answer's decode steps and
    its prompt's prefill, a prompt token about as much as an answer token. Calibrated on the kept
    1,024-request burst: a probe of 98 tokens/s and 0.360 requests/s answered, 272 tokens a request,
    against 183 + 88 for the workload's mean answer and prompt."""
    return box_tok_s / (statistics.mean(answer_tokens) + statistics.mean(prompt_tokens))


def policy_turns(jobs: list[Job], params: SamplingParams, edges: list[int]
                 ) -> Callable[[str, LLMEngine, PolicyRun, Callable[[], float]], Iterator[None]]:
    """`turns_of(name, engine, run, clock)`: the named policy's turns on `engine` into `run` (continuous batching, or a batcher's micro-batches
    with the policy's config), as they run alone or in turns with another."""
    budget = round(VANILLA_BATCH * (statistics.mean(len(j.prompt_ids) for j in jobs) + params.max_tokens))
    configs = policy_configs(edges, params.max_tokens, budget)
    lengths_of = {None: None, "predicted": [j.predicted for j in jobs], "expected": [j.expected for j in jobs],
                  "labels": [j.label for j in jobs]}

    def turns_of(name: str, engine: LLMEngine, run: PolicyRun, clock: Callable[[], float],
                 predict: Callable[[list[Job]], list[float]] | None = None) -> Iterator[None]:
        lengths, progress = lengths_of[LENGTHS_READ[name]], print_progress(name, len(jobs))
        if name.startswith("continuous"):
            return continuous_turns(engine, jobs, params, None if predict else lengths, run, clock, progress,
                                    predict=predict)
        return binned_turns(engine, jobs, params, configs[name], lengths, run, clock, progress)

    return turns_of


def check_pair(pair: tuple[str, ...]) -> None:
    """A pair to serve in turns: two different policies, at most one of them reading predictions
    (the predictor's prompt KV is made once, for one engine); ValueError saying what is wrong."""
    if len(pair) != 2 or len(set(pair)) != 2 or not set(pair) <= set(POLICIES):
        raise ValueError(f"two different policies of {', '.join(POLICIES)}; got {', '.join(pair)}")
    if len(reads := [name for name in pair if name in PREDICTED]) > 1:
        raise ValueError(f"at most one policy that reads predictions; got {', '.join(reads)}")


def run_policies(static_engine: LLMEngine, continuous_engine: LLMEngine, jobs: list[Job], params: SamplingParams,
                 edges: list[int], prediction_s: float, store: RunStore | None = None,
                 only: set[str] | None = None, prompt_kv: list[PrefixEntry] | None = None) -> dict[str, PolicyRun]:
    """Every policy on the same jobs; static batches on `static_engine` (slots for the largest
    variable-size batch), continuous batching on `continuous_engine` (VANILLA_BATCH slots).
    With `store`, a policy it already holds is taken from it and each new run is saved there;
    with `only`, the other policies are not run (only taken from the store). `prompt_kv`: the
    predictor's prompt KV, held by the engine while a policy that read the predictions runs."""
    turns_of = policy_turns(jobs, params, edges)
    runs = {}
    for name in POLICIES:
        done = store.load(name) if store is not None else None
        if done is not None:
            runs[name] = done
            print(f"{name}: {done.wall_s:.1f} s (from {store.folder})", flush=True)
            continue
        if only is not None and name not in only:
            continue
        reads_predictions = name in PREDICTED
        engine = continuous_engine if name.startswith("continuous") else static_engine
        before = box_speed(continuous_engine, jobs[0].prompt_ids)
        runs[name] = PolicyRun()
        with holding(engine, prompt_kv if reads_predictions else None):
            drain(turns_of(name, engine, runs[name], running_clock()))
        after = box_speed(continuous_engine, jobs[0].prompt_ids)
        runs[name].box_tok_s = [before, after]
        if reads_predictions:
            runs[name].prediction_s = prediction_s
        if store is not None:
            store.save(name, runs[name])
        print(f"{name}: {runs[name].wall_s:.1f} s (box speed {before:.0f} then {after:.0f} tok/s)", flush=True)
    return runs


def run_pair_in_turns(pair: tuple[str, str], engine_for: Callable[[str], LLMEngine], jobs: list[Job],
                      params: SamplingParams, edges: list[int], predicting: Iterator | None = None,
                      probe: LLMEngine | None = None, predictor: LengthPredictor | None = None
                      ) -> dict[str, PolicyRun]:
    """Two policies served in turns in one process (`run_in_turns`), each on its own engine from
    `engine_for(name)` (so neither reuses the other's cache) and timed on its own clock, so the
    machine's drift hits both alike. A policy that reads predictions first runs `predicting` (a
    `prediction_turns`), a chunk a turn on its own clock, and counts that as its `prediction_s`;
    its engine then holds the predictor's prompt KV while it runs. Jobs that arrive over time
    (`Job.arrival_s`) are predicted as they arrive to a queue instead, by `predictor` (`PredictOnArrival`), and
    that time is `prediction_in_run_s`. With `probe`, both runs record the box speed before and after
    the pair."""
    check_pair(pair)
    reads = [name for name in pair if name in PREDICTED]
    over_time = any(job.arrival_s > 0 for job in jobs)
    if over_time and any(not name.startswith("continuous") for name in pair):
        raise ValueError("requests that arrive over time are served by the continuous policies only; "
                         f"got {', '.join(pair)}")
    if reads and over_time and predictor is None:
        raise ValueError(f"{reads[0]} predicts its requests as they arrive; the predictor is needed")
    if reads and not over_time and predicting is None:
        raise ValueError(f"{reads[0]} reads predictions; the predictor's turns are needed")
    turns_of = policy_turns(jobs, params, edges)
    runs = {name: PolicyRun() for name in pair}
    clocks = {name: PolicyClock() for name in pair}
    turns = {}
    for name in pair:
        engine = engine_for(name)
        if name in reads and over_time:
            turns[name] = _predicting_on_arrival(PredictOnArrival(predictor, engine), engine, turns_of, name,
                                                 runs[name], clocks[name])
            continue
        policy = turns_of(name, engine, runs[name], clocks[name])
        turns[name] = (_after_prediction(predicting, engine, policy, runs[name], clocks[name])
                       if name in reads else policy)
    before = box_speed(probe, jobs[0].prompt_ids) if probe is not None else None
    run_in_turns(turns, clocks)
    if probe is not None:
        after = box_speed(probe, jobs[0].prompt_ids)
        for run_ in runs.values():
            run_.box_tok_s = [before, after]
    return runs


def _after_prediction(predicting: Iterator, engine: LLMEngine, policy: Iterator[None], run: PolicyRun,
                      clock: PolicyClock) -> Iterator[None]:
    """The predictor's turns, then the policy's on an engine holding the predictor's prompt KV."""
    *_, entries = yield from predicting
    run.prediction_s = clock()
    with holding(engine, entries):
        yield from policy


def _predicting_on_arrival(predict: PredictOnArrival, engine: LLMEngine, turns_of: Callable, name: str,
                           run: PolicyRun, clock: PolicyClock) -> Iterator[None]:
    """The policy's turns, predicting its requests as they arrive, on an engine that holds the
    predictor's prompt KV of those that arrived, and only those, while it runs."""
    with holding(engine, None):
        yield from turns_of(name, engine, run, clock, predict=predict)
    run.prediction_in_run_s = predict.seconds


def print_progress(name: str, n: int, parts: int = 10):
    """A progress callback for a policy run: a line each time another tenth of the `n` requests is answered."""
    every = max(1, n // parts)

    def report(answered: int, at_s: float) -> None:
        if answered % every == 0 or answered == n:
            print(f"  {name}: {answered}/{n} answered, {at_s:.0f} s", flush=True)

    return report


def compare(runs: dict[str, PolicyRun], jobs: list[Job]) -> dict:
    """The issue's keys, from the measured runs, plus how far the answers agree."""
    s = {name: summarize(run) for name, run in runs.items()}
    reference = runs["continuous"].answers
    head, vanilla = s[HEADLINE], s["vanilla"]
    out = {
        **issue_keys(s),
        "samples_per_s_vs_vanilla": {name: v["samples_per_s"] / vanilla["samples_per_s"] for name, v in s.items()},
        "prediction_share": head["prediction_s"] / head["wall_s"],
        "label_agreement": statistics.mean(len(reference[j.id]) == j.label for j in jobs),
        "same_answers_as_continuous": {
            name: statistics.mean(run.answers.get(j.id) == reference[j.id] for j in jobs) for name, run in runs.items()
        },
        "policies": s,
    }
    out["targets"] = {key: target for key, (_, target) in TARGETS.items()}
    out["targets_met"] = {key: bool(op(out[key], target)) for key, (op, target) in TARGETS.items()}
    return out


def policy_table(policies: dict[str, dict], vs_vanilla: dict[str, float] | None = None) -> str:
    """The policies' summaries as a table; the ratio to vanilla's samples/s where given."""
    rows = [[name, f"{p['samples_per_s']:.3f}", f"{p['tokens_per_s']:.1f}", f"{p['effective_token_ratio']:.0%}",
             f"{p['recompute_ratio']:.1%}", f"{p['latency_mean_s']:.1f}", f"{p['latency_p99_s']:.1f}",
             "-" if p.get("box_tok_s") is None else f"{p['box_tok_s']:.0f}"]
            + ([f"{vs_vanilla[name]:.2f}x"] if vs_vanilla else []) for name, p in policies.items()]
    return table(["policy", "samples/s", "tok/s", "useful", "recomputed", "latency mean s", "p99 s", "box tok/s"]
                 + (["vs vanilla"] if vs_vanilla else []), rows)


def issue_keys(summaries: dict[str, dict]) -> dict[str, float]:
    """Those of the issue's keys that the `summarize`d runs given allow (all four once every policy
    ran). `latency_vs_continuous`: mean latency of `continuous+predicted` over `continuous`,
    prediction time included."""
    out, head = {}, summaries.get(HEADLINE)
    if head is not None and "vanilla" in summaries:
        out["speedup_vs_vanilla"] = head["samples_per_s"] / summaries["vanilla"]["samples_per_s"]
    if head is not None:
        out["effective_token_ratio"] = head["effective_token_ratio"]
        out["recompute_ratio"] = head["recompute_ratio"]
    if "continuous" in summaries and "continuous+predicted" in summaries:
        out["latency_vs_continuous"] = (summaries["continuous+predicted"]["latency_mean_s"]
                                        / summaries["continuous"]["latency_mean_s"])
    return out


def rounded(value, digits: int = 4):
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v, digits) for v in value]
    return value


def _chart(policies: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(policies)
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, (key, title) in zip(axes.flat, CHART):
        ax.bar(names, [policies[n][key] for n in names], color=["tab:gray" if "continuous" in n else "tab:blue"
                                                                for n in names])
        ax.set_title(title)
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.suptitle(f"{next(iter(policies.values()))['requests']} requests, all arriving at t=0")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report_pair(pair: tuple[str, str], store: RunStore, measure: Callable[[], dict[str, PolicyRun]], n: int,
                rate: float | None = None, load: float | None = None) -> dict:
    """The pair's runs in turns, from the store or measured now (and kept); printed, and added to
    bench/results/schedule_in_turns.json under the pair's name (and arrival rate, and the load it was
    set from) with the issue's keys they allow."""
    folder = store.pair_folder(pair)
    paths = {name: folder / f"{name.replace('+', '_')}.json" for name in pair}
    if all(path.exists() for path in paths.values()):
        runs = {name: PolicyRun(**json.loads(path.read_text())) for name, path in paths.items()}
        print(f"in turns: {', '.join(pair)} (from {folder})")
    else:
        runs = measure()
        folder.mkdir(parents=True, exist_ok=True)
        for name, path in paths.items():
            path.write_text(json.dumps(dataclasses.asdict(runs[name])))
    summaries = {name: summarize(run) for name, run in runs.items()}
    keys = issue_keys(summaries)
    first, second = pair
    entry = rounded({"requests": n, "arrivals_per_s": rate, **({} if load is None else {"load": load}),
                     "policies": summaries, **keys,
                     "samples_per_s_ratio": summaries[second]["samples_per_s"] / summaries[first]["samples_per_s"],
                     "latency_mean_ratio": summaries[second]["latency_mean_s"] / summaries[first]["latency_mean_s"],
                     "same_answers": statistics.mean(runs[first].answers[k] == runs[second].answers.get(k)
                                                     for k in runs[first].answers),
                     "machine": machine()})
    path = RESULTS / "schedule_in_turns.json"
    kept = json.loads(path.read_text()) if path.exists() else {}
    kept[" + ".join(pair) + ("" if rate is None else f" at {rate:g}/s")
         + ("" if load is None else f" (load {load:g})")
         + ("" if rate is None or not set(pair) & set(PREDICTED) else f", predicting {PREDICTS_A_QUEUE}")] = entry
    path.write_text(json.dumps(kept, indent=1) + "\n")
    print(policy_table(summaries))
    print(f"{second} over {first}, served in turns: samples/s x{entry['samples_per_s_ratio']:.3f}, mean latency "
          f"x{entry['latency_mean_ratio']:.3f}" + "".join(f", {k}: {v:.3f}" for k, v in keys.items()))
    print(f"wrote {path}")
    return entry


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench schedule", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 requests")
    parser.add_argument("-n", type=int, default=None, help="requests in the workload (default 1024)")
    parser.add_argument("--labels", type=Path, default=DEFAULT_LABELS, help="folder of the label parts")
    parser.add_argument("--adapter", type=Path, default=DEFAULT_ADAPTER, help="trained length adapter")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default=None,
                        help=f"comma-separated subset to run now (default all: {','.join(POLICIES)}); runs are kept "
                        "in --store, and the comparison is written once all six are there")
    parser.add_argument("--in-turns", default=None, metavar="A,B",
                        help="serve just these two policies in turns in one process, each on its own engine and "
                        "clock, so the machine's drift hits both alike (e.g. vanilla,predicted+vbs+fcr); kept in "
                        "--store and added to bench/results/schedule_in_turns.json")
    parser.add_argument("--rate", type=float, default=None, metavar="R",
                        help="with --in-turns continuous,continuous+predicted: requests arrive as a Poisson stream "
                        "of R a second (seeded by --seed) instead of all at t=0, each predicted when it arrives")
    parser.add_argument("--load", type=float, default=None, metavar="F",
                        help="as --rate, the rate set to F times what continuous batching can answer on this box "
                        "now, from a speed probe at the start (capacity_per_s): a fixed rate is no fixed load on "
                        "a machine whose speed moves; the rate used is printed and kept")
    parser.add_argument("--store", type=Path, default=RESULTS / "schedule_runs",
                        help="folder of finished policy runs, per workload (reused when the workload is the same)")
    args = parser.parse_args(argv)
    only = set(args.policies.split(",")) if args.policies else None
    if only is not None and not only <= set(POLICIES):
        raise SystemExit(f"--policies: unknown {sorted(only - set(POLICIES))}; known: {', '.join(POLICIES)}")
    pair = tuple(args.in_turns.split(",")) if args.in_turns else None
    if pair is not None:
        try:
            check_pair(pair)
        except ValueError as error:
            raise SystemExit(f"--in-turns: {error}") from None
    if args.rate is not None and args.load is not None:
        raise SystemExit("--load: sets the rate from the box's speed; give it or --rate, not both")
    for option, value in (("--rate", args.rate), ("--load", args.load)):
        if value is not None and (value <= 0 or pair is None or any(not name.startswith("continuous") for name in pair)):
            raise SystemExit(f"{option}: a positive number, with --in-turns of the continuous policies (e.g. --in-turns "
                             f"continuous,continuous+predicted {option} {0.35 if option == '--rate' else 1}); the "
                             "binned policies serve the paper's offline setting, every request at t=0")
    if not (args.adapter / "settings.json").exists():
        raise SystemExit(f"--adapter: no trained length adapter in {args.adapter}; train one with "
                         f"python -m predictor.train, or pass --adapter FOLDER")
    n = args.n or (32 if args.quick else 1024)
    chosen = draw_workload(read_labels(args.labels), n, args.seed)
    max_tokens = max(r["max_tokens"] for r in chosen)
    if any(r["max_tokens"] != max_tokens for r in chosen):
        raise SystemExit("labels: rows made with different max_tokens; the workload needs one")
    params = SamplingParams(max_tokens=max_tokens, stop_on_loop=True)

    # as the labels were made; no drafts: the kept runs were made without, and the padded policies count rows x steps;
    # no answers cached: a policy must not start from the KV of the one before (the paper's systems keep none);
    # continuous+predicted orders admission by priority, shortest first, without preempting what runs
    config = EngineConfig(max_batch_size=VANILLA_BATCH, max_model_len=1024, speculative_tokens=0, cache_answers=False,
                          preempt_for_priority=False)
    device, dtype = select_device_and_dtype(config)
    hf_model, tokenizer = load_hf_model(resolve_model_dir(config.model), dtype, device)
    continuous = LLMEngine(hf_model, tokenizer, config)
    ids = [prompt_ids(continuous, r["prompt"]) for r in chosen]
    static = LLMEngine(hf_model, tokenizer, config.model_copy(update={
        "max_batch_size": VBS_MAX_BATCH, "max_model_len": max(map(len, ids)) + 2 * max_tokens + 1,
        "max_prefill_tokens": VBS_MAX_BATCH * (max(map(len, ids)) + max_tokens)}))
    for engine in (continuous, static):  # first calls allocate and pick kernels
        engine.generate([GenerationRequest(prompt_ids=ids[0], params=SamplingParams(max_tokens=4))])
    if args.load is not None:
        probed = box_speed(continuous, ids[0])
        capacity = capacity_per_s(probed, [r["label"] for r in chosen], list(map(len, ids)))
        args.rate = float(f"{args.load * capacity:.3g}")
        print(f"box speed {probed:.0f} tok/s: continuous batching answers about {capacity:.3f} requests/s; "
              f"load {args.load:g} -> --rate {args.rate:g}", flush=True)

    store = RunStore(args.store, {
        "n": n, "seed": args.seed, "rows": [r["id"] for r in chosen], "labels": [r["label"] for r in chosen],
        "model": config.model, "max_tokens": max_tokens, "edges": EDGES,
        "vanilla_batch": VANILLA_BATCH, "vbs_max_batch": VBS_MAX_BATCH, **device_signature(device, dtype),
        # a burst's runs keep the folder they had; a stream's before PREDICTS_A_QUEUE predicted every arrival
        **({} if args.rate is None else {"rate": args.rate, "predicts": PREDICTS_A_QUEUE})},
        predictor=predictor_signature(args.adapter))
    saved, prompt_kv = store.predictions, None
    if not saved.exists() or (pair is None and any(not store.has(name) for name in PREDICTED
                                                    if only is None or name in only)):
        # the prompt KV is too large to keep between invocations: predicted again (and timed) where needed
        predictor = LengthPredictor(hf_model, tokenizer, PredictorConfig(adapter=str(args.adapter)))
        predictions, expected, prompt_kv, prediction_s = predict_sharing_kv(predictor, ids)
        print(f"predicted {n} lengths in {prediction_s:.0f} s ({len(prompt_kv)} distinct prompts' KV)", flush=True)
        if not saved.exists():
            saved.write_text(json.dumps({"predicted": predictions, "expected": expected, "seconds": prediction_s}))
    kept = json.loads(saved.read_text())  # every part of the run schedules by the first predictions
    if prompt_kv is None:  # nothing predicted now: the kept measurement
        prediction_s = kept["seconds"]
    elif kept["predicted"] != predictions:
        print(f"note: {sum(a != b for a, b in zip(kept['predicted'], predictions))} predictions differ from the "
              "kept ones; the kept ones are used")
    predictions, expected = kept["predicted"], kept["expected"]
    arrivals = [0.0] * n if args.rate is None else poisson_arrivals(n, args.rate, args.seed)
    jobs = [Job(id=f"r{i:05d}", prompt_ids=p, label=r["label"], predicted=q, expected=e, arrival_s=a)
            for i, (r, p, q, e, a) in enumerate(zip(chosen, ids, predictions, expected, arrivals))]
    if pair is not None:
        predicting = predictor = None
        if set(pair) & set(PREDICTED):  # predicted again in the pair's turns, timed on its policy's clock
            predictor = LengthPredictor(hf_model, tokenizer, PredictorConfig(adapter=str(args.adapter)))
            predicting = prediction_turns(predictor, ids) if args.rate is None else None
        unused = {"continuous": [continuous], "static": [static]}  # the second of a kind gets an engine of its own

        def engine_for(name: str) -> LLMEngine:
            kind = "continuous" if name.startswith("continuous") else "static"
            if unused[kind]:
                return unused[kind].pop()
            built = LLMEngine(hf_model, tokenizer, {"continuous": continuous, "static": static}[kind].config)
            built.generate([GenerationRequest(prompt_ids=ids[0], params=SamplingParams(max_tokens=4))])
            return built

        return report_pair(pair, store, lambda: run_pair_in_turns(pair, engine_for, jobs, params, EDGES, predicting,
                                                                   probe=continuous, predictor=predictor), n,
                           args.rate, args.load)
    runs = run_policies(static, continuous, jobs, params, EDGES, prediction_s, store=store, only=only,
                        prompt_kv=prompt_kv)
    missing = [name for name in POLICIES if name not in runs]
    if missing:
        if runs:  # what is there so far, so a long run split across invocations shows its figures as it goes
            summaries = {name: summarize(run) for name, run in runs.items()}
            print(policy_table(summaries))
            if keys := issue_keys(summaries):
                print(", ".join(f"{key}: {value:.3f}" for key, value in keys.items()))
        print(f"kept in {store.folder}: {', '.join(runs) or 'nothing yet'}; still to run: {', '.join(missing)} "
              f"(python -m bench schedule ... --policies {','.join(missing)})")
        return {}

    result = compare(runs, jobs)
    policies = result.pop("policies")
    result = {
        **result,
        "workload": {"requests": n, "distinct_prompts": len({r["id"] for r in chosen}), "seed": args.seed,
                     "labels": str(args.labels), "max_tokens": max_tokens, "edges": EDGES,
                     "vanilla_batch": VANILLA_BATCH, "vbs_max_batch": VBS_MAX_BATCH,
                     "label_mean": statistics.mean(j.label for j in jobs),
                     "prompt_tokens_mean": statistics.mean(map(len, ids)),
                     "prompt_tokens_differ_from_labels": sum(len(p) != r["prompt_tokens"] for p, r in zip(ids, chosen))},
        "predictor": {"adapter": str(args.adapter), "seconds": prediction_s,
                      **length_metrics(predictions, [j.label for j in jobs], EDGES)},
        "policies": policies,
        "requests": [{"id": r["id"], "label": j.label, "predicted": j.predicted, "expected": j.expected,
                      "actual": len(runs["continuous"].answers[j.id])} for r, j in zip(chosen, jobs)],
        "quick": args.quick,
        "machine": machine(),
    }
    result = rounded(result)
    path = write_result("schedule", result)
    _chart(policies, RESULTS / "schedule.png")
    print(policy_table(policies, result["samples_per_s_vs_vanilla"]))
    print({k: result[k] for k in (*TARGETS, "prediction_share", "label_agreement", "targets_met")})
    print(f"wrote {path}")
    return result
