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
