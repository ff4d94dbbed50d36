"""A constrained answer that loops is closed the shortest way its grammar allows (the engine's loop stop
would otherwise cut it mid-object): the shortest completions, the masks that follow them, and the engine
and API ending looping JSON, schema, choice and tool-call answers whole."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from engine.choice_constraint import ChoiceConstraint, ChoiceGrammar
from engine.constraints import DONE
from engine.json_constraint import JSON_CHARACTERS, JsonGrammar, JsonObjectConstraint, shortest_completion
from engine.json_schema_constraint import JsonSchemaConstraint, schema_grammar
from engine.json_schema import schema_key
from engine.types import FinishReason, GenerationRequest, SamplingParams
from tests.test_json_constraint import EOS, json_engine, json_tokenizer  # noqa: F401 (fixtures)

ALPHABET = "".join(sorted(JSON_CHARACTERS))
CITY = {"type": "object", "properties": {"city": {"type": "string", "minLength": 2}, "rank": {"type": "integer"},
                                         "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1}},
        "required": ["city", "rank", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("written, rest", [
    ("", "{}"),
    ('{"a": [1, "x', '"]}'),
    ('{"a": {"b": tr', "ue}}"),
    ('{"a": 12', "}"),
    ('{"a', '":0}'),
    ('{"a": "\\u00', '00"}'),
    ('{"a": [', "]}"),
])
def test_the_shortest_completion_closes_what_is_open(written, rest):
    grammar = JsonGrammar()
    state = grammar.run(grammar.start, written)
    assert shortest_completion(grammar, state, ALPHABET) == rest
    assert grammar.accepts(written + rest)
    assert shortest_completion(grammar, DONE, ALPHABET) == ""


def test_a_schemas_completion_writes_the_required_keys_shortest_values():
    grammar = schema_grammar(schema_key(CITY))
    alphabet = "".join(sorted(JSON_CHARACTERS.union(*map(set, grammar.literal_texts()))))
    for written in ('{"city": "R', '{', '{"city": "Rome", "ra'):
        rest = shortest_completion(grammar, grammar.run(grammar.start, written), alphabet)
        jsonschema.validate(json.loads(written + rest), CITY)  # minLength 2, minItems 1: "R" alone would fail
    assert shortest_completion(grammar, grammar.start, alphabet) == '{"city":"  ","rank":0,"tags":[""]}'


def test_a_bounded_number_completes_to_its_least_writable_value():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 250, "maximum": 300},
                                               "x": {"type": "number", "exclusiveMinimum": 0.5}}, "required": ["n", "x"]}
    grammar = schema_grammar(schema_key(schema))
    alphabet = "".join(sorted(JSON_CHARACTERS.union(*map(set, grammar.literal_texts()))))
    assert shortest_completion(grammar, grammar.start, alphabet) == '{"n":250,"x":1}'
    assert shortest_completion(grammar, grammar.run(grammar.start, '{"n": 2'), alphabet) == '50,"x":1}'
    assert shortest_completion(grammar, grammar.run(grammar.start, '{"n": 299,"x":0.'), alphabet) == '6}'


def test_a_patterned_string_completes_to_a_match():
    schema = {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                               "day": {"type": "string", "format": "date"}}, "required": ["zip", "day"]}
    grammar = schema_grammar(schema_key(schema))
    alphabet = "".join(sorted(JSON_CHARACTERS.union(*map(set, grammar.literal_texts())) | grammar.completion_characters()))
    rest = shortest_completion(grammar, grammar.run(grammar.start, '{"zip": "12'), alphabet)
    assert rest == '000","day":"1000-01-01"}'
    jsonschema.validate(json.loads('{"zip": "12' + rest), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def test_choices_complete_to_the_nearest_whole_choice():
    grammar = ChoiceGrammar(("yes", "yes please", "no"))
    assert shortest_completion(grammar, grammar.start, "aelnopsy ") == "no"
    assert shortest_completion(grammar, grammar.run(grammar.start, "ye"), "aelnopsy ", grammar.may_end) == "s"


def _advance_text(constraint, tokenizer, pieces):
    for piece in pieces:
        constraint.advance(tokenizer.convert_tokens_to_ids(piece))


def _allowed_pieces(constraint, tokenizer) -> set[str]:
    return {tokenizer.convert_ids_to_tokens(i) for i in constraint.allowed().nonzero().flatten().tolist()}


@pytest.mark.parametrize("pieces, first, answer", [
    (['{"', "name", '": ', "[", "1,", ' "', "Paris"], {'"'}, {"name": [1, "Paris"]}),
    (['{"', "name", '": ', ' "', "Paris"], {'"', '"}'}, {"name": "Paris"}),  # '"}' writes two of it at once
])
def test_wrapping_up_allows_only_tokens_that_begin_the_completion(json_tokenizer, pieces, first, answer):  # noqa: F811
    constraint = JsonObjectConstraint(json_tokenizer)
    _advance_text(constraint, json_tokenizer, pieces)
    free = constraint.allowed().sum()
    assert constraint.wrap_up()
    assert _allowed_pieces(constraint, json_tokenizer) == first and constraint.allowed().sum() < free
    while not constraint.is_complete:
        constraint.advance(int(constraint.allowed().nonzero()[-1]))  # the last piece that fits
    assert json.loads(constraint.text) == answer


def test_a_wrap_up_searches_for_its_completion_once(json_tokenizer, monkeypatch):  # noqa: F811
    """The rest of a shortest completion is a shortest completion from where it has got to: the search
    (breadth first, tens of milliseconds through a bounded number's digits) is not run at every token."""
    from engine import json_constraint

    searches = []
    search = json_constraint.shortest_completion
    monkeypatch.setattr(json_constraint, "shortest_completion", lambda *a, **k: searches.append(1) or search(*a, **k))
    constraint = JsonObjectConstraint(json_tokenizer)
    _advance_text(constraint, json_tokenizer, ['{"', "name", '": ', "[", "1,", ' "', "Paris"])
    assert constraint.wrap_up()
    while not constraint.is_complete:
        constraint.advance(int(constraint.allowed().nonzero()[0]))  # the first piece that fits, one character
    assert json.loads(constraint.text) == {"name": [1, "Paris"]} and len(searches) == 1


def test_a_choice_wraps_up_at_the_end_of_sequence_where_a_whole_choice_is_written(json_tokenizer):  # noqa: F811
    constraint = ChoiceConstraint(json_tokenizer, {"choices": ["true", "true false"]})
    _advance_text(constraint, json_tokenizer, ["true"])
    assert constraint.wrap_up()
    assert constraint.allowed().nonzero().flatten().tolist() == [EOS]


def _looping(engine, constraint, arg=None, resume_ids=(), max_tokens=90, bias=None):
    """Greedy decoding pushed into a loop inside a JSON string: 'a' is favoured wherever it may come."""
    tokenizer = engine.tokenizer
    bias = bias or {tokenizer.convert_tokens_to_ids('{"'): 50.0, tokenizer.convert_tokens_to_ids("a"): 100.0}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop_on_loop=True, constraint=constraint,
                            constraint_arg=arg, logit_bias=bias)
    [result] = engine.generate([GenerationRequest(prompt_ids=[1, 10, 11], resume_ids=list(resume_ids),
                                                  params=params)])
    return result


