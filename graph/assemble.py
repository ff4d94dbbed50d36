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


def node_paragraph(node: PlanNode, answers: dict[int, str], reasons: dict[int, str], question: str) -> str:
    """One node's paragraph of the answer, led by its sub-question in bold."""
    body = clean_answer(answers[node.id], node, question) if node.id in answers else ""
    if not body:
        why = "the answer only repeated the question" if node.id in answers else reasons.get(node.id, "no answer")
        body = f"[not answered: {why}]"
    return f"**{_lead(node.text)}** {body}"


def assemble_answer(plan: Plan, answers: dict[int, str], reasons: dict[int, str] | None = None) -> str:
    """One paragraph per node in plan order, each led by its sub-question in bold. A node without
    a usable answer shows `[not answered: <reason>]`, the reason taken from `reasons` when given."""
    return "\n\n".join(node_paragraph(node, answers, reasons or {}, plan.question) for node in plan.nodes)


def settled_text(plan: Plan, answers: dict[int, str], reasons: dict[int, str]) -> str:
    """The start of `assemble_answer` that no later answer can change: the paragraphs of the leading
    nodes, in plan order, that are answered or failed (`plan` complete). A streamed planned answer sends
    it as it grows; once every node is settled it is the whole answer."""
    paragraphs = []
    for node in plan.nodes:
        if node.id not in answers and node.id not in reasons:
            break
        paragraphs.append(node_paragraph(node, answers, reasons, plan.question))
    return "\n\n".join(paragraphs)
