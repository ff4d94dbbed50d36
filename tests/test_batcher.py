"""The length-binned batcher without a model: bins, picking and packing policy, caps, cut-and-resume,
failure handling and counters; then one run on the tiny engine where cut answers resume to the
same tokens as uninterrupted ones."""
from __future__ import annotations

import random

import pydantic
import pytest

from engine.types import FinishReason, GenerationRequest, Result, SamplingParams
from predictor.batcher import Batcher, BatcherConfig, drain
from predictor.bins import LengthBins

EDGES = [32, 64, 128, 256, 512, 1024]


def req(rid: str, predicted=None, prompt_len: int = 8, max_tokens: int = 2000, priority: int = 0):
    return GenerationRequest(
        id=rid,
        prompt_ids=[7] * prompt_len,
        params=SamplingParams(max_tokens=max_tokens),
        predicted_len=predicted,
        priority=priority,
    )


def garbage(rid: str, predicted) -> GenerationRequest:
    """A request whose predicted_len skipped validation, as a buggy predictor could hand over."""
    return req(rid).model_copy(update={"predicted_len": predicted})


def fake_decode(requests: list[GenerationRequest], lengths: dict[str, int]) -> list[Result]:
    """Decode like the engine would if request `id` wanted `lengths[id]` tokens, token i being i:
    LENGTH at max_tokens, else CUT on reaching length_cap, else STOP. Checks that a resumed
    request carries exactly the tokens already generated."""
    results = []
    for r in requests:
        assert r.resume_ids == list(range(len(r.resume_ids)))
        want, params = lengths[r.id], r.params
        limit = min(params.max_tokens, params.length_cap or params.max_tokens)
        if want < limit:
            results.append(result(r.id, want))
        else:
            reason = FinishReason.LENGTH if limit == params.max_tokens else FinishReason.CUT
            results.append(result(r.id, limit, reason))
    return results


def result(rid: str, n: int, reason=FinishReason.STOP) -> Result:
    return Result(request_id=rid, prompt_tokens=8, token_ids=list(range(n)), text="", finish_reason=reason,
                  ttft_s=0.0, latency_s=0.0)


def batcher(**overrides) -> Batcher:
    return Batcher(BatcherConfig(bins=LengthBins(edges=EDGES), **overrides))


def ids_of(batch) -> list[str]:
    return [r.id for r in batch.requests]


# ---- bins and config ----------------------------------------------------------------------------
def test_bins_map_lengths_to_the_first_edge_at_or_above():
    bins = LengthBins(edges=EDGES)
    assert [bins.bin_of(n) for n in (0, 1, 32, 33, 64, 65, 1024, 1025, 10**9)] == [0, 0, 0, 1, 1, 2, 5, 5, 5]
    assert [bins.cap(b) for b in range(6)] == EDGES
    assert [bins.next_bin(b) for b in range(6)] == [1, 2, 3, 4, 5, 5]
    assert len(bins) == 6 and bins.last == 5 and LengthBins().edges == EDGES
    with pytest.raises(ValueError, match="^bin:"):
        bins.cap(6)


@pytest.mark.parametrize("edges", [[], [0, 8], [-4, 8], [8, 8], [16, 8], [8, 16, 12]])
def test_bins_reject_bad_edges_naming_the_field(edges):
    with pytest.raises(pydantic.ValidationError, match="edges"):
        LengthBins(edges=edges)


def test_config_rejects_a_default_bin_that_does_not_exist():
    with pytest.raises(pydantic.ValidationError, match="default_bin"):
        BatcherConfig(bins=LengthBins(edges=[8, 16]), default_bin=2)
    with pytest.raises(pydantic.ValidationError, match="token_budget"):
        BatcherConfig(token_budget=0)
    assert all(f.description for f in BatcherConfig.model_fields.values())


