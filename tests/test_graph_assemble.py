"""Answer assembly: node answers become one answer in plan order, tidied, with clear markers."""
from __future__ import annotations

from graph.assemble import assemble_answer, clean_answer
from graph.plan import PlanNode
from graph.plan_format import parse_plan

QUESTION = "How much paint do I need for my bedroom?"
PLAN = parse_plan(
    QUESTION,
    "1. What is the wall area? [needs: none]\n2. How far does a litre go? [needs: none]\n"
    "3. Litres for two coats [needs: 1, 2]\n4. What does it cost? [needs: 3]",
)


def test_assembly_in_plan_order_with_leads_tidied_answers_and_markers():
    answers = {
        3: "How much paint do I need for my bedroom? Two coats need   8 litres.",  # restates the question
        1: "What is the wall area?\n\nAbout 40 square metres.\n\n\n\nThat is a typical room.   ",
        2: "Step 2: One litre covers about 10 square metres.",
    }
    assert assemble_answer(PLAN, answers, {4: "ran past its budget of 5s"}) == (
        "**What is the wall area?** About 40 square metres.\n"
        "\n"
        "That is a typical room.\n"
        "\n"
        "**How far does a litre go?** One litre covers about 10 square metres.\n"
        "\n"
        "**Litres for two coats.** Two coats need 8 litres.\n"
        "\n"
        "**What does it cost?** [not answered: ran past its budget of 5s]"
    )


def test_missing_and_echo_only_answers_are_marked():
    answers = {1: "  What is the wall area?  ", 2: "x", 3: "y"}
    text = assemble_answer(PLAN, answers)
    assert text.startswith("**What is the wall area?** [not answered: the answer only repeated the question]")
    assert text.endswith("**What does it cost?** [not answered: no answer]")


def test_clean_answer_keeps_text_that_only_starts_like_the_step():
    node = PlanNode(id=2, text="Travel")
    assert clean_answer("Travel is a good reason.", node, "Why?") == "Travel is a good reason."
    assert clean_answer("Travel. People like to see places.", node, "Why?") == "People like to see places."
    assert clean_answer("2. People like   to see places.", node, "Why?") == "People like to see places."
    assert clean_answer("1. First\n2. Second", node, "Why?") == "1. First\n2. Second"


def test_a_stable_start_is_never_taken_back_by_what_follows():
    """Streamed, a node's paragraph goes out as `stable_body` grows: whatever is written next, the
    cleaned answer must start with each stable start sent before. Answers are drawn from the pieces
    cleaning reacts to (labels, echoes of the step and the question, spacing, bold) and cut anywhere."""
    import random

    from graph.assemble import stable_body

    node = PlanNode(id=2, text="How far does a litre go?")
    pieces = ["Step 2:", "2. ", "Answer:", "**", "How far does a litre go?", "How far does a litre go",
              QUESTION, "How much paint", " ", "  ", "\t", "\n", "\n\n\n", ".", "?", ": ", "# ", "One litre",
              " covers about ten square metres", "Travel", "It depends.", " on the wall", "\r\n"]
    rng = random.Random(7)
    checked = 0
    for _ in range(3000):
        answer = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 12)))
        final = clean_answer(answer, node, QUESTION)
        for cut in range(len(answer) + 1):
            start = stable_body(answer[:cut], node, QUESTION)
            assert final.startswith(start), (answer, cut, start, final)
            checked += bool(start)
    assert checked > 10_000  # most cuts do send something


def test_a_stable_start_waits_while_the_answer_may_still_be_a_label_or_an_echo():
    from graph.assemble import stable_body

    node = PlanNode(id=2, text="How far does a litre go?")
    assert stable_body("Step 2", node, QUESTION) == ""  # a label, perhaps
    assert stable_body("How far does a litre", node, QUESTION + " and so on") == ""  # the step, perhaps
    assert stable_body("How much paint do I need for my", node, QUESTION) == ""  # the question, perhaps
    assert stable_body("One litre covers about ten square", node, QUESTION) == "One litre covers about ten square"
    assert stable_body("Step 2: One litre covers about ten", node, QUESTION) == "One litre covers about ten"
    assert stable_body("How far does a litre go?\nOne litre", node, QUESTION) == "One litre"  # the echo line dropped
    assert stable_body("How far does a litre go? One litre covers", node, QUESTION) == "One litre covers"
