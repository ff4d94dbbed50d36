"""The plan line format: writing it, reading single lines leniently, and streaming parsing."""
from __future__ import annotations

import pytest

from graph.plan import Plan, PlanNode, repair
from graph.plan_format import StreamingPlanParser, format_plan, parse_plan, parse_plan_line

PLAN = Plan(
    question="Q?",
    nodes=[
        PlanNode(id=1, text="How big is the wall?", depends_on=[]),
        PlanNode(id=2, text="How far does a litre go?", depends_on=[]),
        PlanNode(id=3, text="How many litres are needed?", depends_on=[1, 2]),
    ],
)

# a messy plan as a small model writes it: preamble, odd numbering, CRLF, garbage, then an end
# marker followed by text that must be ignored
MESSY = (
    "Sure, here is a plan:\r\n"
    "1. How big is the wall? [needs: none]\r\n"
    "2)   How far does   a litre go?   needs: none\n"
    "I think that covers it\n"
    "Step 3: How many litres are needed? [needs: 1, 2].\n"
    "**4.** Price it [needs: 3\n"
    "\n"
    "5. This comes after the end marker [needs: 4]\n"
)
MESSY_NODES = [
    PlanNode(id=1, text="How big is the wall?", depends_on=[]),
    PlanNode(id=2, text="How far does a litre go?", depends_on=[]),
    PlanNode(id=3, text="How many litres are needed?", depends_on=[1, 2]),
    PlanNode(id=4, text="Price it", depends_on=[3]),
]


def test_format_plan_writes_one_line_per_node_with_needs_last():
    assert format_plan(PLAN) == (
        "1. How big is the wall? [needs: none]\n"
        "2. How far does a litre go? [needs: none]\n"
        "3. How many litres are needed? [needs: 1, 2]"
    )


def test_formatted_plan_parses_back_to_the_same_nodes():
    assert parse_plan("Q?", format_plan(PLAN)) == PLAN


@pytest.mark.parametrize(
    "line, expected",
    [
        ("3. Use both [needs: 1, 2]", (3, "Use both", [1, 2])),
        ("  3.   Use   both    [needs:1,2]  ", (3, "Use both", [1, 2])),
        ("3) Use both [needs: none]", (3, "Use both", [])),
        ("Step 3: Use both needs: 1 and 2", (3, "Use both", [1, 2])),
        ("3. Use both [needs: 1, 2", (3, "Use both", [1, 2])),
        ("3. Use both [1, 2]", (3, "Use both", [1, 2])),
        ("3. Use both (needs: 2)", (3, "Use both", [2])),
        ("3. Use both [needs: 2].", (3, "Use both", [2])),
        ("3. Use both,", (3, "Use both", [])),
        ("3. What does a plant need? [needs: none]", (3, "What does a plant need?", [])),
        ("3. What a plant needs to grow [needs: 1]", (3, "What a plant needs to grow", [1])),
        ("3. Compare (cost and time)", (3, "Compare (cost and time)", [])),
        ("- **3.** **Use both** [needs: 1]", (3, "Use both", [1])),
        ("3. [needs: 1]", (3, "", [1])),
        ("3. Use both [needs: 3]", (3, "Use both", [3])),  # a self-loop is read as written
        ("Here is the plan:", None),
        ("10 apples fall", None),
        ("0. Nothing", None),
        ("", None),
    ],
)
def test_parse_plan_line_is_lenient(line, expected):
    node = parse_plan_line(line)
    if expected is None:
        assert node is None
    else:
        assert (node.id, node.text, node.depends_on) == expected


def test_streaming_parser_reads_a_messy_plan_and_stops_at_the_blank_line():
    parser = StreamingPlanParser()
    assert parser.feed(MESSY) == MESSY_NODES
    assert parser.finished
    assert parser.skipped == ["Sure, here is a plan:\r", "I think that covers it"]
    assert parser.feed("6. More [needs: none]\n") == [] and parser.close() == []


def test_streaming_one_character_at_a_time_gives_the_same_nodes_as_all_at_once():
    whole = parse_plan("Q?", MESSY).nodes
    parser = StreamingPlanParser()
    emitted_at: list[int] = []
    nodes = []
    for i, char in enumerate(MESSY):
        new = parser.feed(char)
        nodes += new
        emitted_at += [i] * len(new)
    nodes += parser.close()
    assert nodes == whole == MESSY_NODES
    # each node is emitted exactly when the newline ending its line arrives (lines 2, 3, 5 and 6)
    newlines = [i for i, c in enumerate(MESSY) if c == "\n"]
    assert emitted_at == [newlines[1], newlines[2], newlines[4], newlines[5]]


def test_blank_lines_before_any_node_do_not_end_the_plan():
    parser = StreamingPlanParser()
    assert parser.feed("\n\nPlan:\n\n1. a [needs: none]\n") == [PlanNode(id=1, text="a")]
    assert not parser.finished


def test_close_flushes_an_unterminated_last_line():
    parser = StreamingPlanParser()
    assert parser.feed("1. a [needs: none]\n2. b [needs: 1]") == [PlanNode(id=1, text="a")]
    assert parser.close() == [PlanNode(id=2, text="b", depends_on=[1])]
    assert parser.finished


def test_a_truncated_last_line_is_dropped_when_the_stream_was_cut():
    parser = StreamingPlanParser()
    parser.feed("1. a [needs: none]\n2. b [needs: none]\n3. Compare a with")
    assert parser.close(truncated=True) == []
    assert [n.id for n in parser.nodes] == [1, 2]
    assert parser.skipped == ["3. Compare a with"]
    assert parse_plan("Q?", "1. a\n2. b\n3. Compare a with", truncated=True).nodes[-1].id == 2


def test_truncation_after_a_complete_line_loses_nothing():
    parser = StreamingPlanParser()
    parser.feed("1. a [needs: none]\n2. b [needs: 1]\n")
    assert parser.close(truncated=True) == [] and len(parser.nodes) == 2 and parser.skipped == []


def test_a_runaway_plan_of_100_lines_parses_fully_and_repair_keeps_ten():
    text = "".join(f"{i}. Step number {i} [needs: {i - 1 if i > 1 else 'none'}]\n" for i in range(1, 101))
    plan = parse_plan("Q?", text)
    assert len(plan.nodes) == 100 and plan.nodes[99] == PlanNode(id=100, text="Step number 100", depends_on=[99])
    outcome = repair(plan)
    assert [n.id for n in outcome.plan.nodes] == list(range(1, 11)) and not outcome.fallback


def test_json_style_output_from_a_small_model_yields_no_nodes():
    parser = StreamingPlanParser()
    junk = '{"plan": [{"question": "why", "sub": [{"question": "how", "sub": ['
    assert parser.feed(junk + "\n" + junk) == [] and parser.close() == []
    assert parser.nodes == [] and len(parser.skipped) == 2
