"""`python -m bench judge` without a real model: the verdict reader, the two-order rule, the
tallies, and whole runs through the openai client against scripted judges served in-process."""
from __future__ import annotations

import json
import re

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from bench.judge import combine, embedded_transport, order_outcome, run, tally
from bench.judge_prompts import judge_messages, parse_verdict
from engine.async_engine import AsyncEngine


@pytest.mark.parametrize(
    "reply, verdict",
    [
        ("Both are fine, but A is more specific.\n[[A]]", "A"),
        ("[[B]]", "B"),
        ("They are equally good. [[C]]", "tie"),
        ("Verdict: [[ tie ]]", "tie"),
        ("final: [[b]]", "B"),
        ("[[A]] ... on reflection still [[A]]", "A"),
        ("Output [[A]] if A is better, [[B]] if B is better, [[C]] for a tie.", None),
        ("The better one is [B].", "B"),
        ("[a]", "A"),
        ("[C]", "tie"),
        ("[A] or [B]?", None),
        ("A is more detailed.\n\nA", "A"),
        ("Some analysis.\n**Verdict: B**", "B"),
        ("Some analysis.\nFinal verdict: tie.", "tie"),
        ("Some analysis.\nAssistant A", "A"),
        ("Some analysis.\nAssistant B is better!", "B"),
        ("Some analysis.\n  C  \n\n", "tie"),
        ("Assistant A's answer is better because it lists steps.", "A"),
        ("Overall, Assistant B wins on depth.", "B"),
        ("Assistant A is better in tone, but Assistant B is better in accuracy.", None),
        ("Assistant A gives a list and Assistant B gives a story.", None),
        ("I cannot decide.", None),
        ("", None),
        ("A good answer needs more detail.", None),
    ],
)
def test_parse_verdict(reply, verdict):
    assert parse_verdict(reply) == verdict


@pytest.mark.parametrize(
    "first, second, outcome",
    [
        ("win", "win", "win"), ("win", "tie", "win"), ("tie", "win", "win"),
        ("loss", "loss", "loss"), ("loss", "tie", "loss"), ("tie", "loss", "loss"),
        ("tie", "tie", "tie"), ("win", "loss", "tie"), ("loss", "win", "tie"),
    ],
)
def test_combine_two_orders(first, second, outcome):
    assert combine(first, second) == outcome


def test_order_outcome_maps_shown_labels_back_to_a():
    assert [order_outcome(v, True) for v in ("A", "B", "tie", None)] == ["win", "loss", "tie", "tie"]
    assert [order_outcome(v, False) for v in ("A", "B", "tie", None)] == ["loss", "win", "tie", "tie"]


def test_tally_rates():
    assert tally(["win", "win", "tie", "loss"]) == {
        "n": 4, "wins": 2, "ties": 1, "losses": 1, "win_rate": 0.5, "tie_rate": 0.25, "loss_rate": 0.25,
        "net_win_rate": 0.25,
    }


# ---- whole runs -------------------------------------------------------------------------------

# question id -> (category in Vicuna-80, plato's answer, ar's answer); sot answers are always shorter
ANSWERS = {
    1: ("generic", "a long and careful plato answer", "short ar"),
    2: ("generic", "plato brief", "a much longer ar answer here"),
    11: ("knowledge", "plato explains it at length", "ar says little"),
    12: ("knowledge", "the same text", "the same text"),
    21: ("roleplay", "plato plays the role well", "ar no"),
}
KEY = "sk-test"


def _shown(content: str, label: str) -> str:
    return re.search(rf"\[Assistant {label}'s answer begins\]\n(.*?)\n\[Assistant {label}'s answer ends\]",
                     content, re.DOTALL).group(1)


