"""`python -m bench serve`: the Serve application over HTTP against the same engine called in-process.

A Poisson stream of ShareGPT prompts (data/sharegpt_serve.jsonl, a fixed-seed subset of
../shared/data/sharegpt4k.jsonl) at several rates, the same arrival times for both systems:
- `http`: the application of cluster/local.yaml (its args and runtime_env; Ingress -> Batcher -> one
  Decoder replica for these plain requests; no length predictor unless --predictor) started here
  with Ray Serve, asked with streamed chat completions (`stream_options.include_usage` gives the
  answer's token count);
- `in_process`: one LLMEngine with the same engine settings behind an AsyncEngine, streamed.
Both decode greedily (temperature 0) with the API's loop stop, so they should give the same answers.
Per rate and system: requests/s, output tokens/s, time to first token (first text) and latency,
p50/p99. `http_efficiency` = HTTP tokens/s over in-process tokens/s at the highest rate (`inf`: all
requests at once, saturation). Repeats alternate the order of the two systems and keep each one's
fastest run, so a noisy moment on a shared machine hits both alike; and the in-process engine runs
at the niceness of the Decoder replica, so that other work on the machine takes CPU from both sides
alike rather than from the Serve side first. It lowers itself only once Ray is up: Ray's own
processes (raylet, GCS, agents) keep the niceness of the process that started them and its workers
get 15 more (at most 19), so lowering first would leave the Decoder at 19 under Ray's processes at 15
while the in-process engine ran at 15 beside them (as under `serve run`: those at 0, replicas at 15).
Writes bench/results/serve.json and serve.png.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from bench.common import DATA, REPO, RESULTS, load_jsonl, machine, table, write_result

DATA_FILE = "sharegpt_serve.jsonl"
SOURCE = REPO.parent / "shared" / "data" / "sharegpt4k.jsonl"
SUBSET_ROWS, SUBSET_SEED, MAX_PROMPT_CHARS = 512, 0, 1500
TARGET_EFFICIENCY = 0.9
MODES = ("http", "in_process")
RAY_WORKER_NICENESS = 15  # Ray's default `worker_niceness`: its workers run below the driver


def match_ray_worker_niceness(target: int = RAY_WORKER_NICENESS) -> int:
    """Lower this process (the in-process side) to niceness `target` (never raising it); returns it."""
    current = os.nice(0)
    return os.nice(target - current) if current < target else current


def replica_niceness(deployment: str, app: str = "plato") -> int | None:
    """The niceness of a running replica of `deployment` on this machine (Ray names its process
    `ray::ServeReplica:<app>:<deployment>`); None when there is none."""
    import psutil

    title = f"ServeReplica:{app}:{deployment}"
    for process in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(title in part for part in process.info["cmdline"] or ()):
                return process.nice()
    return None


def write_subset(source=SOURCE, dest=DATA / DATA_FILE, rows: int = SUBSET_ROWS, seed: int = SUBSET_SEED) -> None:
    """The committed prompt file: `rows` prompts drawn with a fixed seed, cut to MAX_PROMPT_CHARS so
    that every one fits the embedded model's context with room for its answer."""
    with open(source) as f:
        usable = [r for r in map(json.loads, f) if r["prompt"].strip()]
    chosen = random.Random(seed).sample(usable, rows)
    with open(dest, "w") as out:
        for row in chosen:
            out.write(json.dumps({"id": row["id"], "prompt": row["prompt"].strip()[:MAX_PROMPT_CHARS]}) + "\n")


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of `n` requests is sent: a Poisson process of `rate`
    requests/s (exponential gaps, seeded); `inf` sends them all at once."""
    if rate == float("inf"):
        return [0.0] * n
    rng, at, offsets = random.Random(seed), 0.0, []
    for _ in range(n):
        at += rng.expovariate(rate)
        offsets.append(at)
    return offsets


@dataclass
class Record:
    """One request as its client saw it: seconds to the first text, to the end, and answer tokens."""

    ttft_s: float | None
    latency_s: float
    tokens: int
    error: str | None = None


async def drive(offsets: list[float], send: Callable[[int], Awaitable[Record]]) -> tuple[list[Record], float]:
    """Calls `send(i)` at `offsets[i]` seconds, all concurrently; the records and the wall seconds
    from the start to the last answer."""
    start = time.perf_counter()

    async def one(i: int, offset: float) -> Record:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        return await send(i)

    records = await asyncio.gather(*(one(i, at) for i, at in enumerate(offsets)))
    return list(records), time.perf_counter() - start


async def read_sse(lines: AsyncIterator[str], started: float, clock=time.perf_counter) -> Record:
    """A streamed chat completion's server-sent events: the first chunk with text content gives the
    time to first token, the usage chunk the answer's token count."""
    ttft, tokens = None, None
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            return Record(ttft, clock() - started, 0, f"stream error: {chunk['error']}")
        if ttft is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
            ttft = clock() - started
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    if tokens is None:
        return Record(ttft, clock() - started, 0, "the stream ended without a usage chunk")
    return Record(ttft, clock() - started, tokens)


