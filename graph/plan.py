"""The plan DAG: sub-questions, the earlier sub-questions each one builds on, how to check a plan,
and how to repair what a small model gets wrong.

One ordering rule runs through the package: a node may depend only on nodes written *before* it
in the plan. It makes every plan acyclic by construction once repaired, it is what lets a node be
dispatched as soon as its line is complete (everything it needs is already known), and it is easy
for a constrained decoder to enforce while the line is being written. A dependency id names the
first node written with that id; a later node that reuses an id is a new node, not a replacement.
"""
from __future__ import annotations

import enum

from pydantic import BaseModel, Field

DEFAULT_MAX_NODES = 10
MIN_NODES = 2  # one node leaves nothing to decode in parallel: plain decoding is cheaper


def text_key(text: str) -> str:
    """The form of a node's text used to spot duplicates: case, spacing and end punctuation ignored."""
    return " ".join(text.split()).strip(" .,;:!?").lower()


class PlanNode(BaseModel):
    """One sub-question of a plan and the ids of the nodes whose answers it needs."""

    id: int = Field(ge=1, description="The number the node was written with (1..n after repair).")
    text: str = Field(description="The sub-question, short and self-contained.")
    depends_on: list[int] = Field(default_factory=list, description="Ids of earlier nodes it needs.")


class ProblemKind(str, enum.Enum):
    TOO_MANY_NODES = "too_many_nodes"
    TOO_FEW_NODES = "too_few_nodes"
    DUPLICATE_ID = "duplicate_id"
    EMPTY_TEXT = "empty_text"
    DUPLICATE_TEXT = "duplicate_text"
    DUPLICATE_DEPENDENCY = "duplicate_dependency"
    SELF_LOOP = "self_loop"
    UNKNOWN_DEPENDENCY = "unknown_dependency"
    FORWARD_REFERENCE = "forward_reference"
    CYCLE = "cycle"


class PlanProblem(BaseModel):
    """One thing wrong with a plan: what kind, which node (None for the whole plan), in words."""

    kind: ProblemKind
    node_id: int | None = None
    detail: str

    def __str__(self) -> str:
        return self.detail


