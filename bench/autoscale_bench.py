"""`python -m bench autoscale`: a burst through the Serve application (cluster/local.yaml's, on the
CPU, without the length predictor) whose Decoder autoscales from one replica to two, two ways:

- `sequences` (the configs here): the Decoder scales on the sequences its replicas report
  (deployments.autoscaling:SequenceLoadPolicy, 16 a replica) and the batcher hands out 40 requests
  for each running replica (`dispatch.requests_per_replica`);
- `micro-batches` (local.yaml before): Serve's own rule on ongoing micro-batches
  (`target_ongoing_requests: 1`) and a fixed 32 requests out, whatever the replicas.

`--requests` chat requests are sent at once, each greedy to `--max-tokens` tokens (`ignore_eos`, no
loop stop, so every answer is as long on both sides). Each side deploys the application afresh; the
sides take turns `--repeats` times. Per side: the burst's wall time, answers a minute, mean and p90
latency, when the second replica ran, and the most requests the batcher had out. `wall_gain` =
`micro-batches`' wall time over `sequences`'. `--threads N` gives every Decoder replica N torch
threads on both sides (default: local.yaml's). Writes bench/results/autoscale.json (`--name` another).
"""
from __future__ import annotations

import argparse
import asyncio
import threading
import time

import numpy as np

from bench.common import machine, table, write_result

SIDES = ("sequences", "micro-batches")


def decoder_override(side: str) -> dict:
    """The Decoder deployment as local.yaml has it (`sequences`), or as it had it before (`micro-batches`)."""
    from bench.serve_bench import local_app

    decoder = next(d for d in local_app()["deployments"] if d["name"] == "Decoder")
    if side == "micro-batches":
        scaling = {k: v for k, v in decoder["autoscaling_config"].items() if k != "policy"}
        decoder = {**decoder, "max_ongoing_requests": 32, "autoscaling_config": {**scaling, "target_ongoing_requests": 1}}
    return decoder


def side_args(side: str, threads: int | None = None) -> dict:
    from bench.serve_bench import app_args

    args = app_args(predictor=False)
    args["limits"]["stop_on_loop"] = False
    if threads is not None:
        args["engine"]["num_threads"] = threads
    if side == "micro-batches":
        args["dispatch"].pop("requests_per_replica", None)
        args["dispatch"]["max_requests_in_flight"] = 32
    return args


class Watcher(threading.Thread):
    """Every half second: the Decoder's running replicas and the batcher's requests out."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, int, int]] = []  # (s since start, running replicas, requests out)
        self.stop = threading.Event()
        self.started_at = time.perf_counter()

    def run(self):
        from ray import serve

        from deployments.replica_count import running_replicas

        batcher = serve.get_deployment_handle("Batcher", app_name="plato")
        while not self.stop.wait(0.5):
            try:
                out = batcher.stats.remote().result()["requests_out"]
                self.samples.append((time.perf_counter() - self.started_at, running_replicas("plato", "Decoder") or 0, out))
            except Exception:  # noqa: BLE001 - a missed sample, not a failed run
                continue


async def _burst(base_url: str, count: int, max_tokens: int) -> list[float]:
    from bench.serve_bench import http_session

    async def ask(i: int) -> float:
        body = {"messages": [{"role": "user", "content": f"Tell me a story about a town called number {i}."}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        sent = time.perf_counter()
        async with session.post("/v1/chat/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:200]}")
            answer = await response.json()
        if answer["usage"]["completion_tokens"] != max_tokens:
            raise RuntimeError(f"an answer of {answer['usage']['completion_tokens']} tokens, not {max_tokens}")
        return time.perf_counter() - sent

    async with http_session(base_url) as session:
        await ask(-1)  # warm-up
        return list(await asyncio.gather(*(ask(i) for i in range(count))))


def _side(side: str, count: int, max_tokens: int, threads: int | None) -> dict:
    from bench.serve_bench import serve_app

    with serve_app(side_args(side, threads), deployments=[decoder_override(side)]) as base_url:
        watcher = Watcher()
        watcher.start()
        started = time.perf_counter()
        latencies = asyncio.run(_burst(base_url, count, max_tokens))
        wall = time.perf_counter() - started
        watcher.stop.set()
        watcher.join()
    second = next((t for t, replicas, _ in watcher.samples if replicas >= 2), None)
    return {"wall_s": round(wall, 2), "answers_per_min": round(60 * count / wall, 1),
            "latency_mean_s": round(float(np.mean(latencies)), 2),
            "latency_p90_s": round(float(np.percentile(latencies, 90)), 2),
            "second_replica_at_s": None if second is None else round(second, 1),
            "most_requests_out": max((out for _, _, out in watcher.samples), default=0),
            "samples": watcher.samples}


def run(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench autoscale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 requests of 32 tokens, once")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="each side this many times, in turns")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of each Decoder replica (default: local.yaml's engine.num_threads)")
    parser.add_argument("--name", default="autoscale", help="results file name (bench/results/NAME.json)")
    args = parser.parse_args(argv)
    count, max_tokens, repeats = (16, 32, 1) if args.quick else (args.requests, args.max_tokens, args.repeats)
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    for i in range(repeats):
        for side in SIDES if i % 2 == 0 else SIDES[::-1]:
            runs[side].append(_side(side, count, max_tokens, args.threads))
            print(side, {k: v for k, v in runs[side][-1].items() if k != "samples"}, flush=True)
    keys = ("wall_s", "answers_per_min", "latency_mean_s", "latency_p90_s")
    sides = {side: {k: round(float(np.mean([r[k] for r in runs[side]])), 2) for k in keys} for side in SIDES}
    payload = {"requests": count, "max_tokens": max_tokens, "repeats": repeats, "threads": args.threads, "sides": sides,
               "wall_gain": round(sides["micro-batches"]["wall_s"] / sides["sequences"]["wall_s"], 2),
               "latency_gain": round(sides["micro-batches"]["latency_mean_s"] / sides["sequences"]["latency_mean_s"], 2),
               "runs": runs, "machine": machine()}
    print(table(["side", "wall s", "answers/min", "latency mean s", "p90 s", "second replica at s", "most out"],
                [[side, *(sides[side][k] for k in keys), [r["second_replica_at_s"] for r in runs[side]],
                  [r["most_requests_out"] for r in runs[side]]] for side in SIDES]))
    print(f"wall_gain {payload['wall_gain']} (micro-batches over sequences), latency_gain {payload['latency_gain']}")
    print(f"wrote {write_result(args.name, payload)}")
    return payload