async def http_request(session, prompt: str, max_tokens: int) -> Record:
    """One streamed chat completion over `session` (an aiohttp.ClientSession with the base URL).
    aiohttp rather than httpx: the client shares the machine's cores with the server it measures,
    and aiohttp reads the same streams for a fifth of httpx's CPU (64 streams of 65 chunks: 0.31 s
    against 1.49 s), CPU the HTTP side's Decoder would otherwise lose to the measuring client."""
    import aiohttp

    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    try:
        async with session.post("/v1/chat/completions", json=body) as response:
            if response.status != 200:
                text = await response.text()
                return Record(None, time.perf_counter() - started, 0, f"HTTP {response.status}: {text[:200]}")
            return await read_sse(_text_lines(response.content), started)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return Record(None, time.perf_counter() - started, 0, f"{type(exc).__name__}: {exc}")


async def _text_lines(content) -> AsyncIterator[str]:
    async for line in content:
        yield line.decode()


def http_session(base_url: str, timeout_s: float = 600.0):
    """The benchmark's HTTP client: no cap on connections (every request of a burst is sent at once)."""
    import aiohttp

    return aiohttp.ClientSession(base_url=base_url, connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def in_process_request(engine, prompt: str, params) -> Record:
    """The same request straight into `engine` (an AsyncEngine), tokenized on its thread as the
    service does; the first token event with text gives the time to first token."""
    from engine.types import GenerationRequest, Result

    started = time.perf_counter()
    messages = [{"role": "user", "content": prompt}]
    ids = await engine.call(lambda e: e.encode_chat(messages))
    ttft = None
    async for item in engine.stream(GenerationRequest(prompt_ids=ids, params=params)):
        if isinstance(item, Result):
            return Record(ttft, time.perf_counter() - started, item.completion_tokens)
        if ttft is None and item.text:
            ttft = time.perf_counter() - started
    raise RuntimeError("the engine stream ended without a result")


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation, as numpy), rounded to the millisecond; None of none."""
    return round(float(np.percentile(values, q)), 3) if values else None


def summarize(records: list[Record], seconds: float) -> dict:
    """Throughput over the run's wall time and p50/p99 of the answered requests' timings."""
    done = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in done if r.ttft_s is not None]
    latency = [r.latency_s for r in done]
    tokens = sum(r.tokens for r in done)
    return {"requests": len(records), "errors": len(records) - len(done), "seconds": round(seconds, 3),
            "output_tokens": tokens, "requests_per_s": round(len(done) / seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "latency_p50_s": percentile(latency, 50), "latency_p99_s": percentile(latency, 99),
            "first_errors": sorted({r.error for r in records if r.error})[:3]}


async def measure(senders: dict[str, Callable[[int], Awaitable[Record]]], rates: list[float], n: int,
                  seed: int, repeats: int) -> dict:
    """Per rate: each system's fastest of `repeats` runs (their order alternating) with its requests'
    timings, the tokens/s of every run, and how many requests got answers of the same length from both."""
    out = {}
    for rate in rates:
        offsets = arrival_offsets(n, rate, seed)
        best: dict[str, tuple[dict, list[Record]]] = {}
        runs: dict[str, list[float]] = {mode: [] for mode in senders}
        for repeat in range(repeats):
            for mode in (list(senders) if repeat % 2 == 0 else list(senders)[::-1]):
                records, seconds = await drive(offsets, senders[mode])
                summary = summarize(records, seconds)
                runs[mode].append(summary["tokens_per_s"])
                if mode not in best or summary["tokens_per_s"] > best[mode][0]["tokens_per_s"]:
                    best[mode] = (summary, records)
        per_request = {mode: _timings(best[mode][1]) for mode in senders}
        same = sum(a == b for a, b in zip(*(t["tokens"] for t in per_request.values())))
        out[str(rate)] = {**{mode: best[mode][0] for mode in senders}, "tokens_per_s_runs": runs,
                          "same_answer_lengths": f"{same}/{n}", "per_request": per_request}
    return out


def _timings(records: list[Record]) -> dict:
    return {"ttft_s": [None if r.ttft_s is None else round(r.ttft_s, 3) for r in records],
            "latency_s": [round(r.latency_s, 3) for r in records], "tokens": [r.tokens for r in records]}


def local_app() -> dict:
    """The application of cluster/local.yaml, as `serve run` reads it."""
    import yaml

    return yaml.safe_load((REPO / "cluster" / "local.yaml").read_text())["applications"][0]


def app_args(predictor: bool) -> dict:
    """cluster/local.yaml's application args, on the CPU (its decoders ask Ray for no GPU, so the
    in-process engine stays off any GPU too), without the length predictor unless asked."""
    args = local_app()["args"]
    args["engine"]["device"] = "cpu"
    if not predictor:
        args["predictor"] = None
    return args


@contextlib.contextmanager
def serve_app(args: dict, start_timeout_s: float = 600.0, deployments: list[dict] | None = None):
    """cluster/local.yaml's application deployed here as `serve run` deploys a config (so its
    runtime_env reaches the application's replicas, and only them), with `args`, on a free local
    port: yields its base URL. Its deployment overrides are replaced by `deployments` (none by
    default, so the Decoder keeps build_app's defaults: one replica, no autoscaling, as the
    in-process side is one engine)."""
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    app = {**local_app(), "name": "plato", "route_prefix": "/", "args": args, "deployments": deployments or []}
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        _get_global_client().deploy_apps(ServeDeploySchema(applications=[app]))  # what `serve run` calls
        deadline = time.monotonic() + start_timeout_s
        while (status := serve.status().applications.get("plato")) is None or status.status != "RUNNING":
            if status is not None and status.status == "DEPLOY_FAILED":
                raise SystemExit(f"the application failed to deploy: {status.message}")
            if time.monotonic() > deadline:
                raise SystemExit(f"the application was not running after {start_timeout_s:.0f} s")
            time.sleep(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


async def _both(base_url: str, args: dict, prompts: list[str], cli) -> tuple[dict, dict]:
    """Both sides measured (`measure`), and each side's `engine_time` over all its runs."""
    from deployments.completion_service import ApiLimits
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.types import SamplingParams

    engine = AsyncEngine(lambda: LLMEngine.from_config(EngineConfig(**args["engine"])))
    params = SamplingParams(max_tokens=cli.max_tokens, temperature=0.0,
                            stop_on_loop=ApiLimits(**args["limits"]).stop_on_loop)
    async with http_session(base_url) as session:
        senders = {"http": lambda i: http_request(session, prompts[i], cli.max_tokens),
                   "in_process": lambda i: in_process_request(engine, prompts[i], params)}
        try:
            for send in senders.values():  # warm-up: first calls allocate and pick kernels
                warm = await send(0)
                if warm.error:
                    raise SystemExit(f"the application refused the warm-up request: {warm.error}")
            per_rate = await measure(senders, cli.rates, len(prompts), cli.seed, cli.repeats)
            from ray import serve

            replica = await serve.get_deployment_handle("Decoder", app_name="plato").stats.remote()
            return per_rate, {"http": engine_time(replica), "in_process": engine_time(await engine.call(
                lambda e: e.stats()))}
        finally:
            engine.shutdown()