class Plan(BaseModel):
    """A question and its plan: nodes in the order they were written."""

    question: str
    nodes: list[PlanNode] = Field(default_factory=list)

    def node(self, node_id: int) -> PlanNode:
        """The first node written with this id; KeyError if there is none."""
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise KeyError(f"plan has no node {node_id}")

    def validate_structure(self, max_nodes: int = DEFAULT_MAX_NODES) -> list[PlanProblem]:
        """Every problem that stops this plan from being executed as is; empty when it is usable."""
        return find_problems(self, max_nodes)

    def ready(self, done: set[int]) -> list[int]:
        """Ids of nodes not in `done` whose dependencies all are, in plan order."""
        return [n.id for n in self.nodes if n.id not in done and all(d in done for d in n.depends_on)]

    def levels(self) -> list[list[int]]:
        """Topological layers: layer k holds the nodes whose longest dependency chain has k links.
        Raises ValueError for duplicate ids, unknown dependencies or cycles (repair first)."""
        ids = [n.id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ValueError("plan has duplicate ids; repair it before computing levels")
        needs = {n.id: set(n.depends_on) for n in self.nodes}
        unknown = sorted(set().union(*needs.values()) - set(ids)) if needs else []
        if unknown:
            raise ValueError(f"plan depends on unknown ids {unknown}; repair it before computing levels")
        layers: list[list[int]] = []
        placed: set[int] = set()
        while len(placed) < len(ids):
            layer = [i for i in ids if i not in placed and needs[i] <= placed]
            if not layer:
                raise ValueError(f"plan has a cycle among nodes {sorted(set(ids) - placed)}")
            layers.append(layer)
            placed.update(layer)
        return layers

    def critical_path_length(self) -> int:
        """Nodes on the longest dependency chain: the fewest sequential decoding rounds possible."""
        return len(self.levels())


def find_problems(plan: Plan, max_nodes: int = DEFAULT_MAX_NODES) -> list[PlanProblem]:
    """All structural problems of a plan, each naming the node and what is wrong with it."""
    problems: list[PlanProblem] = []

    def report(kind: ProblemKind, node_id: int | None, detail: str) -> None:
        problems.append(PlanProblem(kind=kind, node_id=node_id, detail=detail))

    count = len(plan.nodes)
    if count > max_nodes:
        report(ProblemKind.TOO_MANY_NODES, None, f"plan has {count} nodes; at most {max_nodes} are allowed")
    if count < MIN_NODES:
        report(ProblemKind.TOO_FEW_NODES, None, f"plan has {count} node(s); at least {MIN_NODES} are needed")
    first_at: dict[int, int] = {}
    text_of: dict[str, int] = {}
    for pos, node in enumerate(plan.nodes):
        if node.id in first_at:
            report(ProblemKind.DUPLICATE_ID, node.id, f"id {node.id} is used again by line {pos + 1}")
        else:
            first_at[node.id] = pos
        key = text_key(node.text)
        if not key:
            report(ProblemKind.EMPTY_TEXT, node.id, f"node {node.id} (line {pos + 1}) has no text")
        elif key in text_of:
            report(ProblemKind.DUPLICATE_TEXT, node.id, f"node {node.id} repeats the text of node {text_of[key]}")
        else:
            text_of[key] = node.id
    for pos, node in enumerate(plan.nodes):
        seen: set[int] = set()
        for dep in node.depends_on:
            if dep in seen:
                report(ProblemKind.DUPLICATE_DEPENDENCY, node.id, f"node {node.id} lists dependency {dep} twice")
                continue
            seen.add(dep)
            if dep == node.id:
                report(ProblemKind.SELF_LOOP, node.id, f"node {node.id} depends on itself")
            elif dep not in first_at:
                detail = f"node {node.id} depends on {dep}, which does not exist"
                report(ProblemKind.UNKNOWN_DEPENDENCY, node.id, detail)
            elif first_at[dep] > pos:
                report(
                    ProblemKind.FORWARD_REFERENCE,
                    node.id,
                    f"node {node.id} depends on {dep}, which comes later; only earlier nodes may be needed",
                )
    for cycle in _cycles(plan):
        report(ProblemKind.CYCLE, cycle[0], "cycle: " + " -> ".join(map(str, cycle)) + " (each needs the next)")
    return problems


def _cycles(plan: Plan) -> list[list[int]]:
    """Each distinct dependency cycle once, as a closed path of ids; self-loops are reported apart."""
    edges: dict[int, set[int]] = {}
    for node in plan.nodes:
        edges.setdefault(node.id, set()).update(d for d in node.depends_on if d != node.id)
    edges = {k: {d for d in v if d in edges} for k, v in edges.items()}
    state: dict[int, int] = {}  # 1 on the current path, 2 finished
    found: list[list[int]] = []
    seen: set[frozenset[int]] = set()
    for root in edges:
        if root in state:
            continue
        # iterative depth-first search: a runaway plan of thousands of lines must not hit the recursion limit
        path, todo = [root], [iter(sorted(edges[root]))]
        state[root] = 1
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                todo.pop()
            elif state.get(nxt) == 1:
                cycle = path[path.index(nxt):]
                if frozenset(cycle) not in seen:
                    seen.add(frozenset(cycle))
                    found.append(cycle + [nxt])
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                todo.append(iter(sorted(edges[nxt])))
    return found


class PlanNormalizer:
    """Applies the repair rules to nodes one at a time, in the order they were written, so that a
    whole plan (`repair`) and a plan arriving line by line (`DagExecution`) are repaired alike.

    Kept nodes are renumbered 1..n in order and their dependencies rewritten to the new ids. Empty
    nodes and repeated texts are dropped; a dependency on a dropped duplicate points to the node it
    repeated, and one on a dropped empty node to that node's own dependencies. Self-loops are dropped.
    Nodes past `max_nodes` are dropped. A dependency on an id not seen yet is handed back to the
    caller as pending: once the plan is complete it is an unknown or later id, and `finish` drops it.
    """

    def __init__(self, max_nodes: int = DEFAULT_MAX_NODES):
        if max_nodes < MIN_NODES:
            raise ValueError(f"max_nodes must be at least {MIN_NODES}, got {max_nodes}")
        self.max_nodes = max_nodes
        self.nodes: list[PlanNode] = []
        self.changes: list[str] = []
        self._ids: dict[int, tuple[int, ...]] = {}  # a written id -> the new ids it now stands for
        self._texts: dict[str, int] = {}  # text key -> new id of the node that has it
        self._written: dict[int, int] = {}  # new id -> written id
        self._all_written: set[int] = set()
        self._over_limit = 0

    def add(self, node: PlanNode) -> tuple[PlanNode | None, list[int]]:
        """The node renumbered with resolved dependencies (None if dropped), and the written ids it
        needs that are not known yet."""
        label = node.id
        self._all_written.add(label)
        key = text_key(node.text)
        if not key:
            deps, _ = self._resolve(node)
            self._ids.setdefault(label, tuple(deps))
            self.changes.append(f"dropped node {label}: empty text")
            return None, []
        if key in self._texts:
            kept = self._texts[key]
            self._ids.setdefault(label, (kept,))
            self.changes.append(f"dropped node {label}: repeats node {self._written[kept]}")
            return None, []
        if len(self.nodes) >= self.max_nodes:
            self._over_limit += 1
            return None, []
        deps, pending = self._resolve(node)
        new = PlanNode(id=len(self.nodes) + 1, text=node.text.strip(), depends_on=deps)
        if label in self._ids:
            self.changes.append(f"node {label}: id already used, kept as a new node")
        self._ids.setdefault(label, (new.id,))
        self._texts[key] = new.id
        self._written[new.id] = label
        self.nodes.append(new)
        return new, pending

    def _resolve(self, node: PlanNode) -> tuple[list[int], list[int]]:
        resolved: set[int] = set()
        pending: list[int] = []
        for i, dep in enumerate(node.depends_on):
            if dep in node.depends_on[:i]:
                self.changes.append(f"node {node.id}: removed repeated dependency on {dep}")
            elif dep == node.id:
                self.changes.append(f"node {node.id}: removed dependency on itself")
            elif dep in self._ids:
                resolved.update(self._ids[dep])
            else:
                pending.append(dep)
        return sorted(resolved), pending

    def finish(self, pending: dict[int, list[int]]) -> None:
        """Close the plan: drop the still-pending dependencies (`{new id: written ids}`) and record
        the truncation and renumbering."""
        for new_id, deps in sorted(pending.items()):
            label = self._written[new_id]
            for dep in deps:
                where = "comes later in the plan" if dep in self._all_written else "does not exist"
                self.changes.append(f"node {label}: removed dependency on {dep}, which {where}")
        if self._over_limit:
            self.changes.append(f"dropped {self._over_limit} node(s) past the limit of {self.max_nodes}")
        moved = [f"{old}->{new}" for new, old in self._written.items() if old != new]
        if moved:
            self.changes.append("renumbered (written id->new id) " + ", ".join(moved))

    def verdict(self) -> str | None:
        """Why the kept nodes cannot be executed as a plan (use plain decoding), or None."""
        if not self.nodes:
            why = "no plan lines could be parsed" if not self._all_written else "no usable node survived repair"
            return f"fallback to plain decoding: {why}"
        if len(self.nodes) < MIN_NODES:
            return "fallback to plain decoding: only 1 usable node, nothing to decode in parallel"
        return None


class RepairOutcome(BaseModel):
    """What `repair` made of a plan: the repaired plan, each change in words, and whether to give up
    on planning (`fallback_reason` set) and answer with plain decoding instead."""

    plan: Plan
    changes: list[str] = Field(default_factory=list)
    fallback_reason: str | None = None

    @property
    def fallback(self) -> bool:
        return self.fallback_reason is not None


def repair(plan: Plan, max_nodes: int = DEFAULT_MAX_NODES) -> RepairOutcome:
    """Fix what is safe to fix (see `PlanNormalizer`); a result with fewer than two nodes is a
    fallback verdict. A repaired plan that is not a fallback has no `validate_structure` problems."""
    normalizer = PlanNormalizer(max_nodes)
    pending: dict[int, list[int]] = {}
    for node in plan.nodes:
        kept, unknown = normalizer.add(node)
        if kept is not None and unknown:
            pending[kept.id] = unknown
    normalizer.finish(pending)
    return RepairOutcome(
        plan=Plan(question=plan.question, nodes=normalizer.nodes),
        changes=normalizer.changes,
        fallback_reason=normalizer.verdict(),
    )

