"""End to end with two Decoder replicas (real Ray, real Serve, the embedded model): the batcher, in its
own replica, knows which replica holds each conversation (the Decoder's router it asks travels to it
by value, as Serve ships it); and, at most two micro-batches out at once, requests that queue behind
them leave together in one micro-batch, where one client can go away while the other still waits."""
from __future__ import annotations

import json
import threading

import httpx
import pytest
from tests.e2e_app import serve_plato

pytestmark = pytest.mark.e2e
MODEL = "embedded:smollm2-135m"


@pytest.fixture(scope="module")
def server():
    # no drafts: with them a repetitive answer of two sequences ran 256 tokens in 4.6 s, before the proxy's
    # notice of a closed connection reached the batcher (CI at dde20aa)
    args = {"engine": {"max_batch_size": 8, "max_model_len": 1024, "num_threads": 1, "speculative_tokens": 0},
            "limits": {"default_max_tokens": 24, "max_tokens_limit": 256}, "predictor": None,
            "dispatch": {"max_batches_in_flight": 2}}  # two long answers out, and whatever comes next queues
    with serve_plato(args, decoder_replicas=2) as base_url, httpx.Client(base_url=base_url, timeout=120) as client:
        yield client


class Answer(threading.Thread):
    """One streamed chat answer read in a thread: `begun` is set at its first piece of text; with
    `hang_up`, the client disconnects right then."""

    def __init__(self, client: httpx.Client, messages: list[dict], max_tokens: int, hang_up: bool = False):
        super().__init__(daemon=True)
        self.client, self.messages, self.max_tokens, self.hang_up = client, messages, max_tokens, hang_up
        self.begun, self.text, self.usage, self.error = threading.Event(), "", None, None

    def run(self):
        body = {"model": MODEL, "messages": self.messages, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[len("data: "):])
                    piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                    if piece:
                        self.text += piece
                        self.begun.set()
                        if self.hang_up:
                            return
                    self.usage = chunk.get("usage") or self.usage
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.begun.set()

    def started(self) -> "Answer":
        self.start()
        assert self.begun.wait(120) and self.error is None, self.error
        return self

    def done(self) -> "Answer":
        self.join(180)
        assert not self.is_alive() and self.error is None, self.error
        return self


def _batcher_stats() -> dict:
    from ray import serve

    return serve.get_deployment_handle("Batcher", app_name="plato").stats.remote().result()


def _settled_batcher_stats(within_s: float = 60) -> dict:
    """The batcher's counts once nothing is queued or out (at most `within_s` from now)."""
    import time

    deadline = time.monotonic() + within_s
    while (stats := _batcher_stats())["in_flight"] + stats["pending"] and time.monotonic() < deadline:
        time.sleep(0.2)
    return stats


def _blockers(client, tag: str) -> list[Answer]:
    """Two long answers, one a micro-batch each: both micro-batches allowed out are taken until they end."""
    return [Answer(client, [{"role": "user", "content": f"Tell me a story about {tag} number {i}."}], 64).started()
            for i in (1, 2)]


def test_the_batcher_knows_which_replica_holds_each_conversation(server):
    """Two conversations, one on each replica (the second starts while the first runs, so the router
    balances it onto the other): asked from outside, the batcher names each next turn's holder, the
    replica its turn before went to, as it does when it keeps queued turns apart
    (tests/test_batcher_push.py); and each next turn, sent there, finds its turn before cached."""
    from ray import serve

    talks = [[{"role": "user", "content": "Name three colours of the rainbow."}],
             [{"role": "user", "content": "Name two planets of the solar system."}]]
    first = Answer(server, talks[0], 64).started()  # running on one replica: the other is less busy
    second = Answer(server, talks[1], 24).started()
    turns = [first.done(), second.done()]
    for talk, turn in zip(talks, turns):
        talk += [{"role": "assistant", "content": turn.text}, {"role": "user", "content": "Which one do you like?"}]
    batcher = serve.get_deployment_handle("Batcher", app_name="plato")
    holders = []
    for talk in talks:
        tokens = server.post("/tokenize", json={"model": MODEL, "messages": talk, "add_generation_prompt": True})
        assert tokens.status_code == 200, tokens.text
        holders.append(batcher.holder.remote(tokens.json()["tokens"]).result())
    assert None not in holders and holders[0] != holders[1], holders
    assert batcher.holder.remote(tokens.json()["tokens"][:10]).result() is None  # too short a start to hold
    for turn, talk in zip(turns, talks):
        answer = Answer(server, talk, 8).started().done()
        assert answer.usage["prompt_tokens_details"]["cached_tokens"] >= turn.usage["prompt_tokens"], (
            turn.usage, answer.usage)


