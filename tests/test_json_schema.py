"""Structured outputs: JSON Schema compiled to a character grammar, its answers checked by the
`jsonschema` package (the reference validator), its exact lift to tokens, and decoding under it in
the engine and through the API."""
from __future__ import annotations

import asyncio
import json
import random

import jsonschema
import pytest

from engine.constraints import DONE, make_constraint
from engine.json_schema import compile_schema
from engine.json_schema_constraint import JsonSchemaConstraint, SchemaGrammar
from engine.types import FinishReason, GenerationRequest, SamplingParams
from tests.test_json_constraint import EOS, PIECES, json_engine, json_tokenizer  # noqa: F401 (fixtures)

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 5},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", 1, 12]}, "maxItems": 2},
        "ok": {"type": ["boolean", "null"]},
        "city": {"type": "string"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
TREE = {
    "$defs": {"node": {"type": "object", "properties": {"v": {"type": "number"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v", "kids"]}},
    "$ref": "#/$defs/node",
}
PET = {  # a tagged union, as pydantic writes one
    "type": "object",
    "properties": {"pet": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
         "required": ["kind", "lives"]},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "bark": {"type": "string", "maxLength": 3}},
         "required": ["kind", "bark"]},
    ]}},
    "required": ["pet"],
}
LIST = {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "integer"}},
        "minItems": 1, "maxItems": 3}
