"""Prometheus metrics, through Ray's metrics API (`ray.serve.metrics`): every replica exports them on
its node's metrics port, where Ray's Prometheus service discovery already scrapes Serve's own
(`ray_serve_*`). Ours are prefixed `plato_`; see the README for the list.

Each class is the observer one deployment hands to its Ray-free core; the cores call plain methods
and never import Ray."""
from __future__ import annotations

from ray.serve.metrics import Counter, Gauge, Histogram

LENGTH_BOUNDARIES = [8, 16, 32, 64, 128, 256, 512, 1024, 2048]
SECONDS_BOUNDARIES = [0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120]


class BatcherMetrics:
    """Queue depth per bin, micro-batch sizes, predicted vs actual length, re-queues, failures."""

    def __init__(self):
        self.queue_depth = Gauge("plato_batcher_queue_depth", "Requests waiting, per length bin.", tag_keys=("bin",))
        self.batch_size = Histogram("plato_batcher_batch_size", "Requests per micro-batch.",
                                    boundaries=[1, 2, 4, 8, 16, 32, 64, 128])
        self.batch_tokens = Histogram("plato_batcher_batch_tokens", "KV tokens a micro-batch may reach.",
                                      boundaries=[256, 1024, 4096, 16384, 65536, 262144])
        self.length_error = Histogram("plato_predicted_length_abs_error", "|predicted - actual| answer length, tokens.",
                                      boundaries=LENGTH_BOUNDARIES)
        self.under_predicted = Counter("plato_predicted_length_under_total", "Answers longer than predicted.")
        self.predicted = Counter("plato_predicted_length_total", "Answers finished with a prediction.")
        self.requeued = Counter("plato_batcher_requeued_total", "Cut-off answers re-queued to continue.")
        self.cancelled = Counter("plato_batcher_cancelled_total", "Requests whose caller went away before the answer.")
        self.held_apart = Counter("plato_batcher_holder_splits_total", "Times a queued request was left for a later "
                                  "micro-batch because another decoder replica than the batch's holds its prompt.")
        self.failed_batches = Counter("plato_batcher_failed_batches_total", "Micro-batches a decoder failed or lost "
                                      "(its replica died); their unfinished requests were re-queued.")
        self.errors = Counter("plato_batcher_errors_total", "Requests answered with an error: refused by a decoder, "
                              "failed there alone, or in batcher.max_failed_attempts failed micro-batches.")

    def batch(self, size: int, tokens: int) -> None:
        self.batch_size.observe(size)
        self.batch_tokens.observe(tokens)

    def queues(self, depth_per_bin: list[int]) -> None:
        for index, depth in enumerate(depth_per_bin):
            self.queue_depth.set(depth, tags={"bin": str(index)})

    def finished(self, predicted: int | None, actual: int) -> None:
        if predicted is None:
            return
        self.predicted.inc()
        self.length_error.observe(abs(predicted - actual))
        if actual > predicted:
            self.under_predicted.inc()

    def requeue(self) -> None:
        self.requeued.inc()

    def cancel(self) -> None:
        self.cancelled.inc()

    def split(self, requests: int) -> None:
        self.held_apart.inc(requests)

    def failed_batch(self) -> None:
        self.failed_batches.inc()

    def error(self) -> None:
        self.errors.inc()


class AnswerMetrics:
    """Answers per mode, plan fallbacks, time to first token and request latency: the ingress reports
    plain answers, the planner planned ones."""

    def __init__(self):
        self.answers = Counter("plato_answers_total", "Answers, by the mode that produced them.", tag_keys=("mode",))
        self.fallbacks = Counter("plato_plan_fallbacks_total", "Planned answers that fell back to plain decoding.")
        self.planned = Counter("plato_planned_total", "Answers for which a plan was asked (sot, plato, auto).")
        self.ttft = Histogram("plato_time_to_first_token_seconds", "Streamed answers: seconds to the first text.",
                              boundaries=SECONDS_BOUNDARIES)
        self.latency = Histogram("plato_request_latency_seconds", "Seconds from request to full answer.",
                                 boundaries=SECONDS_BOUNDARIES)
        self.formats = Counter("plato_formatted_answers_total", "Answers held to a format by constrained decoding: "
                               "json_object, json_schema, choice or tool_calls.", tag_keys=("format",))

    def answered(self, mode: str, planned: bool, fell_back: bool, latency_s: float) -> None:
        self.answers.inc(tags={"mode": mode})
        self.latency.observe(latency_s)
        if planned:
            self.planned.inc()
        if fell_back:
            self.fallbacks.inc()

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def formatted(self, kind: str) -> None:
        self.formats.inc(tags={"format": kind})


class DecoderMetrics:
    """Generated tokens (rate() of it is tokens/s) and prefix KV reuse on the decoder replicas."""

    def __init__(self):
        self.tokens = Counter("plato_generated_tokens_total", "Tokens generated by the decoders.")
        self.prefix = Counter("plato_prefix_lookups_total", "Shared-prefix lookups by outcome: local (hit), "
                              "fetched (from the context cache), computed (miss).", tag_keys=("outcome",))
        self.drafts = Counter("plato_draft_tokens_total", "Draft tokens the decoders checked (prompt lookup and "
                              "requests' predictions), by outcome: kept (each saved a step) or dropped.", tag_keys=("outcome",))
        # vLLM's pair, so a dashboard's hit rate (rate of hits over rate of queries) carries over
        self.cache_queries = Counter("plato_prefix_cache_queries_total", "Prompt tokens the decoders looked up "
                                     "in their prefix caches (every admitted prompt, resumed answers included).")
        self.cache_hits = Counter("plato_prefix_cache_hits_total", "Of those, the tokens whose KV came from the "
                                  "cache (not computed).")

    def generated(self, count: int) -> None:
        self.tokens.inc(count)

    def prompt_tokens(self, queried: int, hit: int) -> None:
        self.cache_queries.inc(queried)
        if hit:
            self.cache_hits.inc(hit)

    def prefix_lookup(self, outcome: str) -> None:
        self.prefix.inc(tags={"outcome": outcome})

    def drafted(self, kept: int, dropped: int) -> None:
        for outcome, count in (("kept", kept), ("dropped", dropped)):
            if count:
                self.drafts.inc(count, tags={"outcome": outcome})
