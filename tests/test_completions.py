"""POST /v1/completions (OpenAI's legacy text completions) in-process over the tiny engine, and the
official `openai` client against the in-process app."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from test_api import SERVED, WORDS, assert_refused, client, events, make_client  # noqa: F401  (fixtures)


def _complete(client, **body):
    body.setdefault("prompt", WORDS)
    return client.post("/v1/completions", json=body)


def test_completion_has_openai_shape_and_uses_no_chat_template(client):
    response = _complete(client, max_tokens=5)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == SERVED
    [choice] = body["choices"]
    assert choice["text"] and choice["finish_reason"] == "length" and choice["index"] == 0
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}  # the 3 words alone


def test_a_list_of_one_prompt_is_the_same_as_the_string(client):
    plain = _complete(client, max_tokens=6).json()["choices"]
    assert _complete(client, prompt=[WORDS], max_tokens=6).json()["choices"] == plain


def test_streaming_sends_text_pieces_finish_and_usage_matching_the_plain_answer(client):
    plain = _complete(client, max_tokens=6).json()
    chunks = events(_complete(client, max_tokens=6, stream=True, stream_options={"include_usage": True}))
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == plain["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]


def test_n_completions_are_indexed_choices_streamed_or_not(client):
    body = _complete(client, n=2, temperature=1.0, seed=5, max_tokens=5).json()
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["completion_tokens"] == 10
    chunks = events(_complete(client, n=2, temperature=1.0, seed=5, max_tokens=5, stream=True))
    for choice in body["choices"]:
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == choice["index"]) \
            == choice["text"]


def test_logprobs_are_openais_parallel_lists_streamed_or_not(client):
    body = _complete(client, max_tokens=5, logprobs=3).json()
    [choice] = body["choices"]
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 5
    assert all(len(top) == 3 for top in logprobs["top_logprobs"])
    assert logprobs["text_offset"][0] == 0 and all(
        b - a == len(t) for a, b, t in zip(logprobs["text_offset"], logprobs["text_offset"][1:], logprobs["tokens"]))
    chunks = events(_complete(client, max_tokens=5, logprobs=3, stream=True))
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for part in streamed for x in part[key]] == logprobs[key]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": [WORDS, WORDS]}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "  "}, "prompt"),
        ({"prompt": [[1, 2, 3]]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": " ".join(["baba"] * 200)}, "prompt"),
        ({"echo": True}, "echo"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 9}, "n"),
        ({"suffix": " the end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"logit_bias": {"50": -100}}, "logit_bias"),
        ({"max_tokens": 65}, "max_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stream": True, "logprobs": -1}, "logprobs"),
    ],
)
def test_bad_input_is_400_naming_the_field(client, body, param):
    assert_refused(_complete(client, **body), 400, param)


def test_prompt_limit_and_model_name_apply_as_for_chat(make_client):
    client = make_client(max_prompt_tokens=2)
    assert "at most 2" in assert_refused(_complete(client), 400, "prompt")["message"]
    assert_refused(_complete(client, prompt="baba", model="gpt-4"), 404, "model", "model_not_found")


openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2")  # what the openai client (3.x) speaks HTTP with


def _openai(client: TestClient, api_key: str) -> "openai.OpenAI":
    """The official client, its HTTP calls answered by the in-process app."""

    def forward(request: httpx2.Request) -> httpx2.Response:
        reply = client.request(request.method, str(request.url), headers=dict(request.headers), content=request.read())
        return httpx2.Response(reply.status_code, headers=reply.headers, content=reply.content)

    return openai.OpenAI(base_url="http://testserver/v1", api_key=api_key, max_retries=0,
                         http_client=httpx2.Client(transport=httpx2.MockTransport(forward)))


@pytest.fixture
def keyed(make_client):
    return _openai(make_client(api_key="k3y"), api_key="k3y")


def test_openai_client_completes_and_streams_unchanged(keyed):
    reply = keyed.completions.create(model=SERVED, prompt=WORDS, max_tokens=6)
    assert reply.object == "text_completion" and reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6
    stream = keyed.completions.create(model=SERVED, prompt=WORDS, max_tokens=6, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == reply.choices[0].text


def test_openai_client_chats_with_a_mode_and_sees_which_mode_answered(keyed):
    reply = keyed.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": WORDS}],
                                          max_tokens=4, extra_body={"mode": "plato", "return_plan": True})
    assert reply.choices[0].message.content and reply.model_extra["mode"] == "ar"


def test_openai_client_raises_its_own_errors(keyed, make_client):
    with pytest.raises(openai.NotFoundError) as missing:
        keyed.completions.create(model="other", prompt=WORDS)
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    with pytest.raises(openai.BadRequestError, match="echo"):
        keyed.completions.create(model=SERVED, prompt=WORDS, echo=True)
    with pytest.raises(openai.AuthenticationError):
        _openai(make_client(api_key="k3y"), api_key="wrong").completions.create(model=SERVED, prompt=WORDS)
