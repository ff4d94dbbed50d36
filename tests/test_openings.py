"""The opening guard: no line of an answer opens with the given words (a plan node's answer written as
questions), in the guard itself and in the engine that honours it."""
from __future__ import annotations

import pytest

from engine.openings import OpeningGuard
from engine.types import GenerationRequest, SamplingParams


class SpacedTokenizer:
    """Each word one token, another after a space; a word with a hyphen is two tokens."""

    def encode(self, text, add_special_tokens=False):
        ids = []
        for i, word in enumerate(text.split()):
            spaced = 100 if i or text.startswith(" ") else 0
            ids += [spaced + len(piece) for piece in word.split("-")]
        return ids


def test_each_word_is_banned_in_both_of_its_single_token_spellings():
    guard = OpeningGuard.for_words(["What", "Is", " ", "How-to"], SpacedTokenizer())
    assert guard.token_ids == {4, 104, 2, 102}  # the hyphenated word is two tokens: left out


@pytest.mark.parametrize("text", ["", "  ", "Intro:\n", "Intro:\n\n", "Tips:\n1. ", "Tips:\n12.", "Tips:\n3) ",
                                  "Tips:\n- ", "Tips:\n* ", "Tips:\n1. **", "Tips:\n\t**", "A.\n\u2022 "])
def test_where_a_line_opens_the_words_are_banned(text):
    assert OpeningGuard([7, 8]).banned(text) == {7, 8}


@pytest.mark.parametrize("text", ["The", "The answer is", "Tips:\n1. Set", "Tips:\n1.5", "x\n-y", "a\nb ", "1. A"])
def test_elsewhere_nothing_is_banned(text):
    assert OpeningGuard([7, 8]).banned(text) == set()


def test_params_validate_the_words():
    with pytest.raises(ValueError, match="no_openings"):
        SamplingParams(no_openings=["What"] * 65)


@pytest.mark.parametrize("drafts", [0, 4])
def test_the_engine_bans_a_word_where_the_answer_opens_and_nowhere_else(make_engine, tiny_tokenizer, drafts):
    """The tiny tokenizer writes no line breaks, so the answer's start is its one line opening: banning
    the free answer's first word changes that token; banning a later word of it changes nothing."""
    engine = make_engine(max_batch_size=4, speculative_tokens=drafts)
    prompt = tiny_tokenizer.encode("baba babe babi babo babu baba babe", add_special_tokens=False)

    def decode(**sampling):
        params = SamplingParams(max_tokens=16, ignore_eos=True, **sampling)
        [result] = engine.generate([GenerationRequest(prompt_ids=prompt, params=params)])
        return result.token_ids

    free = decode()
    first = tiny_tokenizer.decode([free[0]]).strip()
    later = next(tiny_tokenizer.decode([t]).strip() for t in free[1:] if t != free[0])
    guarded = decode(no_openings=[first])
    assert guarded[0] != free[0]
    assert decode(no_openings=[later]) == free
