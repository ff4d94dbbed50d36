"""Token log probabilities from the engine (`SamplingParams.logprobs`): the model's own, one per
generated token, the same whatever the batch, the drafts or a cut and resume do."""
from __future__ import annotations

import pytest
import torch

from engine.types import FinishReason, GenerationRequest, SamplingParams

PROMPT = [1, 3, 40, 41, 42, 43, 2, 1, 4]


def _reference(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of the HF model's logits at each generated token's place: [len(generated), vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)


def test_each_token_carries_the_models_logprob_and_its_top_alternatives(make_engine, tiny_model):
    engine = make_engine(max_batch_size=2)
    [result] = engine.generate([GenerationRequest(prompt_ids=PROMPT, params=SamplingParams(max_tokens=12, logprobs=3))])
    assert [e.token_id for e in result.logprobs] == result.token_ids
    reference = _reference(tiny_model, PROMPT, result.token_ids)
    for place, entry in enumerate(result.logprobs):
        assert entry.logprob == pytest.approx(reference[place, entry.token_id].item(), abs=1e-4)
        values, ids = reference[place].topk(3)
        assert [t.token_id for t in entry.top] == ids.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
        assert entry.top[0].token_id == entry.token_id  # greedy takes the most likely
        assert entry.token == engine.tokenizer.decode([entry.token_id]) and entry.top[1].token


def test_sampled_tokens_are_scored_by_the_raw_model_and_streamed_with_their_events(make_engine, tiny_model):
    engine = make_engine(max_batch_size=2)
    params = SamplingParams(max_tokens=10, temperature=1.5, seed=4, presence_penalty=1.0, logprobs=0)
    request = GenerationRequest(prompt_ids=PROMPT, params=params)
    engine.add(request)
    streamed = []
    while engine.has_work():
        for event in engine.step():
            assert len(event.logprobs) == len(event.token_ids)
            streamed += event.logprobs
    result = engine.pop_result(request.id)
    assert streamed == result.logprobs and all(e.top == [] for e in result.logprobs)
    reference = _reference(tiny_model, PROMPT, result.token_ids)
    picked = reference.gather(1, torch.tensor(result.token_ids)[:, None])[:, 0]
    assert [e.logprob for e in result.logprobs] == pytest.approx(picked.tolist(), abs=1e-4)


def test_no_logprobs_unless_asked(make_engine):
    [result] = make_engine().generate([GenerationRequest(prompt_ids=PROMPT, params=SamplingParams(max_tokens=4))])
    assert result.logprobs is None


@pytest.mark.parametrize("speculative_tokens", [0, 4])
def test_batched_and_drafted_answers_have_the_logprobs_of_one_alone(make_engine, speculative_tokens):
    from test_drafts import repetitive  # a prompt whose answers echo it, so drafts are kept

    prompt, params = repetitive(3), SamplingParams(max_tokens=16, logprobs=2)
    alone = make_engine(max_batch_size=1, speculative_tokens=0).generate(
        [GenerationRequest(prompt_ids=prompt, params=params)])[0]
    others = [GenerationRequest(prompt_ids=repetitive(10 + i), params=params) for i in range(3)]
    engine = make_engine(max_batch_size=4, speculative_tokens=speculative_tokens, speculative_max_batch=4,
                         speculative_min_ngram=1)
    batched = engine.generate([GenerationRequest(prompt_ids=prompt, params=params)] + others)[0]
    assert batched.token_ids == alone.token_ids
    assert (engine.stats()["accepted_draft_tokens"] > 0) == bool(speculative_tokens)
    assert [e.logprob for e in batched.logprobs] == pytest.approx([e.logprob for e in alone.logprobs], abs=1e-4)


def test_an_answer_cut_and_resumed_keeps_every_tokens_logprob(make_engine):
    engine = make_engine(max_batch_size=2)
    whole = engine.generate([GenerationRequest(prompt_ids=PROMPT, params=SamplingParams(max_tokens=14, logprobs=1))])[0]
    cut = engine.generate([GenerationRequest(prompt_ids=PROMPT, params=SamplingParams(
        max_tokens=14, logprobs=1, length_cap=5))])[0]
    assert cut.finish_reason == FinishReason.CUT and len(cut.logprobs) == 5
    resumed = engine.generate([GenerationRequest(prompt_ids=PROMPT, resume_ids=cut.token_ids,
                                                 resume_logprobs=cut.logprobs,
                                                 params=SamplingParams(max_tokens=14, logprobs=1))])[0]
    assert resumed.token_ids == whole.token_ids
    assert [e.logprob for e in resumed.logprobs] == pytest.approx([e.logprob for e in whole.logprobs], abs=1e-4)
    with pytest.raises(ValueError, match="resume_logprobs"):
        GenerationRequest(prompt_ids=PROMPT, resume_ids=cut.token_ids, params=SamplingParams(max_tokens=14, logprobs=1))


def test_a_seeded_sample_cut_and_resumed_is_the_answer_never_cut(make_engine):
    engine = make_engine(max_batch_size=2)
    params = {"max_tokens": 14, "temperature": 1.2, "seed": 9, "logprobs": 0}
    whole = engine.generate([GenerationRequest(prompt_ids=PROMPT, params=SamplingParams(**params))])[0]
    cut = engine.generate([GenerationRequest(prompt_ids=PROMPT, params=SamplingParams(**params, length_cap=6))])[0]
    resumed = engine.generate([GenerationRequest(prompt_ids=PROMPT, resume_ids=cut.token_ids,
                                                 resume_logprobs=cut.logprobs, params=SamplingParams(**params))])[0]
    assert resumed.token_ids == whole.token_ids
    assert [e.logprob for e in resumed.logprobs] == pytest.approx([e.logprob for e in whole.logprobs], abs=1e-4)


def _prompt_reference(model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the HF model's logits before each prompt token after the first: [len(prompt) - 1, vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits[:-1].float(), dim=-1)


def _check_prompt_scores(entries, model, prompt: list[int], k: int) -> None:
    reference = _prompt_reference(model, prompt)
    assert [e.token_id for e in entries] == prompt[1:]
    for place, entry in enumerate(entries):
        assert entry.logprob == pytest.approx(reference[place, entry.token_id].item(), abs=1e-4)
        values, ids = reference[place].topk(k)
        assert [t.token_id for t in entry.top] == ids.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_prompt_logprobs_score_every_prompt_token_after_the_first(make_engine, tiny_model, decode_alone):
    engine = make_engine(max_batch_size=2)
    [result] = engine.generate([GenerationRequest(prompt_ids=PROMPT,
                                                  params=SamplingParams(max_tokens=6, prompt_logprobs=2))])
    _check_prompt_scores(result.prompt_logprobs, tiny_model, PROMPT, 2)
    assert result.token_ids == decode_alone(PROMPT, max_tokens=6).token_ids
    assert result.logprobs is None and result.prefix_hit_tokens == 0


def test_a_prompt_already_cached_is_computed_again_to_be_scored(make_engine, tiny_model):
    engine = make_engine(max_batch_size=2)
    shared = GenerationRequest(prompt_ids=PROMPT, shared_prefix_len=len(PROMPT) - 1, params=SamplingParams(max_tokens=3))
    [first] = engine.generate([shared])
    [scored] = engine.generate([shared.model_copy(update={"id": "again", "params": SamplingParams(
        max_tokens=3, prompt_logprobs=0)})])
    assert scored.prefix_hit_tokens == 0 and scored.token_ids == first.token_ids
    _check_prompt_scores(scored.prompt_logprobs, tiny_model, PROMPT, 0)


@pytest.mark.parametrize("mixed_batches", [True, False])
def test_prompts_scored_beside_others_in_one_pass_keep_every_answer_and_score(make_engine, tiny_model, decode_alone,
                                                                              mixed_batches):
    # admitted together, and while another answer decodes: rows of several lengths in one pass
    engine = make_engine(max_batch_size=4, mixed_batches=mixed_batches)
    other = [1, 5, 50, 51, 2]
    engine.add(GenerationRequest(id="running", prompt_ids=other, params=SamplingParams(max_tokens=12)))
    engine.step()
    requests = [GenerationRequest(id="a", prompt_ids=PROMPT, params=SamplingParams(max_tokens=5, prompt_logprobs=1)),
                GenerationRequest(id="b", prompt_ids=other + [7, 8], params=SamplingParams(max_tokens=5)),
                GenerationRequest(id="c", prompt_ids=[1, 9, 60, 61], resume_ids=[62, 63],
                                  params=SamplingParams(max_tokens=6, prompt_logprobs=3))]
    for request in requests:
        engine.add(request)
    while engine.has_work():
        engine.step()
    results = {rid: engine.pop_result(rid) for rid in ("running", "a", "b", "c")}
    assert results["running"].token_ids == decode_alone(other, max_tokens=12).token_ids
    for request in requests:
        alone = decode_alone(request.prompt_ids + request.resume_ids, max_tokens=request.params.max_tokens
                             - len(request.resume_ids)).token_ids
        assert results[request.id].token_ids == request.resume_ids + alone
    _check_prompt_scores(results["a"].prompt_logprobs, tiny_model, PROMPT, 1)
    _check_prompt_scores(results["c"].prompt_logprobs, tiny_model, [1, 9, 60, 61], 3)  # the prompt, not the resumed part
    assert results["b"].prompt_logprobs is None


def test_a_one_token_prompt_has_no_scores(make_engine):
    [result] = make_engine().generate([GenerationRequest(prompt_ids=[1], params=SamplingParams(max_tokens=2,
                                                                                             prompt_logprobs=1))])
    assert result.prompt_logprobs == []


def test_the_prompts_scores_come_with_its_first_event_only(make_engine):
    engine = make_engine()
    request = GenerationRequest(prompt_ids=PROMPT, params=SamplingParams(max_tokens=5, prompt_logprobs=0))
    engine.add(request)
    events = []
    while engine.has_work():
        events += engine.step()
    result = engine.pop_result(request.id)
    assert events[0].prompt_logprobs == result.prompt_logprobs and len(result.prompt_logprobs) == len(PROMPT) - 1
    assert all(e.prompt_logprobs is None for e in events[1:])


def test_the_stop_token_that_ends_an_answer_keeps_its_logprob_apart(make_engine, tiny_model, decode_alone):
    full = decode_alone(PROMPT, max_tokens=6).token_ids
    engine = make_engine()
    engine.stop_token_ids = {full[3]}  # pretend the 4th greedy token is end-of-sequence
    [result] = engine.generate([GenerationRequest(prompt_ids=PROMPT, params=SamplingParams(max_tokens=6, logprobs=1))])
    assert result.finish_reason == FinishReason.STOP and result.token_ids == full[:3] and len(result.logprobs) == 3
    reference = _reference(tiny_model, PROMPT, full[:4])
    assert result.stop_logprob.token_id == full[3]
    assert result.stop_logprob.logprob == pytest.approx(reference[3, full[3]].item(), abs=1e-4)
    [plain] = engine.generate([GenerationRequest(prompt_ids=PROMPT, params=SamplingParams(max_tokens=6))])
    assert plain.stop_logprob is None


@pytest.mark.parametrize("mixed_batches", [True, False])
def test_a_long_prompt_is_scored_a_chunk_of_logits_at_a_time(make_engine, tiny_model, decode_alone, mixed_batches,
                                                             monkeypatch):
    """Past EAGER_LOGIT_ROWS rows the pass hands back hidden rows, turned into logits as they are read, so a
    long scored prompt never holds rows x vocab floats at once; the scores are the same."""
    import engine.engine as core
    import engine.llama as llama

    lazy = []
    monkeypatch.setattr(llama, "EAGER_LOGIT_ROWS", 40)
    monkeypatch.setattr(core, "SCORED_ROWS_AT_ONCE", 32)  # five chunks
    original = llama.LogitRows.__init__
    monkeypatch.setattr(llama.LogitRows, "__init__", lambda self, *a: (lazy.append(1), original(self, *a))[1])
    prompt = [1] + [3 + (i * 7) % 250 for i in range(150)]
    engine = make_engine(max_batch_size=2, mixed_batches=mixed_batches, max_prefill_tokens=512)
    engine.add(GenerationRequest(id="running", prompt_ids=[1, 5, 50], params=SamplingParams(max_tokens=6)))
    engine.step()
    engine.add(GenerationRequest(id="long", prompt_ids=prompt, params=SamplingParams(max_tokens=4, prompt_logprobs=2)))
    while engine.has_work():
        engine.step()
    result = engine.pop_result("long")
    assert lazy  # the long prompt's rows came back lazily
    _check_prompt_scores(result.prompt_logprobs, tiny_model, prompt, 2)
    assert result.token_ids == decode_alone(prompt, max_tokens=4).token_ids
    assert engine.pop_result("running").token_ids == decode_alone([1, 5, 50], max_tokens=6).token_ids
