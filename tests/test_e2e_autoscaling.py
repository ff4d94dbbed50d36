"""End to end (real Ray, real Serve, the embedded model): the Decoder scales on the sequences its
replicas report, which Serve's own rule, counting micro-batches, would not have seen; and the
batcher hands out requests for the replicas that run: a second replica lets the requests it held
back in its bins out, while the first replica's answers are still decoding, and the Decoder's
router, counting the first replica's load in sequences, sends them to the new one."""
from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from tests.e2e_app import serve_plato

pytestmark = pytest.mark.e2e
MODEL = "embedded:smollm2-135m"
PER_REPLICA = 6
LONG = 768  # tokens: six such answers on one core outlast a second replica's start


def _decoder_options() -> dict:
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    policy = AutoscalingPolicy(policy_function="deployments.autoscaling:SequenceLoadPolicy",
                               policy_kwargs={"target_sequences": 2})
    # Serve's own rule would need more than 100 micro-batches a replica: no more than PER_REPLICA
    # can be out, so only the sequences can add a replica here
    scaling = AutoscalingConfig(min_replicas=1, max_replicas=2, target_ongoing_requests=100, metrics_interval_s=0.5,
                                look_back_period_s=2, upscale_delay_s=1, downscale_delay_s=3, policy=policy)
    return {"autoscaling_config": scaling, "max_ongoing_requests": PER_REPLICA}


@pytest.fixture(scope="module")
def server():
    # every long answer runs its LONG tokens: no drafts (a lone answer that repeats itself would go several
    # times faster than the others) and no loop stop (it would end one early, freeing its slot)
    args = {"engine": {"max_batch_size": 8, "max_model_len": 1024, "num_threads": 1, "speculative_tokens": 0},
            "limits": {"default_max_tokens": 24, "max_tokens_limit": LONG, "stop_on_loop": False},
            "predictor": None,
            "dispatch": {"requests_per_replica": PER_REPLICA, "max_requests_in_flight": 2 * PER_REPLICA}}
    with serve_plato(args, decoder_options=_decoder_options()) as base_url, \
            httpx.Client(base_url=base_url, timeout=300) as client:
        _until(lambda: client.get("/healthz").status_code == 200, 300, "the app to be ready")
        yield client


def _until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _running_decoders(client: httpx.Client) -> int:
    return client.get("/healthz").json().get("decoder_replicas", {}).get("RUNNING", 0)


def _batcher_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("Batcher", app_name="plato").stats.remote().result()


def _holder(client: httpx.Client, content: str) -> str | None:
    """The Decoder replica the batcher's router sent this chat prompt to (Batcher.holder)."""
    from ray import serve

    tokens = client.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": content}],
                                            "add_generation_prompt": True})
    assert tokens.status_code == 200, tokens.text
    return serve.get_deployment_handle("Batcher", app_name="plato").holder.remote(tokens.json()["tokens"]).result()


def _ask(client: httpx.Client, content: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_second_replica_comes_for_the_sequences_and_takes_what_the_batcher_held_back(server):
    assert _running_decoders(server) == 1
    with concurrent.futures.ThreadPoolExecutor(2 * PER_REPLICA) as pool:
        long = [pool.submit(_ask, server, f"Tell me a long story about a town called {i}.", LONG)
                for i in range(PER_REPLICA)]
        _until(lambda: _batcher_stats()["requests_out"] == PER_REPLICA, 60, "the first replica's share to go out")
        short = [pool.submit(_ask, server, f"Name a colour, number {i}.", 8) for i in range(2)]
        _until(lambda: _batcher_stats()["pending"] == 2, 30, "the two short requests to queue")
        held = _batcher_stats()
        _until(lambda: _running_decoders(server) == 2, 240, "a second decoder replica")
        # the batcher reads the running replicas every 2 s, and looks again every second while it holds
        # requests back
        _until(lambda: _batcher_stats()["pending"] == 0, 30, "the held requests to go out")
        grown = _batcher_stats()
        answers = [s.result(timeout=120) for s in short]
        long_still_running = sum(not f.done() for f in long)
        # where each ran, as the Decoder's router recorded it (asked before the scale-in forgets a replica)
        ran_on = {kind: _holder(server, content) for kind, content in
                  (("long", "Tell me a long story about a town called 0."), ("short", "Name a colour, number 0."))}
        finished = [f.result(timeout=300) for f in long]

    # one replica's worth out, the rest held in the bins, until the second replica runs
    assert held["request_limit"] == PER_REPLICA and held["requests_out"] == PER_REPLICA
    assert grown["request_limit"] == 2 * PER_REPLICA
    # the held requests were answered while the first replica's answers still decoded: they did not
    # wait for a slot there to free
    assert long_still_running > 0
    # the router counts the first replica's 6 sequences, not its 3 micro-batches: the held requests went to
    # the new replica, though they share the system prompt's KV with the first
    assert None not in ran_on.values() and ran_on["short"] != ran_on["long"], ran_on
    assert all(a["usage"]["completion_tokens"] == 8 for a in answers)
    assert all(f["usage"]["completion_tokens"] == LONG for f in finished)
    _until(lambda: _running_decoders(server) == 1, 120, "the scale-in back to one replica")