# ---- picking and packing ------------------------------------------------------------------------
def test_requests_are_grouped_by_bin_and_the_fullest_bin_goes_first():
    b = batcher(token_budget=2000)
    for i in range(6):
        b.submit(req(f"s{i}", predicted=20), now=i)  # bin 0
        if i < 2:
            b.submit(req(f"l{i}", predicted=300), now=i)  # bin 4: longer answers, but fewer
    first = b.next_batch(now=10)
    assert first.bin == 4 and ids_of(first) == ["l0", "l1"]  # more tokens queued: fuller
    second = b.next_batch(now=10)
    assert second.bin == 0 and ids_of(second) == [f"s{i}" for i in range(6)]
    assert b.next_batch(now=10) is None and b.pending() == 0 and b.in_flight() == 8


def test_variable_batch_size_packs_by_tokens():
    b = batcher(token_budget=1100, max_batch_size=100)
    for i in range(40):
        b.submit(req(f"s{i}", predicted=30), now=0)  # costs 8 + 32 = 40
        b.submit(req(f"l{i}", predicted=500), now=0)  # costs 8 + 512 = 520
    sizes = {}
    while (batch := b.next_batch(now=0)) is not None:
        sizes.setdefault(batch.bin, []).append(len(batch.requests))
        assert batch.tokens <= 1100
    assert sizes[0] == [27, 13] and sizes[4] == [2] * 20
    assert b.stats()["batch_sizes"] == {2: 20, 13: 1, 27: 1}


def test_fixed_batch_size_packs_by_count():
    b = batcher(token_budget=1100, max_batch_size=4, variable_batch_size=False)
    for i in range(6):
        b.submit(req(f"s{i}", predicted=30), now=0)
        b.submit(req(f"l{i}", predicted=500), now=0)
    sizes = [(batch.bin, len(batch.requests)) for batch in iter(lambda: b.next_batch(now=0), None)]
    assert sizes == [(0, 4), (4, 4), (0, 2), (4, 2)]  # fill ties at one: the older bin first


def test_length_cap_is_the_bin_edge_or_max_tokens():
    b = batcher(token_budget=10**6)
    b.submit(req("a", predicted=50), now=0)
    b.submit(req("b", predicted=60, max_tokens=40), now=0)
    batch = b.next_batch(now=0)
    assert [r.params.length_cap for r in batch.requests] == [64, 40]
    assert batch.tokens == (8 + 64) + (8 + 40)
    off = batcher(token_budget=10**6, failure_recompute=False)
    off.submit(req("a", predicted=50, max_tokens=300), now=0)
    batch = off.next_batch(now=0)
    assert batch.requests[0].params.length_cap is None and batch.tokens == 8 + 300


def test_a_request_over_the_budget_still_goes_alone():
    b = batcher(token_budget=100)
    b.submit(req("huge", predicted=20, prompt_len=5000), now=0)
    b.submit(req("small", predicted=20), now=1)
    assert ids_of(b.next_batch(now=2)) == ["huge"]
    assert ids_of(b.next_batch(now=2)) == ["small"]
    b.submit(req("next", predicted=20), now=3)
    assert ids_of(b.next_batch(now=3, token_budget=10)) == ["next"]  # an override below any cost


@pytest.mark.parametrize("aging_s, first", [(60, "short0"), (30, "old-long")])
def test_aging_serves_an_old_long_request_before_newer_short_ones(aging_s, first):
    b = batcher(aging_s=aging_s)
    b.submit(req("old-long", predicted=900), now=0)
    for i in range(20):
        b.submit(req(f"short{i}", predicted=10), now=40)
    assert ids_of(b.next_batch(now=41))[0] == first  # the short bin is fuller; 41 s is aged only at 30


def test_priority_goes_first_across_and_within_bins():
    b = batcher(token_budget=10**6, max_batch_size=2)
    for i in range(10):
        b.submit(req(f"s{i}", predicted=10), now=0)
    b.submit(req("late", predicted=100), now=1)
    b.submit(req("critical", predicted=100, priority=5), now=2)
    assert ids_of(b.next_batch(now=3)) == ["critical", "late"]
    b.submit(req("urgent", predicted=10, priority=1), now=4)
    assert ids_of(b.next_batch(now=5)) == ["urgent", "s0"]


