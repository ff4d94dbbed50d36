"""How `python -m bench schedule` serves one workload under each policy, and what it counts.

Static batches (the paper's setting: `vanilla`, `predicted`, `predicted+vbs+fcr`, `oracle`). A
micro-batch is one padded batch: it is done when its last member is done, and until then every row
keeps computing, a finished member's row decoding padding, as in a padded `generate` call. This
engine frees a finished row at once, so `run_static` decodes every row with `ignore_eos` (and no
loop stop) and applies each member's own stop rules here, in the engine's order: the end token,
max_tokens, a loop; then the bin's cap. When every member is done, the rows still running are
aborted. Greedy decoding is batch-invariant here, so a member's tokens up to its stop are exactly
the tokens it gets decoded alone.

The cap: a bin with upper edge E holds answers of up to E tokens, so an answer is cut only when
it has E + 1 tokens and none of them stopped it (an answer of exactly E tokens must sample its end
token first). The cut keeps all its tokens; the batcher re-queues it a bin up, where it resumes
after them (its prompt and kept tokens are prefilled again: that is the recompute).

Continuous (`continuous`, `continuous+predicted`): every request is added to one engine as it
arrives (all at t=0 unless the workload has arrival times) and the engine's own continuous batching
serves them, in arrival order or by priority.

Counted per policy: `decode_tokens`, the answer positions computed (rows x steps, padding and each
sampled end token included); `prefill_tokens`, the prompt (and resumed) tokens prefilled;
`recompute_tokens`, those prefilled again on resume; and each request's final answer and the
seconds from its arrival to its return (a static batch returns its members when it is done).
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field

from engine.engine import LLMEngine
from engine.loops import LoopDetector
from engine.types import FinishReason, GenerationRequest, Result, SamplingParams
from predictor.batcher import Batcher, BatcherConfig


@dataclass
class Job:
    """One request of the workload."""

    id: str
    prompt_ids: list[int]
    label: int  # its true answer length in tokens
    predicted: int | None = None  # what to cap and bin it by
    expected: float | None = None  # the predictor's expected length: what to order it by
    arrival_s: float = 0.0  # when it arrives, from the start of the run


@dataclass
class PolicyRun:
    """What one policy did with the workload."""

    answers: dict[str, list[int]] = field(default_factory=dict)
    latency_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    prediction_s: float = 0.0  # spent predicting lengths before scheduling began
    prediction_in_run_s: float = 0.0  # spent predicting requests as they arrived: inside wall_s and the latencies
    decode_tokens: int = 0
    prefill_tokens: int = 0
    recompute_tokens: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # of the static micro-batches
    box_tok_s: list[float] = field(default_factory=list)  # `box_speed` just before and just after the run

    def finish(self, request_id: str, token_ids: list[int], at_s: float,
               progress: Callable[[int, float], None] | None = None, arrived_s: float = 0.0) -> None:
        """Record one answer, returned `at_s` into the run, of a request that arrived at `arrived_s`;
        `progress(answered so far, at_s)` is told of it."""
        if request_id in self.answers:
            raise RuntimeError(f"request {request_id} was answered twice")
        self.answers[request_id] = list(token_ids)
        self.latency_s[request_id] = at_s - arrived_s
        if progress is not None:
            progress(len(self.answers), at_s)


class _Member:
    """One row of a static batch: its tokens so far and whether its own stop rules ended it."""

    def __init__(self, request: GenerationRequest, stop_ids: set[int]):
        self.request, self.stop_ids = request, stop_ids
        self.tokens = list(request.resume_ids)
        self.loops = LoopDetector() if request.params.stop_on_loop else None
        for token in self.tokens if self.loops else ():  # as the engine does on resume
            self.loops.add(token)
        self.finish: FinishReason | None = None
        self.sampled = 0  # answer positions computed for this member until it was done

    def add(self, token: int) -> None:
        if self.finish is not None:
            return
        self.sampled += 1
        params, cap = self.request.params, self.request.params.length_cap
        if token in self.stop_ids:
            self.finish = FinishReason.STOP
            return
        self.tokens.append(token)
        if len(self.tokens) >= params.max_tokens:
            self.finish = FinishReason.LENGTH
        elif self.loops is not None and self.loops.add(token):
            self.finish = FinishReason.STOP
        elif cap is not None and len(self.tokens) > cap:
            self.finish = FinishReason.CUT

    def result(self, tokenizer, latency_s: float) -> Result:
        return Result(request_id=self.request.id, prompt_tokens=len(self.request.prompt_ids),
                      token_ids=self.tokens, text=tokenizer.decode(self.tokens), finish_reason=self.finish,
                      ttft_s=0.0, latency_s=latency_s)


def run_static(engine: LLMEngine, requests: list[GenerationRequest]) -> tuple[list[Result], int]:
    """Decode one micro-batch as a padded batch (see the module docstring); returns the members'
    results in request order (CUT for a member that overran its cap) and the answer positions the
    batch computed."""
    started = time.perf_counter()
    members = {r.id: _Member(r, engine.stop_token_ids) for r in requests}
    for r in requests:  # every row may pad for as many steps as a fresh row could decode
        padded = r.params.model_copy(update={"ignore_eos": True, "stop_on_loop": False, "length_cap": None,
                                             "max_tokens": len(r.resume_ids) + r.params.max_tokens})
        engine.add(r.model_copy(update={"params": padded}))
    computed = 0
    while any(m.finish is None for m in members.values()):
        if not engine.has_work():
            raise RuntimeError("the engine stopped before every member of the batch was done")
        for event in engine.step():
            computed += len(event.token_ids)
            for token in event.token_ids:
                members[event.request_id].add(token)
    for r in requests:
        engine.abort(r.id)
        engine.pop_result(r.id)
    latency = time.perf_counter() - started
    return [members[r.id].result(engine.tokenizer, latency) for r in requests], computed


class PolicyClock:
    """Seconds one policy has run: it advances only between `resume()` and `pause()`, so that policies
    served in turns in one process (`run_in_turns`) each count only their own turns."""

    def __init__(self):
        self._spent, self._since = 0.0, None

    def resume(self) -> None:
        self._since = time.perf_counter()

    def pause(self) -> None:
        self._spent += time.perf_counter() - self._since
        self._since = None

    def __call__(self) -> float:
        return self._spent + (0.0 if self._since is None else time.perf_counter() - self._since)

    def skip(self, seconds: float) -> None:
        """Move on `seconds` at once: a policy with nothing to do until its next request arrives
        waits at no cost to the machine, and without holding up the policy served beside it."""
        self._spent += max(0.0, seconds)


def running_clock() -> PolicyClock:
    """A clock for a policy that runs alone: running from now on."""
    clock = PolicyClock()
    clock.resume()
    return clock


def binned_turns(engine: LLMEngine, jobs: list[Job], params: SamplingParams, config: BatcherConfig,
                 lengths: list[int] | None, run: PolicyRun, clock: Callable[[], float],
                 progress: Callable[[int, float], None] | None = None) -> Iterator[None]:
    """Every job submitted at t=0 to a `Batcher` (predicted_len from `lengths`, or none: all in the
    default bin), its micro-batches decoded one after another with `run_static` into `run`; yields
    after each micro-batch. Times are read from `clock`, from this generator's first turn."""
    batcher = Batcher(config)
    for i, job in enumerate(jobs):
        predicted = None if lengths is None else lengths[i]
        batcher.submit(GenerationRequest(id=job.id, prompt_ids=job.prompt_ids, params=params,
                                         predicted_len=predicted), now=0.0)
    started = clock()
    elapsed = lambda: clock() - started  # noqa: E731
    while (batch := batcher.next_batch(elapsed())) is not None:
        before = engine.stats()["prefill_tokens"]
        results, computed = run_static(engine, batch.requests)
        run.prefill_tokens += engine.stats()["prefill_tokens"] - before
        run.decode_tokens += computed
        run.batch_sizes.append(len(batch.requests))
        for result in batcher.report(batch.id, results):
            run.finish(result.request_id, result.token_ids, elapsed(), progress)
        run.wall_s = elapsed()
        yield
    run.recompute_tokens = batcher.stats()["recompute_tokens"]


