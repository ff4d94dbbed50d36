"""End to end: real Ray, real Serve, the real embedded SmolLM2 model, over HTTP."""
from __future__ import annotations

import json
import random

import httpx
import pytest
from tests.e2e_app import serve_plato

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server():
    args = {"engine": {"max_batch_size": 8, "max_model_len": 1024, "num_threads": 2},
            "limits": {"default_max_tokens": 48, "max_tokens_limit": 256},
            "dispatch": {"caller_check_s": 1.0}}  # the batcher's death is noticed within the last test's answers
    with serve_plato(args) as base_url, httpx.Client(base_url=base_url, timeout=300) as client:
        yield client


def _ask(client, content: str, **extra):
    body = {"model": "embedded:smollm2-135m", "messages": [{"role": "user", "content": content}], **extra}
    return client.post("/v1/chat/completions", json=body)


def test_answers_a_real_question(server):
    response = _ask(server, "What is the capital of France?", max_tokens=24)
    assert response.status_code == 200, response.text
    body = response.json()
    answer = body["choices"][0]["message"]["content"]
    assert "Paris" in answer
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] > 0
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]


def test_the_responses_route_answers_through_serve_streamed_or_not(server):
    body = {"input": "What is the capital of France?", "max_output_tokens": 24, "temperature": 0}
    response = server.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    text = response.json()["output"][0]["content"][0]["text"]
    assert "Paris" in text
    streamed = server.post("/v1/responses", json={**body, "stream": True})
    events = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == text
    assert events[-1]["type"] in ("response.completed", "response.incomplete")


def test_concurrent_requests_all_answered(server):
    import concurrent.futures

    questions = ["Name a primary color.", "What is 2 plus 2?", "Say hello in French.", "Name a planet."]
    with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
        responses = list(pool.map(lambda q: _ask(server, q, max_tokens=16), questions))
    assert [r.status_code for r in responses] == [200] * len(questions)
    assert all(r.json()["choices"][0]["message"]["content"].strip() for r in responses)


def test_models_and_health(server):
    models = server.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "embedded:smollm2-135m"
    health = server.get("/healthz")
    assert health.status_code == 200 and health.json()["healthy"] is True


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": 7}, "temperature"),
        ({"messages": [{"role": "user", "content": "word " * 2000}]}, "messages"),
    ],
)
def test_bad_input_is_400_naming_the_field(server, body, param):
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert param.split(".")[0] in error["message"]


def test_replica_survives_bad_input(server):
    server.post("/v1/chat/completions", content=b"{not json")
    assert _ask(server, "What is the capital of France?", max_tokens=8).status_code == 200


