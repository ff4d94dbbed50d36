"""Where a sentence ends, for answers that wrap up at one (engine.sentences)."""
from __future__ import annotations

import pytest

from engine.sentences import sentence_end


@pytest.mark.parametrize(("text", "since", "end"), [
    ("It works. Next", 9, 9),
    ("It works.\nNext", 9, 9),
    ("Wait! What? Yes", 6, 11),  # the first end whose space is at `since` or later
    ("Done. Next step. And", 12, 16),
    ('He said "yes." Then', 14, 14),  # closing quotes and bold stay with the sentence
    ("It is **bold.** Then", 15, 15),
    ("It works.", 9, None),  # no space yet: the sentence may go on ("works.com")
    ("Step 1. Do it", 7, None),  # a list's number is not a sentence
    ("See e.g. this", 8, None),  # nor an abbreviation's one-letter part
    ("It works. Next", 12, None),  # ended before `since`
])
def test_a_sentence_ends_at_punctuation_after_a_word_then_whitespace(text, since, end):
    assert sentence_end(text, since) == end