def continuous_turns(engine: LLMEngine, jobs: list[Job], params: SamplingParams, lengths: list[float] | None,
                     run: PolicyRun, clock: PolicyClock, progress: Callable[[int, float], None] | None = None,
                     steps_per_turn: int = 16, predict: Callable[[list[Job]], list[float]] | None = None
                     ) -> Iterator[None]:
    """Every job added to the engine when it arrives on the policy's clock (`Job.arrival_s`; equal
    times in the jobs' order) and served by its continuous batching into `run`; yields every
    `steps_per_turn` steps. The shortest waiting job is admitted first by `lengths`, known up front,
    or by what `predict(the jobs just arrived)` returns for them, its time spent on this clock; equal
    ones in arrival order. `predict` is asked only when the jobs just arrived will not all find a
    free slot with nobody waiting: a job that can start at once has nothing to be ordered against, and
    predicting it would only stall the answers in flight (on a stream this box keeps up with, that was
    all the prediction did). With nothing to decode and more jobs to come, the clock skips to the
    next arrival."""
    prefilled = engine.stats()["prefill_tokens"]
    started = clock()
    members, arrival = {}, {job.id: job.arrival_s for job in jobs}
    shortest_first = sorted(range(len(jobs)), key=lambda i: lengths[i]) if lengths is not None else []
    rank = {i: r for r, i in enumerate(shortest_first)}
    coming = deque(sorted(range(len(jobs)), key=lambda i: jobs[i].arrival_s))
    steps = 0
    while coming or engine.has_work():
        arrived = []
        while coming and jobs[coming[0]].arrival_s <= clock() - started:
            arrived.append(coming.popleft())
        keys = None
        if predict is not None and arrived and len(arrived) > _room(engine):
            keys = predict([jobs[i] for i in arrived])
        for n, i in enumerate(arrived):
            # the engine's priority is an int: a predicted key counts to a thousandth of a token
            priority = -rank.get(i, 0) if keys is None else -round(keys[n] * 1000)
            request = GenerationRequest(id=jobs[i].id, prompt_ids=jobs[i].prompt_ids, params=params, priority=priority)
            members[jobs[i].id] = _Member(request, engine.stop_token_ids)
            engine.add(request)
        if not engine.has_work():
            clock.skip(jobs[coming[0]].arrival_s - (clock() - started))
            continue
        for event in engine.step():
            member = members[event.request_id]
            for token in event.token_ids:
                member.add(token)
            if event.finish_reason is None:
                continue
            if event.finish_reason == FinishReason.STOP and member.finish is None:
                member.sampled += 1  # the end token: sampled, not kept
            result = engine.pop_result(event.request_id)
            run.finish(event.request_id, result.token_ids, clock() - started, progress, arrival[event.request_id])
        steps += 1
        if steps % steps_per_turn == 0 and engine.has_work():
            yield
    run.wall_s = clock() - started
    run.decode_tokens = sum(m.sampled for m in members.values())
    run.prefill_tokens = engine.stats()["prefill_tokens"] - prefilled


