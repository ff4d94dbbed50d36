"""Turns the answers of a plan's nodes into the one answer the user reads, in plan order."""
from __future__ import annotations

import re

from graph.plan import Plan, PlanNode, text_key

_RUNS_OF_SPACES = re.compile(r"(?<=\S)[ \t]{2,}")
_BLANK_LINES = re.compile(r"\n{3,}")
LABEL_CHARS = 24  # a start shorter than this, on one line, may still grow into a label ("**Step 12:**")


def clean_answer(answer: str, node: PlanNode, question: str, head_done: bool = False) -> str:
    """A node's answer with spacing tidied and without what merely echoes the prompt: a leading
    "Step N:" or "N." label, "Answer:", and leading text that restates the step or the question.
    Empty when nothing else is left. `head_done`: the answer's start is cleaned already (it went on
    from a start a client has, see `stable_body`): spacing only."""
    lines = [_RUNS_OF_SPACES.sub(" ", line).rstrip() for line in answer.replace("\r", "").split("\n")]
    text = _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()
    if head_done:
        return text
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


def stable_body(answer_so_far: str, node: PlanNode, question: str, head_done: bool = False) -> str:
    """The start of a node's cleaned answer that no continuation of `answer_so_far` can change: ""
    while its start may still be a label or an echo of the step or the question, else its cleaned
    text so far. A streamed answer sends it before the node is done."""
    body = clean_answer(answer_so_far, node, question, head_done)
    if head_done or not body:
        return body
    raw = answer_so_far.replace("\r", "").strip()
    if len(raw) < LABEL_CHARS and "\n" not in raw:
        return ""
    if "\n" in body:  # its first line is whole, and was checked whole
        return body
    line = text_key(body.replace("*", "").lstrip("# "))  # any "*" may yet be half of a "**" the check drops
    for echo in (e for e in (node.text.strip(), question.strip()) if e):
        sentence = echo.rstrip(".?!:").lower()
        if text_key(echo).startswith(line) or sentence.startswith(body.lower()):
            return ""  # the line may yet be the echo, whole or as a sentence
    return body


def _lead(text: str) -> str:
    text = text.strip()
    return text if text.endswith((".", "?", "!", ":")) else text + "."


def node_paragraph(node: PlanNode, answers: dict[int, str], reasons: dict[int, str], question: str,
                   heads: set[int] = frozenset()) -> str:
    """One node's paragraph of the answer, led by its sub-question in bold (`heads`: the nodes whose
    answers' starts are cleaned already, see `clean_answer`)."""
    body = clean_answer(answers[node.id], node, question, node.id in heads) if node.id in answers else ""
    if not body:
        why = "the answer only repeated the question" if node.id in answers else reasons.get(node.id, "no answer")
        body = f"[not answered: {why}]"
    return f"{paragraph_head(node)}{body}"


def paragraph_head(node: PlanNode) -> str:
    return f"**{_lead(node.text)}** "


def assemble_answer(plan: Plan, answers: dict[int, str], reasons: dict[int, str] | None = None,
                    heads: set[int] = frozenset()) -> str:
    """One paragraph per node in plan order, each led by its sub-question in bold. A node without
    a usable answer shows `[not answered: <reason>]`, the reason taken from `reasons` when given."""
    return "\n\n".join(node_paragraph(node, answers, reasons or {}, plan.question, heads) for node in plan.nodes)


def settled_text(plan: Plan, answers: dict[int, str], reasons: dict[int, str], heads: set[int] = frozenset(),
                 partials: dict[int, str] | None = None) -> tuple[str, PlanNode | None]:
    """The start of `assemble_answer` that no later answer can change (`plan` as far as it is known;
    nodes only ever come after it), and the first node not settled (None when all known ones are): the
    paragraphs of the leading nodes, in plan order, that are answered or failed, then that next node's
    bold lead, whatever its answer will be, and its answer so far (`partials`) up to its stable start.
    A streamed planned answer sends it as it grows."""
    paragraphs, partials = [], partials or {}
    for node in plan.nodes:
        if node.id not in answers and node.id not in reasons:
            body = stable_body(partials[node.id], node, plan.question, node.id in heads) if node.id in partials else ""
            paragraphs.append(paragraph_head(node) + body)
            return "\n\n".join(paragraphs), node
        paragraphs.append(node_paragraph(node, answers, reasons, plan.question, heads))
    return "\n\n".join(paragraphs), None
