"""Chat prompts for planning, for answering plan nodes, and for the Skeleton-of-Thought baseline.

Every builder returns chat messages (a list of {"role", "content"} dicts) for the engine's
`encode_chat`. The worked examples are short on purpose: each prompt token is prefilled for
every request, and a 135M model copies a format from examples far better than from rules.
"""
from __future__ import annotations

from graph.plan import DEFAULT_MAX_NODES, Plan, PlanNode

PLAN_SYSTEM = (
    "You break a question into a few smaller questions that can be answered one by one and then "
    "put together into a full answer. Write one line per small question: its number, a period, the "
    "question in under twelve words, then [needs: ...] with the numbers of earlier lines whose "
    "answers it uses, or [needs: none]. Only earlier lines may be needed. Write {min_lines} to "
    "{max_lines} lines and nothing else."
)

# (question, plan text) pairs: the first has real dependencies (work out X, then use X), the second
# shows that independent parts are fine and common.
PLAN_EXAMPLES = [
    (
        "I want to repaint my bedroom walls. How much paint should I buy and what will it cost?",
        "1. What is the wall area of a typical bedroom? [needs: none]\n"
        "2. How much wall does one litre of paint cover? [needs: none]\n"
        "3. How many litres do two coats of that area take? [needs: 1, 2]\n"
        "4. What does that amount of paint cost? [needs: 3]",
    ),
    (
        "What can I do to sleep better at night?",
        "1. Why does a fixed bedtime help? [needs: none]\n"
        "2. How do screens before bed affect sleep? [needs: none]\n"
        "3. Which evening foods and drinks keep people awake? [needs: none]\n"
        "4. How should the bedroom be set up for sleep? [needs: none]",
    ),
]

# Measured on the 135M model: with the plan shown in its own [needs: ...] format and a long rule
# list, it went on writing plan lines instead of answering; a plain numbered plan and a short
# request per part gave on-topic answers for every part.
NODE_SYSTEM = "You are a helpful assistant. You answer a question part by part, following your plan."

# What a node's answer may not open a line with. Measured on the embedded model over Vicuna-80 (`bench plato`,
# `plato-no-opening-guard` in turns): the parts holding a "?" fell from 11.7% to 1.8%, the model writing
# "The most productive way to work from home is ..." where it had asked "What is a productive way to work
# from home?", for 2% more tokens and time. `Part`, `Plan` and `Answer` open its "Part 2:" and "Plan:" lines,
# which restart the plan. `Do` is left out: it opens advice ("Do stretch").
NODE_NO_OPENINGS = ("What", "How", "Why", "Which", "When", "Where", "Who", "Is", "Are", "Can", "Does", "Should",
                    "Part", "Plan", "Answer")

SOT_SYSTEM = (
    "You outline answers. For the user's question, write a short numbered list of the main points "
    "an answer should cover, three to six points of a few words each. Write only the list."
)

SOT_EXAMPLES = [
    (
        "How do I keep houseplants alive?",
        "1. Enough light\n2. Careful watering\n3. Well-draining soil\n4. Occasional feeding",
    ),
    (
        "Why do people learn a second language?",
        "1. Work opportunities\n2. Travel\n3. Family and friends\n4. Brain exercise",
    ),
]


def _with_examples(system: str, examples: list[tuple[str, str]], question: str) -> list[dict]:
    messages = [{"role": "system", "content": system}]
    for example_question, example_answer in examples:
        messages.append({"role": "user", "content": example_question})
        messages.append({"role": "assistant", "content": example_answer})
    messages.append({"role": "user", "content": question})
    return messages


def plan_messages(question: str, max_nodes: int = DEFAULT_MAX_NODES) -> list[dict]:
    """The planning prompt: instructions, two worked examples as earlier turns, then the question.
    The model's reply is the plan in the `graph.plan_format` line format."""
    system = PLAN_SYSTEM.format(min_lines=2, max_lines=min(max_nodes, 6))
    return _with_examples(system, PLAN_EXAMPLES, question)


def node_preamble() -> list[dict]:
    """What every node prompt of every question starts with: the instructions. Encoded without a
    generation prompt it is a token prefix of every node prompt (it closes with an end-of-turn token),
    so its KV, computed once, serves the first node of every question (`GenerationRequest.preamble_len`)."""
    return [{"role": "system", "content": NODE_SYSTEM}]


