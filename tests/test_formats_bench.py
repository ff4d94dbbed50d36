"""`python -m bench formats`: how answers are judged and summed, and its question set."""
from __future__ import annotations

import jsonschema

from bench.common import load_jsonl
from bench.formats_bench import bounded_schema, judge, response_format, summary

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
    answers = [{"finish": "stop", "tokens": 10, "parses": True, "valid": True, "in_bounds": False},
               {"finish": "length", "tokens": 128, "parses": False, "valid": False, "in_bounds": False}]
    assert summary({"seconds": 1.5, "answers": answers}) == {
        "objects": 1, "valid": 1, "in_bounds": 0, "answers": 2, "finish": {"stop": 1, "length": 1}, "tokens": 138, "seconds": 1.5}


def test_every_question_asks_for_json_and_carries_a_schema_that_is_itself_valid():
    rows = load_jsonl("formats.jsonl")
    assert len(rows) == 12
    for row in rows:
        assert "JSON" in row["question"]  # OpenAI's JSON mode wants the word in the messages
        jsonschema.Draft202012Validator.check_schema(row["schema"])


def test_bounds_become_minimum_and_maximum_and_leave_the_row_as_it_was():
    row = {"schema": SCHEMA, "bounds": {"a": [1, 5]}}
    schema = bounded_schema(row)
    assert schema["properties"]["a"] == {"type": "integer", "minimum": 1, "maximum": 5}
    assert SCHEMA["properties"]["a"] == {"type": "integer"}
    assert judge('{"a": 7}', SCHEMA)[1] and not judge('{"a": 7}', schema)[1]


def test_every_bound_names_a_number_of_its_schema():
    rows = [row for row in load_jsonl("formats.jsonl") if "bounds" in row]
    assert len(rows) == 9
    for row in rows:
        for name, (low, high) in row["bounds"].items():
            assert row["schema"]["properties"][name]["type"] in ("integer", "number") and low < high
        jsonschema.Draft202012Validator.check_schema(bounded_schema(row))
