"""AsyncEngine: the engine on its own thread, served to asyncio callers (generate, stream, abort on
early exit, error propagation, health, and failing rather than hanging when the engine dies).
Each test drives its own event loop with asyncio.run, under a timeout so a bug cannot hang CI."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.async_engine import AsyncEngine, EngineDeadError, RequestSuperseded
from engine.base import Engine
from engine.types import FinishReason, GenerationRequest, Result, SamplingParams, TokenEvent


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def req(rid, prompt, **sampling):
    return GenerationRequest(id=rid, prompt_ids=prompt, params=SamplingParams(**sampling))


@pytest.fixture
def serve(make_engine):
    """`serve(engine=None, step_delay_s=0, **config)` -> an `AsyncEngine` over `engine` (default: a
    fresh tiny LLMEngine built with `config`); `step_delay_s` slows each step so a test can act
    while a request is surely still running. Every AsyncEngine made is shut down afterwards."""
    started = []

    def start(engine=None, step_delay_s=0.0, **config):
        engine = engine or make_engine(**config)
        if step_delay_s:
            real_step = engine.step
            engine.step = lambda: (time.sleep(step_delay_s), real_step())[1]
        started.append(AsyncEngine(engine))
        return started[-1]

    yield start
    for async_engine in started:
        async_engine.shutdown()


class ExplodingEngine(Engine):
    """Accepts requests; once `armed` (default: when two are queued) its step raises."""

    def __init__(self, arm_at: int = 2):
        self.queued, self.arm_at, self.armed = [], arm_at, False

    def add(self, request):
        self.queued.append(request.id)
        self.armed = self.armed or len(self.queued) >= self.arm_at

    def step(self):
        raise RuntimeError("boom: the device fell over")

    def has_work(self):
        return self.armed

    def abort(self, request_id):
        return False

    def pop_result(self, request_id):
        return None

    def prefill_prefix(self, token_ids):
        raise NotImplementedError

    def stats(self):
        return {}


def test_concurrent_generate_calls_equal_sync_decoding(serve, decode_alone):
    prompts = [[10 + i, 40, 41 + 3 * i, 90] + [100 + i] * i for i in range(5)]
    budgets = [5, 17, 9, 12, 3]
    async_engine = serve(max_batch_size=3)

    async def main():
        calls = [async_engine.generate(req(f"r{i}", p, max_tokens=n)) for i, (p, n) in enumerate(zip(prompts, budgets))]
        calls.append(async_engine.generate(req("s", prompts[0], max_tokens=10, temperature=0.8, seed=5)))
        return await asyncio.gather(*calls)

    results = run(main())
    for p, n, result in zip(prompts, budgets, results):
        assert result.finish_reason == FinishReason.LENGTH
        assert result.token_ids == decode_alone(p, max_tokens=n).token_ids
    assert results[-1].token_ids == decode_alone(prompts[0], max_tokens=10, temperature=0.8, seed=5).token_ids
    assert [r.request_id for r in results] == ["r0", "r1", "r2", "r3", "r4", "s"]
    assert async_engine.health()["healthy"]


def test_stream_yields_token_events_then_one_result(serve, decode_alone):
    async_engine = serve()

    async def main():
        return [item async for item in async_engine.stream(req("x", [7, 8, 9], max_tokens=11))]

    items = run(main())
    events, result = items[:-1], items[-1]
    assert isinstance(result, Result) and all(isinstance(e, TokenEvent) for e in events)
    assert result.token_ids == decode_alone([7, 8, 9], max_tokens=11).token_ids
    assert [t for e in events for t in e.token_ids] == result.token_ids
    assert "".join(e.text for e in events) == result.text
    assert [e.finish_reason for e in events if e.finish_reason] == [FinishReason.LENGTH]
    assert events[-1].finish_reason == FinishReason.LENGTH


def test_leaving_a_stream_early_aborts_the_request(serve):
    async_engine = serve(step_delay_s=0.005)
    engine = async_engine.engine
    aborts, real_abort = [], engine.abort
    engine.abort = lambda rid: aborts.append((rid, real_abort(rid))) or aborts[-1][1]

    async def main():
        async for item in async_engine.stream(req("long", [5, 6, 7], max_tokens=400)):
            assert isinstance(item, TokenEvent)
            break  # the generator is dropped here; asyncio closes it, which must abort
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            state = await async_engine.call(lambda e: (e.has_work(), dict(e._results), e.stats()))
            if not state[0]:
                return state

    has_work, leftover, stats = run(main())
    assert aborts == [("long", True)], "the request should have been aborted while still running"
    assert not has_work and leftover == {}
    assert stats["generated_tokens"] < 100


def test_an_id_streamed_again_right_after_its_abort_gets_none_of_the_aborted_requests_tokens(serve, decode_alone):
    # a batcher retries a request under its own id, possibly on the replica that just dropped it
    async_engine = serve(step_delay_s=0.01)

    async def main():
        first = async_engine.stream(req("same", [5, 6, 7], max_tokens=300))
        await anext(first)
        await first.aclose()  # its abort is queued while the engine may be mid-step on it
        return [item async for item in async_engine.stream(req("same", [9, 8, 7, 6], max_tokens=8))]

    for _ in range(3):
        items = run(main())
        assert [t for e in items[:-1] for t in e.token_ids] == items[-1].token_ids
        assert items[-1].token_ids == decode_alone([9, 8, 7, 6], max_tokens=8).token_ids


def test_value_error_from_add_reaches_the_caller(serve):
    async_engine = serve(max_model_len=32)

    async def main():
        with pytest.raises(ValueError, match="prompt_ids"):
            await async_engine.generate(req("too-long", list(range(10, 50)), max_tokens=4))
        return await async_engine.generate(req("fine", [10, 11], max_tokens=4))

    assert run(main()).finish_reason == FinishReason.LENGTH
    health = async_engine.health()
    assert health["healthy"] is True and health["error"] is None


def test_engine_that_raises_fails_pending_requests_and_turns_unhealthy(serve):
    async_engine = serve(engine=ExplodingEngine(arm_at=2))
    assert async_engine.health()["healthy"]

    async def main():
        calls = [async_engine.generate(req(rid, [5, 6], max_tokens=4)) for rid in ("a", "b")]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        with pytest.raises(EngineDeadError):  # later callers are refused at once
            await async_engine.generate(req("c", [5, 6], max_tokens=4))
        return outcomes

    outcomes = run(main(), timeout=10)
    assert [type(o) for o in outcomes] == [EngineDeadError, EngineDeadError]
    assert "boom" in str(outcomes[0])
    health = async_engine.health()
    assert health["healthy"] is False and "boom" in health["error"]


def test_an_id_streamed_again_while_in_flight_supersedes_the_first_attempt(serve, decode_alone):
    # the batcher's retry after a failed call, landing on a replica that lives on with the old stream open
    async_engine = serve(step_delay_s=0.002)

    async def main():
        first = async_engine.stream(req("dup", [5, 6, 7], max_tokens=300))
        await anext(first)
        second = [item async for item in async_engine.stream(req("dup", [8, 9], max_tokens=12))]
        with pytest.raises(RequestSuperseded, match="dup"):
            async for _ in first:
                pass
        await asyncio.sleep(0.05)  # the first stream's own cleanup must not abort anything now
        return second, await async_engine.call(lambda e: (e.has_work(), dict(e._results)))

    items, (has_work, leftover) = run(main())
    assert items[-1].finish_reason == FinishReason.LENGTH
    assert [t for e in items[:-1] for t in e.token_ids] == items[-1].token_ids
    assert items[-1].token_ids == decode_alone([8, 9], max_tokens=12).token_ids
    assert not has_work and leftover == {}


def test_the_superseded_streams_cleanup_does_not_abort_the_retry(serve, decode_alone):
    # the older stream is closed only after its retry was added: its queued abort must spare the retry
    async_engine = serve(step_delay_s=0.002)

    async def main():
        first = async_engine.stream(req("dup", [5, 6, 7], max_tokens=300))
        await anext(first)
        second = async_engine.stream(req("dup", [8, 9], max_tokens=20))
        head = await anext(second)
        await first.aclose()
        return [head] + [item async for item in second]

    items = run(main())
    assert items[-1].finish_reason == FinishReason.LENGTH
    assert items[-1].token_ids == decode_alone([8, 9], max_tokens=20).token_ids


def test_call_racing_with_engine_death_fails_instead_of_hanging(serve):
    exploding = ExplodingEngine(arm_at=10**9)
    async_engine = serve(engine=exploding)
    real_inbox = async_engine._inbox

    class DieDuringPut:
        """Forces the interleaving: the loop starts dying after the liveness check, before the put
        lands (the loop gets 0.2 s to get as far as it can)."""

        def get_nowait(self):
            return real_inbox.get_nowait()

        def put(self, item):
            exploding.armed = True
            async_engine._wake.set()
            async_engine._thread.join(0.2)
            real_inbox.put(item)

    async_engine._inbox = DieDuringPut()

    async def main():
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(async_engine.call(lambda engine: None), 5)

    run(main())
    async_engine._thread.join(5)
    assert not async_engine._thread.is_alive()


def test_health_reports_a_stuck_step(serve):
    gate = threading.Event()
    async_engine = serve(step_delay_s=0)
    engine = async_engine.engine
    real_step = engine.step
    engine.step = lambda: (gate.wait(5), real_step())[1]
    async_engine.stuck_after_s = 0.05

    async def main():
        task = asyncio.create_task(async_engine.generate(req("slow", [5, 6], max_tokens=2)))
        await asyncio.sleep(0.2)
        stuck = async_engine.health()
        gate.set()
        return stuck, await task

    stuck, result = run(main())
    assert stuck["healthy"] is False and stuck["step_age_s"] >= 0.05
    assert result.finish_reason == FinishReason.LENGTH and async_engine.health()["healthy"]


def test_an_engine_built_from_a_function_is_built_and_stepped_on_the_engine_thread(make_engine, decode_alone):
    threads = {}

    def build():
        threads["built"] = threading.current_thread()
        engine = make_engine(max_batch_size=2)
        real_step = engine.step
        engine.step = lambda: (threads.setdefault("stepped", threading.current_thread()), real_step())[1]
        return engine

    async_engine = AsyncEngine(build)
    try:
        request = GenerationRequest(prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=4))
        result = asyncio.run(asyncio.wait_for(async_engine.generate(request), 30))
    finally:
        async_engine.shutdown()
    assert threads["built"] is threads["stepped"] is not threading.main_thread()
    assert result.token_ids == decode_alone([5, 6, 7], max_tokens=4).token_ids


def test_an_engine_that_fails_to_build_raises_from_the_constructor():
    def build():
        raise FileNotFoundError("model: no such folder")

    with pytest.raises(FileNotFoundError, match="model: no such folder"):
        AsyncEngine(build)


def test_a_call_cancelled_while_it_waits_is_skipped_and_the_loop_lives_on(serve):
    """A caller whose task is cancelled while its call waits in the inbox (a client gone while its
    request was being added): the engine thread skips the call instead of failing to hand back its
    result, which stopped the loop for every request (fresh-clone CI at c977a73)."""
    async_engine = serve()
    ran, gate = [], threading.Event()

    async def main():
        busy = asyncio.ensure_future(async_engine.call(lambda e: gate.wait(5)))  # holds the engine thread
        await asyncio.sleep(0.05)
        waiting = asyncio.ensure_future(async_engine.call(lambda e: ran.append("cancelled call")))
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.sleep(0.05)
        gate.set()
        await busy
        return await async_engine.generate(req("after", [5, 6, 7], max_tokens=4))

    result = run(main())
    assert ran == [] and result.finish_reason == FinishReason.LENGTH and len(result.token_ids) == 4
    assert async_engine.health()["healthy"]


def test_a_stream_cancelled_while_its_request_is_added_leaves_nothing_running(serve):
    """Cancelled while the engine thread runs its add (too late to skip it), the stream still aborts
    the request it may have added, and forgets its subscriber."""
    async_engine = serve()
    engine = async_engine.engine
    real_add, adding, release = engine.add, threading.Event(), threading.Event()

    def slow_add(request):
        adding.set()
        release.wait(5)
        real_add(request)

    engine.add = slow_add

    async def main():
        async def consume():
            async for _ in async_engine.stream(req("gone", [5, 6, 7], max_tokens=400)):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.to_thread(adding.wait, 5)
        task.cancel()
        await asyncio.sleep(0.05)
        release.set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            state = await async_engine.call(lambda e: (e.has_work(), e.stats()["generated_tokens"]))
            if not state[0]:
                return state, dict(async_engine._subscribers)

    (has_work, generated), subscribers = run(main())
    assert not has_work and generated < 100 and subscribers == {}
