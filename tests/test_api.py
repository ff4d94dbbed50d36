"""The HTTP API in-process (FastAPI test client) over the tiny engine, and the app configuration."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from deployments.api import create_app
from deployments.chat_service import ApiLimits, ChatService
from deployments.config import ConfigError, load_app_config
from engine.async_engine import AsyncEngine

REPO = Path(__file__).resolve().parent.parent
WORDS = "baba babe babi"


@pytest.fixture
def client(make_engine):
    engine = AsyncEngine(make_engine(max_batch_size=4, max_model_len=128))
    app = create_app()
    app.state.backend = ChatService(engine, ApiLimits(default_max_tokens=8, max_tokens_limit=64))
    with TestClient(app) as test_client:
        yield test_client
    engine.shutdown()


def _chat(client, **body):
    body.setdefault("messages", [{"role": "user", "content": WORDS}])
    return client.post("/v1/chat/completions", json=body)


def test_completion_has_openai_shape_and_usage(client):
    response = _chat(client, max_tokens=5)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5


def test_default_max_tokens_comes_from_limits(client):
    assert _chat(client).json()["usage"]["completion_tokens"] == 8


def test_greedy_answer_is_deterministic_and_text_parts_are_accepted(client):
    first = _chat(client, max_tokens=6).json()["choices"][0]["message"]["content"]
    parts = [{"role": "user", "content": [{"type": "text", "text": WORDS}]}]
    second = _chat(client, messages=parts, max_tokens=6).json()["choices"][0]["message"]["content"]
    assert first == second


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "   "}]}, "messages.0.content"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 65}, "max_tokens"),
        ({"max_tokens": 60, "messages": [{"role": "user", "content": " ".join(["baba"] * 100)}]}, "max_tokens"),
        ({"messages": [{"role": "user", "content": " ".join(["baba"] * 200)}]}, "messages"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 2}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stream": True, "temperature": 9}, "temperature"),
        ({"stream": True, "max_tokens": 65}, "max_tokens"),
    ],
)
def test_bad_input_is_400_naming_the_field(client, body, param):
    response = _chat(client, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(param)


def _events(response) -> list:
    lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_streaming_sends_role_deltas_finish_and_usage_matching_the_plain_answer(client):
    plain = _chat(client, max_tokens=6).json()
    response = _chat(client, max_tokens=6, stream=True, stream_options={"include_usage": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    chunks = _events(response)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]


def test_malformed_json_is_400_and_service_keeps_working(client):
    response = client.post("/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert _chat(client, max_tokens=2).status_code == 200


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["data"][0]["max_model_len"] == 128
    assert client.get("/healthz").json()["healthy"] is True


def test_health_is_503_when_engine_loop_is_dead(client):
    service = client.app.state.backend
    service.engine.shutdown()
    service.engine.error = RuntimeError("boom")
    assert client.get("/healthz").status_code == 503


def test_app_config_errors_name_the_field():
    with pytest.raises(ConfigError, match=r"engine\.max_batch_size"):
        load_app_config({"engine": {"max_batch_size": 0}})
    with pytest.raises(ConfigError, match=r"engine\.nonsense"):
        load_app_config({"engine": {"nonsense": 1}})
    with pytest.raises(ConfigError, match=r"limits\.default_max_tokens"):
        load_app_config({"limits": {"default_max_tokens": "many"}})


@pytest.mark.parametrize("path", sorted((REPO / "cluster").glob("*.yaml")), ids=lambda p: p.name)
def test_cluster_configs_match_serve_schema_and_app_config(path):
    from ray.serve.schema import ServeDeploySchema

    document = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.parse_obj(document)
    for app in schema.applications:
        assert app.import_path == "deployments.app:build_app"
        load_app_config(app.args)