def _room(engine: LLMEngine) -> int:
    """Requests the engine would start at its next step beside those waiting: free slots less the queue."""
    stats = engine.stats()
    return engine.config.max_batch_size - stats["running"] - stats["waiting"]


def run_continuous(engine: LLMEngine, jobs: list[Job], params: SamplingParams,
                   lengths: list[int] | None, progress: Callable[[int, float], None] | None = None) -> PolicyRun:
    """`continuous_turns` run alone to the end."""
    run = PolicyRun()
    drain(continuous_turns(engine, jobs, params, lengths, run, running_clock(), progress))
    return run


def drain(turns: Generator):
    """Run a generator of turns to its end, alone; returns what it returns."""
    while True:
        try:
            next(turns)
        except StopIteration as done:
            return done.value


def run_in_turns(turns: dict[str, Iterator[None]], clocks: dict[str, PolicyClock]) -> list[str]:
    """Serve several policies in one process, a turn at a time (a micro-batch, or some steps of
    continuous batching), the one that has run least so far going next, each timed on its own clock.
    Run one after another, two policies meet the machine at different hours, and this 2-core box's
    speed moves by a quarter between them; in turns, both share every stretch of the run until the
    shorter is done. Returns the order of the turns (policy names)."""
    live, order = dict(turns), []
    while live:
        name = min(live, key=lambda n: clocks[n]())
        order.append(name)
        clocks[name].resume()
        try:
            next(live[name])
        except StopIteration:
            del live[name]
        finally:
            clocks[name].pause()
    return order