FREE = {"type": "object"}
CHAIN = {  # optional nesting without end, and an alternative that must nest: both cut at the depth limit
    "$defs": {"link": {"type": "object", "properties": {"next": {"$ref": "#/$defs/link"}, "also": {"anyOf": [
        {"type": "array", "items": {"$ref": "#/$defs/link"}, "minItems": 1}, {"type": "integer"}]}},
        "required": ["also"]}},
    "$ref": "#/$defs/link",
}
BOUNDED = {  # numeric bounds as pydantic writes them (ge, gt, le, lt), tight and negative windows among them
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 1, "maximum": 12},
        "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "below": {"type": "integer", "minimum": -20, "exclusiveMaximum": -9},
        "window": {"type": "number", "exclusiveMinimum": 9.99, "maximum": 10},
        "exact": {"type": "number", "minimum": 0.25, "maximum": 0.25},
        "whole": {"type": "integer", "minimum": 0.5, "maximum": 2.5},
        "big": {"type": ["integer", "null"], "minimum": 1000},
        "level": {"enum": [1, 5, 9, "max"], "maximum": 5},
        "even": {"type": "integer", "multipleOf": 2, "exclusiveMinimum": -7, "maximum": 9},
        "round": {"type": "number", "multipleOf": 25.0},
    },
    "required": ["count", "ratio", "below", "window", "exact", "whole"],
}
PATTERNED = {  # patterns and formats as pydantic writes them (constr(pattern=...), date, datetime, UUID)
    "type": "object",
    "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
        "word": {"type": "string", "pattern": "b+", "maxLength": 4},  # unanchored: around a run of b
        "even": {"type": "string", "pattern": "^(?:aa)*$", "minLength": 1, "maxLength": 5},  # so 2 or 4 long
        "quote": {"type": "string", "pattern": "^x\"?\\\\?$"},  # characters JSON writes escaped
        "day": {"type": "string", "format": "date"},
        "at": {"type": "string", "format": "date-time"},
        "id": {"type": "string", "format": "uuid"},
        "mail": {"type": "string", "format": "email"},
        "ip": {"type": ["string", "null"], "format": "ipv4"},
    },
    "required": ["code", "word", "even", "quote", "day"],
}
UNIQUE = {  # uniqueItems, as pydantic writes it for set[...] fields: items that must all differ
    "type": "object",
    "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}, "uniqueItems": True},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "uniqueItems": True, "minItems": 2},
        "small": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 3}, "uniqueItems": True},
        "mixed": {"type": "array", "items": {"type": ["number", "boolean", "null"]}, "uniqueItems": True, "maxItems": 6},
        "letters": {"type": "array", "items": {"anyOf": [{"type": "string", "maxLength": 1}, {"const": "ab"}]},
                    "uniqueItems": True},
        "free": {"type": "array", "items": {"type": "object"}, "uniqueItems": False},
        "days": {"type": "array", "items": {"type": "string", "format": "date"}, "uniqueItems": True, "maxItems": 3},
        "codes": {"type": "array", "items": {"type": "string", "pattern": "^[ab]{1,2}$"}, "uniqueItems": True},
        "marks": {"type": "array", "items": {"type": "string", "pattern": "^.$"}, "uniqueItems": True},  # a large class
    },
    "required": ["tags", "colors", "small"],
}
COUNTED = {  # minProperties / maxProperties (pydantic's dict fields with min_length / max_length)
    "type": "object",
    "properties": {
        "scores": {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2,
                   "maxProperties": 3},
        "flags": {"type": "object", "additionalProperties": {"type": "boolean"}, "maxProperties": 1},
        "some": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
                                                 "c": {"type": "integer"}, "d": {"type": "integer"}},
                 "required": ["c"], "minProperties": 2, "maxProperties": 3},
    },
    "required": ["scores", "some"],
}
KEYED = {  # free keys under a rule, as pydantic writes dict[Enum, X], dict[Literal[...], X], dict[constr(...), X]
    "$defs": {"Color": {"enum": ["red", "green"], "type": "string"}},
    "type": "object",
    "properties": {
        "by_color": {"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"$ref": "#/$defs/Color"}},
        "weights": {"type": "object", "additionalProperties": {"type": "number"}, "propertyNames": {"enum": ["p", "q"]},
                    "minProperties": 1},
        "codes": {"type": "object", "patternProperties": {"^[a-c]+$": {"type": "integer"}},
                  "propertyNames": {"maxLength": 2}},
        "short": {"type": "object", "propertyNames": {"maxLength": 1}, "maxProperties": 2},
        "days": {"type": "object", "additionalProperties": {"type": "boolean"}, "propertyNames": {"format": "date"}},
        "both": {"type": "object", "patternProperties": {"x": {"type": "null"}}, "propertyNames": {"enum": ["ax", "b", "x"]}},
        "listed": {"type": "object", "properties": {"a": {"type": "integer"}, "bad": {"type": "integer"}},
                   "propertyNames": {"maxLength": 1}, "patternProperties": {"^z": {"type": "string"}}},
    },
    "required": ["by_color", "weights", "codes"],
}
SCHEMAS = {"person": PERSON, "tree": TREE, "pet": PET, "list": LIST, "free": FREE, "chain": CHAIN, "bounded": BOUNDED,
           "patterned": PATTERNED, "unique": UNIQUE, "counted": COUNTED, "keyed": KEYED}
FORMATS_CHECKED = jsonschema.Draft202012Validator.FORMAT_CHECKER


def _grammar(schema) -> SchemaGrammar:
    return SchemaGrammar(compile_schema(schema), max_depth=6)


@pytest.mark.parametrize("schema, text, valid", [
    (PERSON, '{"name":"Bob","age":3}', True),
    (PERSON, '{"name": "Bob", "age": -30, "tags": ["a", 12], "ok": null, "city": "x\\u00e9"}', True),
    (PERSON, '{"name":"Bob","age":3,"city":"Paris"}', True),  # optional ones skipped
    (PERSON, '{"name":"Bobbyy","age":3}', False),  # maxLength
    (PERSON, '{"name":"","age":3}', False),  # minLength
    (PERSON, '{"name":"x","age":3.5}', False),  # integer
    (PERSON, '{"name":"x","age":3,"tags":[1,12,"a"]}', False),  # maxItems
    (PERSON, '{"name":"x","age":3,"tags":[123]}', False),  # enum
    (PERSON, '{"name":"x","age":3,"extra":1}', False),  # additionalProperties false
    (PERSON, '{"name":"x"}', False),  # required
    (TREE, '{"v":1,"kids":[{"v":2.5e-1,"kids":[]}]}', True),
    (TREE, '{"v":1,"kids":[{"v":2}]}', False),
    (PET, '{"pet":{"kind":"cat","lives":9}}', True),
    (PET, '{"pet":{"kind":"dog","bark":"wof"}}', True),
    (PET, '{"pet":{"kind":"dog","lives":9}}', False),
    (LIST, '[{"a":1,"b":-2},{}]', True),
    (LIST, '[]', False),
    (LIST, '[{"a":"x"}]', False),
    (FREE, '{"a":[1,{"b":null}],"c":"x","d":true}', True),
    (PATTERNED, '{"code":"AB-123","word":"abba","even":"aa","quote":"x","day":"2024-02-28"}', True),
    (PATTERNED, '{"code":"AB-123","word":"b","even":"aaaa","quote":"x\\"\\\\","day":"1999-12-31",'
                '"at":"2024-06-01T23:59:59.5+02:00","id":"123e4567-e89b-12d3-a456-426614174000",'
                '"mail":"ann.lee@mail.example.org","ip":"192.168.0.255"}', True),
    (PATTERNED, '{"code":"ab-123","word":"b","even":"aa","quote":"x","day":"2024-02-28"}', False),
    (PATTERNED, '{"code":"AB-123","word":"aaaa","even":"aa","quote":"x","day":"2024-02-28"}', False),  # no b
    (PATTERNED, '{"code":"AB-123","word":"abbba","even":"aa","quote":"x","day":"2024-02-28"}', False),  # maxLength
    (PATTERNED, '{"code":"AB-123","word":"b","even":"aaa","quote":"x","day":"2024-02-28"}', False),
    (PATTERNED, '{"code":"AB-123","word":"b","even":"aa","quote":"x","day":"2024-13-01"}', False),
    (PATTERNED, '{"code":"AB-123","word":"b","even":"aa","quote":"x","day":"2024-02-28","ip":"256.1.1.1"}', False),
    (BOUNDED, '{"count":1,"ratio":0.5,"below":-20,"window":10,"exact":0.25,"whole":1}', True),
    (BOUNDED, '{"count":12,"ratio":0.999,"below":-10,"window":9.991,"exact":0.250,"whole":2,"big":1000,"level":5}', True),
    (BOUNDED, '{"count":1,"ratio":0.5,"below":-20,"window":10,"exact":0.25,"whole":1,"level":"max"}', True),
    (BOUNDED, '{"count":0,"ratio":0.5,"below":-20,"window":10,"exact":0.25,"whole":1}', False),  # minimum
    (BOUNDED, '{"count":13,"ratio":0.5,"below":-20,"window":10,"exact":0.25,"whole":1}', False),  # maximum
    (BOUNDED, '{"count":1,"ratio":0,"below":-20,"window":10,"exact":0.25,"whole":1}', False),  # exclusiveMinimum
    (BOUNDED, '{"count":1,"ratio":1.0,"below":-20,"window":10,"exact":0.25,"whole":1}', False),  # exclusiveMaximum
    (BOUNDED, '{"count":1,"ratio":0.5,"below":-9,"window":10,"exact":0.25,"whole":1}', False),
    (BOUNDED, '{"count":1,"ratio":0.5,"below":-21,"window":10,"exact":0.25,"whole":1}', False),
    (BOUNDED, '{"count":1,"ratio":0.5,"below":-20,"window":9.99,"exact":0.25,"whole":1}', False),
    (BOUNDED, '{"count":1,"ratio":0.5,"below":-20,"window":10.0001,"exact":0.25,"whole":1}', False),
    (BOUNDED, '{"count":1,"ratio":0.5,"below":-20,"window":10,"exact":0.2501,"whole":1}', False),
    (BOUNDED, '{"count":1,"ratio":0.5,"below":-20,"window":10,"exact":0.25,"whole":3}', False),
    (BOUNDED, '{"count":1,"ratio":0.5,"below":-20,"window":10,"exact":0.25,"whole":1,"big":999}', False),
    (BOUNDED, '{"count":1,"ratio":0.5,"below":-20,"window":10,"exact":0.25,"whole":1,"level":9}', False),
    (BOUNDED, '{"count":1,"ratio":0.5,"below":-20,"window":10,"exact":0.25,"whole":1,"even":-6,"round":-75}', True),
    (BOUNDED, '{"count":1,"ratio":0.5,"below":-20,"window":10,"exact":0.25,"whole":1,"even":5}', False),
    (BOUNDED, '{"count":1,"ratio":0.5,"below":-20,"window":10,"exact":0.25,"whole":1,"even":-8}', False),
    (BOUNDED, '{"count":1,"ratio":0.5,"below":-20,"window":10,"exact":0.25,"whole":1,"round":30}', False),
    (FREE, '{"a":}', False),
    (UNIQUE, '{"tags":["a","ab",""],"colors":["red","blue"],"small":[3,1,2]}', True),
    (UNIQUE, '{"tags":[],"colors":["green","red"],"small":[],"mixed":[1,true,null,0,-1.5,false],"free":[{},{}]}', True),
    (UNIQUE, '{"tags":["a","a"],"colors":["red","blue"],"small":[1]}', False),
    (UNIQUE, '{"tags":["\\n","\\u000a"],"colors":["red","blue"],"small":[1]}', False),  # one string, escaped twice
    (UNIQUE, '{"tags":[],"colors":["red","red"],"small":[1]}', False),
    (UNIQUE, '{"tags":[],"colors":["red"],"small":[1]}', False),  # minItems
    (UNIQUE, '{"tags":[],"colors":["red","blue"],"small":[1,2,3,1]}', False),
    (UNIQUE, '{"tags":[],"colors":["red","blue"],"small":[],"mixed":[1,1.0]}', False),  # one number
    (UNIQUE, '{"tags":[],"colors":["red","blue"],"small":[],"mixed":[0,-0]}', False),
    (UNIQUE, '{"tags":[],"colors":["red","blue"],"small":[],"mixed":[2.50,2.5]}', False),
    (UNIQUE, '{"tags":[],"colors":["red","blue"],"small":[],"mixed":[true,true]}', False),
    (UNIQUE, '{"tags":[],"colors":["red","blue"],"small":[],"letters":["a","ab","b"]}', True),
    (UNIQUE, '{"tags":[],"colors":["red","blue"],"small":[],"letters":["b","b"]}', False),
    (UNIQUE, '{"tags":[],"colors":["red","blue"],"small":[],"codes":["a","b","ab","ba","aa","bb"]}', True),
    (UNIQUE, '{"tags":[],"colors":["red","blue"],"small":[],"codes":["ab","a","ab"]}', False),
    (COUNTED, '{"scores":{"x":1,"y":2},"flags":{"on":true},"some":{"a":1,"c":3}}', True),
    (COUNTED, '{"scores":{"x":1,"y":2,"z":3},"some":{"a":1,"b":2,"c":3}}', True),
    (COUNTED, '{"scores":{"x":1,"y":2},"some":{"c":3,"d":4}}', True),
    (COUNTED, '{"scores":{"x":1},"some":{"a":1,"c":3}}', False),  # minProperties
    (COUNTED, '{"scores":{"x":1,"x":2},"some":{"a":1,"c":3}}', False),  # one key twice is one property
    (COUNTED, '{"scores":{"w":0,"x":1,"y":2,"z":3},"some":{"a":1,"c":3}}', False),  # maxProperties
    (COUNTED, '{"scores":{"x":1,"y":2},"flags":{"on":true,"off":false},"some":{"a":1,"c":3}}', False),
    (COUNTED, '{"scores":{"x":1,"y":2},"some":{"c":3}}', False),
    (COUNTED, '{"scores":{"x":1,"y":2},"some":{"a":1,"b":2,"c":3,"d":4}}', False),
    (UNIQUE, '{"tags":[],"colors":["red","blue"],"small":[],"marks":["a","\\"","b"]}', True),
    (UNIQUE, '{"tags":[],"colors":["red","blue"],"small":[],"marks":["a","b","a"]}', False),
    (UNIQUE, '{"tags":[],"colors":["red","blue"],"small":[],"days":["2024-01-01","2024-01-02"]}', True),
    (UNIQUE, '{"tags":[],"colors":["red","blue"],"small":[],"days":["2024-01-01","2024-01-01"]}', False),
    (KEYED, '{"by_color":{"red":1,"green":2},"weights":{"q":0.5},"codes":{"ab":1,"c":2}}', True),
    (KEYED, '{"by_color":{},"weights":{"p":1,"q":2},"codes":{},"short":{"a":1,"b":[]},"days":{"2024-02-28":true},'
            '"both":{"ax":null,"x":null},"listed":{"a":1}}', True),
    (KEYED, '{"by_color":{"blue":1},"weights":{"q":0.5},"codes":{}}', False),  # not a Color
    (KEYED, '{"by_color":{},"weights":{},"codes":{}}', False),  # minProperties
    (KEYED, '{"by_color":{},"weights":{"r":1},"codes":{}}', False),
    (KEYED, '{"by_color":{},"weights":{"p":1},"codes":{"abc":1}}', False),  # propertyNames' maxLength
    (KEYED, '{"by_color":{},"weights":{"p":1},"codes":{"ab":"x"}}', False),  # the pattern's schema
    (KEYED, '{"by_color":{},"weights":{"p":1},"codes":{},"short":{"ab":1}}', False),
    (KEYED, '{"by_color":{},"weights":{"p":1},"codes":{},"short":{"a":1,"b":2,"c":3}}', False),  # maxProperties
    (KEYED, '{"by_color":{},"weights":{"p":1},"codes":{},"days":{"2024-02-30":true}}', False),
    (KEYED, '{"by_color":{},"weights":{"p":1},"codes":{},"both":{"ax":1}}', False),  # the pattern's schema
    (KEYED, '{"by_color":{},"weights":{"p":1},"codes":{},"listed":{"a":1,"bad":2}}', False),  # a name too long
    ({"type": "object", "properties": {"a": {"minProperties": 1}}, "required": ["a"]}, '{"a":{"b":0}}', True),
    ({"type": "object", "properties": {"a": {"minProperties": 1}}, "required": ["a"]}, '{"a":{}}', False),
])
def test_the_grammar_agrees_with_the_reference_validator(schema, text, valid):
    assert _grammar(schema).accepts(text) is valid
    is_valid = (jsonschema.Draft202012Validator(schema, format_checker=FORMATS_CHECKED).is_valid(json.loads(text))
                if _parses(text) else False)
    assert is_valid is valid


def test_nothing_is_begun_that_cannot_be_finished_within_the_depth_limit():
    grammar = _grammar(CHAIN)  # max_depth 6
    deep = '{"next":' * 5  # five levels open; a sixth link fits if it goes no deeper
    assert grammar.run(grammar.start, deep + '{"') is not None
    assert grammar.run(grammar.start, deep + '{"n') is None  # its "next" would need a seventh level
    assert grammar.run(grammar.start, deep + '{"also":[') is None  # and so would a list of links
    assert grammar.accepts(deep + '{"also":1}' + ',"also":2}' * 5)
    with pytest.raises(ValueError, match="nested containers"):
        SchemaGrammar(compile_schema({"type": "array", "items": {"type": "array", "items": {"type": "array"},
                                                                  "minItems": 1}, "minItems": 1}), max_depth=2)


class NoToken:
    """A constraint that breaks its promise: nothing may come next."""

    def __init__(self, tokenizer):
        self.size = len(tokenizer)

    def allowed(self):
        import torch

        return torch.zeros(self.size, dtype=torch.bool)

    def advance(self, token_id):
        raise ValueError("nothing may come next")

    is_complete = False


def test_a_constraint_that_allows_no_token_ends_its_answer_not_the_engine(json_engine, monkeypatch):  # noqa: F811
    from engine import constraints

    monkeypatch.setitem(constraints.CONSTRAINTS, "no_token", "tests.test_json_schema:NoToken")
    engine = json_engine(max_batch_size=4)
    broken, plain = engine.generate([
        GenerationRequest(prompt_ids=[1, 10, 11], params=SamplingParams(max_tokens=8, constraint="no_token")),
        GenerationRequest(prompt_ids=[1, 10, 12], params=SamplingParams(max_tokens=8, temperature=1.0, seed=1)),
    ])
    assert broken.finish_reason == FinishReason.STOP and broken.token_ids == []
    assert len(plain.token_ids) == 8 or plain.finish_reason == FinishReason.STOP


def test_numbers_have_at_most_19_digits_a_part():
    grammar = _grammar(TREE)
    assert grammar.accepts('{"v":' + "1" * 19 + ',"kids":[]}')
    assert not grammar.accepts('{"v":' + "1" * 20 + ',"kids":[]}')


def test_properties_come_in_the_schemas_order():
    """A subset of what the schema allows, as OpenAI writes it: valid out of order, not admitted."""
    text = '{"age":3,"name":"x"}'
    assert jsonschema.Draft202012Validator(PERSON).is_valid(json.loads(text))
    assert not _grammar(PERSON).accepts(text)


def test_a_patterned_string_decodes_its_escapes_and_escapes_only_control_characters():
    """The pattern reads the text as decoded; a \\u escape is taken for a control character only (a
    subset of what is valid: "\\u0042" is a B, written as it is), so no escape is begun that no
    character of the pattern could finish."""
    grammar = _grammar({"type": "object", "properties": {"a": {"type": "string", "pattern": "^[A-Z\\s]+$"}}})
    assert grammar.accepts('{"a":"A\\nB\\u0009C"}')  # a newline and a tab, escaped two ways
    assert not grammar.accepts('{"a":"A\\u0042"}')
    assert grammar.run(grammar.start, '{"a":"A\\u000') is not None  # \\u0009 to \\u000d are spaces
    assert grammar.run(grammar.start, '{"a":"A\\u001') is None  # \\u0010 to \\u001f are not
    digits = _grammar({"type": "object", "properties": {"a": {"type": "string", "pattern": "^[0-9]+$"}}})
    assert digits.run(digits.start, '{"a":"1\\') is None  # no escape decodes to a digit


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_answer_the_grammar_completes_validates(name):
    """Random walks through the grammar, a character at a time among those it admits: every text
    that reaches the end parses and validates; none stops where no character may follow."""
    schema, grammar = SCHEMAS[name], _grammar(SCHEMAS[name])
    alphabet = sorted(set('{}[]:,"\\ -.e+0123456789abuxtrfalsn') | set("".join(grammar.literal_texts()))
                      | grammar.completion_characters() | set("ZT:@"))
    completed = _completed_walks(grammar, alphabet, random.Random(11), walks=150, most=400, closers='"}]',
                                 closing_after=30, closing_odds=0.7)
    for text in completed:
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS_CHECKED)
    assert len(completed) > 50


