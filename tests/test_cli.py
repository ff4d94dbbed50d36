"""The `plato` command line: parsing, dispatch, and its errors (exit 2 with a message), with the
network parts pointed at the fake OpenAI-compatible server of test_jobs; and what `submit_job`
sends to Ray Jobs."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from deployments import cli, jobs
from test_jobs import REPO, FakeOpenAI, answers, free_url, questions


@pytest.fixture
def fake():
    with FakeOpenAI() as server:
        yield server


def plato(*argv: str) -> int:
    return cli.main(list(argv))


def refused(capsys, *argv: str) -> str:
    """Runs a command that must be refused (exit status 2); returns its message."""
    try:
        code = plato(*argv)
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 2
    return capsys.readouterr().err


def test_ask_prints_the_answer_and_sends_mode_and_budget(fake, capsys):
    assert plato("ask", "What is Ray?", "--base-url", fake.url, "--mode", "plato", "--max-tokens", "5",
                 "--priority", "2") == 0
    out, err = capsys.readouterr()
    assert out == "echo: What is Ray?\n"
    assert err.startswith("[mode plato, 3+4 tokens, ")
    [body] = fake.requests
    assert (body["model"], body["mode"], body["max_tokens"], body["priority"]) == ("fake-model", "plato", 5, 2)
    assert "temperature" not in body and not body.get("stream") and "response_format" not in body


def test_ask_asks_for_json_mode(fake, capsys):
    assert plato("ask", "A cat, as JSON", "--base-url", fake.url, "--json") == 0
    assert fake.requests[0]["response_format"] == {"type": "json_object"}


def test_ask_asks_for_a_schema_read_from_a_file(fake, capsys, tmp_path):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    path = tmp_path / "cat.json"
    path.write_text(json.dumps(schema))
    assert plato("ask", "A cat, as JSON", "--base-url", fake.url, "--schema", str(path)) == 0
    assert fake.requests[0]["response_format"] == {"type": "json_schema", "json_schema": {"name": "cat",
                                                                                          "schema": schema}}
    path.write_text("{not json")
    with pytest.raises(SystemExit):
        plato("ask", "A cat", "--base-url", fake.url, "--schema", str(path))
    assert "--schema: cannot read a JSON Schema" in capsys.readouterr().err


def test_ask_streams_tokens(fake, capsys):
    assert plato("ask", "stream me", "--base-url", fake.url, "--stream") == 0
    out, err = capsys.readouterr()
    assert out == "echo: stream me\n" and err.startswith("[mode ar, 2+3 tokens")
    assert fake.requests[0]["stream"] is True and "mode" not in fake.requests[0]


def test_ask_errors(fake, capsys):
    assert "cannot reach the server at" in refused(capsys, "ask", "hi", "--base-url", free_url())
    assert "invalid choice: 'fast'" in refused(capsys, "ask", "hi", "--mode", "fast")
    assert plato("ask", "REJECT this", "--base-url", fake.url) == 1
    assert "HTTP 400: messages.0.content: rejected" in capsys.readouterr().err


def test_job_run_writes_the_answers(fake, tmp_path, capsys):
    path = questions(tmp_path / "in.jsonl", 3)
    assert plato("job", "run", "--input", path, "--output", str(tmp_path / "out"), "--base-url", fake.url,
                 "--max-tokens", "7") == 0
    assert [r["answer"] for r in answers(tmp_path / "out")] == [f"echo: question {i}" for i in range(3)]
    assert {r["max_tokens"] for r in fake.requests} == {7}
    assert "3/3 rows (100%)" in capsys.readouterr().out


def test_job_run_errors(tmp_path, capsys):
    missing = str(tmp_path / "missing.jsonl")
    assert f"input file {missing} does not exist" in refused(capsys, "job", "run", "--input", missing, "--output", "o")
    path = questions(tmp_path / "in.jsonl", 1)
    assert "--concurrency: Input should be greater than or equal to 1" in refused(
        capsys, "job", "run", "--input", path, "--output", "o", "--concurrency", "0")
    output = str(tmp_path / "out")
    assert jobs.run_and_report(jobs.JobConfig(input=path, output=output, base_url=free_url())) == 2
    assert "cannot reach the API at" in capsys.readouterr().err
    assert "cannot reach the API at" in refused(capsys, "job", "run", "--input", path, "--output", output,
                                                "--base-url", free_url())


def test_job_submit_status_and_logs_go_to_ray_jobs(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(jobs, "submit_job", lambda *a, **k: calls.append(("submit", a, k)) or "raysubmit_9")
    monkeypatch.setattr(jobs, "job_status", lambda *a: calls.append(("status", a)) or "RUNNING")
    monkeypatch.setattr(jobs, "job_logs", lambda *a: calls.append(("logs", a)) or "3/3 rows\n")
    monkeypatch.setattr(jobs, "follow_job", lambda *a: calls.append(("follow", a)) or "FAILED")
    path = questions(tmp_path / "in.jsonl", 1)
    assert plato("job", "submit", "--input", path, "--output", "out", "--address", "http://head:8265",
                 "--base-url", "http://head:8000", "--concurrency", "16") == 0
    assert calls.pop() == ("submit", (path, "out", "http://head:8265"),
                           {"working_dir": ".", "base_url": "http://head:8000", "concurrency": 16})
    assert "submitted raysubmit_9" in capsys.readouterr().out
    assert plato("job", "status", "raysubmit_9") == 0 and capsys.readouterr().out == "RUNNING\n"
    assert calls.pop() == ("status", ("raysubmit_9", jobs.DEFAULT_DASHBOARD))
    assert plato("job", "logs", "raysubmit_9") == 0 and capsys.readouterr().out == "3/3 rows\n"
    assert plato("job", "logs", "raysubmit_9", "-f") == 1  # the job failed
    where = ("raysubmit_9", jobs.DEFAULT_DASHBOARD)
    assert calls[-2:] == [("logs", where), ("follow", where)]
    missing = str(tmp_path / "missing.jsonl")
    monkeypatch.undo()
    assert "does not exist" in refused(capsys, "job", "submit", "--input", missing, "--output", "out")
    nowhere = free_url()
    assert f"Failed to connect to Ray at address: {nowhere}. Is a cluster running" in refused(
        capsys, "job", "status", "raysubmit_9", "--address", nowhere)


def test_serve_and_bench_run_the_underlying_commands(tmp_path, monkeypatch, capsys):
    commands = []
    monkeypatch.setattr(subprocess, "call", lambda command: commands.append(command) or 0)
    config = tmp_path / "local.yaml"
    config.write_text("applications: []\n")
    assert plato("serve", "--config", str(config)) == 0
    assert os.path.basename(commands[-1][0]) == "serve" and commands[-1][1:] == ["run", str(config)]
    assert plato("bench", "engine", "--quick", "--limit", "2") == 0
    assert commands[-1] == [sys.executable, "-m", "bench", "engine", "--quick", "--limit", "2"]
    assert "config file nope.yaml does not exist" in refused(capsys, "serve", "--config", "nope.yaml")
    assert "the following arguments are required" in refused(capsys)


def test_python_dash_m_runs_the_cli_and_exits_2_on_a_usage_error(tmp_path):
    command = [sys.executable, "-m", "deployments.cli", "job", "run", "--input", "missing.jsonl", "--output", "out"]
    done = subprocess.run(command, cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and done.stderr == "error: input file missing.jsonl does not exist\n"


class RecordingJobClient:
    """Stands in for ray.job_submission.JobSubmissionClient."""

    def __init__(self):
        self.submitted = {}

    def submit_job(self, **kwargs):
        self.submitted = kwargs
        return "raysubmit_1"


def test_submit_job_sends_the_command_with_the_working_dir(tmp_path, monkeypatch):
    client = RecordingJobClient()
    monkeypatch.setattr(jobs, "_job_client", lambda address: client)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    questions(tmp_path / "data" / "in.jsonl", 1)
    job_id = jobs.submit_job("data/in.jsonl", "out", concurrency=4, api_key="secret", mode="plato")
    assert job_id == "raysubmit_1"
    assert client.submitted["runtime_env"] == {"working_dir": ".", "env_vars": {jobs.API_KEY_ENV: "secret"}}
    command = client.submitted["entrypoint"]
    assert command == (f"python -m deployments.jobs --input data/in.jsonl --output {tmp_path / 'out'} "
                       "--concurrency 4 --mode plato")
    parser = argparse.ArgumentParser()
    jobs.add_job_arguments(parser)
    config = jobs.config_from_args(parser, parser.parse_args(command.split()[3:]))
    assert (config.concurrency, config.mode, config.api_key) == (4, "plato", None)


def test_a_ray_client_address_is_refused_with_the_address_to_use():
    with pytest.raises(ValueError, match="Ray Client address.*http://<head>:8265"):
        jobs.job_status("raysubmit_1", "ray://head:10001")
