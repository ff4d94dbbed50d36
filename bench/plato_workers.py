"""Each variant of `python -m bench plato` in a process of its own, kept for the whole run, so that
the variants can answer one question after another (drift-free pairs) without sharing a process.

Why processes: every variant needs an engine of its own (no prefix cached by one may serve
another), and all of them must stay alive to take turns question by question. In one process that
means one engine thread per variant, each with its own pool of libgomp workers, and once a process
holds more of those than it has cores, libgomp stops spinning between parallel regions and every
matmul pays a wake-up (engine/async_engine.py measured that at 1.3-1.6x a token at batch 1). A
process per variant keeps each pool at the size a lone engine has; only one works at a time.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import time
import traceback
from multiprocessing.connection import Connection


class VariantFailed(RuntimeError):
    """A variant's process could not build its engine or answer."""


def answer_row(answer) -> dict:
    """What the bench keeps of one `graph.orchestrator.Answer`."""
    return {
        "latency_s": round(answer.latency_s, 3),
        "tokens": answer.completion_tokens,
        "planned": answer.plan is not None or answer.fallback is not None,
        "fallback": answer.fallback,
        "plan_s": answer.plan_s,
        "prefix_hit_tokens": answer.prefix_hit_tokens,
        "node_prompt_tokens": answer.node_prompt_tokens,
        "node_prompt_shareable_tokens": answer.node_prompt_shareable_tokens,
        "text": answer.text,
    }


async def _all_at_once(orchestrator, questions: list[str], mode: str):
    return await asyncio.gather(*(orchestrator.answer(q, mode) for q in questions))


def _serve(conn: Connection, mode: str, answer_config: dict, engine_config: dict) -> None:
    """The child: build the engine, then answer commands until told to stop."""
    try:
        from engine.async_engine import AsyncEngine
        from engine.config import EngineConfig
        from engine.engine import LLMEngine
        from graph.orchestrator import AnswerConfig, EngineClient, Orchestrator

        config = EngineConfig(**engine_config)
        engine = AsyncEngine(lambda: LLMEngine.from_config(config))
        orchestrator = Orchestrator(EngineClient(engine), AnswerConfig(**answer_config))
        loop = asyncio.new_event_loop()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    try:
        while True:
            command, payload = conn.recv()
            if command == "stop":
                return
            try:
                if command == "answer":
                    answer = loop.run_until_complete(orchestrator.answer(payload, mode))
                    conn.send(("ok", answer_row(answer)))
                elif command == "together":
                    started = time.perf_counter()
                    answers = loop.run_until_complete(_all_at_once(orchestrator, payload, mode))
                    conn.send(("ok", ([answer_row(a) for a in answers], time.perf_counter() - started)))
                else:
                    conn.send(("error", f"unknown command {command!r}"))
            except Exception:  # noqa: BLE001
                conn.send(("error", traceback.format_exc()))
    finally:
        engine.shutdown()
        loop.run_until_complete(loop.shutdown_asyncgens())  # else a stream left open warns at exit
        loop.close()


class VariantWorker:
    """One variant's engine and orchestrator in a child process (spawned, so no torch state is
    inherited). `answer(question)` and `together(questions)` block until the child replies."""

    def __init__(self, name: str, mode: str, answer_config: dict, engine_config: dict):
        self.name = name
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, mode, answer_config, engine_config),
                                        name=f"plato-bench-{name}", daemon=True)
        self._process.start()
        child.close()
        self._reply()  # waits for the engine to be built, or raises why it was not

    def _reply(self):
        try:
            status, payload = self._conn.recv()
        except EOFError:
            raise VariantFailed(f"{self.name}: its process exited (code {self._process.exitcode})") from None
        if status not in ("ok", "ready"):
            raise VariantFailed(f"{self.name}: {payload}")
        return payload

    def answer(self, question: str) -> dict:
        """One question answered alone: `answer_row` of it."""
        self._conn.send(("answer", question))
        return self._reply()

    def together(self, questions: list[str]) -> tuple[list[dict], float]:
        """All `questions` in flight at once: their rows and the wall seconds until the last answer."""
        self._conn.send(("together", questions))
        return self._reply()

    def close(self) -> None:
        if self._process.is_alive():
            try:
                self._conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
            self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
