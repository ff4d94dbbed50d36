"""Where a sentence ends in generated text, for an answer that wraps up at a sentence end near its
budget (`SamplingParams.wrap_up_tokens`) rather than stopping in the middle of one."""
from __future__ import annotations

import re

# punctuation after a word of two letters or more (so not a list's "1." nor the "g." of "e.g."), then any
# closing quotes, brackets or bold, then whitespace
_SENTENCE_END = re.compile(r"(?<=[A-Za-z]{2})[.!?]+[\"')\]*]*(?=\s)")


def sentence_end(text: str, since: int) -> int | None:
    """The index just past the first sentence end in `text` whose following whitespace is at `since` or
    later (where the newest tokens' text starts), or None. Lookbehind sees the text before the search start."""
    for match in _SENTENCE_END.finditer(text, max(0, since - 8)):
        if match.end() >= since:
            return match.end()
    return None
