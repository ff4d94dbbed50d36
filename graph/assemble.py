"""Turns the answers of a plan's nodes into the one answer the user reads, in plan order."""
from __future__ import annotations

import re

from graph.plan import Plan, PlanNode, text_key

_RUNS_OF_SPACES = re.compile(r"(?<=\S)[ \t]{2,}")
_BLANK_LINES = re.compile(r"\n{3,}")


def clean_answer(answer: str, node: PlanNode, question: str) -> str:
    """A node's answer with spacing tidied and without what merely echoes the prompt: a leading
    "Step N:" or "N." label, "Answer:", and leading text that restates the step or the question.
    Empty when nothing else is left."""
    lines = [_RUNS_OF_SPACES.sub(" ", line).rstrip() for line in answer.replace("\r", "").split("\n")]
    text = _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()
    label = rf"^(?:\*\*)?(?:step\s*{node.id}\s*[.:)]|{node.id}\.\s|answer\s*:)(?:\*\*)?\s*"
    text = re.sub(label, "", text, flags=re.IGNORECASE)
    echoes = [e for e in (node.text.strip(), question.strip()) if e]
    changed = True
    while text and changed:
        changed = False
        first, _, rest = text.partition("\n")
        if text_key(first.replace("**", "").lstrip("# ")) in {text_key(e) for e in echoes}:
            text, changed = rest.strip(), True
            continue
        for echo in echoes:
            # only a whole sentence that repeats it: "Travel is fun" must survive a step named "Travel"
            repeated = re.match(re.escape(echo.rstrip(".?!:")) + r"\s*[.?!:]+(?:\s+|$)", text, re.IGNORECASE)
            if repeated:
                text, changed = text[repeated.end():].strip(), True
    return text


def _lead(text: str) -> str:
    text = text.strip()
    return text if text.endswith((".", "?", "!", ":")) else text + "."


def assemble_answer(plan: Plan, answers: dict[int, str], reasons: dict[int, str] | None = None) -> str:
    """One paragraph per node in plan order, each led by its sub-question in bold. A node without
    a usable answer shows `[not answered: <reason>]`, the reason taken from `reasons` when given."""
    reasons = reasons or {}
    paragraphs = []
    for node in plan.nodes:
        body = clean_answer(answers[node.id], node, plan.question) if node.id in answers else ""
        if not body:
            if node.id in answers:
                why = "the answer only repeated the question"
            else:
                why = reasons.get(node.id, "no answer")
            body = f"[not answered: {why}]"
        paragraphs.append(f"**{_lead(node.text)}** {body}")
    return "\n\n".join(paragraphs)
