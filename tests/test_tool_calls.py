"""Tool calling by constrained decoding: the schema each tool_choice decodes under, the conversation
as a template without tool support gets it, and the calls a service answers with, whole or streamed,
on a random model whose tokenizer spells JSON (tests.test_json_constraint's pieces)."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from deployments.tool_calls import NamedToolChoice, ToolSpec, calls_schema, template_messages, tool_calls
from engine.json_schema import compile_schema
from tests.conftest import CHATML_TEMPLATE
from tests.test_json_constraint import PIECES, json_engine  # noqa: F401 (a fixture)

WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 4}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "$defs": {"place": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}},
                        "required": ["city"]}},
    "type": "object", "properties": {"at": {"$ref": "#/$defs/place"}}, "required": ["at"]}}}
TOOLS = [ToolSpec.model_validate(WEATHER), ToolSpec.model_validate(CLOCK)]
NAMED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "weather"}})


def test_a_named_function_decodes_under_its_parameters():
    assert calls_schema(TOOLS, NAMED, parallel=True) == WEATHER["function"]["parameters"]


def test_required_decodes_a_list_of_calls_with_each_tools_definitions_kept_apart():
    schema = calls_schema(TOOLS, "required", parallel=True)
    compile_schema(schema)
    good = [{"name": "clock", "parameters": {"at": {"city": "Oslo"}}}, {"name": "weather", "parameters": {
        "city": "Rome", "unit": "c"}}]
    jsonschema.validate(good, schema)
    assert schema["$defs"] == {"tool1-place": CLOCK["function"]["parameters"]["$defs"]["place"]}
    for bad in ([], [{"name": "clock", "parameters": {"city": "Oslo", "unit": "c"}}], [{"name": "other", "parameters": {}}]):
        assert not jsonschema.Draft202012Validator(schema).is_valid(bad)
    single = calls_schema(TOOLS, "required", parallel=False)
    assert single["maxItems"] == 1 and not jsonschema.Draft202012Validator(single).is_valid(good)


def test_calls_are_read_from_a_whole_answer_only():
    [call] = tool_calls('\n{"city": "Rome",\n "unit": "c"}', NAMED)
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Rome", "unit": "c"}'}
    calls = tool_calls('[{"name": "clock", "parameters": {"at": {"city": "Oslo"}}}]', "required")
    assert [c["function"] for c in calls] == [{"name": "clock", "arguments": '{"at": {"city": "Oslo"}}'}]
    assert tool_calls('{"city": "Ro', NAMED) is None  # cut by max_tokens


def test_a_template_without_tools_gets_them_in_a_system_message_and_earlier_calls_as_text():
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "weather", "arguments": '{"city": "Rome", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    messages, tools = template_messages(conversation, TOOLS, "required", template_renders_tools=False)
    assert tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou can call these functions:\n{\"name\": \"weather\"")
    assert "Call one or more of them" in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == [{"name": "weather", "parameters": {"city": "Rome", "unit": "c"}}]
    assert messages[3] == {"role": "tool", "content": "18 degrees"}
    same, tools = template_messages(conversation, TOOLS, "required", template_renders_tools=True)
    assert same == conversation and tools[0]["function"]["name"] == "weather"
    plain, _ = template_messages([{"role": "user", "content": "hi"}], TOOLS, NAMED, template_renders_tools=False)
    assert plain[0]["role"] == "system" and plain[0]["content"].endswith(
        "Call weather: answer with its arguments as one JSON object.")


@pytest.fixture(scope="module")
def json_tokenizer():
    """tests.test_json_constraint's pieces and the tool-call tags', with a chat template (its json_engine
    builds on this one here)."""
    from bench.random_model import piece_tokenizer

    tokenizer = piece_tokenizer(PIECES + ["<", ">", "_", "<tool_call>", "</tool_call>", "<tool", "call>"])
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def service(json_engine):
    from deployments.completion_service import ApiLimits, CompletionService
    from engine.async_engine import AsyncEngine

    served = AsyncEngine(json_engine(max_batch_size=4, max_model_len=512))
    yield CompletionService(served, ApiLimits(default_max_tokens=60))
    served.shutdown()


def _ask(service, **fields):
    from deployments.openai_schema import ChatCompletionRequest

    request = ChatCompletionRequest(messages=[{"role": "user", "content": "weather in rome"}], tools=[WEATHER, CLOCK],
                                    temperature=1.0, **fields)
    if request.stream:
        async def chunks():
            return [chunk async for chunk in service.stream(request)]
        return asyncio.run(chunks())
    return asyncio.run(service.complete(request))


def test_a_named_choice_answers_with_a_call_whose_arguments_validate(service):
    named = {"type": "function", "function": {"name": "weather"}}
    made = 0
    for seed in range(4):
        choice = _ask(service, tool_choice=named, seed=seed).choices[0]
        if choice.finish_reason == "stop":
            [call] = choice.message.tool_calls
            assert choice.message.content is None and call["function"]["name"] == "weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
            made += 1
        else:  # cut by max_tokens: the text, no calls
            assert choice.message.tool_calls is None and choice.message.content
    assert made >= 2


def test_required_answers_with_calls_to_the_tools(service):
    made = []
    for seed in range(4):
        choice = _ask(service, tool_choice="required", parallel_tool_calls=False, seed=seed, max_tokens=80).choices[0]
        if choice.finish_reason == "stop":
            [call] = choice.message.tool_calls
            tool = {"weather": WEATHER, "clock": CLOCK}[call["function"]["name"]]
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
            made.append(call["function"]["name"])
    assert made


def _gathered(deltas: list[dict]) -> list[dict]:
    """Streamed tool-call deltas put together as a client does: by index, the first with id and name,
    the arguments' pieces appended."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        if "id" in delta:
            assert delta["index"] not in calls and delta["function"]["arguments"] == ""
            calls[delta["index"]] = {"id": delta["id"], "name": delta["function"]["name"], "arguments": ""}
        calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return [calls[k] for k in sorted(calls)]