def _completed_walks(grammar, alphabet, rng, walks: int, most: int, closers: str, closing_after: int,
                     closing_odds: float) -> list[str]:
    """The texts of random walks through the grammar that reached its end, a character at a time among
    those it admits (past `closing_after` characters, one of `closers` with `closing_odds`, so that
    walks end); asserts that no walk stops where no character may follow."""
    completed = []
    for _ in range(walks):
        state, text = grammar.start, ""
        while state != DONE and len(text) < most:
            nexts = [(ch, s) for ch in alphabet for s in [grammar.step(state, ch)] if s is not None]
            assert nexts, f"dead end after {text!r}"
            closing = [n for n in nexts if n[0] in closers] if len(text) > closing_after else []
            ch, state = rng.choice(closing if closing and rng.random() < closing_odds else nexts)
            text += ch
        if state == DONE:
            completed.append(text)
    return completed


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "string"}, "must be an object or an array"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}}, "a.pattern: a lookaround"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "(a)\\1"}}}, "pattern: \\\\1 is not"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "a^b"}}}, "'\\^' inside the pattern"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^ab$", "minLength": 3}}}, "no string of 3"),
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^a", "format": "date"}}}, "beside a format"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "ipv4network"}}}, "a.format: 'ipv4network'"),
    ({"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0.01}}}, "multipleOf: only a whole"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, "a.uniqueItems: only items"),
    ({"type": "array", "items": {"type": "object"}, "uniqueItems": True}, "not objects"),
    ({"type": "array", "items": {"type": "string", "pattern": "^[ab]$"}, "uniqueItems": True, "minItems": 3},
     "fewer than minItems 3"),
    ({"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 3}, "fewer than minItems 3"),
    ({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 1}, "uniqueItems": True, "minItems": 3},
     "fewer than minItems 3"),
    ({"type": "array", "items": {"type": "boolean"}, "uniqueItems": "yes"}, "uniqueItems: true or false"),
    ({"type": "object", "properties": {"a": {}}, "minProperties": 2}, "minProperties 2 is above its 1 properties"),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a", "b"], "maxProperties": 1},
     "maxProperties 1 is below its 2 required"),
    ({"type": "object", "additionalProperties": False, "minProperties": 1}, "minProperties 1 with additionalProp"),
    ({"type": "object", "minProperties": -1}, "minProperties: a count"),
    ({"type": "object", "properties": {"a": {"type": "number", "minimum": 5, "maximum": 3}}}, "no number lies within"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0.2, "maximum": 0.8}}}, "no integer"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 10**20}}}, "no integer"),  # over 19 digits
    ({"type": "object", "properties": {"a": {"type": "number", "maximum": "9"}}}, "properties.a.maximum: a number"),
    ({"type": "object", "properties": {"a": {"enum": [1, 2], "minimum": 3}}}, "no value of its enum"),
    ({"type": "object", "properties": {"a": {"$ref": "http://x/y"}}}, "properties.a.\\$ref"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}, "names no definition"),
    ({"type": "object", "required": ["z"], "additionalProperties": False}, "'z' is required"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 2}}}, "below"),
    ({"type": "object", "properties": {"a": {"type": "text"}}}, "not a JSON Schema type"),
    ({"type": "object", "properties": {"a": {"type": [["string"]]}}}, "not a JSON Schema type"),  # was a TypeError
    ({"type": "object", "properties": {"a": {"type": None}}}, "a.type: a type name or a list of them, not None"),  # was read as no type: any
    ({"type": "object", "properties": 0}, "schema.properties: an object of schemas, not 0"),  # was read as none
    ({"type": "object", "properties": {"a": {}}, "required": False}, "required: a list of property names, not False"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": "x"}, "additionalProperties: a schema"),
    ({"type": "object", "minimum": "nan"}, "schema.minimum: a number, not 'nan'"),  # read by no object, still held
    ({"type": "object", "$defs": []}, "\\$defs: an object of named schemas"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": None}, "additionalProperties: a schema \\(an object or a boolean\\), not None"),
    ({"type": "object", "required": [["a"]]}, "a list of property names"),  # was a TypeError
    ({"type": "object", "properties": {"a": {"$ref": ["#/$defs/a"]}}}, "properties.a.\\$ref"),  # was a TypeError
    ({"$defs": [{"type": "object"}], "$ref": "#/$defs/0"}, "\\$defs: an object of named schemas"),  # AttributeError
    ({"type": "object", "properties": {"a": {"const": 1, "type": [{}]}}}, "not a JSON Schema type"),  # TypeError
    ({"type": "array", "minItems": None}, "minItems: a count, not None"),  # TypeError
    ({"type": "object", "properties": {"a": {"enum": [1], "minimum": None}}}, "minimum: a number, not None"),
    ({"type": "object", "properties": {"a": False}}, "admits no value"),
    ({"type": "object", "properties": {"a": {"allOf": [{"type": "string"}, {"maxLength": 2}]}}}, "allOf"),
    ({"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
      "$ref": "#/$defs/n"}, "no finite value"),
    ({"type": "object", "patternProperties": {"^a": {}, "^b": {}}}, "patternProperties: one pattern at most"),
    ({"type": "object", "patternProperties": {"^a": {}}, "propertyNames": {"pattern": "b"}}, "propertyNames pattern"),
    ({"type": "object", "patternProperties": {"(?=a)": {}}}, "patternProperties: a lookaround"),
    ({"type": "object", "patternProperties": {"^a$": {}}, "propertyNames": {"enum": ["b"]}}, "no name that"),
    ({"type": "object", "patternProperties": {"^a": {"type": "text"}}}, "patternProperties.\\^a.type"),
    ({"type": "object", "patternProperties": []}, "patternProperties: an object of schemas"),
    ({"type": "object", "properties": {"ab": {}}, "patternProperties": {"b": {}}}, "'ab' also matches 'b'"),
    ({"type": "object", "propertyNames": {"type": "integer"}}, "propertyNames: admits no string"),
    ({"type": "object", "propertyNames": 3}, "propertyNames: a schema"),
    ({"type": "object", "properties": {"abc": {}}, "required": ["abc"], "propertyNames": {"maxLength": 2}},
     "the required property 'abc'"),
    ({"type": "object", "propertyNames": {"enum": ["a", "b"]}, "minProperties": 3}, "fewer than minProperties 3"),
    ({"type": "object", "propertyNames": False, "minProperties": 1}, "fewer than minProperties 1"),
    ({"type": "object", "properties": {"ab": {}}, "propertyNames": {"maxLength": 1}, "minProperties": 1},
     "no property that propertyNames admits"),
])
def test_what_the_grammar_cannot_honour_is_refused_naming_it(schema, keyword):
    with pytest.raises(ValueError, match=keyword):
        compile_schema(schema)