def test_mutated_requests_get_an_answer_or_a_4xx_through_the_real_path(server):
    """tests/test_api_fuzz.py's mutations, through Ray Serve, the batcher and the real model, eight at
    a time: no 5xx, no stream that fails after it began, and the replicas serve on."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_api_fuzz import VALID, failed_status, mutated

    rng = random.Random(11)
    cases = []
    for route, body in (rng.choice(VALID) for _ in range(160)):
        for _ in range(rng.randint(1, 2)):
            body = mutated(body, rng)
        cases.append((route, body))
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda case: failed_status(server.post(case[0], json=case[1])), cases))
    failures = [(route, json.dumps(body)[:300], status) for (route, body), status in zip(cases, statuses) if status >= 500]
    assert not failures, failures[:3]
    assert 0 < sum(status < 300 for status in statuses) < len(cases)  # both answers and refusals were met
    assert server.get("/healthz").status_code == 200


def _ask_openai(server, **extra):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    asked = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, **extra}
    return client.chat.completions.create(model="embedded:smollm2-135m", **asked)


def test_openai_client_works(server):
    assert "Paris" in _ask_openai(server).choices[0].message.content


def test_openai_client_streams(server):
    stream = _ask_openai(server, stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) > 1 and "Paris" in "".join(pieces)


def test_openai_client_gets_n_choices_with_logprobs_streamed_or_not(server):
    reply = _ask_openai(server, n=2, temperature=0.8, seed=3, logprobs=True, top_logprobs=2)
    assert [c.index for c in reply.choices] == [0, 1]
    assert sum(len(c.logprobs.content) for c in reply.choices) == reply.usage.completion_tokens
    for choice in reply.choices:
        tokens = choice.logprobs.content
        assert "".join(t.token for t in tokens).startswith(choice.message.content[:8])
        assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)
    texts = {0: "", 1: ""}
    for chunk in _ask_openai(server, n=2, temperature=0.8, seed=3, logprobs=True, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {c.index: c.message.content for c in reply.choices}


def test_openai_client_json_mode_answers_with_a_json_object(server):
    import json

    reply = _ask_openai(server, response_format={"type": "json_object"}, max_tokens=48,
                        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON "
                                   "with keys country and capital."}])
    answer = json.loads(reply.choices[0].message.content)
    assert reply.choices[0].finish_reason == "stop" and answer["capital"] == "Paris"


def test_openai_client_parses_structured_outputs_into_a_pydantic_model(server):
    """The openai client's `parse` sends the model's strict JSON Schema and validates the answer into it."""
    openai = pytest.importorskip("openai")
    from pydantic import BaseModel, Field

    class Capital(BaseModel):
        country: str = Field(max_length=30)
        capital: str = Field(max_length=30)
        is_european: bool

    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    reply = client.chat.completions.parse(
        model="embedded:smollm2-135m", response_format=Capital, max_tokens=64,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
    parsed = reply.choices[0].message.parsed
    assert isinstance(parsed, Capital) and parsed.capital == "Paris"


def test_a_unique_items_array_comes_back_without_repeats(server):
    """Greedy, the embedded model tags a post with one tag four times over; under uniqueItems (a set
    field in pydantic) each tag it writes is new, and the answer validates."""
    tags = {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 5}

    def tags_for(schema_tags: dict) -> list[str]:
        schema = {"type": "object", "properties": {"tags": schema_tags}, "required": ["tags"], "additionalProperties": False}
        reply = _ask_openai(server, messages=[{"role": "user", "content": "Tag this post about baking bread."}],
                            max_tokens=96, temperature=0, response_format={
                                "type": "json_schema", "json_schema": {"name": "tags", "schema": schema}})
        assert reply.choices[0].finish_reason == "stop"
        return json.loads(reply.choices[0].message.content)["tags"]

    repeated = tags_for(tags)
    assert len(set(repeated)) < len(repeated)  # why the test means something
    unique = tags_for({**tags, "uniqueItems": True})
    assert len(unique) >= 2 and len(set(unique)) == len(unique)


def test_vllms_guided_choice_through_extra_body(server):
    reply = _ask_openai(server, extra_body={"guided_choice": ["London", "Paris", "Rome"]})
    assert reply.choices[0].message.content in ("London", "Paris", "Rome")  # which one is the model's knowledge
    assert reply.choices[0].finish_reason == "stop"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"],
                   "additionalProperties": False}}}


def test_openai_client_gets_tool_calls_and_answers_from_the_tools_result(server):
    import json

    weather = WEATHER_TOOL
    asked = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    reply = _ask_openai(server, messages=asked, tools=[weather], max_tokens=48,
                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    follow_up = asked + [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    answer = _ask_openai(server, messages=follow_up, tools=[weather], tool_choice="none", max_tokens=32)
    assert "18" in answer.choices[0].message.content
    auto = _ask_openai(server, messages=asked, tools=[weather], max_tokens=24).choices[0]  # 'auto', the default
    for call in auto.message.tool_calls or []:  # the 135M model answers in text; a call would be whole and valid
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert (auto.message.content or auto.message.tool_calls) and auto.finish_reason in ("stop", "length", "tool_calls")


def test_the_openai_clients_responses_call_a_tool_and_answer_from_its_output(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    function = WEATHER_TOOL["function"]
    tools = [{"type": "function", **function}]
    asked = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    reply = client.responses.create(model="embedded:smollm2-135m", input=asked, tools=tools, max_output_tokens=48,
                                    tool_choice={"type": "function", "name": "get_weather"})
    [call] = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    streamed = client.responses.create(model="embedded:smollm2-135m", input=asked, tools=tools, max_output_tokens=48,
                                       tool_choice={"type": "function", "name": "get_weather"}, stream=True)
    pieces = [e.delta for e in streamed if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == call.arguments
    follow_up = asked + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                          "arguments": call.arguments},
                         {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}]
    answer = client.responses.create(model="embedded:smollm2-135m", input=follow_up, tools=tools,
                                     tool_choice="none", max_output_tokens=32)
    assert "18" in answer.output_text
    # the same turn as a follow-up of the stored response: only the call's output is sent, the rest is
    # read from the context-cache actor, which holds every ingress replica's stored responses
    assert client.responses.retrieve(reply.id).output[0].call_id == call.call_id
    chained = client.responses.create(model="embedded:smollm2-135m", previous_response_id=reply.id, tools=tools,
                                      input=follow_up[-1:], tool_choice="none", max_output_tokens=32)
    assert "18" in chained.output_text and chained.usage.input_tokens == answer.usage.input_tokens


def test_openai_clients_stream_helper_gathers_a_call_streamed_piece_by_piece(server):
    import json

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    pieces = []
    with client.chat.completions.stream(
            model="embedded:smollm2-135m", max_tokens=48, tools=[WEATHER_TOOL],
            messages=[{"role": "user", "content": "What is the weather like in Paris today?"}],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                pieces.append(event.arguments_delta)
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert len(pieces) > 1 and "".join(pieces) == call.function.arguments


def test_scores_continuations_as_lm_evaluation_harness_asks(server):
    # local-completions' loglikelihood request: several prompts of token ids, echo, logprobs 1, max_tokens 1
    openai = pytest.importorskip("openai")
    from engine.config import EngineConfig
    from engine.loader import load_tokenizer_and_context

    tokenizer, _ = load_tokenizer_and_context(EngineConfig())
    context = tokenizer.encode("The capital of France is", add_special_tokens=False)
    options = [tokenizer.encode(word, add_special_tokens=False) for word in (" Paris", " banana")]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    reply = client.completions.create(model="embedded:smollm2-135m", prompt=[context + o for o in options],
                                      echo=True, logprobs=1, max_tokens=1, temperature=0)
    scores = []
    for choice, option in zip(sorted(reply.choices, key=lambda c: c.index), options):
        logprobs = choice.logprobs
        assert len(logprobs.tokens) == len(context) + len(option) + 1 and logprobs.token_logprobs[0] is None
        scores.append(sum(logprobs.token_logprobs[len(context):-1]))
    assert scores[0] > scores[1], scores
    assert reply.usage.prompt_tokens == 2 * len(context) + sum(len(o) for o in options)


def test_streaming_bad_input_is_400_before_any_event(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000, "stream": True}
    response = server.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("mode", ["ar", "plato"])
def test_a_client_that_disconnects_mid_answer_stops_its_decoding(server, mode):
    """Serve cancels the calls made for a request whose client went away; the batcher then takes
    the request out of its micro-batch and cancels that call on the decoder, whose engine aborts it
    (a planned answer's plan and parts alike)."""
    from ray import serve

    batcher = serve.get_deployment_handle("Batcher", app_name="plato")
    decoder = serve.get_deployment_handle("Decoder", app_name="plato")
    cancelled = batcher.stats.remote().result()["cancelled"]
    generated = decoder.stats.remote().result()["generated_tokens"]
    body = {"model": "embedded:smollm2-135m", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 256, "ignore_eos": True, "stream": True, "mode": mode}
    if mode == "ar":
        with server.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            next(line for line in response.iter_lines() if '"content"' in line)  # the answer has begun
    else:  # a planned answer is sent whole once assembled: the client gives up while it is planned
        with httpx.Client(base_url=server.base_url, timeout=2.0) as impatient, pytest.raises(httpx.ReadTimeout):
            with impatient.stream("POST", "/v1/chat/completions", json=body) as response:
                list(response.iter_lines())
    _assert_decoding_stopped(batcher, decoder, cancelled, generated)


def _assert_decoding_stopped(batcher, decoder, cancelled: int, generated: int) -> None:
    """The decoder goes idle well before the 256 tokens asked for, and the batcher counts one more
    request cancelled, with nothing left in flight or pending."""
    import time

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        engine = decoder.stats.remote().result()
        if engine["running"] == engine["waiting"] == 0:
            break
        time.sleep(0.2)
    assert engine["running"] == engine["waiting"] == 0
    assert engine["generated_tokens"] - generated < 200  # aborted well before its 256 tokens
    stats = batcher.stats.remote().result()
    assert stats["cancelled"] > cancelled and stats["in_flight"] == stats["pending"] == 0


def test_a_client_that_leaves_a_streamed_response_stops_its_decoding(server):
    """The Responses route reads the chat stream through a wrapper: a client that goes away after the
    first text delta still has its decoding aborted, as on the chat route."""
    from ray import serve

    batcher = serve.get_deployment_handle("Batcher", app_name="plato")
    decoder = serve.get_deployment_handle("Decoder", app_name="plato")
    cancelled = batcher.stats.remote().result()["cancelled"]
    generated = decoder.stats.remote().result()["generated_tokens"]
    body = {"model": "embedded:smollm2-135m", "input": "Tell me a long story about a dragon and a knight.",
            "max_output_tokens": 256, "stream": True}
    with server.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if "response.output_text.delta" in line)
    _assert_decoding_stopped(batcher, decoder, cancelled, generated)