def box_speed(engine: LLMEngine, prompt_ids: list[int], rows: int = 16, steps: int = 32) -> float:
    """Decode tokens/s of one fixed batch (`rows` copies of a prompt, `steps` tokens each, end token
    ignored), its prefill step not timed. Taken just before and just after each policy run: policies
    run one after another for half an hour each, and a shared 2-core machine's speed moves by 15% or
    more within an hour, so this tells a policy's gain from the machine's."""
    seconds, _, decoded = timed_decode(engine, [prompt_ids] * rows, steps)
    return decoded / seconds


def timed_decode(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, int]:
    """Seconds, steps and tokens to decode `new_tokens` for every prompt at once (end token ignored),
    the prefilling step and the token it gives not counted."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, stop_on_loop=False)
    ids = [f"timed-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add(GenerationRequest(id=request_id, prompt_ids=prompt, params=params))
    engine.step()
    started, steps, decoded = time.perf_counter(), 0, 0
    while engine.has_work():
        decoded += sum(len(event.token_ids) for event in engine.step())
        steps += 1
    seconds = time.perf_counter() - started
    for request_id in ids:
        engine.pop_result(request_id)
    return seconds, steps, decoded


def summarize(run: PolicyRun) -> dict:
    """Throughput, token shares and latency of one run. Prediction time counts against the policy:
    it is added to the wall time and to every request's latency (all are predicted before any is
    scheduled)."""
    n = len(run.answers)
    wall = run.wall_s + run.prediction_s
    latencies = sorted(t + run.prediction_s for t in run.latency_s.values())
    useful = sum(len(a) for a in run.answers.values())
    return {
        "requests": n,
        "wall_s": wall,
        "prediction_s": run.prediction_s,
        "prediction_in_run_s": run.prediction_in_run_s,
        "samples_per_s": n / wall,
        "tokens_per_s": useful / wall,
        "useful_tokens": useful,
        "decode_tokens": run.decode_tokens,
        "prefill_tokens": run.prefill_tokens,
        "recompute_tokens": run.recompute_tokens,
        "effective_token_ratio": useful / run.decode_tokens,
        "recompute_ratio": run.recompute_tokens / (run.decode_tokens + run.prefill_tokens),
        "latency_mean_s": statistics.mean(latencies),
        "latency_p99_s": latencies[math.ceil(0.99 * n) - 1],
        "batches": len(run.batch_sizes) or None,  # None: continuous batching has no batches
        "mean_batch_size": statistics.mean(run.batch_sizes) if run.batch_sizes else None,
        "box_tok_s": statistics.mean(run.box_tok_s) if run.box_tok_s else None,  # None: run before the probe
    }
