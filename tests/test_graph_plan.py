"""The plan DAG: structural checks, layers, repair and the fallback verdict. No model needed."""
from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from graph.plan import Plan, PlanNode, ProblemKind, repair
from graph.plan_format import format_plan, parse_plan

K = ProblemKind


def plan_of(*nodes: tuple[int, str, list[int]]) -> Plan:
    return Plan(question="Q?", nodes=[PlanNode(id=i, text=t, depends_on=d) for i, t, d in nodes])


def diamond() -> Plan:
    return plan_of((1, "a", []), (2, "b", [1]), (3, "c", [1]), (4, "d", [2, 3]))


def kinds(plan: Plan, **kwargs) -> list[tuple[ProblemKind, int | None]]:
    return [(p.kind, p.node_id) for p in plan.validate_structure(**kwargs)]


def test_diamond_is_valid_and_has_three_layers():
    plan = diamond()
    assert plan.validate_structure() == []
    assert plan.levels() == [[1], [2, 3], [4]]
    assert plan.critical_path_length() == 3
    assert plan_of((1, "a", []), (2, "b", []), (3, "c", [])).critical_path_length() == 1


def test_ready_returns_undone_nodes_whose_parents_are_done_in_plan_order():
    plan = diamond()
    assert plan.ready(set()) == [1]
    assert plan.ready({1}) == [2, 3]
    assert plan.ready({1, 3}) == [2]
    assert plan.ready({1, 2, 3}) == [4]
    assert plan.ready({1, 2, 3, 4}) == []


@pytest.mark.parametrize(
    "plan, expected",
    [
        (plan_of((1, "a", []), (2, "b", [2])), [(K.SELF_LOOP, 2)]),
        (plan_of((1, "a", []), (2, "b", [7])), [(K.UNKNOWN_DEPENDENCY, 2)]),
        (plan_of((1, "a", [2]), (2, "b", [])), [(K.FORWARD_REFERENCE, 1)]),
        (plan_of((1, "a", []), (1, "b", [])), [(K.DUPLICATE_ID, 1)]),
        (plan_of((1, "a", []), (2, "  ", [1])), [(K.EMPTY_TEXT, 2)]),
        (plan_of((1, "Why so?", []), (2, "why  SO", [])), [(K.DUPLICATE_TEXT, 2)]),
        (plan_of((1, "a", []), (2, "b", [1, 1])), [(K.DUPLICATE_DEPENDENCY, 2)]),
        (plan_of((1, "a", [])), [(K.TOO_FEW_NODES, None)]),
        (Plan(question="Q?"), [(K.TOO_FEW_NODES, None)]),
        (plan_of((1, "a", [2]), (2, "b", [1])), [(K.FORWARD_REFERENCE, 1), (K.CYCLE, 1)]),
    ],
    ids=["self-loop", "unknown", "forward", "dup-id", "empty", "dup-text", "dup-dep", "one", "none", "cycle"],
)
def test_each_problem_is_reported_on_its_node(plan, expected):
    assert kinds(plan) == expected


def test_too_many_nodes_uses_the_configured_limit():
    plan = plan_of(*[(i, f"step {i}", []) for i in range(1, 12)])
    assert kinds(plan) == [(K.TOO_MANY_NODES, None)]
    assert kinds(plan, max_nodes=11) == []
    assert [str(p) for p in plan.validate_structure(max_nodes=5)] == ["plan has 11 nodes; at most 5 are allowed"]


def test_problem_details_name_the_nodes_and_the_cycle_path():
    plan = plan_of((1, "a", [3]), (2, "b", [1]), (3, "c", [2]))
    assert [str(p) for p in plan.validate_structure()] == [
        "node 1 depends on 3, which comes later; only earlier nodes may be needed",
        "cycle: 1 -> 3 -> 2 -> 1 (each needs the next)",
    ]


def test_levels_refuses_plans_that_are_not_dags():
    with pytest.raises(ValueError, match=r"cycle among nodes \[1, 2\]"):
        plan_of((1, "a", [2]), (2, "b", [1])).levels()
    with pytest.raises(ValueError, match=r"unknown ids \[9\]"):
        plan_of((1, "a", []), (2, "b", [9])).levels()
    with pytest.raises(ValueError, match="duplicate ids"):
        plan_of((1, "a", []), (1, "b", [])).critical_path_length()


def test_node_ids_start_at_one():
    with pytest.raises(ValidationError):
        PlanNode(id=0, text="a")