def test_a_request_aged_in_the_queue_still_waits_for_a_higher_priority_one():
    # a batch job at priority -1 (the API's 1) queued long ago, a chat at 0 just now: the chat goes first
    b = batcher(aging_s=30, max_batch_size=2)
    for i in range(4):
        b.submit(req(f"job{i}", predicted=900, priority=-1), now=0)
    b.submit(req("chat", predicted=10), now=100)
    assert ids_of(b.next_batch(now=101)) == ["chat"]
    assert ids_of(b.next_batch(now=102)) == ["job0", "job1"]  # then the job, oldest first


def test_garbage_predictions_use_the_default_bin_and_are_counted():
    b = batcher(default_bin=2)
    b.submit(req("none"), now=0)
    for rid, value in [("neg", -5), ("nan", float("nan")), ("str", "12"), ("float", 3.5), ("bool", True)]:
        b.submit(garbage(rid, value), now=0)
    b.submit(req("absurd", predicted=10**9, max_tokens=200), now=0)
    assert b.stats()["queued_per_bin"] == [0, 0, 6, 1, 0, 0]  # absurd: clamped to max_tokens, bin 3
    assert b.stats()["default_bin_uses"] == 6 and b.stats()["clamped_predictions"] == 1
    assert batcher().default_bin == 5


def test_duplicate_ids_are_rejected_while_live():
    b = batcher()
    b.submit(req("x", predicted=10), now=0)
    with pytest.raises(ValueError, match="^id: request 'x'"):
        b.submit(req("x", predicted=10), now=0)
    batch = b.next_batch(now=0)
    with pytest.raises(ValueError, match="^id:"):
        b.submit(req("x", predicted=10), now=0)
    assert [r.request_id for r in b.report(batch.id, [result("x", 3)])] == ["x"]
    b.submit(req("x", predicted=10), now=1)  # answered: the id is free again
    assert b.pending() == 1


# ---- results back -------------------------------------------------------------------------------
def serve_all(b: Batcher, lengths: dict[str, int], now: float = 0.0) -> dict[str, Result]:
    final = {}
    while (batch := b.next_batch(now)) is not None:
        for r in b.report(batch.id, fake_decode(batch.requests, lengths)):
            assert r.request_id not in final
            final[r.request_id] = r
    return final


def test_cut_answers_resume_one_bin_up_and_finish_with_all_tokens():
    b = batcher(token_budget=10**6)
    lengths = {"under": 20, "over": 100, "last": 1500, "max": 5000}
    for rid, want in lengths.items():
        b.submit(req(rid, predicted=20), now=0)
    first = b.next_batch(now=0)
    cut = b.report(first.id, fake_decode(first.requests, lengths))
    assert [r.request_id for r in cut] == ["under"]
    assert b.stats()["queued_per_bin"] == [0, 3, 0, 0, 0, 0]
    again = b.next_batch(now=0)
    assert {r.id: r.resume_ids for r in again.requests} == {rid: list(range(32)) for rid in ("over", "last", "max")}
    assert {r.params.length_cap for r in again.requests} == {64} and {r.predicted_len for r in again.requests} == {64}
    b.report(again.id, fake_decode(again.requests, lengths))
    final = serve_all(b, lengths)
    assert {rid: (r.finish_reason, r.token_ids) for rid, r in final.items()} == {
        "over": (FinishReason.STOP, list(range(100))),
        "last": (FinishReason.STOP, list(range(1500))),  # cut at 1024, then uncapped to the end
        "max": (FinishReason.LENGTH, list(range(2000))),
    }
    stats = b.stats()
    # over: cut at 32, 64; last and max: at 32, 64, 128, 256, 512, 1024
    assert stats["requeues"] == 2 + 6 + 6
    assert stats["requeued_tokens"] == 32 + 64 + 2 * (32 + 64 + 128 + 256 + 512 + 1024)
    assert stats["recompute_tokens"] == stats["requeued_tokens"] + 8 * stats["requeues"]
    assert stats["finished"] == 4 and b.pending() == b.in_flight() == 0


