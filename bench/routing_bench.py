"""`python -m bench routing`: conversations through the Serve application (cluster/local.yaml's, on
the CPU, without the length predictor) with two Decoder replicas, each micro-batch sent by the
Decoder's prefix-affinity router (deployments.prefix_router) against Serve's power of two choices.
A conversation's next turn finds its earlier turns' KV only on the replica that answered them.

`--conversations` conversations talk at once, each `--turns` user messages (the short ShareGPT
prompts of bench turns), every answer greedy and streamed with its usage. Each side deploys the
application afresh (empty caches) and first holds one untimed conversation; the sides take turns
`--repeats` times. Per side, over the turns after the first: the share of prompt tokens served from a
replica's cache (`usage.prompt_tokens_details.cached_tokens`), the share of them that found at least
the turn before's whole prompt cached (the rest landed on a replica without it), mean time to first
token, and how many conversations got the same answers under both. `ttft_gain` = the later turns' mean time to first
token under power of two choices over under prefix affinity. Writes bench/results/routing.json.

`--busy N` lets at most N requests out to the decoders at once, so turns queue in the batcher, and
when several slots free at once, queued turns leave together, several to a micro-batch, which runs on
one replica: a third side, `affinity-unsplit`, turns off the batcher's keeping apart of prompts that
different replicas hold (`split_by_holder`), and `split_gain` is its later turns' mean time to first
token over `affinity`'s. Writes bench/results/routing_busy.json. `--lockstep` sends every
conversation's next turn at once, in rounds, so turns arrive together and leave several to a
micro-batch (with the same third side); it writes routing_lockstep.json (routing_busy_lockstep.json
with `--busy`)."""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import numpy as np

from bench.common import machine, table, write_result
from bench.turns_bench import conversations

SIDES = ("affinity", "balanced")
SPLIT_SIDES = ("affinity", "affinity-unsplit", "balanced")
POWER_OF_TWO = "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter"  # Serve's default
REPLICAS = 2


def decoder_overrides(side: str) -> list[dict]:
    """The Decoder deployment's overrides: two replicas, a CPU core each; Serve's own router on `balanced`."""
    decoder = {"name": "Decoder", "num_replicas": REPLICAS, "max_ongoing_requests": 32,
               "ray_actor_options": {"num_cpus": 1}}
    if side == "balanced":
        decoder["request_router_config"] = {"request_router_class": POWER_OF_TWO}
    return [decoder]