def _same_calls(gathered: list[dict], whole: list[dict]) -> bool:
    return [(c["name"], json.loads(c["arguments"])) for c in gathered] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole]


def test_streamed_calls_come_as_openai_streams_them_name_first_then_the_arguments(service):
    named = {"type": "function", "function": {"name": "weather"}}
    seed = next(seed for seed in range(20) if _ask(service, tool_choice=named, seed=seed).choices[0].message.tool_calls)
    whole = _ask(service, tool_choice=named, seed=seed).choices[0].message
    chunks = _ask(service, tool_choice=named, seed=seed, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant"}
    assert not any(d.get("content") for d in deltas)  # no text: the answer is the call
    sent = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(sent) > 2  # piece by piece, not whole
    first = sent[0][0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"]["name"] == "weather"
    assert all("id" not in d for chunk_deltas in sent[1:] for d in chunk_deltas)
    assert _same_calls(_gathered([d for chunk_deltas in sent for d in chunk_deltas]), whole.tool_calls)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_required_streams_each_call_under_its_own_index(service):
    for seed in range(6):
        whole = _ask(service, tool_choice="required", seed=seed, max_tokens=80).choices[0]
        chunks = _ask(service, tool_choice="required", seed=seed, max_tokens=80, stream=True)
        deltas = [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get("tool_calls", [])]
        assert chunks[-1]["choices"][0]["finish_reason"] == whole.finish_reason
        if whole.finish_reason == "stop":
            assert _same_calls(_gathered(deltas), whole.message.tool_calls)
            assert len({d["id"] for d in deltas if "id" in d}) == len(whole.message.tool_calls)


def test_none_answers_in_text_and_refusals_name_their_field(service):
    from deployments.openai_schema import RequestError

    reply = _ask(service, tool_choice="none", max_tokens=5).choices[0].message
    assert reply.tool_calls is None and isinstance(reply.content, str)
    with pytest.raises(RequestError) as refused:
        _ask(service, tool_choice="required", response_format={"type": "json_object"})
    assert refused.value.param == "response_format" and "tool_choice asks for a format already" in refused.value.message
    with pytest.raises(RequestError) as refused:
        _ask(service, tool_choice="required", stream=True, logprobs=True)
    assert refused.value.param == "logprobs"


def test_a_conversation_with_calls_and_results_is_tokenized_as_it_is_answered(service):
    from deployments.openai_schema import ChatCompletionRequest, TokenizeRequest

    conversation = [
        {"role": "user", "content": "weather in rome"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "weather", "arguments": '{"city": "rome", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "warm"},
    ]
    tokens = asyncio.run(service.tokenize(TokenizeRequest(messages=conversation)))["tokens"]
    request = ChatCompletionRequest(messages=conversation, max_tokens=3)
    [engine_request] = asyncio.run(service.to_engine_requests(request))
    assert engine_request.prompt_ids == tokens and len(tokens) > 10
    reply = asyncio.run(service.complete(request)).choices[0]
    assert reply.message.tool_calls is None and reply.finish_reason in ("stop", "length")


@pytest.mark.parametrize("call, field", [
    ({}, "function"),
    ({"id": "call_1", "type": "function", "function": {"arguments": "{}"}}, "function.name"),
    ({"id": "call_1", "type": "function", "function": "weather"}, "function"),
    ({"id": 7, "type": "function", "function": {"name": "weather"}}, "id"),
])
def test_a_malformed_earlier_call_is_a_400_naming_it(call, field):
    """Earlier calls were read as plain dicts: a call without a function, or a function that was not an
    object, raised KeyError or TypeError while the prompt was written (a 500; found by tests/test_api_fuzz)."""
    from pydantic import ValidationError

    from deployments.openai_schema import ChatCompletionRequest

    with pytest.raises(ValidationError) as refused:
        ChatCompletionRequest(messages=[{"role": "user", "content": "weather in rome"},
                                        {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert ".".join(map(str, refused.value.errors()[0]["loc"])) == f"messages.1.tool_calls.0.{field}"


def test_the_observer_counts_answers_by_the_format_they_were_held_to(service):
    class Recorder:
        def __init__(self):
            self.formats, self.answers = [], 0

        def answered(self, mode, planned, fell_back, latency_s):
            self.answers += 1

        def first_token(self, seconds):
            pass

        def formatted(self, kind):
            self.formats.append(kind)

    recorder = Recorder()
    service.observer = recorder
    try:
        _ask(service, tool_choice="none", guided_choice=["yes", "no"])
        _ask(service, tool_choice={"type": "function", "function": {"name": "weather"}}, stream=True)
        _ask(service, tool_choice="none", response_format={"type": "json_schema", "json_schema": {
            "name": "w", "schema": WEATHER["function"]["parameters"]}}, max_tokens=20)
        _ask(service, tool_choice="none", max_tokens=2)
    finally:
        service.observer = None
    assert recorder.formats == ["choice", "tool_calls", "json_schema"] and recorder.answers == 4


def test_auto_leaves_text_free_and_holds_a_call_once_one_is_opened():
    from engine.constraints import DONE
    from engine.tool_call_constraint import END, FREE, ToolCallGrammar
    from deployments.tool_calls import call_schema

    grammar = ToolCallGrammar(call_schema(TOOLS))
    assert grammar.run(grammar.start, "Sunny, I think.") == FREE and grammar.run(grammar.start, "<toolbox>") == FREE
    call = '<tool_call>{"name": "weather", "arguments": {"city": "rome", "unit": "c"}}</tool_call>'
    after = grammar.run(grammar.start, "\n" + call)
    assert after == ("lead", 0, 0, True) and grammar.may_end(after)
    assert grammar.run(after, "and text") is None  # after a call: another call or the end
    assert grammar.run(after, "\n" + call) == after
    assert grammar.run(grammar.start, '<tool_call>{"name": "weather", "arguments": {"city": "rome"}}') is None
    assert grammar.run(grammar.start, '<tool_call>{"name": "oven"') is None
    single = ToolCallGrammar(call_schema(TOOLS), parallel=False)
    assert single.run(single.start, call) == END and single.run(single.start, call + "<") is None
    assert DONE not in (after, END)


def test_tagged_calls_are_read_only_from_a_whole_answer_of_calls():
    from deployments.tool_calls import may_be_calls, tagged_calls

    text = ' <tool_call>{"name": "clock", "arguments": {"at": {"city": "oslo"}}}</tool_call>\n<tool_call>' \
           '{"name": "weather", "arguments": {"city": "rome", "unit": "f"}}</tool_call>'
    assert [c["function"] for c in tagged_calls(text)] == [
        {"name": "clock", "arguments": '{"at": {"city": "oslo"}}'},
        {"name": "weather", "arguments": '{"city": "rome", "unit": "f"}'}]
    assert tagged_calls("It is sunny.") is None and tagged_calls(text[:60]) is None
    assert may_be_calls("") and may_be_calls(" <tool") and may_be_calls(text) and not may_be_calls("<tx")


def _tag_bias(service) -> dict:
    tag = service.engine.engine.tokenizer.convert_tokens_to_ids("<tool_call>")
    return {str(tag): 100}


def test_auto_answers_with_text_or_with_calls_that_validate(service):
    text = _ask(service, seed=3, max_tokens=8).choices[0]  # tool_choice 'auto': the default with tools
    assert text.message.tool_calls is None and text.finish_reason in ("stop", "length")
    made = []
    for seed in range(4):
        choice = _ask(service, seed=seed, max_tokens=80, parallel_tool_calls=False,
                      logit_bias=_tag_bias(service)).choices[0]
        if choice.message.tool_calls:
            [call] = choice.message.tool_calls
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            tool = {"weather": WEATHER, "clock": CLOCK}[call["function"]["name"]]
            jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
            made.append(call["function"]["name"])
        else:  # cut before the call closed: its text, 'length'
            assert choice.finish_reason == "length" and choice.message.content.startswith("<tool_call>")
    assert made


def test_auto_streams_text_and_calls_as_they_come(service):
    def streamed(**fields):
        chunks = _ask(service, stream=True, **fields)
        deltas = [c["choices"][0] for c in chunks if c["choices"]]
        text = "".join(d["delta"].get("content") or "" for d in deltas)
        calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
        return text, calls, deltas[-1]["finish_reason"]

    whole = _ask(service, seed=3, max_tokens=8).choices[0]
    assert streamed(seed=3, max_tokens=8) == (whole.message.content, [], whole.finish_reason)
    bias, branches = _tag_bias(service), set()
    for seed in range(4):
        fields = {"seed": seed, "max_tokens": 80, "logit_bias": bias, "parallel_tool_calls": seed % 2 == 0}
        whole = _ask(service, **fields).choices[0]
        text, calls, finish = streamed(**fields)
        assert finish == whole.finish_reason
        if whole.message.tool_calls:
            assert text == "" and _same_calls(_gathered(calls), whole.message.tool_calls)
            branches.add("calls")
        elif calls:  # cut by max_tokens inside a call: streamed as far as it got (as OpenAI streams one), no text
            assert finish == "length" and text == "" and whole.message.content.startswith("<tool_call>")
            for call in _gathered(calls):
                assert call["name"] in ("weather", "clock") and call["arguments"] in whole.message.content
            branches.add("cut")
        else:
            assert text == whole.message.content and not calls
    assert "calls" in branches
