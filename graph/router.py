"""The `auto` mode's router: does planning pay off for this question?

Planning helps answers made of several separable parts (advice, explanations, comparisons,
what-ifs). It hurts where the answer is one chain (code, arithmetic, estimates), one voice
(role-play) or one document in a given form (letters, emails, reviews), and it is wasted on short
facts. A few word rules capture that with no model call, so routing costs nothing; a learned
router (SoT-R trained one on LIMA) can replace `route` behind the same signature.
"""
from __future__ import annotations

import re
from typing import Literal

_CODE = re.compile(
    r"\b(program|function|implement|algorithm|code|python|c\+\+|java(script)?|sql|regex|regular expression|"
    r"data structure|compile|debug)\b", re.I)
_MATH = re.compile(r"(\d\s*[-+*/^=]\s*\d|\bf\(x\)|\bsolve\b|\bcalculate\b|\bequation\b|\bhow many\b|\bhow much\b)", re.I)
_NUMBER = re.compile(r"\d+(\.\d+)?")
_ROLEPLAY = re.compile(
    r"^(as an? |pretend|imagine you are|you are an? |if you were|now you are|suppose you are)|"
    r"\byou('| a)re an? \w+ (who|reaching)|\b(act as|(take on|assume|embrace|play) the (role|part)|"
    r"embody the persona|(imagine|picture) yourself as|role-?play)\b", re.I)
_WRITING = re.compile(
    r"\b(write|draft|compose|structure|craft|construct|edit|rewrite|paraphrase|proofread)\b.*\b(email|letter|"
    r"post|review|script|poem|story|essay|announcement|speech|proposal|paragraph|headline|title|slogan|tweet|"
    r"limerick|lyrics)\b", re.I)
# an answer in a set form or length: one piece to write, not parts to plan
_FORMAT = re.compile(r"\b(json|csv|yaml|xml)\b|\b(in|with) (fewer|less) than \w+ (words|sentences|lines|paragraphs)\b",
                     re.I)
_SHORT_FACT = re.compile(r"^(what|who|when|where|which)\b", re.I)

Route = Literal["ar", "plato"]


def route(question: str) -> tuple[Route, str]:
    """The mode for `question` and the rule that chose it."""
    text = question.strip()
    if _CODE.search(text):
        return "ar", "code"
    if _MATH.search(text) or len(_NUMBER.findall(text)) >= 2:
        return "ar", "math or estimate"
    if _ROLEPLAY.search(text):
        return "ar", "role-play"
    if _WRITING.search(text):
        return "ar", "a document to write"
    if _FORMAT.search(text):
        return "ar", "a set form or length"
    if _SHORT_FACT.search(text) and len(text.split()) <= 8:
        return "ar", "short fact"
    return "plato", "several separable parts"