def engine_time(stats: dict) -> dict:
    """How fast each side's engine ran while it ran: the time inside engine steps over the whole
    benchmark (both sides decode the same requests). A Decoder replica whose steps take longer than
    the in-process engine's is slowed by its host process; equal step times put the loss elsewhere."""
    steps, seconds, tokens = stats["steps"], stats["step_s"], stats["generated_tokens"]
    return {"steps": steps, "step_s": round(seconds, 1), "generated_tokens": tokens,
            "ms_per_step": round(1000 * seconds / steps, 1) if steps else None,
            "tokens_per_step_s": round(tokens / seconds, 1) if seconds else None}


def _chart(per_rate: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(per_rate)
    panels = [("tokens_per_s", "output tokens/s"), ("requests_per_s", "requests/s"),
              ("ttft_p50_s", "time to first token p50 (s)"), ("ttft_p99_s", "time to first token p99 (s)"),
              ("latency_p50_s", "latency p50 (s)"), ("latency_p99_s", "latency p99 (s)")]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (key, title) in zip(axes.flat, panels):
        for mode, color in zip(MODES, ("tab:blue", "tab:gray")):
            ax.plot(rates, [per_rate[r][mode][key] or 0.0 for r in rates], marker="o", color=color, label=mode)
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("arrival rate (requests/s)")
    axes.flat[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 requests at rates 1 and inf, one run each")
    parser.add_argument("-n", type=int, default=None, help=f"requests per run (default 64, at most {SUBSET_ROWS})")
    parser.add_argument("--rates", default=None, help="arrival rates in requests/s, comma-separated; inf = all at "
                        "once (default 0.5,1,2,inf; --quick 1,inf)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument("--repeats", type=int, default=None, help="runs per rate and system (default 2, --quick 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    parser.add_argument("--predictor", action="store_true", help="serve with the length predictor of local.yaml")
    parser.add_argument("--routing-priority", choices=["normal", "idle"], default=None,
                        help="CPU class of the routing replicas (the config's routing_priority; default: local.yaml's)")
    parser.add_argument("--write-subset", action="store_true", help=f"rewrite data/{DATA_FILE} from {SOURCE} and stop")
    return parser


def _print_report(result: dict) -> None:
    fmt = lambda value: "-" if value is None else f"{value:.2f}"
    print(table(["rate/s", "system", "req/s", "tok/s", "TTFT p50", "TTFT p99", "latency p50", "latency p99", "errors"],
                [[rate, mode, fmt(s["requests_per_s"]), f"{s['tokens_per_s']:.1f}", fmt(s["ttft_p50_s"]),
                  fmt(s["ttft_p99_s"]), fmt(s["latency_p50_s"]), fmt(s["latency_p99_s"]), s["errors"]]
                 for rate, both in result["rates"].items() for mode, s in ((m, both[m]) for m in MODES)]))
    print(f"\nhttp_efficiency (HTTP tok/s / in-process tok/s at rate {result['efficiency_rate']}): "
          f"{result['http_efficiency']:.3f} (target >= {TARGET_EFFICIENCY}: "
          f"{'met' if result['target_met'] else 'not met'})")


def run(argv: list[str]) -> dict:
    cli = _parser().parse_args(argv)
    if cli.write_subset:
        write_subset()
        print(f"wrote {DATA / DATA_FILE}")
        return {}
    n = cli.n or (16 if cli.quick else 64)
    cli.rates = sorted(float(r) for r in (cli.rates or ("1,inf" if cli.quick else "0.5,1,2,inf")).split(","))
    cli.repeats = cli.repeats or (1 if cli.quick else 2)
    rows = load_jsonl(DATA_FILE)
    if not 1 <= n <= len(rows):
        raise SystemExit(f"-n: {n} requests asked; data/{DATA_FILE} holds {len(rows)} prompts")
    prompts = [row["prompt"] for row in rows[:n]]

    args = app_args(cli.predictor)
    if cli.routing_priority is not None:
        args["routing_priority"] = cli.routing_priority
    load_before = os.getloadavg()[0]  # the machine is shared: say how busy it was
    with serve_app(args) as base_url:
        decoder_niceness = replica_niceness("Decoder")
        niceness = match_ray_worker_niceness(RAY_WORKER_NICENESS if decoder_niceness is None else decoder_niceness)
        per_rate, engine_seconds = asyncio.run(_both(base_url, args, prompts, cli))
    saturation = str(cli.rates[-1])
    efficiency = per_rate[saturation]["http"]["tokens_per_s"] / per_rate[saturation]["in_process"]["tokens_per_s"]
    result = {
        "model": args["engine"]["model"],
        "workload": {"data": f"data/{DATA_FILE}", "requests": n, "rates": [str(r) for r in cli.rates],
                     "max_tokens": cli.max_tokens, "temperature": 0, "seed": cli.seed,
                     "prompt_chars_mean": round(sum(map(len, prompts)) / n, 1)},
        "app_args": args, "rates": per_rate, "engine_time": engine_seconds,
        "http_efficiency": round(efficiency, 3), "efficiency_rate": saturation,
        "target": TARGET_EFFICIENCY, "target_met": efficiency >= TARGET_EFFICIENCY,
        "quick": cli.quick, "repeats": cli.repeats,
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]}, "niceness": niceness,
        "decoder_niceness": decoder_niceness,
        "machine": machine(),
    }
    path = write_result("serve", result)
    _chart(per_rate, RESULTS / "serve.png")
    _print_report(result)
    print("engine time (all runs):", engine_seconds)
    print(f"wrote {path}")
    return result
