"""Run an `Engine` on its own thread and serve it to asyncio code: submit, stream, cancel."""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from engine.base import Engine
from engine.types import FinishReason, GenerationRequest, Result, TokenEvent

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped; requests cannot be served by this replica."""


class RequestFaulted(RuntimeError):
    """The engine ended this request on a fault in its own part of a step (FinishReason.ERROR); the
    engine and the other requests went on."""


class RequestSuperseded(RuntimeError):
    """The same request id was streamed again (a retry): this older attempt was aborted for it."""


class _Subscriber:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _put_all(pushes: list[tuple[_Subscriber, object]]) -> None:
    for subscriber, item in pushes:
        subscriber.queue.put_nowait(item)


def _abort_and_drop(engine: Engine, request_id: str) -> None:
    if engine.abort(request_id):
        engine.pop_result(request_id)


class AsyncEngine:
    """One thread owns the engine and loops `step()` while there is work; everything else talks to
    it through an inbox, so the engine itself never needs locks. torch releases the GIL inside its
    kernels, so the asyncio side stays responsive while a step runs.

    `engine` is an engine, or a function that builds one: then it is built on the engine thread
    (the constructor waits, and raises what the build raised). Prefer the function: with torch's
    OpenMP runtime (libgomp) every thread that runs parallel torch work keeps a pool of worker
    threads for good, and once a process holds more of those workers than it has cores, all of them
    stop spinning between parallel regions and sleep instead, so every matmul pays a wake-up. An
    engine loaded on one thread and stepped on another met exactly that: measured on the 2-core box,
    SmolLM2-135M at batch 1 took 62-75 ms a token, against 46 ms built and stepped on one thread.

    `on_death(error)` is called if the loop dies of an error (not on `shutdown`), once every request has
    been sent EngineDeadError: a replica that cannot serve may leave at once for a fresh one."""

    def __init__(self, engine: Engine | Callable[[], Engine], stuck_after_s: float = 120.0,
                 on_death: Callable[[BaseException], None] | None = None):
        self.engine: Engine = engine if isinstance(engine, Engine) else None  # type: ignore[assignment]
        self.stuck_after_s = stuck_after_s
        self.on_death = on_death  # called on the engine thread with the error (see above)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._subscribers: dict[str, _Subscriber] = {}
        self._stopping = False
        self._inbox_lock = threading.Lock()  # no work is queued once the loop has died
        self._step_started: float | None = None
        self.error: BaseException | None = None
        built = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(None if self.engine else engine, built),
                                        name="engine-loop", daemon=True)
        self._thread.start()
        built.wait()
        if self.engine is None:
            raise self.error  # type: ignore[misc]  # the build failed: nothing to serve

    # ---- asyncio side ---------------------------------------------------------------------------
    async def call(self, fn: Callable):
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._inbox_lock:
            if self.error is not None or not self._thread.is_alive():
                raise EngineDeadError(f"engine loop is not running: {self.error!r}")
            self._inbox.put((fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent | Result]:
        """Yield the request's token events as they are produced, then its `Result`.

        Leaving the iteration early (client gone, task cancelled) aborts the request. Streaming an id
        that is still in flight aborts the older attempt, whose stream raises `RequestSuperseded`. A
        request the engine ended on a fault raises `RequestFaulted` in place of its last event."""
        subscriber = _Subscriber(asyncio.get_running_loop())

        def add(engine: Engine) -> None:
            # The batcher refuses duplicate ids, so an id that is still in flight here is its retry of an
            # attempt it gave up on (the call failed while this replica lived on): the newest attempt wins.
            superseded = self._subscribers.pop(request.id, None)
            if superseded is not None:  # (a stream that already ended queued its own abort before this)
                _abort_and_drop(engine, request.id)
                superseded.push(RequestSuperseded(f"request '{request.id}' was streamed again; this attempt is dropped"))
            engine.add(request)
            # subscribed on the engine thread, after the add: a step that ran before it cannot hand this
            # stream the last events of an aborted request that had the same id
            self._subscribers[request.id] = subscriber

        def abort_unless_superseded(engine: Engine) -> None:
            if self._subscribers.get(request.id) in (None, subscriber):
                _abort_and_drop(engine, request.id)
            if self._subscribers.get(request.id) is subscriber:  # added after this stream had ended
                del self._subscribers[request.id]

        done = False
        try:
            await self.call(add)
            while True:
                item = await subscriber.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason == FinishReason.ERROR:
                    if isinstance(item, Result):
                        done = True
                        raise RequestFaulted(f"request '{request.id}' failed: {item.error}")
                    continue  # its Result, which says why, comes next
                yield item
                if isinstance(item, Result):
                    done = True
                    return
        finally:
            if self._subscribers.get(request.id) is subscriber:
                del self._subscribers[request.id]
            # also when the add was not seen through: cancelled while the engine thread ran it, the
            # request may be in the engine all the same (the abort of one that is not finds nothing)
            if not done and self.error is None and self._thread.is_alive():
                self._inbox.put((abort_unless_superseded, None))
                self._wake.set()

    async def generate(self, request: GenerationRequest) -> Result:
        async for item in self.stream(request):
            if isinstance(item, Result):
                return item
        raise EngineDeadError(f"request {request.id} ended without a result")

    def health(self) -> dict:
        """Alive and stepping: a step running longer than `stuck_after_s` counts as stuck."""
        step_age = time.monotonic() - self._step_started if self._step_started else 0.0
        healthy = self._thread.is_alive() and self.error is None and step_age < self.stuck_after_s
        return {"healthy": healthy, "step_age_s": round(step_age, 3), "error": repr(self.error) if self.error else None}

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- engine thread --------------------------------------------------------------------------
    def _run(self, build: Callable[[], Engine] | None, built: threading.Event) -> None:
        if build is not None:
            try:
                self.engine = build()
            except BaseException as exc:  # the constructor raises it
                self.error = exc
                built.set()
                return
        built.set()
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_work():
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                self._step_started = time.monotonic()
                events = self.engine.step()
                self._step_started = None
                self._deliver(events)
            reason: BaseException = EngineDeadError("the engine was shut down")
            died = False
        except BaseException as exc:  # a broken engine must fail its requests, not hang them
            log.exception("engine loop died")
            reason, died = exc, True
        with self._inbox_lock:
            self.error = reason
        for subscriber in list(self._subscribers.values()):
            subscriber.push(EngineDeadError(f"engine loop stopped: {reason!r}"))
        self._fail_inbox(reason)
        if died and self.on_death is not None:
            self.on_death(reason)

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn, future = self._inbox.get_nowait()
            except queue.Empty:
                return
            # a caller cancelled while this waited (its task was): nobody wants the work, and setting the
            # result of a cancelled future would raise here and stop the loop for every request
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(self.engine)
            except Exception as exc:
                if future is not None:
                    future.set_exception(exc)
                continue
            if future is not None:
                future.set_result(result)

    def _fail_inbox(self, exc: BaseException) -> None:
        while True:
            try:
                _, future = self._inbox.get_nowait()
            except queue.Empty:
                return
            if future is not None:
                future.set_exception(EngineDeadError(f"engine loop stopped: {exc!r}"))

    def _deliver(self, events: list[TokenEvent]) -> None:
        # one wake-up per event loop for the whole step: pushed one by one, a busy loop thread wakes
        # at the first and its consumers see one request's token at a time instead of the step's
        pending: dict[asyncio.AbstractEventLoop, list] = {}
        for event in events:
            subscriber = self._subscribers.get(event.request_id)
            items = [event]
            if event.finish_reason is not None:
                items.append(self.engine.pop_result(event.request_id))  # always taken, so none piles up
            if subscriber:
                pending.setdefault(subscriber.loop, []).extend((subscriber, item) for item in items)
        for loop, pushes in pending.items():
            loop.call_soon_threadsafe(_put_all, pushes)