def test_one_request_of_a_micro_batch_is_aborted_on_its_decoder_while_the_other_decodes_on(server):
    """What the batcher asks when one caller of a micro-batch goes away and another still waits: the
    abort reaches the replica running the micro-batch (through the Decoder's router)."""
    from ray import serve

    from engine.types import GenerationRequest, SamplingParams

    decoder = serve.get_deployment_handle("Decoder", app_name="plato")
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    batch = {"id": "e2e-abort", "requests": [GenerationRequest(id=i, prompt_ids=[1, 504, 28, 30], params=params)
                                             .model_dump(mode="json") for i in ("goes", "stays")]}
    tokens, ends, aborted = {"goes": 0, "stays": 0}, {}, None
    for message in decoder.options(stream=True).run_batch.remote(batch):
        for item in message:
            if "event" in item:
                tokens[item["event"]["request_id"]] += len(item["event"]["token_ids"])
            else:
                ends[(item.get("result") or item["error"])["request_id"]] = item
        if aborted is None and tokens["goes"] >= 2:
            aborted = decoder.abort.remote({"batch_id": "e2e-abort", "abort": ["goes"]}).result()
    assert aborted == 1 and tokens["goes"] < 64
    assert ends["goes"]["error"]["message"] == "aborted: its caller went away"
    assert ends["stays"]["result"]["finish_reason"] == "length" and len(ends["stays"]["result"]["token_ids"]) == 64


