"""Batch jobs against a fake OpenAI-compatible server (FastAPI under uvicorn in a thread): reading
JSONL and Parquet with bad rows, ids, retries, errors per row, and exactly-once resume after a job
is cancelled or killed. No Ray, no model."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from deployments import jobs
from deployments.job_io import JobInputError, ServerUnavailable, answer_row, read_rows
from deployments.jobs import JobConfig, run_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class FakeOpenAI:
    """A stand-in for the application's API: answers `echo: <last message>`, one token per word.
    `busy` first chat requests get 503 with Retry-After: 1; a message containing REJECT gets 400;
    past `hang_after` requests it answers nothing until stopped. `requests` holds every chat body."""

    def __init__(self):
        self.requests: list[dict] = []
        self.busy = 0
        self.hang_after: int | None = None
        self.stopping = threading.Event()
        self.app = FastAPI()
        self.app.get("/v1/models")(self._models)
        self.app.post("/v1/chat/completions")(self._chat)

    async def _models(self):
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def _chat(self, request: Request):
        body = await request.json()
        self.requests.append(body)
        if len(self.requests) <= self.busy:
            return _error(503, "server_overloaded", headers={"Retry-After": "1"})
        if self.hang_after is not None and len(self.requests) > self.hang_after:
            while not self.stopping.is_set():
                await asyncio.sleep(0.02)
            return _error(503, "stopping")
        question = body["messages"][-1]["content"]
        if "REJECT" in question:
            return _error(400, "messages.0.content: rejected by the fake server")
        words = f"echo: {question}".split()
        mode = body.get("mode", "ar")
        usage = {"prompt_tokens": len(question.split()), "completion_tokens": len(words),
                 "total_tokens": len(question.split()) + len(words)}
        if body.get("stream"):
            return StreamingResponse(_events(words, mode, usage), media_type="text/event-stream")
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "fake-model", "mode": mode,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": " ".join(words)},
                             "finish_reason": "stop"}],
                "usage": usage}

    def __enter__(self) -> FakeOpenAI:
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)
        self._thread.start()
        while not self._server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self._server.should_exit = True
        self._thread.join(10)


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    return JSONResponse(status_code=status, content=body, headers=headers)


async def _events(words: list[str], mode: str, usage: dict):
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "fake-model", "mode": mode}
    for i, word in enumerate(words):
        delta = {"content": word if i == 0 else f" {word}"}
        yield f"data: {json.dumps({**chunk, 'choices': [{'index': 0, 'delta': delta, 'finish_reason': None}]})}\n\n"
    yield f"data: {json.dumps({**chunk, 'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'stop'}]})}\n\n"
    yield f"data: {json.dumps({**chunk, 'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


@pytest.fixture
def fake():
    with FakeOpenAI() as server:
        yield server


def free_url() -> str:
    """A local address where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        f.writelines((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows)
    return str(path)


def questions(path, n: int) -> str:
    return write_jsonl(path, [{"prompt": f"question {i}"} for i in range(n)])


def answers(output) -> list[dict]:
    return pq.read_table(os.path.join(output, "answers.parquet")).to_pylist()


def written_ids(output) -> list[str]:
    """Every id in every part file, repeats included."""
    parts = os.path.join(output, "parts")
    return [i for name in sorted(os.listdir(parts)) if name.endswith(".parquet")
            for i in pq.read_table(os.path.join(parts, name))["id"].to_pylist()]


def run(fake: FakeOpenAI, input: str, output, **options):
    return asyncio.run(run_job(JobConfig(input=input, output=str(output), base_url=fake.url, progress_s=0, **options)))


def test_jsonl_rows_bad_ones_kept_with_their_line_and_problem(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "hi", "max_tokens": 5, "mode": "plato", "extra": 1},
        {"messages": [{"role": "user", "content": "hello"}], "temperature": 1},
        {"prompt": "x", "max_tokens": "10"},
        {"id": "b"},
        {"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
        "{not json",
        "",
        "[1, 2]",
        {"id": "a", "prompt": "again"},
        {"id": 7, "prompt": "int id", "mode": "fast"},
    ])
    rows = read_rows(path)
    assert [r.row for r in rows] == [1, 2, 3, 4, 5, 6, 8, 9, 10]
    assert rows[0].id == "a" and rows[0].error is None
    assert rows[0].request == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "mode": "plato"}
    assert rows[1].id.startswith("row2-") and rows[1].request["temperature"] == 1
    assert json.loads(rows[1].messages) == [{"role": "user", "content": "hello"}] and rows[1].prompt is None
    errors = [r.error for r in rows[2:]]
    assert errors[0].startswith("line 3: max_tokens") and "integer" in errors[0]
    assert errors[1] == "line 4: no prompt or messages"
    assert errors[2] == "line 5: give prompt or messages, not both"
    assert errors[3].startswith("line 6: not valid JSON") and errors[4] == "line 8: not a JSON object"
    assert errors[5].startswith("line 9: duplicate id 'a' (first at line 1)") and rows[7].id == "a@9"
    assert rows[8].id == "7" and errors[6].startswith("line 10: mode")
    assert all(r.request is None for r in rows[2:])
    assert len({r.id for r in rows}) == len(rows)
    assert [r.id for r in read_rows(path)] == [r.id for r in rows]  # stable across reads


