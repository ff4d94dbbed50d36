"""The serving benchmark's parts, without Ray or the real model: Poisson arrivals, the summary math,
reading a streamed chat completion (from a local HTTP server too), the in-process runner on the tiny
model, alternating repeats, and the committed prompt subset."""
from __future__ import annotations

import asyncio
import json
import os
import statistics

import pytest

from bench.common import DATA, load_jsonl
from bench.serve_bench import (
    DATA_FILE,
    MAX_PROMPT_CHARS,
    SOURCE,
    SUBSET_ROWS,
    Record,
    arrival_offsets,
    drive,
    engine_time,
    http_request,
    http_session,
    in_process_request,
    measure,
    percentile,
    read_sse,
    summarize,
    write_subset,
)
from engine.async_engine import AsyncEngine
from engine.types import SamplingParams

INF = float("inf")


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_poisson_arrivals_are_seeded_with_the_mean_gap_of_the_rate():
    offsets = arrival_offsets(4000, 2.0, seed=3)
    assert offsets == arrival_offsets(4000, 2.0, seed=3) != arrival_offsets(4000, 2.0, seed=4)
    gaps = [b - a for a, b in zip([0.0, *offsets], offsets)]
    assert all(g > 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.5, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.5, rel=0.1)  # exponential: sd equals the mean


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, INF, seed=0) == [0.0] * 5


def test_percentiles_interpolate_and_summary_leaves_errors_out():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([float(v) for v in range(1, 101)], 99) == pytest.approx(99.01)
    assert percentile([], 50) is None
    records = [Record(0.1, 1.0, 10), Record(0.3, 3.0, 30), Record(None, 2.0, 20),
               Record(None, 0.5, 0, error="HTTP 503: overloaded")]
    summary = summarize(records, seconds=4.0)
    assert summary["requests"] == 4 and summary["errors"] == 1 and summary["output_tokens"] == 60
    assert summary["requests_per_s"] == 0.75 and summary["tokens_per_s"] == 15.0
    assert summary["ttft_p50_s"] == 0.2 and summary["latency_p50_s"] == 2.0 and summary["latency_p99_s"] == 2.98
    assert summary["first_errors"] == ["HTTP 503: overloaded"]


def _chunk(**fields) -> str:
    return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": [], **fields})


STREAM = [
    _chunk(choices=[{"index": 0, "delta": {"role": "assistant"}}]), "",
    _chunk(choices=[{"index": 0, "delta": {"content": "Paris"}}]), "",
    _chunk(choices=[{"index": 0, "delta": {"content": " it is."}}]), "",
    _chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]), "",
    _chunk(usage={"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}), "",
    "data: [DONE]", "",
]


async def _lines(lines):
    for line in lines:
        yield line


def _clock():
    """A fake clock that advances one second a call."""
    ticks = iter(range(1, 100))
    return lambda: float(next(ticks))


def test_sse_first_content_chunk_gives_ttft_and_usage_the_tokens():
    record = run(read_sse(_lines(STREAM), started=0.0, clock=_clock()))
    assert record == Record(ttft_s=1.0, latency_s=2.0, tokens=3)  # the role chunk is not a token


def test_sse_without_usage_or_with_an_error_is_an_error():
    no_usage = run(read_sse(_lines(STREAM[:6] + ["data: [DONE]"]), started=0.0, clock=_clock()))
    assert no_usage.error == "the stream ended without a usage chunk"
    failed = run(read_sse(_lines(['data: {"error": {"message": "engine died"}}']), started=0.0))
    assert failed.error.startswith("stream error") and "engine died" in failed.error


def test_http_request_streams_and_reports_refusals():
    from aiohttp import web

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["temperature"] == 0
        if body["messages"][0]["content"] == "busy":
            return web.json_response({"error": {"message": "server overloaded"}}, status=503)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for line in STREAM:  # a chunk at a time, as a server streams them
            await response.write((line + "\n").encode())
        return response

    async def ask(*prompts):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with http_session(f"http://127.0.0.1:{port}") as session:
                return [await http_request(session, prompt, max_tokens=8) for prompt in prompts]
        finally:
            await runner.cleanup()

    answered, refused = run(ask("hi", "busy"))
    assert answered.error is None and answered.tokens == 3 and 0 <= answered.ttft_s <= answered.latency_s
    assert refused.tokens == 0 and refused.error.startswith("HTTP 503") and "overloaded" in refused.error
    closed = run(ask_closed_port())
    assert closed.tokens == 0 and closed.error.startswith("ClientConnectorError")


async def ask_closed_port():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with http_session(f"http://127.0.0.1:{port}") as session:
        return await http_request(session, "hi", max_tokens=8)


def test_in_process_runner_streams_every_request_on_the_tiny_model(make_engine):
    engine = AsyncEngine(make_engine(max_batch_size=4, max_model_len=256))
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = ["baba babe", "dada", "fafa fefe fifi", "gaga", "kaka keke", "lala"]
    try:
        records, seconds = run(drive(arrival_offsets(len(prompts), INF, seed=0),
                                     lambda i: in_process_request(engine, prompts[i], params)))
    finally:
        engine.shutdown()
    assert [r.tokens for r in records] == [6] * len(prompts)  # the tiny model never ends early
    assert all(r.error is None and 0 < r.ttft_s <= r.latency_s <= seconds for r in records)


def test_engine_time_is_the_time_inside_engine_steps(make_engine):
    from engine.types import GenerationRequest

    engine = make_engine(max_batch_size=4, max_model_len=256)
    assert engine_time(engine.stats()) == {"steps": 0, "step_s": 0.0, "generated_tokens": 0, "ms_per_step": None,
                                           "tokens_per_step_s": None}
    engine.generate([GenerationRequest(prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=6, temperature=0.0))
                     for _ in range(3)])
    stats = engine.stats()
    timed = engine_time(stats)
    assert stats["step_s"] > 0 and timed["steps"] == stats["steps"] > 0 and timed["generated_tokens"] == 18
    assert timed["ms_per_step"] == round(1000 * stats["step_s"] / stats["steps"], 1)
    assert timed["tokens_per_step_s"] == round(18 / stats["step_s"], 1)