def test_a_cut_answers_prediction_tokens_add_up_over_its_attempts():
    b = batcher(token_budget=10**6)
    b.submit(req("long", predicted=20), now=0)
    counted = {}
    for attempt in range(3):  # cut at 32, then 64, then done at 100: each attempt took 5 and dropped 1
        batch = b.next_batch(now=0)
        results = [r.model_copy(update={"accepted_prediction_tokens": 5, "rejected_prediction_tokens": 1})
                   for r in fake_decode(batch.requests, {"long": 100})]
        counted.update({r.request_id: r for r in b.report(batch.id, results)})
    done = counted["long"]
    assert done.token_ids == list(range(100))
    assert (done.accepted_prediction_tokens, done.rejected_prediction_tokens) == (15, 3)


def test_foreign_duplicate_and_late_results_are_ignored():
    b = batcher()
    b.submit(req("a", predicted=10), now=0)
    b.submit(req("b", predicted=10), now=0)
    batch = b.next_batch(now=0)
    results = [result("a", 3), result("stranger", 3), result("a", 5), result("b", 4)]
    assert [(r.request_id, len(r.token_ids)) for r in b.report(batch.id, results)] == [("a", 3), ("b", 4)]
    assert b.report(batch.id, [result("a", 3)]) == []  # the batch was already reported
    assert b.report("nope", [result("b", 3)]) == []
    assert b.stats()["ignored_results"] == 4 and b.stats()["finished"] == 2
    assert b.pending() == b.in_flight() == 0


def test_requests_missing_from_a_report_are_requeued_as_they_were():
    b = batcher()
    for rid in ("a", "b", "c"):
        b.submit(req(rid, predicted=10), now=0)
    batch = b.next_batch(now=0)
    b.submit(req("d", predicted=10), now=1)
    assert b.report(batch.id, [result("b", 2)])[0].request_id == "b"
    again = [b.next_batch(now=2) for _ in range(3)]  # after a failure each goes alone
    assert [ids_of(batch) for batch in again] == [["a"], ["c"], ["d"]]
    assert again[0].requests[0] == batch.requests[0] and again[1].requests[0] == batch.requests[2]
    assert b.stats()["missing_results"] == 2


def test_fail_requeues_the_batch_in_front_with_nothing_lost_or_duplicated():
    b = batcher(max_batch_size=2)
    for rid in ("a", "b", "c"):
        b.submit(req(rid, predicted=10), now=0)
    failed = b.next_batch(now=0)
    assert b.in_flight() == 2 and b.fail(failed.id) == 2
    assert b.fail(failed.id) == 0 and b.report(failed.id, [result("a", 1)]) == []
    assert b.in_flight() == 0 and b.pending() == 3
    b.submit(req("d", predicted=10), now=1)
    retried = [b.next_batch(now=1) for _ in range(2)]  # back in front of c and d, each alone
    assert [r.requests for r in retried] == [failed.requests[:1], failed.requests[1:]]
    assert failed.id not in {r.id for r in retried}
    lengths = {"a": 1, "b": 2, "c": 3, "d": 4}
    final = [f for r in retried for f in b.report(r.id, fake_decode(r.requests, lengths))]
    final += list(serve_all(b, lengths).values())
    assert sorted(r.request_id for r in final) == ["a", "b", "c", "d"]
    assert b.stats()["failed_batches"] == 1 and b.pending() == b.in_flight() == 0


