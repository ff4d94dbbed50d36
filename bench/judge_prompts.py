"""The pairwise judge's prompts and the reader of its verdict.

The protocol is MT-bench's pairwise comparison (FastChat llm_judge "pair-v2"); the wording here
is this project's own. A verdict is "A", "B" or "tie", as the judge labelled the answers shown.
"""
from __future__ import annotations

import re
from typing import Literal

Verdict = Literal["A", "B", "tie"]

SYSTEM = """You are an impartial judge comparing two AI assistants' answers to the same user question.
Decide which answer serves the user better. Weigh helpfulness, relevance, accuracy, depth and
coherence. The order in which the answers are shown is arbitrary: it must not sway you. A longer
answer is not a better one unless the extra length adds value; a cut-off or repetitive answer loses
credit for what is missing or repeated. Do not favour an assistant for its name.

First compare the two answers in a few sentences (under 150 words). Then, on the last line, give
your verdict in exactly this format: [[A]] if Assistant A's answer is better, [[B]] if Assistant
B's answer is better, [[C]] if they are equally good."""

USER = """User question:
{question}

[Assistant A's answer begins]
{first}
[Assistant A's answer ends]

[Assistant B's answer begins]
{second}
[Assistant B's answer ends]

Compare the two answers, then end with [[A]], [[B]] or [[C]]."""


def judge_messages(question: str, first: str, second: str) -> list[dict]:
    """The chat messages asking to compare `first` (shown as Assistant A) with `second` (Assistant B)."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": USER.format(question=question, first=first.strip(), second=second.strip())},
    ]


_LABEL = {"a": "A", "b": "B", "c": "tie", "tie": "tie"}
_STRICT = re.compile(r"\[\[\s*(a|b|c|tie)\s*\]\]", re.IGNORECASE)
_SINGLE = re.compile(r"(?<!\[)\[\s*(a|b|c|tie)\s*\](?!\])", re.IGNORECASE)
_FINAL_LINE = re.compile(
    r"^(?:(?:final\s+)?(?:verdict|answer|winner|decision)\s*(?:is)?\s*[:\-]?\s*)?"
    r"(?:assistant\s+)?(a|b|c|tie)(?:\s+is\s+better)?$",
    re.IGNORECASE,
)
_PREFERENCE = re.compile(
    r"\bassistant\s+(a|b)(?:'s\s+(?:answer|response))?\s+(?:is\s+(?:better|superior|the\s+better)|wins)\b",
    re.IGNORECASE,
)


def _one(matches: list[str]) -> Verdict | None:
    verdicts = {_LABEL[m.lower()] for m in matches}
    return verdicts.pop() if len(verdicts) == 1 else None


def parse_verdict(reply: str) -> Verdict | None:
    """The verdict in a judge's reply, or None when there is none or it contradicts itself.

    Read in tiers; the first tier that finds anything decides, and if what it finds disagrees
    (say both [[A]] and [[B]], as when a weak judge repeats the instructions) the reply is
    unparsed rather than guessed:

    1. the asked-for marks `[[A]]`, `[[B]]`, `[[C]]` (or `[[tie]]`), any case, spaces inside allowed;
    2. single brackets: `[A]`, `[B]`, `[C]`, `[tie]`;
    3. a last non-empty line that is only a verdict, markdown `*`/`#`/`` ` `` and trailing `.`/`!`
       stripped: `A`, `B`, `C`, `tie`, `Assistant A`, `Verdict: B`, `Final verdict: tie`,
       `Assistant B is better`;
    4. a stated preference anywhere: `Assistant A is better`, `Assistant B's answer is superior`,
       `Assistant A wins`.

    C and tie both mean a tie."""
    for pattern in (_STRICT, _SINGLE):
        found = pattern.findall(reply)
        if found:
            return _one(found)
    lines = [line for line in reply.splitlines() if line.strip()]
    if lines:
        last = re.sub(r"[*#`]", "", lines[-1]).strip().rstrip(".!").strip()
        final = _FINAL_LINE.match(last)
        if final:
            return _one([final.group(1)])
    found = _PREFERENCE.findall(reply)
    return _one(found) if found else None