def test_prometheus_metrics_are_exported_under_the_names_the_readme_lists(server):
    # as `ray_plato_...`: Ray's exporter prefixes the custom metrics of `ray.serve.metrics` with `ray_`
    import re
    import time

    import ray

    assert _ask(server, "Name a river.", max_tokens=8).status_code == 200
    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    wanted = {"plato_generated_tokens_total", "plato_prefix_cache_queries_total", "plato_answers_total",
              "plato_request_latency_seconds_bucket", "plato_batcher_batch_size_bucket"}
    deadline, names = time.monotonic() + 90, set()
    while time.monotonic() < deadline:  # replicas report every few seconds
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        names = set(re.findall(r"^ray_(plato_\w+)", text, re.MULTILINE))  # Ray prefixes every custom metric
        if wanted <= names:
            break
        time.sleep(3)
    assert wanted <= names, sorted(names)


def test_a_planned_stream_is_taken_up_by_a_new_planner_when_its_replica_dies(server):
    """A planned answer streams its paragraphs as they are written. Once the first is whole and the
    next has begun, the planner replica making it is killed: the ingress asks again under the same key,
    Serve's fresh replica takes the answer up from the context cache (the plan and the nodes already
    answered are kept, a paragraph begun goes on from where the client has it), and the client's one
    stream goes on after the text it has, to a whole answer."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import ray
    from ray import serve

    body = {"model": "embedded:smollm2-135m", "mode": "plato", "max_tokens": 200, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "How can I improve my time management skills?"}]}
    begun = threading.Event()  # the first paragraph is whole: the next has begun
    chunks, errors = [], []

    def stream() -> None:
        with server.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    errors.extend([chunk["error"]] if "error" in chunk else [])
                    chunks.append(chunk)
                    if "\n\n**" in "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                                              if c.get("choices")):
                        begun.set()

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(stream)
        assert begun.wait(240)
        had = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
        [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "#Planner#" in a["name"]]
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        done.result(timeout=300)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert errors == [] and text.startswith(had) and len(text) > len(had), (errors, had, text)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")].count("stop") == 1
    assert sum("role" in c["choices"][0]["delta"] for c in chunks if c.get("choices")) == 1
    assert len({c["id"] for c in chunks}) == 1 and chunks[-1]["usage"]["completion_tokens"] > 0
    assert chunks[0]["mode"] == "plato" and had.startswith("**"), had  # planned: paragraphs, each led by its part
    first_part = had.split("**")[1]
    assert text.count(f"**{first_part}**") == 1, text  # taken up after what was sent, not started over
    planner = serve.get_deployment_handle("Planner", app_name="plato")
    resumed = planner.resumed.remote().result()
    assert resumed["answers"] == 1 and resumed["nodes_reused"] >= 1, resumed


def test_answers_in_flight_survive_the_batchers_death(server):
    """Last in this module: it kills the batcher's replica while two answers stream and a third waits
    whole. Serve starts a fresh batcher, empty; each call cut short is sent to it again
    (actors.decode_client.HandleBatcher), a stream resuming after the tokens it had passed on, so every
    client gets its whole answer, once: greedy, each is the answer it gets from an undisturbed server.
    The decoder, finding the micro-batches' batcher dead, stops decoding them for nobody."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import ray
    from ray import serve

    decoder = serve.get_deployment_handle("Decoder", app_name="plato")
    orphaned_before = decoder.stats.remote().result()["orphaned_batches"]

    def streamed(content: str) -> tuple[str, dict, list]:
        body = {"model": "embedded:smollm2-135m", "messages": [{"role": "user", "content": content}],
                "max_tokens": 96, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        text, usage, errors = "", None, []
        with server.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: "):])
                errors += [chunk["error"]] if "error" in chunk else []
                if chunk.get("choices"):
                    text += chunk["choices"][0]["delta"].get("content") or ""
                    if len(text) > 20:  # tokens are flowing through the batcher (Serve itself sends a call
                        begun.set()  # again if its replica died before it yielded anything)
                usage = chunk.get("usage") or usage
        return text, usage, errors

    questions = ["Tell me a long story about a red fox.", "Describe a long walk along a river."]
    begun = threading.Event()
    with ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(streamed, q) for q in questions]
        whole = pool.submit(_ask, server, "Tell me about the moon.", max_tokens=64, temperature=0, ignore_eos=True)
        assert begun.wait(120)
        [name] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "Batcher" in a["name"]]
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        answers = [s.result(timeout=300) for s in streams]
        whole = whole.result(timeout=300)
    for text, usage, errors in answers:
        assert errors == [] and usage["completion_tokens"] == 96, (errors, usage)
    assert whole.status_code == 200 and whole.json()["usage"]["completion_tokens"] == 64
    assert decoder.stats.remote().result()["orphaned_batches"] > orphaned_before
    deadline = time.monotonic() + 60
    while name in {a["name"] for a in ray.util.list_named_actors(True)} and time.monotonic() < deadline:
        time.sleep(1)
    for (text, _, _), question in zip(answers, questions):  # the same as undisturbed, on the new batcher
        again = _ask(server, question, max_tokens=96, temperature=0, ignore_eos=True)
        assert again.json()["choices"][0]["message"]["content"] == text