def test_parquet_rows_and_a_missing_input(tmp_path):
    path = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({
        "id": [None, "q2", None],
        "prompt": ["first", None, None],
        "messages": [None, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "second"}], None],
        "max_tokens": [4, None, 2],
    }), path)
    rows = read_rows(path)
    assert rows[0].id.startswith("row1-")
    assert rows[0].request == {"messages": [{"role": "user", "content": "first"}], "max_tokens": 4}
    assert rows[1].id == "q2" and rows[1].request["messages"][1] == {"role": "user", "content": "second"}
    assert rows[2].error == "row 3: no prompt or messages"
    with pytest.raises(JobInputError, match="does not exist"):
        read_rows(str(tmp_path / "missing.jsonl"))


def test_the_apis_other_fields_go_to_the_server_and_what_one_answer_cannot_hold_is_a_bad_row(tmp_path):
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"prompt": "a", "response_format": schema, "stop": ["."], "seed": 3, "top_p": 0.5, "category": "kept out"},
        {"prompt": "b", "n": 2},
        {"prompt": "c", "stream": True},
        {"prompt": "d", "logprobs": True},
        {"prompt": "e", "n": 1, "stream": False, "logprobs": False},
        {"prompt": "f", "tools": [{"type": "function", "function": {"name": "g"}}], "tool_choice": "required"},
    ])
    rows = read_rows(path)
    assert rows[0].request == {"messages": [{"role": "user", "content": "a"}], "response_format": schema,
                               "stop": ["."], "seed": 3, "top_p": 0.5}
    assert [r.error for r in rows[1:4]] == [
        f"line {i}: {field}: a job row gets one answer, written without log probabilities, plan or streaming; "
        f"leave {field} out" for i, field in ((2, "n"), (3, "stream"), (4, "logprobs"))]
    assert rows[4].error is None and rows[4].request["n"] == 1
    assert rows[5].error == "line 6: tool_choice: a job row's answer is text, not tool calls; set tool_choice to 'none'"
    parquet = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"prompt": ["x", "y"], "stop": [None, ["!"]]}), parquet)
    assert [r.request for r in read_rows(parquet)] == [
        {"messages": [{"role": "user", "content": "x"}]}, {"messages": [{"role": "user", "content": "y"}], "stop": ["!"]}]


