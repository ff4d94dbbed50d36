"""`python -m bench formats`: how answers are judged and summed, and its question set."""
from __future__ import annotations

import jsonschema

from bench.common import load_jsonl
from bench.formats_bench import refined_schema, judge, response_format, summary

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_an_answer_counts_as_an_object_and_as_valid_separately():
    assert judge(' {"a": 1}\n', SCHEMA) == (True, True)
    assert judge('{"a": "x"}', SCHEMA) == (True, False)
    assert judge('[1]', SCHEMA) == (False, False)
    assert judge('```json\n{"a": 1}\n```', SCHEMA) == (False, False)  # a fenced object is not a JSON answer
    assert judge('{"a": 1', SCHEMA) == (False, False)


def test_formats_are_asked_as_the_api_takes_them():
    assert response_format(None, SCHEMA) is None
    assert response_format("json_object", SCHEMA) == {"type": "json_object"}
    assert response_format("json_schema", SCHEMA)["json_schema"]["schema"] is SCHEMA


def test_the_summary_counts_finishes_tokens_and_valid_answers():
    answers = [{"finish": "stop", "tokens": 10, "parses": True, "valid": True, "refined_valid": False},
               {"finish": "length", "tokens": 128, "parses": False, "valid": False, "refined_valid": False}]
    assert summary({"seconds": 1.5, "answers": answers}) == {
        "objects": 1, "valid": 1, "refined_valid": 0, "answers": 2, "finish": {"stop": 1, "length": 1}, "tokens": 138, "seconds": 1.5}


def test_every_question_asks_for_json_and_carries_a_schema_that_is_itself_valid():
    rows = load_jsonl("formats.jsonl")
    assert len(rows) == 24
    for row in rows:
        assert "JSON" in row["question"]  # OpenAI's JSON mode wants the word in the messages
        jsonschema.Draft202012Validator.check_schema(row["schema"])


def test_refinements_join_their_properties_and_leave_the_row_as_it_was():
    row = {"schema": SCHEMA, "refine": {"a": {"minimum": 1, "maximum": 5}}}
    schema = refined_schema(row)
    assert schema["properties"]["a"] == {"type": "integer", "minimum": 1, "maximum": 5}
    assert SCHEMA["properties"]["a"] == {"type": "integer"}
    assert judge('{"a": 7}', SCHEMA)[1] and not judge('{"a": 7}', schema)[1]


def test_formats_are_checked_when_answers_are_judged():
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}}
    assert judge('{"d": "2024-02-28"}', schema) == (True, True)
    assert judge('{"d": "2024-02-30"}', schema) == (True, False)
    duration = {"type": "object", "properties": {"d": {"type": "string", "format": "duration"}}}
    assert judge('{"d": "PT5M"}', duration) == (True, True)
    assert judge('{"d": "10.0"}', duration) == (True, False)


def test_every_refinement_fits_the_type_of_the_property_it_refines():
    rows = [row for row in load_jsonl("formats.jsonl") if "refine" in row]
    assert len(rows) == 23
    for row in rows:
        for name, keywords in row["refine"].items():
            kind = row["schema"]["properties"][name]["type"]
            allowed = {"integer": {"minimum", "maximum"}, "number": {"minimum", "maximum"}, "array": {"uniqueItems"},
                       "object": {"propertyNames", "patternProperties", "minProperties", "maxProperties"}}
            assert set(keywords) <= allowed.get(kind, {"format", "pattern"})
        jsonschema.Draft202012Validator.check_schema(refined_schema(row))
