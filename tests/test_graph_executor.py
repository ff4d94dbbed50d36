"""The per-request DAG state machine: pipelined dispatch, waiting, failure, expiry and fallback."""
from __future__ import annotations

import pytest

from graph.executor import DagExecution, NodeStatus, NodeTiming
from graph.plan import PlanNode, repair
from graph.plan_format import parse_plan, parse_plan_line

DIAMOND = ["1. a [needs: none]", "2. b [needs: 1]", "3. c [needs: 1]", "4. d [needs: 2, 3]"]


class Clock:
    """A settable clock so times are exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def execution(**kwargs) -> tuple[DagExecution, Clock]:
    clock = Clock()
    return DagExecution("Q?", clock=clock, **kwargs), clock


def add(ex: DagExecution, line: str) -> PlanNode | None:
    return ex.add_node(parse_plan_line(line))


def ids(nodes: list[PlanNode]) -> list[int]:
    return [n.id for n in nodes]


def test_diamond_nodes_are_dispatched_as_soon_as_their_parents_are_answered():
    ex, _ = execution()
    add(ex, DIAMOND[0])
    assert ids(ex.dispatchable()) == [1]  # before the plan is complete: pipelining
    add(ex, DIAMOND[1])
    assert ids(ex.dispatchable()) == []  # its parent is still running
    ex.node_done(1, "A", 0.5)
    assert ids(ex.dispatchable()) == [2]
    assert ids(ex.dispatchable()) == []  # each node is handed out once
    add(ex, DIAMOND[2])
    assert ids(ex.dispatchable()) == [3]
    add(ex, DIAMOND[3])
    ex.node_done(2, "B", 0.5)
    assert ids(ex.dispatchable()) == []
    ex.node_done(3, "C", 0.5)
    assert ids(ex.dispatchable()) == [4]
    assert not ex.is_finished
    assert ex.plan_complete() is None
    ex.node_done(4, "D", 0.5)
    assert ex.is_finished and ex.answers == {1: "A", 2: "B", 3: "C", 4: "D"}
    assert ex.parent_answers(4) == {2: "B", 3: "C"}


def test_without_pipelining_nothing_starts_before_the_plan_is_complete():
    ex, _ = execution(pipelining=False)
    for line in DIAMOND:
        add(ex, line)
    assert ex.dispatchable() == []
    ex.plan_complete()
    assert ids(ex.dispatchable()) == [1]


def test_a_node_naming_a_later_id_waits_for_the_plan_then_runs_without_that_dependency():
    ex, _ = execution()
    add(ex, "1. a [needs: none]")
    assert ids(ex.dispatchable()) == [1]
    assert add(ex, "2. b [needs: 1, 3]") == PlanNode(id=2, text="b", depends_on=[1])
    ex.node_done(1, "A", 1.0)
    assert ex.dispatchable() == []  # 2 waits: id 3 is unknown so far
    add(ex, "3. c [needs: none]")
    assert ids(ex.dispatchable()) == [3]  # and 3 is later than 2, so 2 keeps waiting for the plan
    ex.plan_complete()
    assert ids(ex.dispatchable()) == [2]
    assert ex.changes == ["node 2: removed dependency on 3, which comes later in the plan"]


def test_a_node_naming_an_unknown_id_waits_then_runs_and_the_change_is_recorded():
    ex, _ = execution()
    add(ex, "1. a [needs: none]")
    add(ex, "2. b [needs: 7]")
    assert ids(ex.dispatchable()) == [1]
    ex.plan_complete()
    assert ids(ex.dispatchable()) == [2]
    assert ex.changes == ["node 2: removed dependency on 7, which does not exist"]


def test_streamed_nodes_are_repaired_like_a_whole_plan():
    text = (
        "1. a [needs: 1]\n2. b [needs: 1, 1]\n2. c [needs: 2]\n3. [needs: 1]\n"
        "4. A [needs: 3]\n5. d [needs: 4, 6, 9]\n6. e [needs: 3, 5]\n"
    )
    ex, _ = execution()
    for node in parse_plan("Q?", text).nodes:
        add(ex, format_line(node))
    ex.plan_complete()
    batch = repair(parse_plan("Q?", text))
    assert ex.plan == batch.plan and ex.changes == batch.changes


def format_line(node: PlanNode) -> str:
    return f"{node.id}. {node.text} [needs: {', '.join(map(str, node.depends_on)) or 'none'}]"


def test_failure_propagates_to_dependants_with_the_reason():
    ex, _ = execution()
    for line in DIAMOND:
        add(ex, line)
    ex.plan_complete()
    ex.dispatchable()
    ex.node_done(1, "A", 1.0)
    assert ids(ex.dispatchable()) == [2, 3]
    assert ex.node_failed(2, "decoder crashed") == [2, 4]
    assert ex.failures == {2: "decoder crashed", 4: "parent 2 failed: decoder crashed"}
    assert ex.status(3) is NodeStatus.RUNNING and not ex.is_finished
    ex.node_done(3, "C", 1.0)
    assert ex.dispatchable() == [] and ex.is_finished


def test_a_node_arriving_after_its_parent_failed_fails_at_once():
    ex, _ = execution()
    add(ex, "1. a [needs: none]")
    ex.dispatchable()
    ex.node_failed(1, "boom")
    add(ex, "2. b [needs: 1]")
    add(ex, "3. c [needs: none]")
    assert ex.status(2) is NodeStatus.FAILED and ex.failures[2] == "parent 1 failed: boom"
    assert ids(ex.dispatchable()) == [3]


def test_a_node_running_past_its_budget_fails_and_a_late_answer_is_discarded():
    ex, clock = execution(node_budget_s=5.0)
    for line in DIAMOND:
        add(ex, line)
    ex.plan_complete()
    ex.dispatchable()
    clock.now += 1.0
    ex.node_done(1, "A", 1.0)
    ex.dispatchable()  # 2 and 3 start at t=1
    clock.now += 2.0
    ex.node_done(3, "C", 2.0)
    assert ex.expire(clock.now + 2.9) == []
    assert ex.expire(clock.now + 3.0) == [2, 4]
    assert ex.failures[2] == "ran past its budget of 5s"
    assert ex.node_done(2, "late", 9.0) is False and 2 not in ex.answers
    assert ex.is_finished


def test_the_deadline_fails_everything_unfinished_and_closes_the_plan():
    ex, clock = execution(deadline=110.0)
    add(ex, DIAMOND[0])
    add(ex, DIAMOND[1])
    ex.dispatchable()
    assert ex.expire(109.9) == []
    assert ex.expire(110.0) == [1, 2]
    reason = "request deadline passed after 10.0s"
    assert ex.failures == {1: reason, 2: f"parent 1 failed: {reason}"}
    assert ex.is_finished and ex.fallback_reason is None
    assert add(ex, DIAMOND[2]) is None
    assert ex.changes[-1] == "ignored node 3: it arrived after the plan was complete"


def test_a_one_node_plan_falls_back_and_fails_what_was_started():
    ex, _ = execution()
    add(ex, "1. a [needs: none]")
    assert ids(ex.dispatchable()) == [1]
    reason = "fallback to plain decoding: only 1 usable node, nothing to decode in parallel"
    assert ex.plan_complete() == reason and ex.plan_complete() == reason
    assert ex.failures == {1: reason} and ex.is_finished


def test_an_empty_plan_falls_back():
    ex, _ = execution()
    assert ex.plan_complete() == "fallback to plain decoding: no plan lines could be parsed"
    assert ex.is_finished


def test_a_100_node_stream_keeps_the_first_ten():
    ex, _ = execution()
    kept = [add(ex, f"{i}. step {i} [needs: none]") for i in range(1, 101)]
    assert sum(k is not None for k in kept) == 10
    assert ex.plan_complete() is None
    assert ids(ex.dispatchable()) == list(range(1, 11))
    assert ex.changes == ["dropped 90 node(s) past the limit of 10"]


def test_timings_report_each_node_relative_to_the_start():
    ex, clock = execution()
    add(ex, "1. a [needs: none]")
    add(ex, "2. b [needs: 1]")
    ex.plan_complete()
    clock.now += 1.0
    ex.dispatchable()
    clock.now += 2.0
    ex.node_done(1, "A", 1.75)
    ex.dispatchable()
    clock.now += 0.5
    ex.node_failed(2, "cancelled")
    assert ex.timings() == [
        NodeTiming(id=1, text="a", status=NodeStatus.DONE, dispatched_s=1.0, finished_s=3.0, decode_s=1.75),
        NodeTiming(id=2, text="b", status=NodeStatus.FAILED, dispatched_s=3.0, finished_s=3.5, reason="cancelled"),
    ]


def test_misuse_is_reported_clearly():
    ex, _ = execution()
    add(ex, "1. a [needs: none]")
    with pytest.raises(ValueError, match="node 1 is pending, not running"):
        ex.node_done(1, "A", 1.0)
    with pytest.raises(ValueError, match="unknown node 5"):
        ex.node_failed(5, "x")
    ex.dispatchable()
    ex.node_done(1, "A", 1.0)
    with pytest.raises(ValueError, match="already answered"):
        ex.node_failed(1, "x")