async def _turn(session, messages: list[dict], max_tokens: int) -> dict:
    """One streamed answer: its text, time to first text, and usage."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent, first, text, usage = time.perf_counter(), None, [], None
    async with session.post("/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            piece = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if piece:
                first = first or time.perf_counter()
                text.append(piece)
            usage = chunk.get("usage") or usage
    if usage is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return {"text": "".join(text), "ttft_s": round((first or time.perf_counter()) - sent, 4),
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


async def _in_lockstep(session, talks: list[list[str]], max_tokens: int) -> list[list[dict]]:
    """The conversations' turns in rounds: every conversation's next turn is sent at once, when all
    have their answer to the turn before (agents stepping together, a harness replaying chats)."""
    histories: list[list[dict]] = [[] for _ in talks]
    turns: list[list[dict]] = [[] for _ in talks]
    for round_ in range(max(map(len, talks))):
        going = [i for i, talk in enumerate(talks) if round_ < len(talk)]
        for i in going:
            histories[i].append({"role": "user", "content": talks[i][round_]})
        answers = await asyncio.gather(*(_turn(session, histories[i], max_tokens) for i in going))
        for i, answer in zip(going, answers):
            turns[i].append(answer)
            histories[i].append({"role": "assistant", "content": answer["text"]})
    return turns


async def _conversation(session, talk: list[str], max_tokens: int) -> list[dict]:
    messages, turns = [], []
    for user in talk:
        messages.append({"role": "user", "content": user})
        turns.append(await _turn(session, messages, max_tokens))
        messages.append({"role": "assistant", "content": turns[-1]["text"]})
    return turns


def _side(side: str, warmup: list[str], talks: list[list[str]], max_tokens: int, busy: int | None = None,
          lockstep: bool = False) -> tuple[list[list[dict]], dict]:
    """Each conversation's turns, and the batcher's micro-batches: how many, their mean size, and how
    often a request was kept out of one for its holder."""
    from ray import serve

    from bench.serve_bench import app_args, http_session, serve_app

    args = app_args(predictor=False)
    args["engine"]["num_threads"] = 1  # a core for each of the two replicas
    args["dispatch"]["max_requests_in_flight"] = args["dispatch"]["max_batches_in_flight"] = 32 * REPLICAS
    if busy is not None:
        args["dispatch"]["max_requests_in_flight"] = busy
    args["dispatch"]["split_by_holder"] = side != "affinity-unsplit"

    async def talk_all(base_url: str) -> list[list[dict]]:
        async with http_session(base_url) as session:
            await _conversation(session, warmup, max_tokens)
            if lockstep:
                return await _in_lockstep(session, talks, max_tokens)
            return list(await asyncio.gather(*(_conversation(session, t, max_tokens) for t in talks)))

    with serve_app(args, deployments=decoder_overrides(side)) as base_url:
        talks_done = asyncio.run(talk_all(base_url))
        stats = serve.get_deployment_handle("Batcher", app_name="plato").stats.remote().result()
    return talks_done, {key: stats[key] for key in ("batches", "mean_batch_size", "holder_splits")}


def summarize(runs: dict[str, list[list[list[dict]]]]) -> dict:
    """Per side, over every repeat's conversations: the later turns' cached share and mean time to
    first token, and time to first token per turn."""
    out = {}
    for side, repeats in runs.items():
        talks = [talk for repeat in repeats for talk in repeat]
        later = [turn for talk in talks for turn in talk[1:]]
        found = [turn["cached_tokens"] >= before["prompt_tokens"] for talk in talks
                 for before, turn in zip(talk, talk[1:])]
        out[side] = {
            "later_turns_found_earlier": round(sum(found) / len(found), 3),
            "later_turns_cached_share": round(sum(t["cached_tokens"] for t in later)
                                              / sum(t["prompt_tokens"] for t in later), 3),
            "later_turns_ttft_s": round(float(np.mean([t["ttft_s"] for t in later])), 3),
            "ttft_s_per_turn": [round(float(np.mean(col)), 3) for col in zip(*[[t["ttft_s"] for t in talk]
                                                                            for talk in talks])],
        }
    return out


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench routing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 conversations of 3 turns, 24 tokens, once")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="each side this many times, in turns")
    parser.add_argument("--busy", type=int, default=None, metavar="N",
                        help="at most N requests out at once; adds the side affinity-unsplit (see above)")
    parser.add_argument("--lockstep", action="store_true",
                        help="send every conversation's next turn at once, in rounds; adds the side affinity-unsplit")
    args = parser.parse_args(argv)
    if args.busy is not None and args.busy < 1:
        parser.error(f"--busy must be at least 1, got {args.busy}")
    split_sides = args.busy is not None or args.lockstep
    sides_run = SPLIT_SIDES if split_sides else SIDES
    count, turns, max_tokens, repeats = ((4, 3, 24, 1) if args.quick else
                                         (args.conversations, args.turns, args.max_tokens, args.repeats))

    talks = conversations(count + 1, turns)
    runs: dict[str, list] = {side: [] for side in sides_run}
    batchers: dict[str, list] = {side: [] for side in sides_run}
    for i in range(repeats):
        for side in sides_run if i % 2 == 0 else sides_run[::-1]:
            done, batcher = _side(side, talks[0][:2], talks[1:], max_tokens, args.busy, args.lockstep)
            runs[side].append(done)
            batchers[side].append(batcher)
    sides = summarize(runs)
    texts = [[[t["text"] for t in talk] for r in runs[side] for talk in r] for side in sides_run]
    same = sum(all(talk == per_side[0] for talk in per_side[1:]) for per_side in zip(*texts))
    ttft = {side: sides[side]["later_turns_ttft_s"] for side in sides_run}
    payload = {
        "conversations": count, "turns": turns, "max_tokens": max_tokens, "repeats": repeats, "replicas": REPLICAS,
        "busy": args.busy, "lockstep": args.lockstep, "sides": sides,
        "ttft_gain": round(ttft["balanced"] / ttft["affinity"], 2),
        **({"split_gain": round(ttft["affinity-unsplit"] / ttft["affinity"], 2)} if split_sides else {}),
        "same_answers": same, "batchers": batchers, "runs": runs, "machine": machine(),
    }
    print(table(["side", "found the turn before", "later turns cached", "later turns TTFT s", *(f"turn {t + 1} TTFT s" for t in range(turns))],
                [[side, sides[side]["later_turns_found_earlier"], sides[side]["later_turns_cached_share"], sides[side]["later_turns_ttft_s"],
                  *sides[side]["ttft_s_per_turn"]] for side in sides_run]))
    print(f"ttft_gain {payload['ttft_gain']} (later turns, power of two choices over prefix affinity); "
          + (f"split_gain {payload['split_gain']} (affinity-unsplit over affinity); " if split_sides else "")
          + f"same answers in {same} of {count * repeats} conversations")
    for side in sides_run:
        print(f"{side}: micro-batches {[b['batches'] for b in batchers[side]]}, mean size "
              f"{[round(b['mean_batch_size'], 2) for b in batchers[side]]}, held apart for their holder "
              f"{[b['holder_splits'] for b in batchers[side]]}")
    name = "routing" + ("_busy" if args.busy is not None else "") + ("_lockstep" if args.lockstep else "")
    print(f"wrote {write_result(name, payload)}")
    return payload