def test_the_token_mask_is_exactly_the_tokens_the_grammar_accepts_whole(json_tokenizer):  # noqa: F811
    strings = [json_tokenizer.decode([i]) for i in range(len(json_tokenizer))]
    rng = random.Random(5)
    for schema in (PERSON, FREE, UNIQUE, SHORT_SET, CODE_SET, COUNTED):
        for _ in range(5):
            constraint = JsonSchemaConstraint(json_tokenizer, schema)
            grammar = constraint.grammar
            for _ in range(40):
                if constraint.is_complete:
                    break
                mask = constraint.allowed()
                expected = [i > EOS and s != "" and "\ufffd" not in s and grammar.run(constraint.state, s) is not None
                            for i, s in enumerate(strings)]
                assert mask.tolist() == expected
                assert mask.any()
                constraint.advance(rng.choice(mask.nonzero()[:, 0].tolist()))


@pytest.mark.parametrize("items, distinct", [
    ({"type": "integer", "minimum": 1, "maximum": 3}, 3),
    ({"enum": ["x", 1, 1.0, True]}, 3),  # 1 and 1.0 are one value; true is not 1
    ({"type": ["boolean", "null"]}, 3),
    ({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 1}, {"enum": [0, 1, 2]}]}, 3),
    ({"type": "string", "maxLength": 0}, 1),
    ({"type": "string", "pattern": "^[ab]c?$"}, 4),
    ({"type": "string", "pattern": "^(?:x|xy|\\n)$"}, 3),  # one a prefix of another; a character written escaped
    ({"type": "string", "pattern": "^[0-4]$", "minLength": 1}, 5),
    ({"anyOf": [{"type": "string", "pattern": "^a$"}, {"enum": ["a", "b"]}]}, 2),
    ({"type": "integer", "multipleOf": 5, "minimum": -10, "maximum": 10}, 5),
    ({"type": "number", "minimum": 0.5, "maximum": 0.5}, 1),
])
def test_a_unique_array_of_few_values_fills_up_and_never_repeats_one(items, distinct):
    """Walks that seldom close the array: each completed one validates (no value twice), some hold every
    value there is, and none reached a dead end (the walk asserts it) when there was none left to add."""
    schema = {"type": "array", "items": items, "uniqueItems": True}
    grammar = _grammar(schema)
    alphabet = sorted(set('[],"-.0123456789 abcnxy\\') | set("".join(grammar.literal_texts())))
    completed = _completed_walks(grammar, alphabet, random.Random(4), walks=80, most=400, closers="]",
                                 closing_after=120, closing_odds=0.2)
    sizes = set()
    for text in completed:
        jsonschema.validate(json.loads(text), schema)
        sizes.add(len(json.loads(text)))
    assert max(sizes) == distinct and len(completed) > 40


