"""POST /v1/responses (OpenAI's Responses API) in-process over the tiny engine, answered as the chat
request it amounts to; and the official `openai` client's `responses.create`, streamed or not."""
from __future__ import annotations

import json

import pytest

from test_api import SERVED, WORDS, _chat, assert_refused, client, make_client  # noqa: F401  (fixtures)
from test_completions import _openai


def _respond(client, **body):
    body.setdefault("input", WORDS)
    return client.post("/v1/responses", json=body)


def _events(response) -> list[dict]:
    """The events of a streamed response: each `event:` line's type equals its data's."""
    events, kind = [], None
    for line in response.text.splitlines():
        if line.startswith("event: "):
            kind = line[len("event: "):]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: "):])
            assert data["type"] == kind
            events.append(data)
    return events


def test_a_response_is_the_chat_answer_in_responses_shape(client):
    chat = _chat(client, max_tokens=6, temperature=0).json()
    response = _respond(client, max_output_tokens=6, temperature=0)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["model"] == SERVED
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "incomplete"
    assert message["content"][0]["type"] == "output_text"
    assert message["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    usage = body["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (chat["usage"]["prompt_tokens"], 6)
    assert usage["total_tokens"] == usage["input_tokens"] + 6 and body["mode"] == "ar"


def test_instructions_and_messages_are_the_chat_conversation(client):
    messages = [{"role": "user", "content": "baba bebe"}, {"role": "assistant", "content": "bibi"},
                {"role": "user", "content": [{"type": "input_text", "text": "bobo "}, {"type": "input_text", "text": "bubu"}]}]
    chat = _chat(client, max_tokens=5, temperature=0, messages=[
        {"role": "system", "content": "baba"}, *messages[:2], {"role": "user", "content": "bobo bubu"}]).json()
    body = _respond(client, max_output_tokens=5, temperature=0, instructions="baba", input=[
        messages[0], messages[1], {"type": "message", **messages[2]}]).json()
    assert body["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert body["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"] and body["instructions"] == "baba"


def test_a_streamed_response_sends_openais_events_in_order_and_the_same_text(client):
    whole = _respond(client, max_output_tokens=8, temperature=0).json()
    events = _events(_respond(client, max_output_tokens=8, temperature=0, stream=True))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and len(kinds) > 9
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == events[-4]["text"] == whole["output"][0]["content"][0]["text"]
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == text and final["usage"]["output_tokens"] == 8


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.message.role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.message.content"),
    ({"input": [{"type": "function_call_output", "call_id": "c1"}]}, "input.0.function_call_output.output"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 65}, "max_tokens"),  # past the server's limit: the service names its own field
    ({"temperature": 3}, "temperature"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tool_choice": "required"}, "tool_choice"),  # without tools
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"mode": "fast"}, "mode"),
    ({"model": "gpt-4"}, "model"),
])
def test_bad_input_is_a_4xx_naming_the_field(client, body, param):
    response = _respond(client, **body)
    if param == "model":
        assert_refused(response, 404, param, "model_not_found")
    else:
        assert_refused(response, 400, param)


def test_the_openai_client_creates_responses_streamed_or_not(make_client):
    openai_client = _openai(make_client(api_key="k3y"), api_key="k3y")
    reply = openai_client.responses.create(model=SERVED, input=WORDS, max_output_tokens=6, temperature=0)
    assert reply.output_text and reply.status == "incomplete" and reply.usage.output_tokens == 6
    stream = openai_client.responses.create(model=SERVED, input=WORDS, max_output_tokens=6, temperature=0,
                                            stream=True)
    deltas, final = [], None
    for event in stream:
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        final = event
    assert "".join(deltas) == reply.output_text and final.type == "response.incomplete"


def test_a_request_reads_as_the_chat_request_it_amounts_to():
    from deployments.responses_api import ResponsesRequest

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = ResponsesRequest(input=[{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
                            text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}},
                            max_output_tokens=9, mode="plato").to_chat()
    assert [(m.role, m.content) for m in chat.messages] == [("system", "be brief"), ("user", "hi")]
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert chat.max_tokens == 9 and chat.mode == "plato" and chat.temperature == 0.0 and not chat.stream
    streamed = ResponsesRequest(input="hi", stream=True, text={"format": {"type": "json_object"}}).to_chat()
    assert streamed.include_usage and streamed.response_format == {"type": "json_object"}