def test_a_looping_json_answer_is_closed_not_cut(json_engine):  # noqa: F811
    engine = json_engine()
    result = _looping(engine, "json_object")
    assert result.finish_reason == FinishReason.STOP and len(result.token_ids) < 60
    [(key, value)] = json.loads(result.text).items()
    assert set(key) == {"a"} and len(key) >= 32  # the loop ran until the detector saw it, then closed
    assert value == 0 and result.text.endswith("0}")


def test_a_looping_schema_answer_is_closed_with_its_required_keys(json_engine):  # noqa: F811
    engine = json_engine()
    schema = {"type": "object", "properties": {"note": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["note", "n"], "additionalProperties": False}
    tokenizer = engine.tokenizer
    bias = {tokenizer.convert_tokens_to_ids('{"'): 50.0, tokenizer.convert_tokens_to_ids('": '): 50.0,
            tokenizer.convert_tokens_to_ids('"'): 50.0, tokenizer.convert_tokens_to_ids("a"): 100.0}
    result = _looping(engine, "json_schema", schema, bias=bias)
    assert result.finish_reason == FinishReason.STOP
    answer = json.loads(result.text)
    jsonschema.validate(answer, schema)
    assert set(answer["note"]) == {"a"}


def test_a_resumed_answer_wraps_up_where_the_uncut_one_did(json_engine):  # noqa: F811
    engine = json_engine()
    whole = _looping(engine, "json_object")
    for cut in (20, 34, len(whole.token_ids) - 1):
        resumed = _looping(engine, "json_object", resume_ids=whole.token_ids[:cut])
        assert resumed.token_ids == whole.token_ids and resumed.finish_reason == FinishReason.STOP


def test_without_a_constraint_the_loop_still_ends_the_answer(json_engine):  # noqa: F811
    engine = json_engine()
    tokenizer = engine.tokenizer
    params = SamplingParams(max_tokens=90, temperature=0.0, stop_on_loop=True,
                            logit_bias={tokenizer.convert_tokens_to_ids("a"): 100.0})
    [result] = engine.generate([GenerationRequest(prompt_ids=[1, 10, 11], params=params)])
    assert result.finish_reason == FinishReason.STOP and set(result.text) == {"a"} and len(result.token_ids) < 40


def test_json_mode_on_the_api_closes_a_looping_answer(json_engine):  # noqa: F811
    from deployments.completion_service import ApiLimits, CompletionService
    from deployments.openai_schema import CompletionRequest
    from engine.async_engine import AsyncEngine

    served = AsyncEngine(json_engine())
    tokenizer = served.engine.tokenizer
    bias = {str(tokenizer.convert_tokens_to_ids('{"')): 50, str(tokenizer.convert_tokens_to_ids("a")): 100}
    try:
        service = CompletionService(served, ApiLimits(default_max_tokens=90))
        request = CompletionRequest(prompt=[[1, 10, 11]], temperature=0.0, logit_bias=bias,
                                    response_format={"type": "json_object"})
        choice = asyncio.run(service.complete(request)).choices[0]
    finally:
        served.shutdown()
    assert choice.finish_reason == "stop" and isinstance(json.loads(choice.text), dict)
