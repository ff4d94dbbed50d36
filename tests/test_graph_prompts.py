"""Prompt builders: worked examples in the plan format, and the shared-prefix layout of node
prompts, checked at message level and at token level with in-process tokenizers (no model)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.base import Engine
from graph.plan import Plan, repair
from graph.plan_format import format_plan, parse_plan
from graph.prompts import (
    PLAN_EXAMPLES,
    SOT_EXAMPLES,
    follow_up_messages,
    node_messages,
    node_preamble,
    node_task,
    plan_messages,
    shared_prefix_messages,
    sot_point_messages,
    streaming_prefix_probe,
    sot_skeleton_messages,
)

QUESTION = "How much paint do I need for my bedroom, and what will it cost?"
PLAN = parse_plan(
    QUESTION,
    "1. What is the wall area? [needs: none]\n2. How far does a litre go? [needs: none]\n"
    "3. How many litres do two coats take? [needs: 1, 2]\n4. What does that paint cost? [needs: 3]",
)
ANSWERS = {1: "About 40 square metres.", 2: "About 10 square metres per litre.", 3: "Eight litres."}

# SmolLM2's own chat template: it inserts a default system turn when the first message is not one
SMOLLM_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def all_node_messages(plan: Plan) -> list[list[dict]]:
    parents = lambda node: {d: ANSWERS[d] for d in node.depends_on}  # noqa: E731
    return [node_messages(QUESTION, plan, node, parents(node)) for node in plan.nodes]


def encode_chat(tokenizer, messages, add_generation_prompt=True) -> list[int]:
    return Engine.encode_chat(SimpleNamespace(tokenizer=tokenizer), messages, add_generation_prompt)


@pytest.fixture(scope="module")
def bpe_tokenizer():
    """A byte-level BPE trained in-process on the prompts themselves, so merges do happen across
    the text near message boundaries, with SmolLM2's chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [m["content"] for messages in all_node_messages(PLAN) for m in messages]
    backend.train_from_iterator(corpus * 3, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>")
    tokenizer.chat_template = SMOLLM_TEMPLATE
    return tokenizer


def test_planning_prompt_is_instructions_two_examples_then_the_question():
    messages = plan_messages(QUESTION)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[-1]["content"] == QUESTION
    assert "Write 2 to 6 lines" in messages[0]["content"]
    assert "Write 2 to 3 lines" in plan_messages(QUESTION, max_nodes=3)[0]["content"]


@pytest.mark.parametrize("question, text", PLAN_EXAMPLES)
def test_worked_examples_are_clean_plans_in_the_canonical_format(question, text):
    plan = parse_plan(question, text)
    assert format_plan(plan) == text
    outcome = repair(plan)
    assert outcome.changes == [] and not outcome.fallback


def test_one_worked_example_has_real_dependencies_and_one_has_none():
    first, second = (parse_plan(q, t) for q, t in PLAN_EXAMPLES)
    assert first.critical_path_length() == 3 and any(len(n.depends_on) >= 2 for n in first.nodes)
    assert second.critical_path_length() == 1


def test_shared_prefix_is_a_message_level_prefix_of_every_node_prompt():
    prefix = shared_prefix_messages(QUESTION, PLAN)
    prompts = all_node_messages(PLAN)
    for messages in prompts:
        assert messages[: len(prefix)] == prefix and len(messages) == len(prefix) + 1
        assert messages[-1]["role"] == "user"
    assert len({m[-1]["content"] for m in prompts}) == len(PLAN.nodes)  # the tails really differ


@pytest.mark.parametrize("which", ["tiny_tokenizer", "bpe_tokenizer"])
def test_shared_prefix_tokens_are_a_token_prefix_of_every_node_prompt(which, request):
    tokenizer = request.getfixturevalue(which)
    prefix = encode_chat(tokenizer, shared_prefix_messages(QUESTION, PLAN), add_generation_prompt=False)
    assert len(prefix) > 20
    for messages in all_node_messages(PLAN):
        ids = encode_chat(tokenizer, messages)
        assert ids[: len(prefix)] == prefix and len(ids) > len(prefix)


def test_a_partial_plan_shares_the_question_and_a_text_prefix_of_the_plan():
    partial = Plan(question=QUESTION, nodes=PLAN.nodes[:2])
    early, final = shared_prefix_messages(QUESTION, partial), shared_prefix_messages(QUESTION, PLAN)
    assert early[:-1] == final[:-1] and early[-2]["content"] == QUESTION
    assert final[-1]["content"].startswith(early[-1]["content"]) and final[-1] != early[-1]


@pytest.mark.parametrize("which", ["tiny_tokenizer", "bpe_tokenizer"])
def test_the_preamble_is_a_token_prefix_of_every_node_prompt_of_every_question(which, request):
    tokenizer = request.getfixturevalue(which)
    preamble = encode_chat(tokenizer, node_preamble(), add_generation_prompt=False)
    other = parse_plan("Why is the sky blue?", "1. What is light made of? [needs: none]\n2. Why is blue scattered more? [needs: 1]")
    for question, plan in ((QUESTION, PLAN), ("Why is the sky blue?", other)):
        for node in plan.nodes:
            ids = encode_chat(tokenizer, node_messages(question, plan, node, {}))
            assert ids[: len(preamble)] == preamble and len(ids) > len(preamble)


@pytest.mark.parametrize("which", ["tiny_tokenizer", "bpe_tokenizer"])
def test_while_the_plan_streams_the_plan_so_far_is_a_token_prefix_of_every_later_node_prompt(which, request):
    tokenizer = request.getfixturevalue(which)
    question_only = encode_chat(tokenizer, shared_prefix_messages(QUESTION, PLAN)[:-1], add_generation_prompt=False)
    shared = []
    for seen in (1, 2, 3):
        partial = Plan(question=QUESTION, nodes=PLAN.nodes[:seen])
        closed = encode_chat(tokenizer, shared_prefix_messages(QUESTION, partial), add_generation_prompt=False)
        probe = encode_chat(tokenizer, streaming_prefix_probe(QUESTION, partial), add_generation_prompt=False)
        common = next((i for i, (a, b) in enumerate(zip(closed, probe)) if a != b), min(len(closed), len(probe)))
        shared.append(closed[:common])
        later = [Plan(question=QUESTION, nodes=PLAN.nodes[:n]) for n in range(seen, len(PLAN.nodes) + 1)]
        for plan in later:  # this plan or any longer one: every node prompt starts with it
            for node in plan.nodes:
                ids = encode_chat(tokenizer, node_messages(QUESTION, plan, node, {}))
                assert ids[:common] == shared[-1]
        # it holds the plan text seen so far: all but the plan message's closing tokens
        assert len(closed) - len(shared[-1]) <= 3
        if which == "bpe_tokenizer":
            assert tokenizer.decode(shared[-1]).rstrip().endswith(PLAN.nodes[seen - 1].text)
    assert len(question_only) < len(shared[0]) < len(shared[1]) < len(shared[2])


def test_node_task_lists_parent_answers_then_names_the_step():
    node = PLAN.nodes[2]
    assert node_task(node, {2: " About 10 square metres per litre. ", 1: "About 40 square metres."}, PLAN) == (
        "Earlier parts, already answered:\n"
        "Part 1 (What is the wall area?): About 40 square metres.\n"
        "Part 2 (How far does a litre go?): About 10 square metres per litre.\n"
        "\n"
        "Answer part 3 in two or three sentences: How many litres do two coats take?"
    )
    assert node_task(PLAN.nodes[0], {}, PLAN) == "Answer part 1 in two or three sentences: What is the wall area?"


@pytest.mark.parametrize("question, text", SOT_EXAMPLES)
def test_sot_examples_are_flat_short_skeletons(question, text):
    plan = parse_plan(question, text)
    assert 3 <= len(plan.nodes) <= 6 and all(n.depends_on == [] for n in plan.nodes)
    assert all(len(n.text.split()) <= 5 for n in plan.nodes)


def test_sot_prompts():
    messages = sot_skeleton_messages(QUESTION)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert messages[-1]["content"] == QUESTION
    [point] = sot_point_messages(QUESTION, ["Wall area", "Coverage", "Price"], 2)
    assert point["role"] == "user"
    assert f"Question: {QUESTION}\n\nOutline of the answer:\n1. Wall area\n2. Coverage\n3. Price" in point["content"]
    assert point["content"].endswith("Write only point 2 (Coverage), in one or two sentences.")
    with pytest.raises(ValueError, match=r"point must be in 1..3, got 4"):
        sot_point_messages(QUESTION, ["a", "b", "c"], 4)


@pytest.mark.parametrize("which", ["tiny_tokenizer", "bpe_tokenizer"])
def test_a_parents_prompt_and_answer_tokens_are_a_token_prefix_of_its_childs_follow_up(which, request):
    """Node 3 continues node 1's conversation; node 4 continues node 3's: the parent's prompt (with the
    generation prompt) followed by its answer's tokens is how the child's prompt starts, so the KV
    the engine kept for them is reused. The other parent's answer is quoted in the child's message."""
    tokenizer = request.getfixturevalue(which)
    one = node_messages(QUESTION, PLAN, PLAN.nodes[0], {})
    three = follow_up_messages(one, ANSWERS[1], PLAN, PLAN.nodes[2], {2: ANSWERS[2]})
    four = follow_up_messages(three, ANSWERS[3], PLAN, PLAN.nodes[3], {})
    assert "Part 2 (How far does a litre go?): About 10 square metres per litre." in three[-1]["content"]
    assert "Part 1 (" not in three[-1]["content"] and three[-1]["content"].endswith(PLAN.nodes[2].text)
    for parent, answer, child in ((one, ANSWERS[1], three), (three, ANSWERS[3], four)):
        kept = encode_chat(tokenizer, parent) + tokenizer.encode(answer, add_special_tokens=False)
        ids = encode_chat(tokenizer, child)
        assert ids[: len(kept)] == kept and len(ids) > len(kept)