def shared_prefix_messages(question: str, plan: Plan) -> list[dict]:
    """The part of every node prompt that is the same for all nodes of a request: the preamble
    (instructions), the question as the user asked it, and the plan as an assistant turn.

    Layout guarantee: `encode_chat(shared_prefix_messages(q, plan), add_generation_prompt=False)`
    is a token prefix of `encode_chat(node_messages(q, plan, node, parents))` for every node, so
    its KV cache can be computed once and reused. It holds because the node-specific text is a
    separate final message: a chat template closes every message with its own end-of-turn
    special token, and tokenizers split text at special tokens before merging, so nothing after
    that token can change the tokens before it.

    While the plan is still streaming, the plan message closes with an end-of-turn token right after
    the last line seen so far, so the prompt of a node that saw one more plan line does not start
    with all of this one's tokens: only with those up to that last line's text (see
    `streaming_prefix_probe`)."""
    return [
        *node_preamble(),
        {"role": "user", "content": question},
        {"role": "assistant", "content": plain_plan(plan)},
    ]


def streaming_prefix_probe(question: str, plan: Plan) -> list[dict]:
    """`shared_prefix_messages` as they would read with one more plan line. The token prefix that
    these and `shared_prefix_messages(question, plan)` have in common runs to the end of the plan
    text seen so far (not its end-of-turn token): every node prompt built from this plan or from
    any longer one starts with it, so it is what a node dispatched while the plan streams marks as
    shared, and a later node reuses its KV (the engine's prefix cache matches the longest cached
    prefix) and computes only the plan lines added since."""
    messages = shared_prefix_messages(question, plan)
    messages[-1] = {**messages[-1], "content": f"{messages[-1]['content']}\n{len(plan.nodes) + 1}. "}
    return messages


def plain_plan(plan: Plan) -> str:
    """The plan as the node prompts show it: numbered parts, no dependency annotations."""
    return "Plan:\n" + "\n".join(f"{node.id}. {node.text}" for node in plan.nodes)


def node_task(node: PlanNode, parent_answers: dict[int, str], plan: Plan) -> str:
    """The node-specific last message: the parents' answers, then which step to answer."""
    lines = []
    if parent_answers:
        lines.append("Earlier parts, already answered:")
        for parent_id in sorted(parent_answers):
            parent = plan.node(parent_id)
            lines.append(f"Part {parent_id} ({parent.text}): {parent_answers[parent_id].strip()}")
        lines.append("")
    lines.append(f"Answer part {node.id} in two or three sentences: {node.text}")
    return "\n".join(lines)


def node_messages(question: str, plan: Plan, node: PlanNode, parent_answers: dict[int, str]) -> list[dict]:
    """The full prompt for one plan node: the shared prefix, then one user message for this node."""
    return shared_prefix_messages(question, plan) + [
        {"role": "user", "content": node_task(node, parent_answers, plan)}
    ]


def follow_up_messages(lead_messages: list[dict], lead_answer: str, plan: Plan, node: PlanNode,
                       other_parent_answers: dict[int, str]) -> list[dict]:
    """The prompt of a node that has parents, as a follow-up in the conversation of one of them (the
    lead): the lead's own prompt, its answer as the assistant's turn, then this node's task with the
    other parents' answers.

    Layout guarantee: the lead's prompt followed by its answer tokens is a token prefix of this
    prompt (the answer closes with the template's end-of-turn token, as in `shared_prefix_messages`),
    as long as the answer's text encodes back to the tokens that were generated, which it does for
    text a model wrote and the engine decoded. So the KV the engine kept for the lead's prompt and
    answer (`keep_kv`) is reused, and only this node's own message is prefilled: the lead's answer,
    usually the longest part of a node prompt, is never computed twice. The plan shown is the
    one the lead saw (while the plan streams, the part written so far); this node's own message
    names its sub-question."""
    return lead_messages + [
        {"role": "assistant", "content": lead_answer},
        {"role": "user", "content": node_task(node, other_parent_answers, plan)},
    ]


def sot_skeleton_messages(question: str) -> list[dict]:
    """The Skeleton-of-Thought first stage: a flat numbered list of short points, no dependencies.
    Its reply parses with `graph.plan_format.parse_plan` (lines without [needs: ...] have none)."""
    return _with_examples(SOT_SYSTEM, SOT_EXAMPLES, question)


def sot_point_messages(question: str, skeleton: list[str], point: int) -> list[dict]:
    """The Skeleton-of-Thought second stage for point `point` (1-based) of `skeleton`: one user
    message with the question, the outline and which point to write. The baseline prefills all of
    it again for every point, so a faithful `sot` mode does not prefill a shared prefix for it."""
    if not 1 <= point <= len(skeleton):
        raise ValueError(f"point must be in 1..{len(skeleton)}, got {point}")
    outline = "\n".join(f"{i}. {text}" for i, text in enumerate(skeleton, start=1))
    content = (
        f"You are writing one point of a longer answer.\n\nQuestion: {question}\n\n"
        f"Outline of the answer:\n{outline}\n\n"
        f"Write only point {point} ({skeleton[point - 1]}), in one or two sentences."
    )
    return [{"role": "user", "content": content}]