def test_openai_batch_input_lines_are_rows(tmp_path):
    """The lines OpenAI's Batch API and vLLM's run_batch read: the custom id is the row's id, the body its request."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0.2}
    path = write_jsonl(tmp_path / "batch.jsonl", [
        {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": body},
        {"custom_id": "req-2", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "req-3", "method": "GET", "url": "/v1/chat/completions", "body": body},
        {"custom_id": "req-4", "body": "hi"},
        {"custom_id": "req-5", "body": {**body, "max_tokens": "8"}},
    ])
    rows = read_rows(path)
    assert rows[0].id == "req-1" and rows[0].error is None and json.loads(rows[0].messages) == body["messages"]
    assert rows[0].request == {"messages": body["messages"], "model": "m", "max_tokens": 8, "temperature": 0.2}
    assert [r.id for r in rows] == ["req-1", "req-2", "req-3", "req-4", "req-5"]
    assert rows[1].error == "line 2: url: only /v1/chat/completions is served by a job, not '/v1/embeddings'"
    assert rows[2].error == "line 3: method: POST, not 'GET'"
    assert rows[3].error == "line 4: body: a JSON object, the request, is needed"
    assert rows[4].error.startswith("line 5: max_tokens")


def test_job_answers_every_row_in_input_order_with_errors_in_their_column(fake, tmp_path, capsys):
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "one two"},
        {"prompt": "REJECT me"},
        {"id": "c", "messages": [{"role": "user", "content": "three"}], "max_tokens": 3, "mode": "sot"},
        {"id": "d"},
    ])
    summary = run(fake, path, tmp_path / "out", max_tokens=16, concurrency=3)
    assert (summary.total, summary.answered, summary.errors, summary.errors_in_answers) == (4, 2, 2, 2)
    out = answers(tmp_path / "out")
    assert [r["row"] for r in out] == [1, 2, 3, 4]
    assert out[0] | {"latency_s": 0} == {
        "id": "a", "row": 1, "prompt": "one two", "messages": None, "answer": "echo: one two", "finish_reason": "stop",
        "prompt_tokens": 2, "completion_tokens": 3, "latency_s": 0, "mode": "ar", "error": None}
    assert out[0]["latency_s"] > 0
    assert out[1]["answer"] is None and out[1]["error"] == "HTTP 400: messages.0.content: rejected by the fake server"
    assert out[2]["answer"] == "echo: three" and out[2]["mode"] == "sot"
    assert out[3]["error"] == "line 4: no prompt or messages"
    sent = {r["messages"][-1]["content"]: r for r in fake.requests}
    assert len(fake.requests) == 3  # no retry of a 400, no request for a bad row
    assert sent["one two"]["max_tokens"] == 16 and sent["three"]["max_tokens"] == 3
    printed = capsys.readouterr().out
    assert "4 of 4 rows to do (1 bad), 0 already in" in printed and "bad row: line 4: no prompt or messages" in printed
    progress = [line for line in printed.splitlines() if " rows (" in line]
    assert len(progress) == 4 and progress[-1].startswith("4/4 rows (100%), ")
    assert progress[-1].endswith("rows/s, ETA 0s, 2 with errors")


def test_503_is_retried_after_retry_after(fake, tmp_path):
    fake.busy = 1
    started = time.monotonic()
    run(fake, questions(tmp_path / "in.jsonl", 1), tmp_path / "out", concurrency=1)
    assert time.monotonic() - started >= 0.95
    assert len(fake.requests) == 2 and answers(tmp_path / "out")[0]["answer"] == "echo: question 0"


class FlakyTransport(httpx.AsyncBaseTransport):
    """Fails the first `failures` requests as if the connection were refused, then passes them on."""

    def __init__(self, inner: httpx.AsyncBaseTransport, failures: int):
        self.inner, self.failures = inner, failures

    async def handle_async_request(self, request):
        if self.failures:
            self.failures -= 1
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)


def test_lost_connections_are_retried_then_give_up(tmp_path):
    server = FakeOpenAI()
    [row] = read_rows(questions(tmp_path / "in.jsonl", 1))

    async def ask(failures: int, max_retries: int):
        transport = FlakyTransport(httpx.ASGITransport(server.app), failures)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            return await answer_row(client, row, {"max_tokens": 4}, max_retries)

    assert asyncio.run(ask(failures=1, max_retries=1))["answer"] == "echo: question 0"
    with pytest.raises(ServerUnavailable, match="ConnectError.*after 2 tries"):
        asyncio.run(ask(failures=2, max_retries=1))


def test_a_server_that_stays_busy_stops_the_job_resumably(fake, tmp_path, capsys):
    fake.busy = 1
    config = JobConfig(input=questions(tmp_path / "in.jsonl", 3), output=str(tmp_path / "out"), base_url=fake.url,
                       max_retries=0, concurrency=1)
    assert jobs.run_and_report(config) == 1
    assert "503" in capsys.readouterr().err and not os.path.exists(tmp_path / "out" / "answers.parquet")
    assert jobs.run_and_report(config) == 0
    assert [r["answer"] for r in answers(tmp_path / "out")] == [f"echo: question {i}" for i in range(3)]


def _assert_exactly_once(output, n: int):
    ids = written_ids(output)
    assert len(ids) == len(set(ids)) == n
    out = answers(output)
    assert [r["answer"] for r in out] == [f"echo: question {i}" for i in range(n)]


def test_a_cancelled_job_keeps_its_answers_and_resumes_each_row_once(fake, tmp_path):
    path, output, n = questions(tmp_path / "in.jsonl", 12), tmp_path / "out", 12
    fake.hang_after = 5

    async def cancel_when_stuck():
        job = asyncio.create_task(run_job(JobConfig(input=path, output=str(output), base_url=fake.url, concurrency=3)))
        while len(fake.requests) < 5 + 3:
            await asyncio.sleep(0.02)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job

    asyncio.run(cancel_when_stuck())
    assert len(written_ids(output)) == 5  # the answers in memory were written on the way out
    fake.hang_after, fake.requests = None, []
    run(fake, path, output)
    assert len(fake.requests) == n - 5
    _assert_exactly_once(output, n)
    rerun = run(fake, path, output)  # a finished job, rerun: nothing to ask, the same answers
    assert len(fake.requests) == n - 5 and (rerun.skipped, rerun.answered, rerun.errors) == (n, 0, 0)
    _assert_exactly_once(output, n)


@pytest.mark.parametrize("how, kept", [(signal.SIGKILL, 4), (signal.SIGTERM, 5)], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_or_stopped_job_resumes_each_row_once(fake, tmp_path, how, kept):
    """SIGKILL loses the answer not yet in a part; SIGTERM (`ray job stop`) writes it on the way out."""
    path, output, n = questions(tmp_path / "in.jsonl", 10), tmp_path / "out", 10
    fake.hang_after = 5
    command = [sys.executable, "-m", "deployments.jobs", "--input", path, "--output", str(output),
               "--base-url", fake.url, "--concurrency", "2", "--flush-rows", "2"]
    job = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(fake.requests) < 5 + 2 and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(fake.requests) == 7, job.stderr.read() if job.poll() is not None else "job stuck"
    finally:
        job.send_signal(how)
        stderr = job.communicate(timeout=30)[1]
    if how == signal.SIGTERM:
        assert job.returncode == 1 and "stopped (interrupted); rerun the same command to resume" in stderr
    assert len(written_ids(output)) == kept
    fake.hang_after, fake.requests = None, []
    run(fake, path, output)
    assert len(fake.requests) == n - kept
    _assert_exactly_once(output, n)


def test_an_output_folder_of_another_input_is_refused(fake, tmp_path):
    run(fake, questions(tmp_path / "a.jsonl", 2), tmp_path / "out")
    with pytest.raises(JobInputError, match="holds answers for other rows"):
        run(fake, questions(tmp_path / "b.jsonl", 3), tmp_path / "out")


def test_an_unreachable_server_stops_the_job_before_it_starts(tmp_path):
    config = JobConfig(input=questions(tmp_path / "in.jsonl", 1), output=str(tmp_path / "out"), base_url=free_url())
    with pytest.raises(JobInputError, match="cannot reach the API"):
        asyncio.run(run_job(config))
