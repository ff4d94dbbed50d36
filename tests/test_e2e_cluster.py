"""End to end the way users run it: `serve run cluster/local.yaml` in the background (real Ray, real
Serve, the embedded SmolLM2 model and its length adapter), the official openai client against it,
plain, streamed and planned; a load that makes the decoder deployment scale from 1 to 2 replicas
and back, watched through Serve's status (the /healthz report); then a clean shutdown."""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parent.parent
BASE = "http://127.0.0.1:8000"


def _wait(predicate, timeout: float, what: str, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"serve run exited early ({proc.returncode}) while waiting for {what}")
        try:
            value = predicate()
            if value:
                return value
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _decoder_replicas() -> dict:
    return httpx.get(f"{BASE}/healthz", timeout=30).json().get("decoder_replicas", {})


def _running_decoders() -> int:
    return _decoder_replicas().get("RUNNING", 0)


def _settled() -> bool:
    """No decoder replica starting or stopping: the app is stopped idle, as users stop it."""
    replicas = _decoder_replicas()
    return bool(replicas) and set(replicas) == {"RUNNING"}


def _ctrl_c_answered():
    """In the child before `serve run` starts: Ctrl-C back to its default. A test run started in the
    background of a non-interactive shell (as CI may start it) has SIGINT ignored, the child inherits
    that, and Python then never turns Ctrl-C into KeyboardInterrupt: `serve run` would not stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    # unbuffered, so that a shutdown that hangs shows in the log how far it got
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    serve_bin = Path(sys.executable).parent / "serve"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(serve_bin), "run", "cluster/local.yaml"], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_ctrl_c_answered)
    try:
        _wait(lambda: httpx.get(f"{BASE}/healthz", timeout=10).status_code == 200, 420, "the app to be ready", proc)
        yield proc
    finally:
        try:
            _wait(_settled, 120, "the decoder replicas to settle", proc)
        except AssertionError:
            pass  # shut down anyway: the shutdown itself is what is checked below
        # Ctrl-C on `serve run` itself (not its process group: Ray's own processes must stay up
        # while it shuts the application and then Ray down in order)
        proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=180)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError("serve run did not shut down cleanly:\n" + log.read_text()[-3000:])
    assert proc.returncode is not None


@pytest.fixture
def client(served):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", timeout=300)


def test_openai_client_plain_and_streamed(client):
    answer = client.chat.completions.create(model="embedded:smollm2-135m", max_tokens=24, temperature=0,
                                            messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in answer.choices[0].message.content and answer.usage.completion_tokens > 0
    pieces = client.chat.completions.create(model="embedded:smollm2-135m", max_tokens=24, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "What is the capital of France?"}])
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert text == answer.choices[0].message.content  # greedy: the same answer, token by token
    completion = client.completions.create(model="embedded:smollm2-135m", prompt="The capital of France is",
                                           max_tokens=8, temperature=0)
    assert completion.choices[0].text.strip()


def test_planned_answer_with_its_plan(client):
    answer = client.chat.completions.create(
        model="embedded:smollm2-135m", max_tokens=160,
        messages=[{"role": "user", "content": "How can I improve my time management skills?"}],
        extra_body={"mode": "plato", "return_plan": True})
    extra = answer.model_extra
    assert answer.choices[0].message.content.strip()
    assert extra["mode"] in ("plato", "ar") and "nodes" in extra["plan"]
    if extra["plan"]["fallback"] is None:  # planned for real: the answer is built from the nodes
        assert extra["mode"] == "plato" and len(extra["plan"]["nodes"]) >= 2


def test_decoders_scale_out_under_load_and_back(client):
    assert _running_decoders() == 1

    def ask(i):
        return client.chat.completions.create(model="embedded:smollm2-135m", max_tokens=200, temperature=0.7,
                                              seed=i, messages=[{"role": "user", "content": f"Write a story about {i} cats."}])

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        answers = [pool.submit(ask, i) for i in range(48)]
        _wait(lambda: _running_decoders() == 2, 240, "a second decoder replica")
        assert all(a.result().choices[0].message.content for a in answers)
    _wait(lambda: _running_decoders() == 1, 240, "the scale-in back to one replica")