def test_repair_fixes_a_messy_plan_and_says_what_it_changed():
    plan = plan_of(
        (1, "Find the area", []),
        (2, "Find the coverage", [2]),  # self-loop
        (2, "Count the litres", [1, 1]),  # reused id, repeated dependency
        (4, "", [1]),  # empty: dependants inherit its dependency on 1
        (5, "find the area.", [4]),  # repeats node 1
        (6, "Price the paint", [3, 5, 9]),  # 3 is later, 9 does not exist
        (3, "Add it up", [2, 4, 5, 6]),  # 2 names the first node written as 2
    )
    outcome = repair(plan)
    assert outcome.changes == [
        "node 2: removed dependency on itself",
        "node 2: removed repeated dependency on 1",
        "node 2: id already used, kept as a new node",
        "dropped node 4: empty text",
        "dropped node 5: repeats node 1",
        "node 6: removed dependency on 3, which comes later in the plan",
        "node 6: removed dependency on 9, which does not exist",
        "renumbered (written id->new id) 2->3, 6->4, 3->5",
    ]
    assert format_plan(outcome.plan) == (
        "1. Find the area [needs: none]\n"
        "2. Find the coverage [needs: none]\n"
        "3. Count the litres [needs: 1]\n"
        "4. Price the paint [needs: 1]\n"
        "5. Add it up [needs: 1, 2, 4]"
    )
    assert not outcome.fallback and outcome.plan.validate_structure() == []


def test_repair_breaks_cycles_by_dropping_references_to_later_nodes():
    outcome = repair(plan_of((1, "a", [3]), (2, "b", [1]), (3, "c", [2])))
    assert outcome.changes == ["node 1: removed dependency on 3, which comes later in the plan"]
    assert outcome.plan.levels() == [[1], [2], [3]]


def test_repair_of_a_valid_plan_changes_nothing():
    outcome = repair(diamond())
    assert outcome.changes == [] and outcome.plan == diamond() and outcome.fallback_reason is None


def test_repair_truncates_100_nodes_to_the_limit():
    plan = plan_of(*[(i, f"step {i}", [i - 1] if i > 1 else []) for i in range(1, 101)])
    outcome = repair(plan)
    assert len(outcome.plan.nodes) == 10
    assert outcome.plan.nodes[-1] == PlanNode(id=10, text="step 10", depends_on=[9])
    assert outcome.changes == ["dropped 90 node(s) past the limit of 10"]
    assert [n.id for n in repair(plan, max_nodes=3).plan.nodes] == [1, 2, 3]
    with pytest.raises(ValueError, match="max_nodes must be at least 2, got 1"):
        repair(plan, max_nodes=1)


ONE_NODE = "fallback to plain decoding: only 1 usable node, nothing to decode in parallel"


@pytest.mark.parametrize(
    "plan, reason",
    [
        (Plan(question="Q?"), "fallback to plain decoding: no plan lines could be parsed"),
        (plan_of((1, "", []), (2, " ", [])), "fallback to plain decoding: no usable node survived repair"),
        (plan_of((1, "a", [])), ONE_NODE),
        (plan_of((1, "Same", []), (2, "same?", [1])), ONE_NODE),
    ],
    ids=["nothing", "all-empty", "one", "duplicates"],
)
def test_unusable_plans_get_a_fallback_verdict(plan, reason):
    outcome = repair(plan)
    assert outcome.fallback and outcome.fallback_reason == reason


def test_garbage_text_parses_to_nothing_and_falls_back():
    plan = parse_plan("Q?", "Sure! Here is how I would think about it.\n{\"steps\": [\n  {\"q\": \"why\"")
    assert plan.nodes == []
    assert repair(plan).fallback_reason == "fallback to plain decoding: no plan lines could be parsed"


def test_every_repaired_random_plan_is_valid_or_a_fallback():
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "", "Alpha", "delta"]
    for _ in range(300):
        nodes = [
            PlanNode(id=rng.randint(1, 14), text=rng.choice(words) + rng.choice(["", " x", " y", " z"]),
                     depends_on=[rng.randint(1, 14) for _ in range(rng.randint(0, 3))])
            for _ in range(rng.randint(0, 14))
        ]
        outcome = repair(Plan(question="Q?", nodes=nodes))
        if outcome.fallback:
            assert len(outcome.plan.nodes) < 2
        else:
            assert outcome.plan.validate_structure() == [], nodes
            assert [n.id for n in outcome.plan.nodes] == list(range(1, len(outcome.plan.nodes) + 1))