SHORT_SET = {"type": "array", "items": {"type": "string", "maxLength": 1}, "uniqueItems": True}
CODE_SET = {"type": "array", "items": {"type": "string", "pattern": "^[a-c]{1,2}$"}, "uniqueItems": True, "maxItems": 9}


def test_a_unique_array_never_offers_a_token_that_would_repeat_an_item(json_tokenizer):  # noqa: F811
    """Strings of one character that must differ: once "a" is there, a token that would write it again is
    out of the mask (the shortcut that lets every plain token fit a string is not taken then), and so is a
    close of the array once every value of a finite kind is used."""
    ids = {json_tokenizer.decode([i]): i for i in range(len(json_tokenizer))}

    def allowed_after(schema, pieces: list[str]) -> set[str]:
        constraint = JsonSchemaConstraint(json_tokenizer, schema)
        for piece in pieces:
            constraint.advance(ids[piece])
        return {json_tokenizer.decode([i]) for i in constraint.allowed().nonzero()[:, 0].tolist()}

    allowed = allowed_after(SHORT_SET, ["[", '"', "a", '",', ' "'])
    assert "a" not in allowed and "b" in allowed and '"' in allowed and "ab" not in allowed
    small = {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True}
    allowed = allowed_after(small, ["[", "1", ","])
    assert "2" in allowed and "1" not in allowed and "12" not in allowed
    allowed = allowed_after(small, ["[", "1", ",", "2"])
    assert "]" in allowed and "," not in allowed  # no third value is left to write