def test_calls_and_their_outputs_read_as_the_chat_turns_they_are():
    from deployments.responses_api import ResponsesRequest

    chat = ResponsesRequest(input=[
        {"role": "user", "content": "weather in Paris and Rome?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"},
    ], tools=[{"type": "function", "name": "weather", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False).to_chat()
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool", "tool"]
    assert [(c.id, c.function.name) for c in chat.messages[1].tool_calls] == [("c1", "weather"), ("c2", "weather")]
    assert (chat.messages[2].tool_call_id, chat.messages[2].content) == ("c1", "sunny")
    assert chat.tools[0].function.name == "weather" and chat.tool_choice.function.name == "weather"
    assert chat.parallel_tool_calls is False


def _writer(**fields):
    from deployments.responses_api import ResponsesRequest, ResponseWriter

    return ResponseWriter(ResponsesRequest(input="hi", **fields), SERVED)


def test_a_chat_answer_with_calls_becomes_function_call_items_after_its_text():
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}
    chat = {"choices": [{"message": {"content": None, "tool_calls": [call]}, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}, "mode": "ar"}
    response = _writer().from_chat(chat)
    assert response["status"] == "completed" and response["output"] == [
        {"type": "function_call", "id": "fc_call_1", "call_id": "call_1", "name": "weather",
         "arguments": '{"city":"Paris"}', "status": "completed"}]
    chat["choices"][0]["message"]["content"] = "Let me look."
    assert [item["type"] for item in _writer().from_chat(chat)["output"]] == ["message", "function_call"]


def test_streamed_calls_open_an_item_each_and_send_their_arguments_piece_by_piece():
    import asyncio

    chunks = [{"choices": [{"delta": {"content": "Let me look."}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                      "function": {"name": "weather", "arguments": ""}}]}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}}]},
              {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
                            "finish_reason": "tool_calls"}]},
              {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}]

    async def collect():
        async def source():
            for chunk in chunks:
                yield chunk
        return [e async for e in _writer().events(source())]

    events = asyncio.run(collect())
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert events[5]["output_index"] == 1 and events[5]["item"]["status"] == "in_progress"
    assert events[11]["arguments"] == '{"city":"Paris"}' and events[11]["output_index"] == 1
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["arguments"] == '{"city":"Paris"}' and final["usage"]["output_tokens"] == 9


def _text(response: dict) -> str:
    return response["output"][0]["content"][0]["text"]


