"""The copy guard: an answer may not write out again the beginning of the texts it is given (a
plan's sub-questions), in the guard itself and in the engine that honours it."""
from __future__ import annotations

import pytest

from engine.copies import CopyGuard
from engine.types import GenerationRequest, SamplingParams


def test_the_token_after_the_allowed_beginning_of_a_text_is_banned():
    guard = CopyGuard([[5, 6, 7, 8]], allowed=2)
    assert guard.banned([]) == set() and guard.banned([1, 5]) == set()
    assert guard.banned([1, 5, 6]) == {7}
    assert guard.banned([5, 6, 7]) == {8}  # a copy that got further (resumed tokens) is still stopped


def test_a_phrase_from_inside_a_text_may_be_quoted():
    guard = CopyGuard([[5, 6, 7, 8]], allowed=2)
    assert guard.banned([9, 6, 7]) == set()


def test_texts_no_longer_than_the_allowed_copy_need_no_guard():
    guard = CopyGuard([[5, 6], [3, 4, 9]], allowed=2)
    assert guard.banned([5, 6]) == set() and guard.banned([3, 4]) == {9}


def test_every_text_in_both_spellings_is_guarded():
    class SpacedTokenizer:  # a word after a space is another token than the same word starting a line
        def encode(self, text, add_special_tokens=False):
            return [(100 if i or text.startswith(" ") else 0) + len(w) for i, w in enumerate(text.split())]

    guard = CopyGuard.for_texts(["ab abc abcd", "  ", "x"], SpacedTokenizer(), allowed=2)
    assert guard.banned([2, 103]) == {104}  # the text starting a line
    assert guard.banned([102, 103]) == {104}  # after "1." or a space


def test_params_validate_the_guard():
    with pytest.raises(ValueError, match="no_copy_tokens"):
        SamplingParams(no_copy=["a b c"], no_copy_tokens=0)
    with pytest.raises(ValueError, match="no_copy"):
        SamplingParams(no_copy=["x"] * 65)


@pytest.mark.parametrize("drafts", [0, 4])
def test_the_engine_never_lets_the_answer_copy_past_the_allowed_tokens(make_engine, tiny_tokenizer, drafts):
    """The prompt holds a free answer's text (so the engine's prompt-lookup drafts have copies to
    propose), and the free answer to that prompt is the text not to copy: the guarded answer starts
    with its allowed two tokens, then goes elsewhere, and never holds three tokens of its beginning in
    a row, with drafts or without."""
    prompt = tiny_tokenizer.encode("baba babe babi babo babu", add_special_tokens=False)

    def decode(**sampling):
        engine = make_engine(max_batch_size=4, speculative_tokens=drafts)
        params = SamplingParams(max_tokens=24, ignore_eos=True, **sampling)
        [result] = engine.generate([GenerationRequest(prompt_ids=prompt, params=params)])
        return result.token_ids

    free = decode()
    text = tiny_tokenizer.decode(free[:6])
    prompt += tiny_tokenizer.encode(text, add_special_tokens=False)
    free = decode()
    text = tiny_tokenizer.decode(free[:6])
    guarded = decode(no_copy=[text], no_copy_tokens=2)
    start = tiny_tokenizer.encode(text, add_special_tokens=False)[:3]
    assert guarded[:2] == free[:2] and guarded[2] != free[2]
    assert all(guarded[i:i + 3] != start for i in range(len(guarded)))
