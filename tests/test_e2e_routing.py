"""End to end: the Decoder deployment with two replicas (real Ray, real Serve, the embedded model),
where a conversation's next turn must land on the replica that holds its earlier turns (the
Decoder's prefix-affinity router), which the answer's usage shows as cached prompt tokens."""
from __future__ import annotations

import concurrent.futures

import pytest
from tests.e2e_app import serve_plato

pytestmark = pytest.mark.e2e
CONVERSATIONS = 6  # sent at random, each would find its replica with chance 1/2: 1/64 for all six


@pytest.fixture(scope="module")
def client():
    openai = pytest.importorskip("openai")
    args = {"engine": {"max_batch_size": 8, "max_model_len": 1024, "num_threads": 1},
            "limits": {"default_max_tokens": 24, "max_tokens_limit": 64}, "predictor": None,
            "batcher": {"token_budget": 1}}  # a micro-batch per request: each turn routed on its own
    # the Decoder's own router with its defaults: the six first turns, routed in one instant, must
    # spread over both replicas (five of six went to one in a run before the router counted its choices
    # not yet sent), or their next turns find their holder more than 4 busier and are balanced away
    with serve_plato(args, decoder_replicas=2) as base_url:
        yield openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=120, max_retries=0)


def _two_turns(client, i: int) -> tuple[int, int, int]:
    """The first turn's prompt tokens and cached ones, and the second turn's cached ones."""
    messages = [{"role": "user", "content": f"Name {i + 2} colours of the rainbow."}]
    first = client.chat.completions.create(model="embedded:smollm2-135m", messages=messages, max_tokens=24,
                                           temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And which is your favourite?"}]
    second = client.chat.completions.create(model="embedded:smollm2-135m", messages=messages, max_tokens=8,
                                            temperature=0)
    return (first.usage.prompt_tokens, first.usage.prompt_tokens_details.cached_tokens,
            second.usage.prompt_tokens_details.cached_tokens)


def test_each_conversations_next_turn_finds_its_earlier_turn_on_its_replica(client):
    """All at once, so that both replicas are busy and Serve's power of two choices would send some
    next turns away from their earlier ones. (Here each turn is a micro-batch of its own, so the router
    alone is tested; the batcher's keeping apart of different holders' prompts is tested apart.)"""
    with concurrent.futures.ThreadPoolExecutor(CONVERSATIONS) as pool:
        turns = list(pool.map(lambda i: _two_turns(client, i), range(CONVERSATIONS)))
    assert all(first_cached < prompt - 1 for prompt, first_cached, _ in turns), turns  # none was asked before
    assert all(cached >= prompt for prompt, _, cached in turns), turns
