"""The plain decode pass at fixed shapes (engine.graphs): on the CPU the padded, bucketed pass runs
eagerly and must give what the ragged pass gives; on CUDA (where a GPU is) the captured graphs must
give the eager engine's answers."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from engine.graphs import DecodeGraphs, batch_buckets, span_buckets
from engine.types import GenerationRequest, SamplingParams

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def _padded(engine) -> DecodeGraphs:
    runner = engine.runner
    runner.graphs = DecodeGraphs(runner.plain_decode, runner.max_slots, runner.max_len, runner.device, capture=False)
    return runner.graphs


def _answers(engine, prompts, max_tokens=40, **params):
    for i, prompt in enumerate(prompts):
        engine.add(GenerationRequest(id=f"r{i}", prompt_ids=prompt,
                                     params=SamplingParams(max_tokens=max_tokens + 5 * i, **params)))
    while engine.has_work():
        engine.step()
    return [engine.pop_result(f"r{i}").token_ids for i in range(len(prompts))]


PROMPTS = [[1, 7, 9, 11], [1, 20, 21], list(range(3, 60)), [1, 5] * 20, [1, 99, 98, 97, 96]]


def test_buckets_cover_every_size_up_to_the_limit():
    assert batch_buckets(1) == [1]
    assert batch_buckets(24) == [1, 2, 4, 8, 16, 24]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert span_buckets(100) == [100]
    assert span_buckets(2048) == [256, 512, 1024, 2048]
    assert span_buckets(1500) == [256, 512, 1024, 1500]


def test_the_padded_pass_gives_the_ragged_pass_logits_and_kv(make_engine):
    plain, padded = make_engine(max_batch_size=8), make_engine(max_batch_size=8)
    graphs = _padded(padded)
    for engine in (plain, padded):  # three sequences at different lengths, in slots 0-2
        for i, prompt in enumerate(PROMPTS[:3]):
            engine.add(GenerationRequest(id=f"r{i}", prompt_ids=prompt, params=SamplingParams(max_tokens=8)))
        engine.step()
    tokens, positions = torch.tensor([5, 6, 7]), torch.tensor([4, 3, 57])
    want = plain.runner.decode(tokens, positions)
    got = padded.runner.decode(tokens, positions)
    assert got.shape == want.shape and want.shape[0] == 3
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for cache in ("k_cache", "v_cache"):  # the running slots' KV is the same; slot 3 got the padding row
        a, b = getattr(plain.runner, cache), getattr(padded.runner, cache)
        torch.testing.assert_close(b[:, :3, :, :58], a[:, :3, :, :58], rtol=1e-5, atol=1e-5)
    assert graphs.captured == 0 and graphs.replays == 0  # eager: nothing captured


def test_the_engine_answers_the_same_through_the_padded_pass(make_engine):
    want = _answers(make_engine(max_batch_size=3), PROMPTS)
    engine = make_engine(max_batch_size=3)
    _padded(engine)
    assert _answers(engine, PROMPTS) == want


def test_passes_with_extra_tokens_stay_ragged(make_engine):
    """Drafted tokens make a pass that is not plain: it must not go to the fixed-shape pass, and the
    answers stay the same."""
    rng = random.Random(1)  # a phrase repeated: the tiny model's answers then echo it, so drafts match
    phrases = [[rng.randrange(6, 256) for _ in range(6)] for _ in range(2)]
    prompts = [[1, 2, 3] + phrase * 4 + phrase[:2] for phrase in phrases]
    drafting = {"speculative_tokens": 4, "speculative_min_ngram": 1}
    want = _answers(make_engine(max_batch_size=2), prompts, max_tokens=60)
    engine = make_engine(max_batch_size=2, **drafting)
    graphs = _padded(engine)
    seen = []
    forward = graphs.forward
    graphs.forward = lambda tokens, positions, span: seen.append(len(tokens)) or forward(tokens, positions, span)
    assert _answers(engine, prompts, max_tokens=60) == want
    assert engine.stats()["accepted_draft_tokens"] > 0
    assert 0 < len(seen) < engine.stats()["steps"]  # some passes went the fixed way, some the ragged way


def test_drafts_and_jump_forward_default_on_without_graphs_and_as_set(make_engine):
    engine = make_engine()
    assert engine.runner.graphs is None and engine.jump_forward and engine.speculative_tokens == 4
    engine = make_engine(jump_forward=False, speculative_tokens=2)
    assert not engine.jump_forward and engine.speculative_tokens == 2


def test_capture_is_refused_off_cuda(make_engine):
    runner = make_engine().runner
    with pytest.raises(ValueError, match="cuda_graphs"):
        DecodeGraphs(runner.plain_decode, runner.max_slots, runner.max_len, runner.device, capture=True)


@cuda
def test_cuda_graphs_give_the_eager_answers(tiny_model, tiny_tokenizer):
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    model = copy.deepcopy(tiny_model).to("cuda")  # the fixture is shared: leave it on the CPU
    eager = LLMEngine(model, tiny_tokenizer, EngineConfig(max_batch_size=4, cuda_graphs=False))
    graphed = LLMEngine(model, tiny_tokenizer, EngineConfig(max_batch_size=4))
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    # passes with drafted or forced tokens would run eagerly: off by default where steps are graphed
    assert graphed.speculative_tokens == 0 and not graphed.jump_forward
    assert eager.speculative_tokens == 4 and eager.jump_forward
    assert _answers(graphed, PROMPTS) == _answers(eager, PROMPTS)
    assert graphed.runner.graphs.captured > 0 and graphed.stats()["graph_replays"] > 0
    seeded = {"temperature": 0.8, "seed": 3}
    assert _answers(graphed, PROMPTS, **seeded) == _answers(eager, PROMPTS, **seeded)