def test_fail_with_partial_progress_resumes_after_the_tokens_already_sent():
    b = batcher(max_batch_size=2)
    for rid in ("a", "b"):
        b.submit(req(rid, predicted=10), now=0)
    batch = b.next_batch(now=0)
    b.fail(batch.id, partial={"a": [5, 6, 7], "zzz": [1]})  # an unknown id is ignored
    retried = [r for _ in range(2) for r in b.next_batch(now=0).requests]
    resumed = {r.id: r.resume_ids for r in retried}
    assert resumed == {"a": [5, 6, 7], "b": []}


def test_a_request_whose_batch_keeps_failing_is_answered_with_an_error_and_its_batch_mates_are_not():
    """As when one request brings down every decoder replica it reaches: it is retried alone, so
    the others of its first micro-batch finish, and after max_failed_attempts it is answered ERROR."""
    b = batcher(max_failed_attempts=3)
    for rid in ("a", "poison", "c"):
        b.submit(req(rid, predicted=10), now=0)
    lengths, final, sizes = {"a": 4, "c": 6}, [], []
    while (batch := b.next_batch(now=0)) is not None:
        sizes.append(len(batch.requests))
        if "poison" in ids_of(batch):
            final += b.report(batch.id, [], partial={})  # the replica died with it
        else:
            final += b.report(batch.id, fake_decode(batch.requests, lengths))
    assert sizes == [3, 1, 1, 1, 1]  # the first batch, then a, poison, c alone; then poison's last try
    by_id = {r.request_id: r for r in final}
    assert sorted(by_id) == ["a", "c", "poison"] and len(final) == 3
    assert by_id["a"].token_ids == list(range(4)) and by_id["c"].finish_reason == FinishReason.STOP
    assert by_id["poison"].finish_reason == FinishReason.ERROR and "failed 3 times" in by_id["poison"].error
    assert b.stats()["failed_out"] == 1 and b.stats()["failed_batches"] == 3
    assert b.pending() == b.in_flight() == 0
    b.submit(req("poison", predicted=10), now=1)  # answered, so its id may come again


# ---- on the tiny engine -------------------------------------------------------------------------
def test_cut_and_resumed_answers_equal_uninterrupted_ones(make_engine, decode_alone):
    rng = random.Random(5)
    prompts = {f"r{i}": [rng.randrange(6, 256) for _ in range(5 + 3 * i)] for i in range(4)}
    b = Batcher(BatcherConfig(bins=LengthBins(edges=[4, 8, 16]), token_budget=60))
    for rid, prompt in prompts.items():
        request = GenerationRequest(id=rid, prompt_ids=prompt, params=SamplingParams(max_tokens=20), predicted_len=1)
        b.submit(request, now=0)
    final = drain(b, make_engine(max_batch_size=4), clock=lambda: 0.0)
    assert sorted(r.request_id for r in final) == sorted(prompts)
    for r in final:
        reference = decode_alone(prompts[r.request_id], max_tokens=20)
        assert r.finish_reason == FinishReason.LENGTH
        assert r.token_ids == reference.token_ids and r.text == reference.text
    assert b.stats()["requeues"] == 4 * 3  # cut at 4, 8 and 16, then run to max_tokens


def test_max_requests_caps_a_batch_below_max_batch_size_and_must_be_positive():
    b = batcher(token_budget=10**6, max_batch_size=8)
    for i in range(6):
        b.submit(req(f"r{i}", 10), now=0.0)
    assert [r.id for r in b.next_batch(now=0.0, max_requests=2).requests] == ["r0", "r1"]
    assert len(b.next_batch(now=0.0).requests) == 4
    with pytest.raises(ValueError, match="max_requests"):
        b.next_batch(now=0.0, max_requests=0)