def test_free_keys_under_a_rule_are_never_written_twice_and_run_out():
    """Kept keys: an enum's names are written once each, and once both are there no comma is offered (no
    dead end); a pattern's keys likewise, so "a" cannot come again but "b" can."""
    grammar = _grammar({"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"enum": ["p", "q"]}})
    assert grammar.run(grammar.start, '{"p":1,"p') is None
    assert grammar.run(grammar.start, '{"p":1,"q') is not None
    assert grammar.run(grammar.start, '{"p":1,"q":2,') is None and grammar.accepts('{"p":1,"q":2}')
    patterned = _grammar({"type": "object", "patternProperties": {"^[ab]$": {"type": "integer"}}})
    assert patterned.run(patterned.start, '{"a":1,"a') is None
    assert patterned.accepts('{"a":1,"b":2}') and patterned.run(patterned.start, '{"a":1,"b":2,') is None
    assert not patterned.accepts('{"c":1}')  # a key that would fall to additionalProperties is not written
    none = _grammar({"type": "object", "propertyNames": False})
    assert none.accepts("{}") and none.run(none.start, '{"') is None


def test_a_key_the_tokenizer_cannot_spell_is_refused(json_tokenizer):  # noqa: F811
    schema = {"type": "object", "properties": {"\u00fc\u00f1": {"type": "integer"}}}  # neither is a piece
    with pytest.raises(ValueError, match="cannot spell"):
        make_constraint("json_schema", json_tokenizer, arg=schema)


SMALL = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "n": {"type": "integer"},
                                          "ok": {"type": "boolean"}}, "required": ["name", "n", "ok"],
         "additionalProperties": False}


