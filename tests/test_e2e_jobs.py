"""End to end: a batch job submitted to Ray Jobs on a real local Ray cluster (`ray start --head`
with its dashboard), answering through the real application deployed with `serve deploy`
(embedded SmolLM2), once with `ray job submit` and once with `plato job submit --follow`."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import jsonschema
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
PORT_OPTIONS = ["--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
                "--dashboard-agent-grpc-port", "--metrics-export-port", "--runtime-env-agent-port",
                "--node-manager-port", "--object-manager-port"]
CAPITAL = {"type": "object", "properties": {"country": {"type": "string", "maxLength": 30},
                                          "capital": {"type": "string", "maxLength": 30}},
           "required": ["country", "capital"], "additionalProperties": False}
ROWS = [
    {"id": "france", "prompt": "What is the capital of France?"},
    {"messages": [{"role": "user", "content": "Say hello in French."}], "max_tokens": 6},
    {"id": "empty"},
    {"custom_id": "capital-json", "method": "POST", "url": "/v1/chat/completions", "body": {  # OpenAI's batch line
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in JSON."}], "max_tokens": 48,
        "response_format": {"type": "json_schema", "json_schema": {"name": "capital", "schema": CAPITAL}}}},
]


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _wait_for(url: str, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    pytest.fail(f"{what} did not come up at {url} within {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def cluster():
    """A one-node Ray cluster of its own (own temp dir and ports, so neither `ray.init()` elsewhere
    nor `ray stop` can confuse it with another), with the application deployed on it. Stopped by
    signalling the `ray start --block` process, which takes down what it started."""
    temp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths have a length limit
    ports = _free_ports(len(PORT_OPTIONS) + 1)
    dashboard, http_port = ports[1], ports[-1]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # RAY_AUTH_MODE: Ray 2.60 turns token auth on for a `ray start` wherever ~/.ray/auth_token exists,
    # and then only clients that set RAY_AUTH_MODE=token get in; this test's cluster is local and open
    env.update(PATH=f"{BIN}:{env['PATH']}", HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
    command = [f"{BIN}/ray", "start", "--head", "--block", "--num-cpus", "2", "--include-dashboard", "true",
               "--dashboard-host", "127.0.0.1", "--temp-dir", temp]
    command += [part for option, port in zip(PORT_OPTIONS, ports) for part in (option, str(port))]
    log = open(os.path.join(temp, "ray-start.log"), "w")
    head = subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        address = f"http://127.0.0.1:{dashboard}"
        _wait_for(f"{address}/api/version", 180, "the Ray dashboard")
        config = {
            "proxy_location": "HeadOnly",
            "http_options": {"host": "127.0.0.1", "port": http_port},
            "applications": [{
                "name": "plato", "route_prefix": "/", "import_path": "deployments.app:build_app",
                "args": {"engine": {"max_batch_size": 4, "max_model_len": 512, "num_threads": 1},
                         "limits": {"default_max_tokens": 8, "max_tokens_limit": 64}},
            }],
        }
        config_path = os.path.join(temp, "serve.json")
        with open(config_path, "w") as f:
            json.dump(config, f)
        subprocess.run([f"{BIN}/serve", "deploy", config_path, "--address", address], env=env, check=True, timeout=120)
        base_url = f"http://127.0.0.1:{http_port}"
        _wait_for(f"{base_url}/healthz", 300, "the application")
        yield {"address": address, "base_url": base_url, "env": env, "temp": temp}
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        with open(os.path.join(temp, "ray-start.log")) as f:
            print(f.read()[-3000:])
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


def _check_answers(output: str) -> None:
    rows = pq.read_table(os.path.join(output, "answers.parquet")).to_pylist()
    assert [r["row"] for r in rows] == [1, 2, 3, 4]
    france, hello, empty, structured = rows
    assert france["id"] == "france" and "Paris" in france["answer"] and france["error"] is None
    assert france["completion_tokens"] <= 8 and france["mode"] == "ar" and france["latency_s"] > 0
    assert hello["answer"] and hello["completion_tokens"] <= 6 and hello["id"].startswith("row2-")
    assert empty["answer"] is None and empty["error"] == "line 3: no prompt or messages"
    assert structured["id"] == "capital-json" and structured["finish_reason"] == "stop"
    jsonschema.validate(json.loads(structured["answer"]), CAPITAL)


def test_ray_job_submit_and_plato_job_submit(cluster, tmp_path):
    input_path = tmp_path / "rows.jsonl"
    input_path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    run = dict(cwd=REPO, env=cluster["env"], capture_output=True, text=True, timeout=300)

    out1 = str(tmp_path / "out1")
    done = subprocess.run([f"{BIN}/ray", "job", "submit", "--address", cluster["address"], "--working-dir", ".", "--",
                           "python", "-m", "deployments.jobs", "--input", str(input_path), "--output", out1,
                           "--base-url", cluster["base_url"], "--progress-s", "0"], **run)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4/4 rows (100%)" in done.stdout and "succeeded" in done.stdout
    _check_answers(out1)

    out2 = str(tmp_path / "out2")
    done = subprocess.run([sys.executable, "-m", "deployments.cli", "job", "submit", "--input", str(input_path),
                           "--output", out2, "--address", cluster["address"], "--base-url", cluster["base_url"],
                           "--follow"], **run)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = done.stdout.split()[1].rstrip(";")
    _check_answers(out2)
    status = subprocess.run([sys.executable, "-m", "deployments.cli", "job", "status", job_id,
                             "--address", cluster["address"]], **run)
    assert status.stdout == "SUCCEEDED\n"
