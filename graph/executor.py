"""The execution state of one planned request: which nodes may be decoded now, which are running,
answered or failed. Plain methods, no threads or Ray: the planner actor drives it.

Nodes arrive as the streaming parser emits them and are repaired on arrival by the same rules as
`graph.plan.repair` (renumbered 1..n, dependencies rewritten), so every id this class hands out
is a repaired id and `plan` is always a repaired plan. A node that names an id not seen yet waits:
once the plan is complete that id is unknown or later in the plan, the dependency is dropped (as
`repair` would) and the node proceeds.
"""
from __future__ import annotations

import enum
import time
from collections.abc import Callable

from pydantic import BaseModel

from graph.plan import DEFAULT_MAX_NODES, Plan, PlanNode, PlanNormalizer


class NodeStatus(str, enum.Enum):
    PENDING = "pending"  # not dispatched: waiting for its parents (or for the plan to complete)
    RUNNING = "running"  # dispatched to a decoder
    DONE = "done"
    FAILED = "failed"


class NodeTiming(BaseModel):
    """One node's outcome and times, in seconds from the start of the execution."""

    id: int
    text: str
    status: NodeStatus
    dispatched_s: float | None = None
    finished_s: float | None = None
    decode_s: float | None = None
    reason: str | None = None


class DagExecution:
    """Tracks one request's plan DAG from the first streamed node to the last answer.

    `deadline` is an absolute time on `clock` after which every unfinished node fails;
    `node_budget_s` is how long one dispatched node may run. With `pipelining` off, nothing is
    dispatched before the plan is complete (the ablation)."""

    def __init__(
        self,
        question: str,
        max_nodes: int = DEFAULT_MAX_NODES,
        deadline: float | None = None,
        node_budget_s: float | None = None,
        pipelining: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.question = question
        self.deadline = deadline
        self.node_budget_s = node_budget_s
        self.pipelining = pipelining
        self.clock = clock
        self.started = clock()
        self.plan_is_complete = False
        self.fallback_reason: str | None = None
        self._normalizer = PlanNormalizer(max_nodes)
        self._pending_ids: dict[int, list[int]] = {}  # node -> written ids it names that are not known yet
        self._status: dict[int, NodeStatus] = {}
        self._answers: dict[int, str] = {}
        self._reasons: dict[int, str] = {}
        self._dispatched: dict[int, float] = {}
        self._finished: dict[int, float] = {}
        self._decode_s: dict[int, float] = {}

    # ---- the plan ---------------------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The repaired plan as known so far."""
        return Plan(question=self.question, nodes=list(self._normalizer.nodes))

    @property
    def changes(self) -> list[str]:
        """What repair changed so far, in words."""
        return list(self._normalizer.changes)

    def add_node(self, node: PlanNode) -> PlanNode | None:
        """Take a node as parsed; returns it repaired (new id, rewritten dependencies), or None when
        repair drops it or the plan is already complete. A node whose parent has failed fails too."""
        if self.plan_is_complete:
            self._normalizer.changes.append(f"ignored node {node.id}: it arrived after the plan was complete")
            return None
        kept, unknown = self._normalizer.add(node)
        if kept is None:
            return None
        self._status[kept.id] = NodeStatus.PENDING
        if unknown:
            self._pending_ids[kept.id] = unknown
        failed = [d for d in kept.depends_on if self._status[d] is NodeStatus.FAILED]
        if failed:
            self._fail(kept.id, f"parent {failed[0]} failed: {self._reasons[failed[0]]}")
        return kept

    def plan_complete(self) -> str | None:
        """No more nodes will come: drop dependencies that never resolved and decide whether the
        plan is usable. Returns the fallback reason (every unfinished node then fails with it) or
        None. Calling it again changes nothing."""
        if self.plan_is_complete:
            return self.fallback_reason
        self._close_plan()
        self.fallback_reason = self._normalizer.verdict()
        if self.fallback_reason is not None:
            for node_id in self._unfinished():
                self._fail(node_id, self.fallback_reason)
        return self.fallback_reason

    # ---- dispatch and results ---------------------------------------------------------------
    def dispatchable(self) -> list[PlanNode]:
        """Take the nodes that may start now: not dispatched yet, every parent answered and every
        named id known. They are marked running; each is returned once."""
        if not (self.pipelining or self.plan_is_complete):
            return []
        now = self.clock()
        taken = []
        for node in self._normalizer.nodes:
            if (
                self._status[node.id] is NodeStatus.PENDING
                and node.id not in self._pending_ids
                and all(self._status[d] is NodeStatus.DONE for d in node.depends_on)
            ):
                self._status[node.id] = NodeStatus.RUNNING
                self._dispatched[node.id] = now
                taken.append(node)
        return taken

    def node_done(self, node_id: int, answer: str, seconds: float) -> bool:
        """Record a running node's answer and its decode time. False (answer discarded) when the
        node had already failed, e.g. by expiry or fallback while it was decoding."""
        status = self._require(node_id)
        if status is NodeStatus.FAILED:
            return False
        if status is not NodeStatus.RUNNING:
            raise ValueError(f"node {node_id} is {status.value}, not running: it cannot be done")
        self._status[node_id] = NodeStatus.DONE
        self._answers[node_id] = answer
        self._decode_s[node_id] = seconds
        self._finished[node_id] = self.clock()
        return True

    def node_restored(self, node_id: int, answer: str) -> None:
        """Take a pending node's answer as given (made before, by another planner): it is done without
        being dispatched here, and its children may start."""
        if self._require(node_id) is not NodeStatus.PENDING:
            raise ValueError(f"node {node_id} is {self._status[node_id].value}, not pending: it cannot be restored")
        self._status[node_id] = NodeStatus.DONE
        self._answers[node_id] = answer

    def node_failed(self, node_id: int, reason: str) -> list[int]:
        """Fail a node and, transitively, every node that needs it; returns the ids failed now."""
        if self._require(node_id) is NodeStatus.DONE:
            raise ValueError(f"node {node_id} is already answered: it cannot fail")
        return self._fail(node_id, reason)

    def expire(self, now: float | None = None) -> list[int]:
        """Fail what ran out of time: everything unfinished once the deadline has passed (which also
        closes the plan, with no fallback verdict: it is too late for one), else each running node past its
        budget. Returns the ids failed now."""
        now = self.clock() if now is None else now
        failed: list[int] = []
        if self.deadline is not None and now >= self.deadline:
            reason = f"request deadline passed after {now - self.started:.1f}s"
            for node_id in self._unfinished():
                failed += self._fail(node_id, reason)
            if not self.plan_is_complete:
                self._close_plan()
            return failed
        if self.node_budget_s is not None:
            for node_id, since in self._dispatched.items():
                if self._status[node_id] is NodeStatus.RUNNING and now - since >= self.node_budget_s:
                    failed += self._fail(node_id, f"ran past its budget of {self.node_budget_s:g}s")
        return failed

    # ---- reading the state ------------------------------------------------------------------
    @property
    def is_finished(self) -> bool:
        """The plan is complete and every node is answered or failed."""
        return self.plan_is_complete and not self._unfinished()

    @property
    def answers(self) -> dict[int, str]:
        return dict(self._answers)

    @property
    def failures(self) -> dict[int, str]:
        """Reason for each failed node."""
        return dict(self._reasons)

    def status(self, node_id: int) -> NodeStatus:
        return self._require(node_id)

    def has_children(self, node_id: int) -> bool:
        """Whether a node known so far needs this one."""
        self._require(node_id)
        return any(node_id in node.depends_on for node in self._normalizer.nodes)

    def parent_answers(self, node_id: int) -> dict[int, str]:
        """Answers of the node's parents, for its prompt."""
        self._require(node_id)
        node = self._normalizer.nodes[node_id - 1]
        return {d: self._answers[d] for d in node.depends_on if d in self._answers}

    def timings(self) -> list[NodeTiming]:
        """Per-node status and times, in plan order."""

        def since_start(t: float | None) -> float | None:
            return None if t is None else t - self.started

        return [
            NodeTiming(
                id=n.id,
                text=n.text,
                status=self._status[n.id],
                dispatched_s=since_start(self._dispatched.get(n.id)),
                finished_s=since_start(self._finished.get(n.id)),
                decode_s=self._decode_s.get(n.id),
                reason=self._reasons.get(n.id),
            )
            for n in self._normalizer.nodes
        ]

    # ---- internals --------------------------------------------------------------------------
    def _require(self, node_id: int) -> NodeStatus:
        if node_id not in self._status:
            raise ValueError(f"unknown node {node_id}; known ids are 1..{len(self._status)}")
        return self._status[node_id]

    def _close_plan(self) -> None:
        self.plan_is_complete = True
        self._normalizer.finish(self._pending_ids)
        self._pending_ids.clear()

    def _unfinished(self) -> list[int]:
        return [i for i, s in self._status.items() if s in (NodeStatus.PENDING, NodeStatus.RUNNING)]

    def _fail(self, node_id: int, reason: str) -> list[int]:
        """Fail a node and its unfinished descendants (ids only ever point backwards, so one pass
        in plan order reaches them all)."""
        if self._status[node_id] in (NodeStatus.DONE, NodeStatus.FAILED):
            return []
        failed = [node_id]
        self._status[node_id] = NodeStatus.FAILED
        self._reasons[node_id] = reason
        self._finished[node_id] = self.clock()
        for node in self._normalizer.nodes[node_id:]:
            hit = next((d for d in node.depends_on if d in failed), None)
            if hit is not None and self._status[node.id] in (NodeStatus.PENDING, NodeStatus.RUNNING):
                self._status[node.id] = NodeStatus.FAILED
                self._reasons[node.id] = f"parent {hit} failed: {self._reasons[hit]}"
                self._finished[node.id] = self.clock()
                failed.append(node.id)
        return failed