def _decode(engine, seed: int, max_tokens: int = 40, resume_ids=()):
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, constraint="json_schema",
                            constraint_arg=SMALL)
    [result] = engine.generate([GenerationRequest(prompt_ids=[1, 10, 11], resume_ids=list(resume_ids),
                                                  params=params)])
    return result


def test_answers_decoded_under_a_schema_validate(json_engine):  # noqa: F811
    engine, grammar, finished = json_engine(max_batch_size=4), _grammar(SMALL), 0
    for seed in range(10):
        result = _decode(engine, seed)
        assert grammar.run(grammar.start, result.text) is not None, result.text
        if result.finish_reason == FinishReason.STOP:
            jsonschema.validate(json.loads(result.text), SMALL)
            finished += 1
    assert finished >= 5


def test_a_schema_answer_cut_and_resumed_is_the_answer_never_cut(json_engine):  # noqa: F811
    engine = json_engine()
    for seed in range(3):
        whole = _decode(engine, seed=seed, max_tokens=30)
        resumed = _decode(engine, seed=seed, max_tokens=30, resume_ids=whole.token_ids[: len(whole.token_ids) // 2])
        assert resumed.token_ids == whole.token_ids


def test_structured_outputs_on_the_api(json_engine):  # noqa: F811
    from deployments.completion_service import ApiLimits, CompletionService
    from deployments.openai_schema import ChatCompletionRequest, CompletionRequest, RequestError
    from engine.async_engine import AsyncEngine

    served = AsyncEngine(json_engine(max_batch_size=4))
    schema_format = {"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL, "strict": True}}
    try:
        service = CompletionService(served, ApiLimits(default_max_tokens=40))
        answers = [asyncio.run(service.complete(CompletionRequest(prompt=[[1, 10, 11]], temperature=1.0, seed=seed,
                                                                  **fields)))
                   for seed in range(4) for fields in ({"response_format": schema_format}, {"guided_json": SMALL},
                                                       {"guided_json": json.dumps(SMALL)})]
        with pytest.raises(RequestError) as both:
            asyncio.run(service.complete(CompletionRequest(prompt=[[1, 10, 11]], guided_json=SMALL,
                                                           response_format={"type": "json_object"})))
        unspellable = {"type": "object", "properties": {"\u00fc\u00f1": {"type": "integer"}}}
        with pytest.raises(RequestError) as spelling:
            asyncio.run(service.complete(CompletionRequest(prompt=[[1, 10, 11]], guided_json=unspellable)))
    finally:
        served.shutdown()
    finished = [json.loads(a.choices[0].text) for a in answers if a.choices[0].finish_reason == "stop"]
    assert len(finished) >= 6
    for answer in finished:
        jsonschema.validate(answer, SMALL)
    assert both.value.param == "guided_json" and spelling.value.param == "guided_json"
    with pytest.raises(ValueError, match="'dependentRequired' is not supported"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "object", "dependentRequired": {"x": ["y"]}}}}}})


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_a_mutated_schema_compiles_or_is_refused_with_a_value_error():
    """Schemas of every shape above, mutated at random as tests/test_api_fuzz mutates requests: each one
    compiles to a grammar that walks, or is a ValueError (a 400), never another exception (a 500)."""
    from tests.test_api_fuzz import mutated

    rng, compiled = random.Random(3), 0
    for _ in range(1500):
        schema = SCHEMAS[rng.choice(sorted(SCHEMAS))]
        for _ in range(rng.randint(1, 3)):
            schema = mutated(schema, rng)
        try:
            grammar = _grammar(schema)
        except ValueError:
            continue
        compiled += 1
        state = grammar.start
        for ch in '{"a": [1, "x"], "b": -2.5}'[: rng.randint(1, 20)]:
            state = grammar.step(state, ch) if state not in (None, DONE) else state
    assert compiled > 100  # the rest refused