def test_a_cancelled_request_leaves_its_queue_or_its_batch_and_is_never_requeued():
    b = batcher(max_batch_size=2)
    for rid in ("a", "b", "c"):
        b.submit(req(rid, predicted=10), now=0)
    batch = b.next_batch(now=0)  # a and b in flight, c queued
    assert b.batch_of("a") == batch.id and b.batch_of("c") is None and b.left_in(batch.id) == 2
    assert b.cancel("c") and b.pending() == 0
    assert b.cancel("a") and b.left_in(batch.id) == 1 and b.batch_of("a") is None
    assert not b.cancel("a") and not b.cancel("nobody")
    assert b.report_one(batch.id, result("a", 3)) is None  # its result, should one come, is ignored
    assert b.fail(batch.id) == 1 and ids_of(b.next_batch(now=1)) == ["b"]  # the failure re-queues b alone
    b.submit(req("a", predicted=10), now=2)  # the id is free again
    assert b.stats()["cancelled"] == 2 and b.stats()["ignored_results"] == 1


def test_a_micro_batch_holds_the_prompts_of_one_holder_and_those_nobody_holds():
    """Prompts cached on different decoder replicas go in different micro-batches, each to its holder;
    a prompt no replica holds joins any. The first request still goes first, whatever its holder."""
    b = batcher(token_budget=10**6)
    holders = {1: None, 2: "a", 3: "b", 4: "a", 5: None, 6: "b"}
    for i in holders:
        b.submit(req(f"r{i}", predicted=10).model_copy(update={"prompt_ids": [i] * 8}), now=i)

    def holder_of(prompt_ids):
        return holders[prompt_ids[0]]

    assert ids_of(b.next_batch(now=10, holder_of=holder_of)) == ["r1", "r2", "r4", "r5"]
    assert b.stats()["holder_splits"] == 2
    assert ids_of(b.next_batch(now=11, holder_of=holder_of)) == ["r3", "r6"]
    b.submit(req("x", predicted=10).model_copy(update={"prompt_ids": [3] * 8}), now=12)
    b.submit(req("y", predicted=10).model_copy(update={"prompt_ids": [2] * 8}), now=13)
    assert ids_of(b.next_batch(now=14)) == ["x", "y"]  # without holder_of, one batch as before


def test_keeping_holders_apart_does_not_reorder_priorities():
    b = batcher(token_budget=10**6)
    b.submit(req("low", predicted=10).model_copy(update={"prompt_ids": [1] * 8}), now=0)
    b.submit(req("high", predicted=10, priority=3).model_copy(update={"prompt_ids": [2] * 8}), now=1)
    holder_of = {1: "a", 2: "b"}.get
    assert ids_of(b.next_batch(now=2, holder_of=lambda p: holder_of(p[0]))) == ["high"]
    assert ids_of(b.next_batch(now=3, holder_of=lambda p: holder_of(p[0]))) == ["low"]


def test_a_queued_prompts_holder_is_asked_once_a_second_and_a_pack_asks_a_bounded_number():
    b = batcher(token_budget=10**6, max_batch_size=2)
    b.submit(req("a0", predicted=10).model_copy(update={"prompt_ids": [1] * 8}), now=0)
    for i in range(10):
        b.submit(req(f"b{i}", predicted=10).model_copy(update={"prompt_ids": [2] * 8}), now=0)
    b.submit(req("a1", predicted=10).model_copy(update={"prompt_ids": [1] * 8}), now=0)
    asked = []

    def holder_of(prompt_ids):
        asked.append(prompt_ids[0])
        return {1: "a", 2: "b"}[prompt_ids[0]]

    assert ids_of(b.next_batch(now=1, holder_of=holder_of)) == ["a0"]  # a1 lies past 2 x 2 askings
    assert asked == [1, 2, 2, 2]
    assert ids_of(b.next_batch(now=1.5, holder_of=holder_of)) == ["b0", "b1"]
    assert len(asked) == 4  # known from the pack before
    assert ids_of(b.next_batch(now=3, holder_of=holder_of)) == ["b2", "b3"]
    assert len(asked) == 6  # over a second later: b2 asked again, b3 for the first time
