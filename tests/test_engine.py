"""Behaviour of LLMEngine on a tiny random Llama: exact logits, batch-invariant greedy decoding,
prefix reuse, continuous batching, priorities, sampling, finish reasons, aborts, validation and
the TokenEvent stream."""
from __future__ import annotations

import itertools
import random

import pydantic
import pytest
import torch

from engine.llama import LlamaRunner, PrefillItem
from engine.types import FinishReason, GenerationRequest, SamplingParams


def ids(n: int, seed: int) -> list[int]:
    """A reproducible prompt of n ordinary word ids (no special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(6, 256) for _ in range(n)]


def req(rid, prompt, priority=0, resume_ids=(), **sampling):
    return GenerationRequest(
        id=rid, prompt_ids=prompt, params=SamplingParams(**sampling), priority=priority, resume_ids=list(resume_ids)
    )


def run_all(engine):
    """Step until idle; returns all events and the request ids in order of their first event."""
    events, first_seen = [], []
    while engine.has_work():
        for event in engine.step():
            events.append(event)
            if event.request_id not in first_seen:
                first_seen.append(event.request_id)
    return events, first_seen


# ---- the runner ---------------------------------------------------------------------------------
def test_runner_logits_match_hf_forward_for_prefill_and_decode(tiny_model):
    runner = LlamaRunner(tiny_model, max_slots=2, max_len=64)
    a, b = ids(9, 1), ids(4, 2)
    with torch.no_grad():
        hf = lambda tokens: tiny_model(torch.tensor([tokens])).logits[0, -1]  # noqa: E731
        prefill = runner.prefill([PrefillItem(0, a, 0), PrefillItem(1, b, 0)])
        torch.testing.assert_close(prefill[0], hf(a), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(prefill[1], hf(b), atol=1e-5, rtol=1e-5)
        decode = runner.decode(torch.tensor([17, 33]), torch.tensor([len(a), len(b)]))
        torch.testing.assert_close(decode[0], hf(a + [17]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(decode[1], hf(b + [33]), atol=1e-5, rtol=1e-5)
        # a prefill that continues after cached positions (the prefix-cache path)
        tail = runner.prefill([PrefillItem(1, [40, 41, 42], len(b) + 1)])
        torch.testing.assert_close(tail[0], hf(b + [33, 40, 41, 42]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["matmul-attention", "sdpa-attention"])
def test_both_decode_attention_paths_match_hf(tiny_model, fused):
    """The GPU path (SDPA with a padding mask) and the CPU path (batched matmuls) agree with HF."""
    runner = LlamaRunner(tiny_model, max_slots=2, max_len=64)
    runner.fused_decode_attention = fused
    a, b = ids(11, 3), ids(5, 4)  # different lengths: the shorter one is masked in the batch
    with torch.no_grad():
        runner.prefill([PrefillItem(0, a, 0), PrefillItem(1, b, 0)])
        decode = runner.decode(torch.tensor([9, 99]), torch.tensor([len(a), len(b)]))
        for row, tokens in ((0, a + [9]), (1, b + [99])):
            expected = tiny_model(torch.tensor([tokens])).logits[0, -1]
            torch.testing.assert_close(decode[row], expected, atol=1e-5, rtol=1e-5)


def two_runners_decoding(tiny_model, fused: bool, a: list[int], b: list[int], max_slots: int):
    """Two identical runners with prompts `a` and `b` prefilled in slots 0 and 1, ready to decode."""
    runners = [LlamaRunner(tiny_model, max_slots=max_slots, max_len=64) for _ in range(2)]
    with torch.no_grad():
        for runner in runners:
            runner.fused_decode_attention = fused
            runner.prefill([PrefillItem(0, a, 0), PrefillItem(1, b, 0)])
    return runners


@pytest.mark.parametrize("fused", [False, True], ids=["matmul-attention", "sdpa-attention"])
def test_decode_with_extra_tokens_for_one_sequence_keeps_the_decode_rows_bit_identical(tiny_model, fused):
    """Forced tokens run in the decode pass after their sequence's decode token: the decode rows get
    the same bits as without them, and the extra rows' last logits are that sequence's next."""
    a, b = ids(11, 3), ids(5, 4)
    plain, extended = two_runners_decoding(tiny_model, fused, a, b, max_slots=2)
    with torch.no_grad():
        tokens, positions = torch.tensor([9, 99]), torch.tensor([len(a), len(b)])
        alone = plain.decode(tokens, positions)
        both = extended.decode(tokens, positions, [PrefillItem(1, [40, 41, 42], len(b) + 1)])
        assert both.shape[0] == 3 and torch.equal(both[:2], alone)
        torch.testing.assert_close(both[2], tiny_model(torch.tensor([b + [99, 40, 41, 42]])).logits[0, -1],
                                   atol=1e-5, rtol=1e-5)
        # the slot holds the extra tokens' KV: decoding on from there matches the model
        after = extended.decode(torch.tensor([9, 7]), torch.tensor([len(a) + 1, len(b) + 4]))
        torch.testing.assert_close(after[1], tiny_model(torch.tensor([b + [99, 40, 41, 42, 7]])).logits[0, -1],
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["matmul-attention", "sdpa-attention"])
def test_a_prompt_prefilled_in_the_decode_pass_gets_its_logits_and_leaves_the_decode_rows_alone(tiny_model, fused):
    """A prompt for a slot that does not decode (an admitted request) runs in the running batch's pass:
    the decode rows keep their bits, and its last row and the row after its shared prefix are the model's."""
    a, b, prompt = ids(11, 5), ids(5, 6), ids(12, 7)
    plain, mixed = two_runners_decoding(tiny_model, fused, a, b, max_slots=3)
    with torch.no_grad():
        tokens, positions = torch.tensor([9, 99]), torch.tensor([len(a), len(b)])
        alone = plain.decode(tokens, positions)
        out = mixed.decode(tokens, positions, [PrefillItem(2, prompt, 0, prefix_end=7)])
        assert out.shape[0] == 4 and torch.equal(out[:2], alone)
        reference = tiny_model(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(out[2], reference[-1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[3], reference[6], atol=1e-5, rtol=1e-5)
        # slot 2 holds the prompt's KV: it decodes on as the model does
        after = mixed.decode(torch.tensor([9, 7, 8]), torch.tensor([len(a) + 1, len(b) + 1, len(prompt)]))
        torch.testing.assert_close(after[2], tiny_model(torch.tensor([prompt + [8]])).logits[0, -1],
                                   atol=1e-5, rtol=1e-5)


# ---- greedy equivalence -------------------------------------------------------------------------
def test_greedy_alone_equals_mixed_batch_equals_prefix_cached(make_engine, decode_alone):
    target = ids(12, 10)
    alone = decode_alone(target, max_tokens=24)
    assert alone.finish_reason == FinishReason.LENGTH and len(alone.token_ids) == 24

    # three slots, four requests of different lengths and budgets: the batch changes while it runs
    engine = make_engine(max_batch_size=3)
    mates = [req("m1", ids(3, 11), max_tokens=5), req("m2", ids(20, 12), max_tokens=30), req("m3", ids(7, 13), max_tokens=12)]
    results = engine.generate([mates[0], req("t", target, max_tokens=24), *mates[1:]])
    assert results[1].token_ids == alone.token_ids
    assert [len(r.token_ids) for r in results] == [5, 24, 30, 12]

    engine = make_engine()
    engine.prefill_prefix(target[:8])
    [cached] = engine.generate([req("t", target, max_tokens=24)])
    assert cached.prefix_hit_tokens == 8
    assert cached.token_ids == alone.token_ids
    assert cached.text == alone.text


def test_continuations_sharing_one_prefix_decode_as_one_batch(make_engine, decode_alone):
    prefix = ids(10, 20)
    prompts = [prefix + ids(3, 21), prefix + ids(6, 22), prefix + ids(1, 23), list(prefix)]  # last: prefix only
    expected = [decode_alone(p, max_tokens=15).token_ids for p in prompts]
    assert len({tuple(e) for e in expected}) == 4, "different prompts should give different answers"
    engine = make_engine(max_batch_size=4)
    engine.prefill_prefix(prefix)
    results = engine.generate([req(f"c{i}", p, max_tokens=15) for i, p in enumerate(prompts)])
    assert [r.token_ids for r in results] == expected
    assert [r.prefix_hit_tokens for r in results] == [10] * 4
    assert engine.stats()["prefix_hits"] == 4


def test_chat_prompt_encodes_with_template_and_decodes_to_text(make_engine, tiny_tokenizer):
    engine = make_engine()
    prompt = engine.encode_chat([{"role": "system", "content": "baba"}, {"role": "user", "content": "bebe bibi"}])
    assert prompt[:3] == [1, 5, engine.encode("baba")[0]] and prompt[-2:] == [1, 4]  # ...<|im_start|>assistant
    assert engine.encode_chat([{"role": "user", "content": "bebe"}], add_generation_prompt=False)[-1] == 2
    [result] = engine.generate([req("chat", prompt, max_tokens=8)])
    assert result.text == tiny_tokenizer.decode(result.token_ids) and len(result.text.split(" ")) == 8


# ---- continuous batching ------------------------------------------------------------------------
def test_two_slots_serve_five_requests_with_results_equal_to_alone(make_engine, decode_alone):
    prompts, budgets = [ids(3 + 4 * i, 30 + i) for i in range(5)], [9, 3, 14, 6, 11]
    engine = make_engine(max_batch_size=2)
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        engine.add(req(f"r{i}", p, max_tokens=n))
    running = []
    while engine.has_work():
        engine.step()
        running.append(engine.stats()["running"])
    assert max(running) == 2 and running[-1] == 0
    results = [engine.pop_result(f"r{i}") for i in range(5)]
    for p, n, result in zip(prompts, budgets, results):
        assert result.finish_reason == FinishReason.LENGTH
        assert result.token_ids == decode_alone(p, max_tokens=n).token_ids  # slots compacted correctly


def test_request_added_mid_run_joins_before_long_ones_finish(make_engine, decode_alone):
    engine = make_engine(max_batch_size=4)
    engine.add(req("long1", ids(5, 40), max_tokens=60))
    engine.add(req("long2", ids(9, 41), max_tokens=60))
    for _ in range(3):
        engine.step()
    engine.add(req("late", ids(6, 42), max_tokens=4))
    late_tokens, steps = [], 0
    while engine.pop_result("late") is None:
        events = engine.step()
        steps += 1
        late_tokens += [t for e in events if e.request_id == "late" for t in e.token_ids]
        assert late_tokens, "the new request should be admitted at once, not after the batch drains"
        assert {e.request_id for e in events} >= {"long1", "long2"}  # still running alongside
    assert steps == 4  # its prompt prefills in the batch's decode pass, which gives it its first token
    assert late_tokens == decode_alone(ids(6, 42), max_tokens=4).token_ids
    assert engine.stats()["running"] == 2


def test_finished_sequence_frees_its_slot_for_a_waiting_one(make_engine):
    engine = make_engine(max_batch_size=2)
    engine.add(req("short", ids(4, 50), max_tokens=2))
    engine.add(req("long", ids(4, 51), max_tokens=10))
    engine.add(req("queued", ids(4, 52), max_tokens=3))
    engine.step()  # admits two; each gets two tokens: "short" is done and its slot freed
    assert engine.pop_result("short").finish_reason == FinishReason.LENGTH
    assert engine.stats()["running"] == 1 and engine.stats()["waiting"] == 1
    events = engine.step()
    assert "queued" in {e.request_id for e in events}
    assert engine.stats()["running"] == 2 and engine.stats()["waiting"] == 0


# ---- priority -----------------------------------------------------------------------------------
def test_higher_priority_is_admitted_first_and_ties_are_fifo(make_engine):
    engine = make_engine(max_batch_size=1, preempt_for_priority=False)  # tests/test_preemption.py: with it
    engine.add(req("blocker", ids(4, 60), max_tokens=3))
    engine.step()
    engine.add(req("low", ids(4, 61), max_tokens=2, priority=0))
    engine.add(req("high", ids(4, 62), max_tokens=2, priority=5))
    _, order = run_all(engine)
    assert order == ["blocker", "high", "low"]

    engine = make_engine(max_batch_size=1)
    for name in ["a", "b", "c", "d"]:
        engine.add(req(name, ids(3, ord(name)), max_tokens=2, priority=1))
    _, order = run_all(engine)
    assert order == ["a", "b", "c", "d"]


# ---- sampling -----------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(make_engine, decode_alone):
    prompt = ids(8, 70)
    alone = decode_alone(prompt, max_tokens=20, temperature=0.9, seed=7)
    engine = make_engine(max_batch_size=3)
    results = engine.generate(
        [req("g", ids(5, 71), max_tokens=8), req("s", prompt, max_tokens=20, temperature=0.9, seed=7),
         req("o", ids(11, 72), max_tokens=25, temperature=1.2, seed=3)]
    )
    assert results[1].token_ids == alone.token_ids
    other_seed = decode_alone(prompt, max_tokens=20, temperature=0.9, seed=8)
    greedy = decode_alone(prompt, max_tokens=20)
    assert other_seed.token_ids != alone.token_ids
    assert alone.token_ids != greedy.token_ids  # temperature really samples
    tiny_top_p = decode_alone(prompt, max_tokens=20, temperature=1.5, top_p=1e-6, seed=9)
    assert tiny_top_p.token_ids == greedy.token_ids


def test_a_seed_beyond_64_bits_samples_rather_than_stopping_the_engine(make_engine, decode_alone):
    """torch takes seeds in [-2^63, 2^64); a JSON seed outside it (or a sequence's seed times 1,000,003)
    raised on the engine's thread and stopped the engine for every request (found by tests/test_api_fuzz)."""
    prompt = ids(8, 70)
    engine = make_engine(max_batch_size=3)
    huge, low, edge = engine.generate([req(f"s{i}", prompt, max_tokens=6, temperature=0.9, seed=seed)
                                       for i, seed in enumerate((2**64 + 7, -(2**63) - 1, 2**64 - 1))])
    assert len(huge.token_ids) == len(low.token_ids) == len(edge.token_ids) == 6
    assert huge.token_ids == decode_alone(prompt, max_tokens=6, temperature=0.9, seed=7).token_ids  # 2^64 + 7 is 7


# ---- finish reasons -----------------------------------------------------------------------------
def test_stop_string_ends_answer_and_is_not_included(decode_alone):
    prompt = ids(7, 80)
    full = decode_alone(prompt, max_tokens=16)
    stop = " " + full.text.split(" ")[5]  # a whole word, so the match lies within one token's text
    stopped = decode_alone(prompt, max_tokens=16, stop=["zzzz", stop])
    assert stopped.finish_reason == FinishReason.STOP
    assert stopped.text == full.text[: full.text.index(stop)]
    assert stop not in stopped.text and len(stopped.token_ids) < 16


def test_eos_token_stops_and_is_not_returned(make_engine, decode_alone):
    prompt = ids(6, 81)
    full = decode_alone(prompt, max_tokens=12).token_ids
    engine = make_engine()
    engine.stop_token_ids = {full[4]}  # pretend the 5th greedy token is end-of-sequence
    [result] = engine.generate([req("e", prompt, max_tokens=12)])
    assert result.finish_reason == FinishReason.STOP
    assert result.token_ids == full[: full.index(full[4])]


def test_min_tokens_holds_the_end_of_sequence_back_until_the_answer_is_that_long(make_engine, decode_alone):
    prompt = ids(6, 81)
    full = decode_alone(prompt, max_tokens=12).token_ids
    engine = make_engine()
    eos = full[4]
    engine.stop_token_ids = {eos}
    first_stop = full.index(eos)
    [result] = engine.generate([req("m", prompt, max_tokens=12, min_tokens=first_stop + 3)])
    assert eos not in result.token_ids[:first_stop + 3] and len(result.token_ids) >= first_stop + 3
    assert result.token_ids[:first_stop] == full[:first_stop]  # the same answer up to where it would have ended
    [ignoring] = engine.generate([req("i", prompt, max_tokens=12, ignore_eos=True)])
    assert ignoring.finish_reason == FinishReason.LENGTH and ignoring.token_ids == full


def test_length_cut_and_resume_equal_the_uninterrupted_run(make_engine, decode_alone):
    prompt = ids(9, 90)
    full = decode_alone(prompt, max_tokens=20)
    assert full.finish_reason == FinishReason.LENGTH and len(full.token_ids) == 20
    cut = decode_alone(prompt, max_tokens=20, length_cap=7)
    assert cut.finish_reason == FinishReason.CUT and cut.token_ids == full.token_ids[:7]
    engine = make_engine()
    [resumed] = engine.generate([req("r", prompt, resume_ids=cut.token_ids, max_tokens=20)])
    assert resumed.finish_reason == FinishReason.LENGTH
    assert resumed.token_ids == full.token_ids
    assert resumed.text == full.text
    # resumed tokens that are not the model's own choice really condition what comes next
    forced = [200, 201, 202]
    [other] = make_engine().generate([req("f", prompt, resume_ids=forced, max_tokens=10)])
    assert other.token_ids == forced + decode_alone(prompt + forced, max_tokens=7).token_ids
    assert other.token_ids[3:] != full.token_ids[:7]


# ---- abort --------------------------------------------------------------------------------------
def test_abort_waiting_and_running_frees_slots_and_others_finish(make_engine, decode_alone):
    engine = make_engine(max_batch_size=2)
    engine.add(req("a", ids(5, 100), max_tokens=10))
    engine.add(req("b", ids(8, 101), max_tokens=10))
    engine.add(req("c", ids(3, 102), max_tokens=10))
    engine.step()
    assert engine.abort("c") and engine.abort("a")  # c is waiting, a is running
    assert not engine.abort("nope")
    assert engine.stats()["running"] == 1 and engine.stats()["waiting"] == 0
    for rid in ("a", "c"):
        assert engine.pop_result(rid).finish_reason == FinishReason.ABORT
    engine.add(req("d", ids(6, 103), max_tokens=7))
    _, order = run_all(engine)
    assert set(order) == {"b", "d"}
    assert engine.pop_result("b").token_ids == decode_alone(ids(8, 101), max_tokens=10).token_ids
    assert engine.pop_result("d").token_ids == decode_alone(ids(6, 103), max_tokens=7).token_ids


# ---- validation ---------------------------------------------------------------------------------
def test_bad_input_is_rejected_naming_the_field(make_engine):
    engine = make_engine(max_model_len=32)
    with pytest.raises(ValueError, match="prompt_ids"):
        engine.add(req("long", ids(32, 110)))
    engine.add(req("x", ids(4, 111)))
    with pytest.raises(ValueError, match="^id:"):
        engine.add(req("x", ids(4, 112)))
    with pytest.raises(ValueError, match="resume_ids"):
        engine.add(req("y", ids(4, 113), resume_ids=[7, 8], max_tokens=2))
    with pytest.raises(pydantic.ValidationError, match="prompt_ids"):
        GenerationRequest(prompt_ids=[])
    with pytest.raises(pydantic.ValidationError, match="temperature"):
        SamplingParams(temperature=2.5)
    with pytest.raises(pydantic.ValidationError, match="temperature"):
        SamplingParams(temperature=-0.1)
    assert engine.stats()["waiting"] == 1  # only "x" got in


# ---- token events -------------------------------------------------------------------------------
def _check_events_match_results(engine, requests):
    for request in requests:
        engine.add(request)
    events, _ = run_all(engine)
    for request in requests:
        mine = [e for e in events if e.request_id == request.id]
        result = engine.pop_result(request.id)
        assert "".join(e.text for e in mine) == result.text
        assert [t for e in mine for t in e.token_ids] == result.token_ids
        assert [e.finish_reason for e in mine if e.finish_reason] == [result.finish_reason]


def test_token_events_add_up_to_the_result(make_engine, decode_alone):
    full = decode_alone(ids(7, 120), max_tokens=16).text
    requests = [
        req("plain", ids(7, 121), max_tokens=9),
        req("stop", ids(7, 120), max_tokens=16, stop=[" " + full.split(" ")[6]]),
        req("cut", ids(4, 122), max_tokens=16, length_cap=5),
        req("sampled", ids(10, 123), max_tokens=12, temperature=1.0, seed=1),
    ]
    _check_events_match_results(make_engine(max_batch_size=2), requests)


def _pieces_engine(tiny_model, pieces):
    from bench.random_model import piece_tokenizer
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    return LLMEngine(tiny_model, piece_tokenizer(pieces), EngineConfig(max_batch_size=1))


def test_an_answer_wraps_up_at_the_first_sentence_end_within_its_last_tokens(tiny_model):
    words = [" " + "".join(w) for w in itertools.product("abcdefg", repeat=3)][:253]  # ids 3.. decode to these
    prompt = ids(7, 140)
    [full] = _pieces_engine(tiny_model, words).generate([req("f", prompt, max_tokens=16)])
    tokens = full.token_ids
    at = next(i for i in range(10, 4, -1) if tokens.count(tokens[i]) == 1)  # a token that comes once
    pieces = list(words)
    pieces[tokens[at] - 3] += "."  # that token ends a sentence
    engine = _pieces_engine(tiny_model, pieces)
    text = lambda ids_: "".join(pieces[t - 3] for t in ids_)  # noqa: E731
    # within the last 16 - at + 1 tokens the sentence end counts: the answer stops once the next token's space came
    [wrapped] = engine.generate([req("w", prompt, max_tokens=16, wrap_up_tokens=16 - at)])
    assert wrapped.finish_reason == FinishReason.STOP and wrapped.token_ids == tokens[: at + 2]
    assert wrapped.text == text(tokens[: at + 1]) and wrapped.text.endswith(".")
    # a sentence that ends before the last tokens does not end the answer
    [on] = engine.generate([req("o", prompt, max_tokens=16, wrap_up_tokens=16 - at - 2)])
    assert on.finish_reason == FinishReason.LENGTH and on.token_ids == tokens and on.text == text(tokens)
    _check_events_match_results(engine, [req("s", prompt, max_tokens=16, wrap_up_tokens=16 - at)])


def test_stop_string_spanning_two_tokens_is_not_streamed(make_engine, decode_alone):
    full = decode_alone(ids(7, 130), max_tokens=16).text
    words = full.split(" ")
    stop = words[3][-2:] + " " + words[4][:2]  # end of one token's text + start of the next
    _check_events_match_results(make_engine(), [req("s", ids(7, 130), max_tokens=16, stop=[stop])])