def test_a_client_that_leaves_a_shared_micro_batch_is_aborted_on_its_replica_while_the_other_finishes(server):
    """Two requests queued behind two long answers leave in one micro-batch; one client disconnects
    after its first piece of text. The batcher asks the Decoder to abort that request alone, the
    router sends the call to the replica running the micro-batch (which says it aborted one), and
    the other answer runs to its 64 tokens."""
    before = _batcher_stats()
    blockers = _blockers(server, "a knight")
    # 256 tokens: on a loaded box the proxy notices the closed connection late; it must before the end
    leaves = Answer(server, [{"role": "user", "content": "Write a poem about the sea."}], 256, hang_up=True)
    stays = Answer(server, [{"role": "user", "content": "Write a poem about the hills."}], 64)
    leaves.start()
    stays.start()
    for answer in [*blockers, leaves, stays]:
        answer.done()
    assert leaves.text and stays.usage["completion_tokens"] == 64
    # the abort races the other answer's last 60-odd tokens (CI at 6a19f00 read the stats first), not the
    # 256 the leaving one would run: wait until nothing is out, then ask whether it ended early
    after = _settled_batcher_stats()
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["decoder_aborts"] == before["decoder_aborts"] + 1
    assert after["in_flight"] == after["pending"] == 0


def test_a_replica_whose_engine_dies_exits_its_answers_finish_on_the_other_and_serve_replaces_it(server):
    """Last in this module: it takes a replica down. Both replicas run a long answer; one's forward pass
    is made to raise, as a device fault would. Its engine dies, the replica's process exits
    (actors.decoder.exit_replica), the batcher re-queues the answer after the tokens already streamed,
    and the other replica finishes it: both answers run to their full length, their streams never cut.
    Serve then starts a replacement, and the app serves on."""
    import time

    import ray
    from ray import serve

    def break_a_busy_engine(replica_actor) -> bool:  # runs in the replica's process (by value: cloudpickle)
        def fail(*args, **kwargs):
            raise RuntimeError("injected: the device fell over")

        engine = replica_actor._replica_impl._user_callable_wrapper._callable.engine.engine  # Serve's internals (Ray 2.60)
        if not engine.has_work():
            return False
        engine.runner.decode = engine.runner.prefill = fail
        return True

    before = _batcher_stats()
    answers = [Answer(server, [{"role": "user", "content": f"Tell me a long story about a lighthouse number {i}."}],
                      160).started() for i in (1, 2)]
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "Decoder" in a["name"])
    assert len(names) == 2, names
    broken = next(name for name in names
                  if ray.get(ray.get_actor(name, namespace="serve").__ray_call__.remote(break_a_busy_engine)))
    for answer in answers:
        answer.done()
        assert answer.usage["completion_tokens"] == 160, answer.usage
    after = _batcher_stats()
    assert after["failed_batches"] >= before["failed_batches"] + 1 and after["failed_out"] == before["failed_out"]
    assert after["in_flight"] == after["pending"] == 0

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        states = serve.status().applications["plato"].deployments["Decoder"].replica_states
        if states.get("RUNNING") == 2 and broken not in {a["name"] for a in ray.util.list_named_actors(True)}:
            break
        time.sleep(2)
    assert states.get("RUNNING") == 2, states
    assert Answer(server, [{"role": "user", "content": "Say hello."}], 8).started().done().usage["completion_tokens"] == 8
