"""Prompt-lookup decoding: drafts from the sequence's own text, checked in the decode pass, give
the same answers as plain decoding in fewer steps; so do drafts from a prediction (OpenAI's predicted
outputs), which also count their kept and rejected tokens."""
from __future__ import annotations

import random

import pytest
import torch

from engine.drafts import PredictionDrafts, lookup_draft
from engine.llama import LlamaRunner, PrefillItem
from engine.types import FinishReason, GenerationRequest, SamplingParams


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 256) for _ in range(n)]


def repetitive(seed: int) -> list[int]:
    """A prompt that repeats a phrase: the tiny model's answers then echo it, so drafts match."""
    phrase = ids(6, seed)
    return ids(3, seed + 100) + phrase * 4 + phrase[:2]


def req(rid, prompt, **sampling):
    return GenerationRequest(id=rid, prompt_ids=prompt, params=SamplingParams(**sampling))


# ---- the lookup ---------------------------------------------------------------------------------
def test_lookup_takes_what_followed_the_latest_longest_match():
    assert lookup_draft([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert lookup_draft([1, 2, 3, 8, 5, 2, 3, 9, 2, 3], 2) == [9, 2]  # the latest of two 2-gram matches
    assert lookup_draft([1, 2, 3, 4, 9, 2, 3], 3) == [4, 9, 2]  # no 3-gram recurs: the 2-gram does
    assert lookup_draft([7, 8, 7], 5) == [8, 7]  # cut at the end of the text
    assert lookup_draft([5, 6, 7], 3) == []
    assert lookup_draft([5, 6, 5], 0) == []
    assert lookup_draft([5, 6, 7, 5], 3, min_ngram=2) == []


# ---- the runner ---------------------------------------------------------------------------------
def test_decode_gives_logits_for_each_of_an_items_last_rows(tiny_model):
    a, b = ids(9, 1), ids(5, 2)
    runner = LlamaRunner(tiny_model, max_slots=2, max_len=64)
    with torch.no_grad():
        runner.prefill([PrefillItem(0, a, 0), PrefillItem(1, b, 0)])
        drafted = [40, 41, 42]
        logits = runner.decode(torch.tensor([9, 99]), torch.tensor([len(a), len(b)]),
                               [PrefillItem(1, drafted, len(b) + 1, logit_rows=3)])
        assert logits.shape[0] == 5
        for k in range(3):
            expected = tiny_model(torch.tensor([b + [99] + drafted[: k + 1]])).logits[0, -1]
            torch.testing.assert_close(logits[2 + k], expected, atol=1e-5, rtol=1e-5)


# ---- the engine ---------------------------------------------------------------------------------
def _generate(make_engine, requests, **config):
    # plain decoding unless a test asks for drafts; drafts by single tokens too: the tiny random model
    # echoes tokens of its prompt more than whole phrases
    engine = make_engine(**{"speculative_tokens": 0, "speculative_min_ngram": 1, **config})
    results = engine.generate([r.model_copy(deep=True) for r in requests])
    return results, engine.stats()


@pytest.mark.parametrize("slots", [1, 3])
def test_greedy_answers_are_the_same_with_drafts_in_fewer_steps(make_engine, slots):
    requests = [req("a", repetitive(1), max_tokens=40), req("b", repetitive(2), max_tokens=25),
                req("c", ids(12, 3), max_tokens=30)]
    plain, plain_stats = _generate(make_engine, requests, max_batch_size=slots)
    drafted, stats = _generate(make_engine, requests, max_batch_size=slots, speculative_tokens=4)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert [r.text for r in drafted] == [r.text for r in plain]
    assert [r.finish_reason for r in drafted] == [FinishReason.LENGTH] * 3
    assert stats["generated_tokens"] == plain_stats["generated_tokens"] == 95
    assert stats["accepted_draft_tokens"] > 0 and stats["draft_tokens"] >= stats["accepted_draft_tokens"]
    assert stats["steps"] < plain_stats["steps"]
    assert stats["forced_tokens"] == 0  # a kept draft token's KV is used as it is, never computed again
    assert plain_stats["draft_tokens"] == 0


def test_drafts_wait_while_the_batch_is_larger_than_the_limit(make_engine):
    requests = [req(str(i), repetitive(i), max_tokens=budget) for i, budget in enumerate((4, 20, 20))]
    plain, _ = _generate(make_engine, requests, max_batch_size=3)
    drafted, stats = _generate(make_engine, requests, max_batch_size=3, speculative_tokens=4,
                               speculative_max_batch=2)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    # three decode together at first (no drafts); once one is done the other two draft
    assert 0 < stats["draft_tokens"]
    alone = make_engine(max_batch_size=3, speculative_tokens=4, speculative_max_batch=2, speculative_min_ngram=1)
    alone.generate([req(str(i), repetitive(i), max_tokens=1) for i in range(3)])
    assert alone.stats()["draft_tokens"] == 0


def test_seeded_sampling_and_penalties_give_the_same_answer_with_drafts(make_engine):
    requests = [req("s", repetitive(4), max_tokens=30, temperature=0.7, seed=11),
                req("p", repetitive(5), max_tokens=30, frequency_penalty=0.5)]
    plain, _ = _generate(make_engine, requests, max_batch_size=2)
    drafted, _ = _generate(make_engine, requests, max_batch_size=2, speculative_tokens=3)
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]


def test_budget_stop_and_cut_end_where_plain_decoding_ends(make_engine, tiny_tokenizer):
    prompt = repetitive(6)
    plain, _ = _generate(make_engine, [req("x", prompt, max_tokens=33)], max_batch_size=1)
    text = plain[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a string the answer reaches halfway
    requests = [req("max", prompt, max_tokens=7), req("cut", prompt, max_tokens=33, length_cap=9),
                req("stop", prompt, max_tokens=33, stop=[stop])]
    plain, _ = _generate(make_engine, requests, max_batch_size=3)
    drafted, stats = _generate(make_engine, requests, max_batch_size=3, speculative_tokens=8)
    assert [(r.token_ids, r.text, r.finish_reason) for r in drafted] == [
        (r.token_ids, r.text, r.finish_reason) for r in plain]
    assert [r.finish_reason for r in drafted] == [FinishReason.LENGTH, FinishReason.CUT, FinishReason.STOP]
    assert len(drafted[0].token_ids) == 7 and len(drafted[1].token_ids) == 9
    assert stats["accepted_draft_tokens"] > 0


def test_an_answer_reaching_the_context_limit_stops_there_with_drafts(make_engine):
    prompt = repetitive(7)
    plain, _ = _generate(make_engine, [req("x", prompt, max_tokens=200)], max_batch_size=1, max_model_len=60)
    drafted, _ = _generate(make_engine, [req("x", prompt, max_tokens=200)], max_batch_size=1, max_model_len=60,
                           speculative_tokens=8)
    assert drafted[0].token_ids == plain[0].token_ids
    assert len(prompt) + len(drafted[0].token_ids) == 60


def test_token_events_add_up_to_the_result_with_drafts(make_engine):
    engine = make_engine(max_batch_size=2, speculative_tokens=4, speculative_min_ngram=1)
    for i in range(2):
        engine.add(req(f"e{i}", repetitive(8 + i), max_tokens=30))
    streamed = {"e0": [], "e1": []}
    while engine.has_work():
        for event in engine.step():
            streamed[event.request_id] += event.token_ids
    for rid, tokens in streamed.items():
        assert engine.pop_result(rid).token_ids == tokens
    assert engine.stats()["accepted_draft_tokens"] > 0


def test_the_decoder_replica_reports_kept_and_dropped_draft_tokens_once(make_engine):
    import asyncio

    from actors.decoder import DecoderReplica

    class Recorder:
        def __init__(self):
            self.kept = self.dropped = self.tokens = 0

        def generated(self, count):
            self.tokens += count

        def prefix_lookup(self, outcome):
            pass

        def prompt_tokens(self, queried, hit):
            self.queried, self.hit = getattr(self, "queried", 0) + queried, getattr(self, "hit", 0) + hit

        def drafted(self, kept, dropped):
            self.kept, self.dropped = self.kept + kept, self.dropped + dropped

    recorder = Recorder()
    decoder = DecoderReplica({}, name="d", observer=recorder,
                             engine=make_engine(max_batch_size=2, speculative_tokens=4, speculative_min_ngram=1))

    async def run(rid):
        batch = {"requests": [req(rid, repetitive(1), max_tokens=30).model_dump(mode="json")]}
        async for _ in decoder.run_batch(batch):
            pass

    try:
        asyncio.run(run("a"))
        asyncio.run(run("b"))  # a second batch adds only its own drafts
        stats = decoder.engine.engine.stats()
    finally:
        decoder.engine.shutdown()
    assert recorder.tokens == 60
    # the second prompt is the first's: it starts from the first answer's KV, all but its last token
    assert recorder.queried == 2 * len(repetitive(1)) and recorder.hit == len(repetitive(1)) - 1
    assert recorder.kept == stats["accepted_draft_tokens"] > 0
    assert recorder.dropped == stats["draft_tokens"] - stats["accepted_draft_tokens"]


# ---- predictions (OpenAI's predicted outputs) -------------------------------------------------------
def test_a_prediction_drafts_its_start_then_what_follows_the_answers_tail_where_the_answer_has_got_to():
    drafts = PredictionDrafts([1, 2, 3, 4, 5, 1, 2, 9, 9])
    assert drafts.draft([], 3) == [1, 2, 3]  # nothing written: the prediction's start
    assert drafts.draft([1, 2], 3) == [3, 4, 5]  # [1, 2] twice in it: the occurrence nearest the answer's length
    assert drafts.draft([4, 5, 1, 2], 3) == [9, 9]  # the longest tail found wins: [5, 1, 2] ends at 7
    assert drafts.draft([0, 1, 2, 3], 2) == [4, 5]  # an edit ([0]) before the copy resumes
    assert drafts.draft([3], 2) == [4, 5]  # one token written: one token is tail enough
    assert drafts.draft([8, 9, 7], 3) == []  # no two-token tail of it is in the prediction
    assert drafts.draft([1, 2], 0) == [] and PredictionDrafts([]).draft([], 4) == []


@pytest.mark.parametrize("slots", [1, 3])
def test_an_answer_is_the_same_with_a_prediction_and_takes_fewer_steps_when_it_repeats_it(make_engine, slots):
    requests = [req("a", repetitive(1), max_tokens=40), req("b", ids(12, 3), max_tokens=30),
                req("c", repetitive(2), max_tokens=25)]
    plain, plain_stats = _generate(make_engine, requests, max_batch_size=slots)
    # "a" predicted exactly, "b" predicted with an edit in its middle, "c" predicted as another answer
    edited = plain[1].token_ids[:10] + [7, 7, 7] + plain[1].token_ids[13:]
    predicted = [r.model_copy(update={"params": r.params.model_copy(update={"prediction": prediction})})
                 for r, prediction in zip(requests, (plain[0].token_ids, edited, plain[1].token_ids))]
    drafted, stats = _generate(make_engine, predicted, max_batch_size=slots, speculative_max_batch=1)  # any batch
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert [r.text for r in drafted] == [r.text for r in plain]
    a, b, c = drafted
    # 40 tokens: the prompt's pass chooses 1, then 3 steps choose 1 each and keep 16 + 16 + 4 drafted
    assert a.accepted_prediction_tokens == 36 and a.rejected_prediction_tokens == 0
    assert 20 <= b.accepted_prediction_tokens < 29 and b.rejected_prediction_tokens > 0
    assert c.accepted_prediction_tokens == 0
    assert stats["steps"] < plain_stats["steps"] and stats["generated_tokens"] == plain_stats["generated_tokens"]
    assert stats["accepted_draft_tokens"] == a.accepted_prediction_tokens + b.accepted_prediction_tokens  # lookup off
    assert [(r.accepted_prediction_tokens, r.rejected_prediction_tokens) for r in plain] == [(0, 0)] * 3


def test_a_prediction_with_a_token_the_model_does_not_have_is_refused(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="params.prediction: token ids are from 0 to 255"):
        engine.add(req("x", [5, 6], max_tokens=4, prediction=[5, 256]))
    with pytest.raises(ValueError, match="params.prediction"):
        engine.add(req("y", [5, 6], max_tokens=4, prediction=[-1]))
