"""Ray-free planning core: the plan DAG, its line format and parsers, prompts, the per-request
execution state machine and answer assembly."""
from graph.assemble import assemble_answer
from graph.executor import DagExecution, NodeStatus, NodeTiming
from graph.plan import Plan, PlanNode, PlanProblem, ProblemKind, RepairOutcome, repair
from graph.plan_format import StreamingPlanParser, format_plan, parse_plan, parse_plan_line

__all__ = [
    "DagExecution",
    "NodeStatus",
    "NodeTiming",
    "Plan",
    "PlanNode",
    "PlanProblem",
    "ProblemKind",
    "RepairOutcome",
    "StreamingPlanParser",
    "assemble_answer",
    "format_plan",
    "parse_plan",
    "parse_plan_line",
    "repair",
]