def test_measure_alternates_repeats_and_compares_answer_lengths():
    calls = []

    def sender(mode, tokens):
        async def send(i):
            calls.append(mode)
            return Record(0.01, 0.02, tokens(i))
        return send

    per_rate = run(measure({"http": sender("http", lambda i: 4), "in_process": sender("in_process", lambda i: 4 + (i == 0))},
                           rates=[50.0, INF], n=3, seed=0, repeats=2))
    assert list(per_rate) == ["50.0", "inf"]
    assert calls[:12] == ["http"] * 3 + ["in_process"] * 6 + ["http"] * 3  # second repeat: the other first
    inf = per_rate["inf"]
    assert inf["same_answer_lengths"] == "2/3" and len(inf["tokens_per_s_runs"]["http"]) == 2
    assert inf["http"]["output_tokens"] == 12 and inf["in_process"]["output_tokens"] == 13
    assert inf["per_request"]["in_process"] == {"ttft_s": [0.01] * 3, "latency_s": [0.02] * 3, "tokens": [5, 4, 4]}


def test_committed_subset_is_the_seeded_draw_of_the_shared_file(tmp_path):
    rows = load_jsonl(DATA_FILE)
    assert len(rows) == SUBSET_ROWS == len({r["id"] for r in rows})
    assert all(0 < len(r["prompt"]) <= MAX_PROMPT_CHARS and set(r) == {"id", "prompt"} for r in rows)
    if not SOURCE.exists():
        pytest.skip(f"{SOURCE} is not here to redraw the subset from")
    write_subset(dest=tmp_path / DATA_FILE)
    assert (DATA / DATA_FILE).read_text() == (tmp_path / DATA_FILE).read_text()


def test_the_in_process_side_runs_at_the_niceness_it_is_given_and_never_raises_itself():
    """The in-process side drops to the Decoder replica's niceness (Ray's worker niceness, 15, by
    default), and never raises itself, so other work on the machine slows both sides alike."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import os, sys; from bench.serve_bench import match_ray_worker_niceness as m; "
            "print(m(*map(int, sys.argv[1:])), os.nice(0))")
    run = lambda *prefix, args=(): subprocess.run([*prefix, sys.executable, "-c", code, *args],
                                                  cwd=Path(__file__).parents[1], capture_output=True, text=True,
                                                  check=True).stdout.split()
    assert run() == ["15", "15"]
    assert run(args=("12",)) == ["12", "12"]
    assert run("nice", "-n", "19") == ["19", "19"]


def test_a_replicas_niceness_is_read_from_its_process_title():
    """Ray titles a replica's process `ray::ServeReplica:<app>:<deployment>`; the bench finds it by that."""
    import subprocess
    import sys
    import time

    from bench.serve_bench import replica_niceness

    child = subprocess.Popen(["nice", "-n", "7", sys.executable, "-c", "import time; time.sleep(30)",
                              "ray::ServeReplica:testapp:Decoder"])
    try:
        deadline = time.monotonic() + 10
        while (got := replica_niceness("Decoder", app="testapp")) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got == min(19, os.nice(0) + 7)
        assert replica_niceness("Decoder", app="no-such-app") is None
    finally:
        child.kill()
        child.wait()