def test_a_follow_up_continues_the_stored_conversation_without_its_instructions(client):
    first = _respond(client, input="baba bebe", instructions="bibi", max_output_tokens=5).json()
    second = _respond(client, input="bobo", previous_response_id=first["id"], max_output_tokens=5).json()
    turns = [{"role": "user", "content": "baba bebe"}, {"role": "assistant", "content": _text(first)},
             {"role": "user", "content": "bobo"}]
    chat = _chat(client, max_tokens=5, messages=turns).json()
    assert _text(second) == chat["choices"][0]["message"]["content"]
    assert second["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]  # no "bibi" system message
    assert second["previous_response_id"] == first["id"] and second["store"] is True
    third = _respond(client, input="bubu", previous_response_id=second["id"], max_output_tokens=5).json()
    turns += [{"role": "assistant", "content": _text(second)}, {"role": "user", "content": "bubu"}]
    assert _text(third) == _chat(client, max_tokens=5, messages=turns).json()["choices"][0]["message"]["content"]


def test_a_stored_response_is_fetched_and_deleted(client):
    created = _respond(client, max_output_tokens=4).json()
    fetched = client.get(f"/v1/responses/{created['id']}")
    assert fetched.status_code == 200 and fetched.json() == created
    deleted = client.delete(f"/v1/responses/{created['id']}")
    assert deleted.json() == {"id": created["id"], "object": "response.deleted", "deleted": True}
    assert_refused(client.get(f"/v1/responses/{created['id']}"), 404, None, "not_found")
    assert_refused(client.delete(f"/v1/responses/{created['id']}"), 404, None, "not_found")
    follow_up = _respond(client, previous_response_id=created["id"])
    assert_refused(follow_up, 400, "previous_response_id", "previous_response_not_found")


def test_a_response_asked_not_to_be_stored_cannot_be_fetched_or_followed(client):
    created = _respond(client, max_output_tokens=4, store=False).json()
    assert created["store"] is False
    assert_refused(client.get(f"/v1/responses/{created['id']}"), 404, None, "not_found")
    follow_up = _respond(client, previous_response_id=created["id"])
    assert_refused(follow_up, 400, "previous_response_id", "previous_response_not_found")


def test_a_streamed_response_is_stored_as_its_last_event_gives_it(client):
    final = _events(_respond(client, max_output_tokens=6, stream=True))[-1]["response"]
    assert client.get(f"/v1/responses/{final['id']}").json() == final
    follow_up = _respond(client, input="bobo", previous_response_id=final["id"], max_output_tokens=5, stream=True)
    turns = [{"role": "user", "content": WORDS}, {"role": "assistant", "content": _text(final)},
             {"role": "user", "content": "bobo"}]
    chat = _chat(client, max_tokens=5, messages=turns).json()
    assert _text(_events(follow_up)[-1]["response"]) == chat["choices"][0]["message"]["content"]


def test_a_follow_up_after_calls_sends_only_their_outputs():
    from deployments.responses_api import ResponsesRequest

    asked = ResponsesRequest(input="weather in Paris?", instructions="be brief")
    response = {"output": [
        {"type": "message", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'}]}
    history = asked.conversation(None, response)
    assert history == [{"role": "user", "content": "weather in Paris?"},
                       {"role": "assistant", "content": "Let me look.", "tool_calls": [
                           {"id": "c1", "type": "function",
                            "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}]}]
    chat = ResponsesRequest(input=[{"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
                            previous_response_id="resp_x").to_chat(history)
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool"]
    assert chat.messages[1].tool_calls[0].id == "c1" and chat.messages[2].tool_call_id == "c1"
    only_calls = ResponsesRequest(input="x").conversation(None, {"output": [response["output"][1]]})
    assert only_calls[-1]["content"] is None  # a turn of calls alone has no text, as chat writes it


def test_the_openai_client_follows_up_fetches_and_deletes_responses(make_client):
    openai_client = _openai(make_client(), api_key="x")
    first = openai_client.responses.create(model=SERVED, input=WORDS, max_output_tokens=4)
    second = openai_client.responses.create(model=SERVED, input="bobo", previous_response_id=first.id,
                                            max_output_tokens=4)
    assert second.previous_response_id == first.id and second.output_text
    assert openai_client.responses.retrieve(first.id).output_text == first.output_text
    openai_client.responses.delete(first.id)
    with pytest.raises(Exception, match="404"):
        openai_client.responses.retrieve(first.id)


def test_an_answer_whose_storing_fails_still_goes_out(make_client):
    class Broken:
        async def put_response(self, response_id, record):
            raise ConnectionError("the store's actor is gone")

        async def get_response(self, response_id):
            return None

    client = make_client()
    client.app.state.responses = Broken()
    response = _respond(client, max_output_tokens=4)
    assert response.status_code == 200 and _text(response.json())
    final = _events(_respond(client, max_output_tokens=4, stream=True))[-1]
    assert final["type"] == "response.incomplete" and _text(final["response"])
    assert_refused(_respond(client, previous_response_id=response.json()["id"]), 400, "previous_response_id",
                   "previous_response_not_found")


def test_a_stored_responses_input_items_are_listed_a_page_at_a_time(client):
    asked = [{"role": "user", "content": "baba"}, {"role": "assistant", "content": "bebe"},
             {"role": "user", "content": "bibi"}]
    created = _respond(client, input=asked, max_output_tokens=3).json()
    path = f"/v1/responses/{created['id']}/input_items"
    newest_first = client.get(path).json()
    assert newest_first["object"] == "list" and newest_first["has_more"] is False
    assert [(i["role"], i["content"][0]["text"]) for i in newest_first["data"]] == [
        ("user", "bibi"), ("assistant", "bebe"), ("user", "baba")]
    assert newest_first["data"][1]["content"][0]["type"] == "output_text"
    first = client.get(path, params={"order": "asc", "limit": 2}).json()
    assert [i["content"][0]["text"] for i in first["data"]] == ["baba", "bebe"] and first["has_more"] is True
    assert first["last_id"] == first["data"][-1]["id"]
    rest = client.get(path, params={"order": "asc", "limit": 2, "after": first["last_id"]}).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["bibi"] and rest["has_more"] is False
    assert_refused(client.get(path, params={"after": "msg_nothing"}), 400, "after")
    assert client.get(path, params={"limit": 0}).status_code == 400
    assert_refused(client.get("/v1/responses/resp_nothing/input_items"), 404, None, "not_found")


def test_input_items_keep_calls_and_their_outputs_and_the_sdk_lists_them(make_client):
    from deployments.responses_api import ResponsesRequest

    listed = ResponsesRequest(input=[
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]).listed_input()
    assert [(i["type"], i["call_id"]) for i in listed] == [("function_call", "c1"), ("function_call_output", "c1")]
    assert listed[0]["id"] == "fc_c1" and listed[1]["output"] == "sunny"
    openai_client = _openai(make_client(), api_key="x")
    created = openai_client.responses.create(model=SERVED, input=WORDS, max_output_tokens=3)
    [item] = list(openai_client.responses.input_items.list(created.id))
    assert item.type == "message" and item.content[0].text == WORDS
