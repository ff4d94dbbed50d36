"""vLLM's guided_choice (and structured_outputs' choice, json and json_object): the answer is exactly
one of the strings, decoded on a random model whose tokenizer spells them."""
from __future__ import annotations

import asyncio
import json

import pytest

from engine.choice_constraint import ChoiceConstraint, ChoiceGrammar
from engine.constraints import DONE
from tests.test_json_constraint import EOS, json_engine, json_tokenizer  # noqa: F401 (fixtures)

CHOICES = ["yes", "yes please", "no"]


def test_the_grammar_admits_the_choices_only():
    grammar = ChoiceGrammar(tuple(CHOICES))
    assert grammar.run(grammar.start, "no") == DONE and grammar.run(grammar.start, "yes please") == DONE
    assert grammar.run(grammar.start, "yes") == ("yes",) and grammar.may_end(("yes",))
    assert grammar.run(grammar.start, "ye") == ("ye",) and not grammar.may_end(("ye",))
    assert grammar.run(grammar.start, "maybe") is None and grammar.run(grammar.start, "nope") is None


def test_a_whole_choice_a_longer_one_extends_may_end_or_go_on(json_tokenizer):  # noqa: F811
    constraint = ChoiceConstraint(json_tokenizer, {"choices": CHOICES})
    for piece in ("y", "e", "s"):
        constraint.advance(json_tokenizer.convert_tokens_to_ids(piece))
    allowed = {json_tokenizer.convert_ids_to_tokens(i) for i in constraint.allowed().nonzero()[:, 0].tolist()}
    assert allowed == {"<|im_end|>", " "}  # the end of sequence, or the space that goes on to " please"
    assert not constraint.is_complete
    with pytest.raises(ValueError, match="cannot come next in any choice"):
        constraint.advance(json_tokenizer.convert_tokens_to_ids("x"))


@pytest.mark.parametrize("arg, problem", [({"choices": []}, "1 to 256"), ({"choices": ["a", ""]}, "non-empty"),
                                          ({"choices": ["\u00fc\u00f1"]}, "cannot spell")])
def test_bad_choices_are_refused(json_tokenizer, arg, problem):  # noqa: F811
    with pytest.raises(ValueError, match=problem):
        ChoiceConstraint(json_tokenizer, arg)


def test_guided_choice_and_structured_outputs_on_the_api(json_engine):  # noqa: F811
    from deployments.completion_service import ApiLimits, CompletionService
    from deployments.openai_schema import CompletionRequest, RequestError
    from engine.async_engine import AsyncEngine

    served = AsyncEngine(json_engine(max_batch_size=4))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}

    def ask(**fields):
        return asyncio.run(service.complete(CompletionRequest(prompt=[[1, 10, 11]], temperature=1.0, max_tokens=40,
                                                              **fields))).choices[0]

    try:
        service = CompletionService(served, ApiLimits())
        chosen = [ask(seed=seed, guided_choice=CHOICES) for seed in range(12)]
        structured = [ask(seed=seed, structured_outputs={"choice": CHOICES}) for seed in range(3)]
        typed = [ask(seed=seed, structured_outputs={"json": schema}) for seed in range(3)]
        with pytest.raises(RequestError) as unspellable:
            ask(guided_choice=["\u00fc\u00f1"])
        with pytest.raises(RequestError) as two:
            ask(guided_choice=CHOICES, guided_json=schema)
    finally:
        served.shutdown()
    assert {c.text for c in chosen + structured} <= set(CHOICES) and len({c.text for c in chosen}) >= 2
    assert all(c.finish_reason == "stop" for c in chosen)
    assert [json.loads(c.text).keys() for c in typed if c.finish_reason == "stop"]
    assert unspellable.value.param == "guided_choice" and two.value.param == "guided_choice"
    for bad in ({"regex": "a+"}, {"json_object": True, "choice": ["a"]}, {"choice": "a"}):
        with pytest.raises(ValueError, match="structured_outputs"):
            CompletionRequest(prompt="x", structured_outputs=bad)