def test_answers_to_a_pydantic_models_schema_validate_as_that_model():
    """What `client.chat.completions.parse(response_format=Model)` sends: pydantic's own schema, with its
    bounds, patterns and formats; every answer the grammar completes is a valid Model."""
    import datetime
    import pathlib
    import uuid
    from typing import Annotated, Literal

    from pydantic import BaseModel, Field, IPvAnyAddress

    class Booking(BaseModel):
        guest: Annotated[str, Field(min_length=1, max_length=12)]
        room: Annotated[str, Field(pattern=r"^[A-D][0-9]{3}$")]
        nights: Annotated[int, Field(ge=1, le=14)]
        price: Annotated[float, Field(gt=0, lt=10000)]
        arrival: datetime.date
        booked_at: datetime.datetime
        reference: uuid.UUID
        kind: Literal["single", "double"]
        stay: datetime.timedelta
        wifi_gateway: IPvAnyAddress
        receipt_folder: pathlib.Path
        perks: set[Literal["breakfast", "parking", "wifi"]]
        notes: frozenset[Annotated[str, Field(max_length=3)]]
        extras: Annotated[dict[str, int], Field(min_length=1, max_length=2)]
        rates: dict[Literal["low", "high"], float]
        codes: dict[Annotated[str, Field(pattern=r"^[A-D]{1,2}$", max_length=2)], int]

    schema = Booking.model_json_schema()
    grammar = _grammar(schema)
    alphabet = sorted(set('{}[]:,"\\ -.+0123456789abcdefZTPYMWDHS/') | set("".join(grammar.literal_texts()))
                      | grammar.completion_characters())
    completed = _completed_walks(grammar, alphabet, random.Random(2), walks=60, most=600, closers='"}',
                                 closing_after=60, closing_odds=0.5)
    for text in completed:
        Booking.model_validate_json(text)
    assert len(completed) > 20
