"""Tool calls streamed piece by piece: however the answer's text is split into pieces, the deltas put
together give each call's name and its arguments as written."""
from __future__ import annotations

import json
import random

import pytest

from deployments.tool_call_stream import CallStream, answer_stream, opens_calls
from deployments.tool_calls import NamedToolChoice

REQUIRED = ('[ {"name": "weather", "parameters": {"city": "Ro\\"me}", "n": [1, {"a": 2}]}},\n'
            '  {"name":"clock","parameters":{}}]')
AUTO = (' <tool_call>{"name": "w", "arguments": 5}</tool_call>\n'
        '<tool_call>{"name": "x", "arguments": "s]}"}</tool_call><tool_call>{"name": "y", "arguments": true}</tool_call>')


def _split_and_gather(stream: CallStream, text: str, seed: int) -> tuple[list[dict], list[dict]]:
    rng, deltas, at = random.Random(seed), [], 0
    while at < len(text):
        size = rng.randint(1, 6)
        deltas += stream.feed(text[at:at + size])
        at += size
    calls = []
    for delta in deltas:
        if "id" in delta:
            assert delta["index"] == len(calls) and delta["type"] == "function"
            assert delta["function"]["arguments"] == ""  # the opening alone, as OpenAI sends it
            calls.append({"name": delta["function"]["name"], "arguments": ""})
        else:
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return calls, deltas


@pytest.mark.parametrize("seed", range(12))
def test_required_calls_come_out_whole_however_the_text_is_split(seed):
    calls, _ = _split_and_gather(answer_stream("required"), REQUIRED, seed)
    assert [c["name"] for c in calls] == ["weather", "clock"]
    assert json.loads(calls[0]["arguments"]) == {"city": 'Ro"me}', "n": [1, {"a": 2}]}
    assert calls[1]["arguments"] == "{}"


@pytest.mark.parametrize("seed", range(12))
def test_auto_calls_with_bare_and_string_arguments(seed):
    assert opens_calls(AUTO) and not opens_calls("<tool") and not opens_calls("Sunny <tool_call>")
    calls, _ = _split_and_gather(CallStream(), AUTO, seed)
    assert calls == [{"name": "w", "arguments": "5"}, {"name": "x", "arguments": '"s]}"'},
                     {"name": "y", "arguments": "true"}]


def test_a_named_call_opens_at_once_and_its_arguments_are_the_answer():
    stream = answer_stream(NamedToolChoice(function={"name": "weather"}))
    [opening] = stream.feed("")
    assert opening["function"] == {"name": "weather", "arguments": ""} and opening["id"].startswith("call_")
    assert stream.feed('{"city"') == [{"index": 0, "function": {"arguments": '{"city"'}}]
    assert stream.started


def test_nothing_opens_before_a_name_is_whole():
    stream = answer_stream("required")
    assert stream.feed('[{"name": "wea') == [] and not stream.started
    [opening] = stream.feed('ther", "para')
    assert opening["function"]["name"] == "weather"