def fake_judge(script) -> httpx.ASGITransport:
    """An OpenAI-compatible judge in-process: `script(first, second)` writes the reply to a request
    showing `first` as Assistant A and `second` as B. It wants the bearer key KEY."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-judge", "object": "model", "created": 0, "owned_by": "t"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        if request.headers.get("authorization") != f"Bearer {KEY}":
            error = {"error": {"message": "bad key", "type": "invalid_request_error"}}
            return JSONResponse(status_code=401, content=error)
        body = await request.json()
        assert body["model"] == "fake-judge" and body["messages"][0]["role"] == "system"
        content = body["messages"][1]["content"]
        reply = script(_shown(content, "A"), _shown(content, "B"))
        return {"id": "x", "object": "chat.completion", "created": 0, "model": "fake-judge",
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": reply}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    return httpx.ASGITransport(app=app)


@pytest.fixture
def answers_file(tmp_path):
    rows = lambda texts: [{"id": i, "category": c, "text": t} for i, (c, t) in texts.items()]  # noqa: E731
    answers = {"plato": rows({i: (c, p) for i, (c, p, _) in ANSWERS.items()}),
               "ar": rows({i: (c, a) for i, (c, _, a) in ANSWERS.items()}),
               "sot": rows({i: (c, "s") for i, (c, *_) in ANSWERS.items()})}
    payload = {"data": "vicuna80", "budget": 64, "answers": answers}
    path = tmp_path / "plato.json"
    path.write_text(json.dumps(payload))
    return path


def _run(answers_file, tmp_path, script, *extra) -> dict:
    out = tmp_path / "judge.json"
    argv = ["--answers", str(answers_file), "--out", str(out), "--base-url", "http://judge.test/v1",
            "--api-key", KEY, "--concurrency", "3", *extra]
    returned = run(argv, transport=fake_judge(script))
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(returned))
    return written


def _counts(summary: dict) -> tuple:
    return summary["n"], summary["wins"], summary["ties"], summary["losses"]


def test_a_judge_that_always_prefers_the_first_answer_ties_everything(answers_file, tmp_path):
    result = _run(answers_file, tmp_path, lambda first, second: "First is best.\n[[A]]")
    assert result["judge"]["model"] == "fake-judge" and result["judge"]["base_url"] == "http://judge.test/v1"
    plato_ar = result["pairs"]["plato:ar"]
    assert _counts(plato_ar["overall"]) == (5, 0, 5, 0) and plato_ar["overall"]["net_win_rate"] == 0.0
    assert plato_ar["judge_replies"] == 8 and plato_ar["unparsed"] == 0
    assert plato_ar["identical_answers"] == 1 and plato_ar["orders_contradict"] == 4
    assert plato_ar["first_shown_picked"] == 1.0
    assert _counts(result["pairs"]["plato:sot"]["overall"]) == (5, 0, 5, 0)


def test_a_judge_that_prefers_the_longer_answer_gives_exact_wins(answers_file, tmp_path, capsys):
    longer = lambda first, second: "[[A]]" if len(first) > len(second) else "[[B]]"  # noqa: E731
    result = _run(answers_file, tmp_path, longer)
    plato_ar = result["pairs"]["plato:ar"]
    assert _counts(plato_ar["overall"]) == (5, 3, 1, 1) and plato_ar["overall"]["net_win_rate"] == 0.4
    categories = {name: _counts(t) for name, t in plato_ar["categories"].items()}
    assert categories == {"generic": (2, 1, 0, 1), "knowledge": (2, 1, 1, 0), "roleplay": (1, 1, 0, 0)}
    assert plato_ar["orders_contradict"] == 0 and plato_ar["first_shown_picked"] == 0.5
    assert [q["outcome"] for q in plato_ar["questions"]] == ["win", "loss", "win", "tie", "win"]
    assert _counts(result["pairs"]["plato:sot"]["overall"]) == (5, 5, 0, 0)
    assert "plato vs ar: win 0.60 tie 0.20 loss 0.20 net +0.40 (n=5, unparsed 0" in capsys.readouterr().out


def test_unparseable_replies_are_counted_as_ties(answers_file, tmp_path):
    replies = iter(["Hmm.", "[[B]]"] * 20)
    result = _run(answers_file, tmp_path, lambda first, second: next(replies), "--pairs", "plato:ar")
    plato_ar = result["pairs"]["plato:ar"]
    assert plato_ar["unparsed"] == 4 and plato_ar["judge_replies"] == 8
    assert plato_ar["overall"]["n"] == 5 and list(result["pairs"]) == ["plato:ar"]


def test_limit_takes_the_first_questions(answers_file, tmp_path):
    result = _run(answers_file, tmp_path, lambda first, second: "[[C]]", "--limit", "2")
    assert [q["id"] for q in result["pairs"]["plato:ar"]["questions"]] == [1, 2]
    assert result["limit"] == 2 and result["pairs"]["plato:ar"]["overall"]["ties"] == 2


def test_bad_pairs_and_bad_key_fail_with_a_message(answers_file, tmp_path):
    with pytest.raises(SystemExit, match=r"no answers for \['auto'\]"):
        _run(answers_file, tmp_path, lambda first, second: "[[A]]", "--pairs", "plato:auto")
    with pytest.raises(SystemExit, match="check --base-url"):
        run(["--answers", str(answers_file), "--out", str(tmp_path / "j.json"), "--base-url", "http://judge.test/v1",
             "--api-key", "wrong"], transport=fake_judge(lambda first, second: "[[A]]"))


def test_the_embedded_judge_path_runs_through_the_project_api(answers_file, tmp_path, make_engine):
    """The project's own app over the tiny random engine: its word salad never parses, so every
    judged question is a tie, and nothing crashes."""
    engine = AsyncEngine(make_engine(max_batch_size=2, max_model_len=512))
    try:
        out = tmp_path / "judge.json"
        run(["--answers", str(answers_file), "--out", str(out), "--pairs", "plato:ar", "--max-tokens", "16",
             "--concurrency", "2"], transport=embedded_transport(engine, 2))
    finally:
        engine.shutdown()
    result = json.loads(out.read_text())
    assert result["judge"]["base_url"] is None and result["judge"]["model"] == "embedded:smollm2-135m"
    plato_ar = result["pairs"]["plato:ar"]
    assert plato_ar["unparsed"] == plato_ar["judge_replies"] == 8
    assert _counts(plato_ar["overall"]) == (5, 0, 5, 0)


def test_judge_messages_show_first_as_assistant_a():
    system, user = judge_messages("Q?", " one ", "two")
    assert system["role"] == "system" and "[[A]]" in system["content"]
    assert _shown(user["content"], "A") == "one" and _shown(user["content"], "B") == "two"
