"""The line format the model writes a plan in, and the parsers that read it, whole or streaming.

One node per line, dependencies last, always written out:

    1. How large is the wall area to paint? [needs: none]
    2. How much area does a litre of paint cover? [needs: none]
    3. How many litres do two coats take? [needs: 1, 2]

The plan ends at the first blank line after a node (or when the text ends).

Why this shape:
- One line per node lets a streaming parser hand each node over the moment its newline arrives,
  so its decoding can start while the rest of the plan is still being written.
- The id comes first, so when a constrained decoder reaches the dependency list it already knows
  which ids are allowed (only those below the line's own): self-loops, forward references and
  cycles can be made impossible rather than repaired.
- Dependencies come last: the model first writes what the step asks (which usually mentions what
  it builds on), then names the steps it needs, conditioned on that text. "needs" is a plain
  English word a 135M model already associates with "this uses that".
- `[needs: none]` is written even for roots, so every line has one fixed shape for a grammar:
  `<id>. <text without '[' or newline> [needs: <none | ids>]` and a newline. The '[' ends the
  free text, the ']' ends the line, and a grammar can force '[' after a token budget.
- A blank line as the end marker costs the model nothing (lists end that way anyway) and is a
  natural engine stop string ("\\n\\n"), so a model that rambles after its plan is cut off.

The parser is lenient, because small models drift: extra spaces, `3)` or `Step 3:`, a missing
bracket (`needs: 1, 2` or `[needs: 1, 2`), `[1, 2]` without the word, `needs: none`, no
dependency list at all (read as none), markdown bold, and punctuation after the bracket are all
accepted. Lines that do not start with a number are skipped (preambles, commentary).
"""
from __future__ import annotations

import re

from graph.plan import Plan, PlanNode

_NUMBERED = re.compile(
    r"^\s*(?:[-*>#]+\s*)?(?:\*\*)?\s*(?:step\s*)?(?P<id>\d{1,4})\s*(?:\*\*)?\s*[.):\-]\s*(?P<rest>.*)$",
    re.IGNORECASE,
)
# the dependency list at the end of a line, with or without its brackets or keyword
_NEEDS = re.compile(
    r"(?:\[\s*(?:needs?\s*:?)?(?P<a>[^\[\]]*?)\]?"
    r"|\(\s*needs?\s*:?(?P<b>[^()]*?)\)?"
    r"|\bneeds?\s*:(?P<c>[^\[\]()]*?))$",
    re.IGNORECASE,
)
_DEP_LIST = re.compile(r"^\s*(?:none|nothing|no|-)?\s*$|^\s*\d+(?:\s*(?:,|&|and|\s)\s*\d+)*\s*$", re.IGNORECASE)


def format_node(node: PlanNode) -> str:
    """One node as a plan line, without the newline."""
    needs = ", ".join(map(str, node.depends_on)) or "none"
    return f"{node.id}. {node.text} [needs: {needs}]"


def format_plan(plan: Plan) -> str:
    """The plan in the line format, one node per line, no trailing newline or end marker."""
    return "\n".join(format_node(node) for node in plan.nodes)


def parse_plan_line(line: str) -> PlanNode | None:
    """Read one plan line leniently; None when it is not a numbered line (or is numbered 0).

    A line whose text is empty still gives a node (with empty text), so that repair can drop it
    and rewrite the dependencies that point at it."""
    match = _NUMBERED.match(line.replace("\r", ""))
    if match is None or int(match["id"]) < 1:
        return None
    rest = match["rest"].strip().rstrip(".,;:! ").strip()
    depends_on: list[int] = []
    needs = _NEEDS.search(rest)
    if needs is not None:
        listed = next(g for g in needs.groups() if g is not None)
        if _DEP_LIST.match(listed):
            depends_on = [int(d) for d in re.findall(r"\d+", listed)]
            rest = rest[: needs.start()]
    text = " ".join(rest.replace("**", "").split()).rstrip(",;: ")
    return PlanNode(id=int(match["id"]), text=text, depends_on=depends_on)


class StreamingPlanParser:
    """Turns plan text arriving in pieces into nodes, each as soon as its line is complete.

    `feed` returns the nodes whose lines the new text completed; `close` returns the last line's
    node when the stream ends without a newline. `finished` becomes True at the end marker (a blank
    line after at least one node) or at `close`; text fed after that is ignored. Non-plan lines
    are kept in `skipped`. Feeding the same text in any split gives the same nodes."""

    def __init__(self) -> None:
        self.nodes: list[PlanNode] = []
        self.skipped: list[str] = []
        self.finished = False
        self._buffer = ""

    def feed(self, text_delta: str) -> list[PlanNode]:
        """Add streamed text; the nodes whose lines it completed, in order."""
        if self.finished:
            return []
        self._buffer += text_delta
        emitted: list[PlanNode] = []
        while not self.finished and "\n" in self._buffer:
            line, self._buffer = self._buffer.split("\n", 1)
            emitted.extend(self._take(line))
        return emitted

    def close(self, truncated: bool = False) -> list[PlanNode]:
        """End of stream: parse the unterminated last line, unless the stream was `truncated`
        (cut by a token limit), in which case that line is incomplete and is skipped."""
        if self.finished:
            return []
        line, self._buffer = self._buffer, ""
        emitted: list[PlanNode] = []
        if truncated and line.strip():
            self.skipped.append(line)
        else:
            emitted = self._take(line)
        self.finished = True
        return emitted

    def _take(self, line: str) -> list[PlanNode]:
        if not line.strip():
            self.finished = bool(self.nodes)
            return []
        node = parse_plan_line(line)
        if node is None:
            self.skipped.append(line)
            return []
        self.nodes.append(node)
        return [node]


def parse_plan(question: str, text: str, truncated: bool = False) -> Plan:
    """A whole plan text parsed at once (as streaming would), not yet validated or repaired."""
    parser = StreamingPlanParser()
    parser.feed(text)
    parser.close(truncated=truncated)
    return Plan(question=question, nodes=parser.nodes)
