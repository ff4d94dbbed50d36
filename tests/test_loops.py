"""The degenerate-repetition stop: the detector itself, and the engine honouring it."""
from __future__ import annotations

import random

from engine.loops import MIN_SPAN, LoopDetector
from engine.types import FinishReason, GenerationRequest, SamplingParams


def first_loop_at(tokens: list[int]) -> int | None:
    detector = LoopDetector()
    return next((i for i, t in enumerate(tokens) if detector.add(t)), None)


def test_a_block_written_three_times_is_a_loop_and_twice_is_not():
    rng = random.Random(0)
    intro = [rng.randrange(1000) for _ in range(30)]
    block = [rng.randrange(1000, 2000) for _ in range(40)]
    tokens = intro + block * 4
    # fires on the last token of the third copy: run of 2 * 40 matches at period 40
    assert first_loop_at(tokens) == len(intro) + 3 * len(block) - 1
    assert first_loop_at(intro + block * 2) is None


def test_short_blocks_need_a_long_span():
    row = [7, 8, 9]  # a table separator row, say: fine a few times, a loop when it goes on
    assert first_loop_at(row * 8) is None
    fired = first_loop_at(row * 30)
    assert fired == len(row) + MIN_SPAN - 1
    assert first_loop_at([5] * (MIN_SPAN + 1)) == MIN_SPAN


def test_varied_text_never_fires():
    rng = random.Random(1)
    assert first_loop_at([rng.randrange(50_000) for _ in range(2000)]) is None


def test_engine_stops_a_looping_answer_where_the_detector_says(make_engine, decode_alone):
    # greedy decoding of a tiny random model falls into a cycle: find a prompt where it does
    for seed in range(20):
        prompt = [random.Random(seed).randrange(6, 256) for _ in range(8)]
        full = decode_alone(prompt, max_tokens=300, ignore_eos=True)
        at = first_loop_at(full.token_ids)
        if at is not None:
            break
    assert at is not None, "no looping prompt found for the tiny model"
    request = GenerationRequest(id="l", prompt_ids=prompt,
                                params=SamplingParams(max_tokens=300, ignore_eos=True, stop_on_loop=True))
    [stopped] = make_engine().generate([request])
    assert stopped.finish_reason == FinishReason.STOP
    assert stopped.token_ids == full.token_ids[: at + 1]
    # a cut answer resumed later stops at the same token as the uninterrupted one
    resumed = request.model_copy(update={"id": "r", "resume_ids": full.token_ids[: at - 5]})
    [again] = make_engine().generate([resumed])
    assert again.token_ids == stopped.token_ids and again.finish_reason == FinishReason.STOP
