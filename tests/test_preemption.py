"""Preemption for priority (`EngineConfig.preempt_for_priority`): with every slot taken, a waiting request
of higher priority takes the slot of the lowest-priority running answer, which waits and then goes on
where it was, with the same tokens, text and events as had it never stopped."""
from __future__ import annotations

import pytest

from engine.types import GenerationRequest, SamplingParams
from test_engine import ids, req


def _run(engine, texts: dict | None = None) -> tuple[dict, list[str], dict]:
    """Step until idle: each request's streamed text (added to `texts`, the events before), the order
    requests finished, their results."""
    texts, finished = {} if texts is None else texts, []
    while engine.has_work():
        for event in engine.step():
            texts[event.request_id] = texts.get(event.request_id, "") + event.text
            if event.finish_reason is not None:
                finished.append(event.request_id)
    return texts, finished, {rid: engine.pop_result(rid) for rid in finished}


@pytest.mark.parametrize("mixed_batches", [True, False])
@pytest.mark.parametrize("cache_answers", [True, False])
def test_a_higher_priority_takes_a_running_answers_slot_and_that_answer_goes_on_unchanged(
        make_engine, decode_alone, mixed_batches, cache_answers):
    engine = make_engine(max_batch_size=2, mixed_batches=mixed_batches, cache_answers=cache_answers)
    engine.add(req("job", ids(6, 1), max_tokens=16, priority=-1))
    engine.add(req("other", ids(5, 2), max_tokens=16, priority=0))
    before = {}
    for _ in range(4):
        for event in engine.step():
            before[event.request_id] = before.get(event.request_id, "") + event.text
    engine.add(req("chat", ids(7, 3), max_tokens=4, priority=0))
    texts, finished, results = _run(engine, before)
    assert finished.index("chat") < finished.index("job")  # the chat did not wait for the job's answer to end
    assert engine.stats()["preempted"] == 1
    for rid, prompt, budget in (("job", ids(6, 1), 16), ("other", ids(5, 2), 16), ("chat", ids(7, 3), 4)):
        alone = decode_alone(prompt, max_tokens=budget)
        assert results[rid].token_ids == alone.token_ids, rid
        assert results[rid].text == texts[rid] == alone.text, rid
    assert results["job"].prefix_hit_tokens == 0  # its first admission's, not the KV it was given back


def test_a_preempted_seeded_answer_samples_as_it_would_have(make_engine, decode_alone):
    engine = make_engine(max_batch_size=1)
    engine.add(req("job", ids(6, 4), max_tokens=14, priority=-3, temperature=1.1, seed=9))
    for _ in range(5):
        engine.step()
    engine.add(req("chat", ids(4, 5), max_tokens=3, priority=2))
    _, finished, results = _run(engine)
    assert finished == ["chat", "job"] and engine.stats()["preempted"] == 1
    assert results["job"].token_ids == decode_alone(ids(6, 4), max_tokens=14, temperature=1.1, seed=9).token_ids


def test_equal_priorities_and_scored_prompts_are_never_preempted(make_engine):
    engine = make_engine(max_batch_size=1)
    engine.add(req("first", ids(6, 6), max_tokens=8))
    engine.step()
    engine.add(req("same", ids(6, 7), max_tokens=2))
    _, finished, _ = _run(engine)
    assert finished == ["first", "same"] and engine.stats()["preempted"] == 0

    engine = make_engine(max_batch_size=1)
    engine.add(GenerationRequest(id="scored", prompt_ids=ids(6, 8), priority=-1,
                                 params=SamplingParams(max_tokens=6, prompt_logprobs=1)))
    engine.step()
    engine.add(req("chat", ids(6, 9), max_tokens=2, priority=1))
    _, finished, _ = _run(engine)
    assert finished == ["scored", "chat"] and engine.stats()["preempted"] == 0


def test_off_a_higher_priority_waits_for_a_free_slot(make_engine):
    engine = make_engine(max_batch_size=1, preempt_for_priority=False)
    engine.add(req("job", ids(6, 1), max_tokens=8, priority=-1))
    engine.step()
    engine.add(req("chat", ids(7, 3), max_tokens=2, priority=0))
    _, finished, _ = _run(engine)
    assert finished == ["job", "chat"] and engine.stats()["preempted"] == 0


def test_a_preempted_answer_can_be_aborted_while_it_waits(make_engine):
    engine = make_engine(max_batch_size=1)
    engine.add(req("job", ids(6, 1), max_tokens=12, priority=-1))
    for _ in range(3):
        engine.step()
    engine.add(req("chat", ids(7, 3), max_tokens=6, priority=0))
    engine.step()
    assert engine.stats()["preempted"] == 1 and engine.abort("job")
    aborted = engine.pop_result("job")
    assert aborted.finish_reason.value == "abort" and len(aborted.token_ids) >= 3
    _, finished, _ = _run(engine)
    assert finished == ["chat"]
