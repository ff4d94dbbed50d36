"""How the planner side reaches the decoders: through the central batcher, never around it.

`BatcherClient` is both what `CompletionService` needs (an AsyncEngine-like object: tokenize, then
`generate` / `stream`) and what the plan `Orchestrator` needs (a `DecodeClient`). It tokenizes
locally, with the served model's tokenizer, and submits every request to the batcher."""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from engine.base import chat_ids
from engine.types import GenerationRequest, Result, TokenEvent

log = logging.getLogger(__name__)


class Tokenizing:
    """The tokenizer side of an engine: what a request is checked and encoded with."""

    def __init__(self, tokenizer, model_name: str, max_model_len: int):
        self.tokenizer, self.model_name, self.max_model_len = tokenizer, model_name, max_model_len

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return chat_ids(self.tokenizer, messages, add_generation_prompt)


FINAL = ("stop", "length")  # an event's finish_reason that ends the answer (a "cut" one goes on)


def replica_died_errors() -> tuple[type[BaseException], ...]:
    # not ActorUnavailableError: that replica may live on, still serving the first call of this id
    from ray.exceptions import ActorDiedError

    return (ActorDiedError,)


async def call_again_if_replica_died(call: Callable[[], Awaitable], what: str, retries: int = 4, backoff_s: float = 0.5,
                                    retry_on: tuple[type[BaseException], ...] | None = None):
    """`await call()`, made again while the replica serving it dies under it (up to `retries` times,
    `backoff_s` doubling between; Serve holds a call while no replica of the deployment is up)."""
    retry_on = retry_on if retry_on is not None else replica_died_errors()
    for attempt in itertools.count():
        try:
            return await call()
        except retry_on as error:
            await pause_or_raise(attempt, error, what, retries, backoff_s)


async def pause_or_raise(attempt: int, error: BaseException, what: str, retries: int, backoff_s: float) -> None:
    """Before sending a call again after its replica died: raise `error` once `retries` are spent."""
    if attempt >= retries:
        raise error
    log.warning("the %s replica died (%r); sending the request again", what, error)
    await asyncio.sleep(backoff_s * 2**attempt)


class HandleBatcher:
    """A Serve handle to the batcher deployment, seen as an object with submit / stream.

    The batcher holds every queued request in memory, and Serve restarts its replica if it dies. A
    call that its death cut short is made again, up to `retries` times, `backoff_s` doubling between
    (Serve holds a call while no replica is up): a stream resumes after the tokens it had already
    passed on, so its reader sees one answer, and one whose last event had come is finished here."""

    def __init__(self, handle, retries: int = 4, backoff_s: float = 0.5,
                 retry_on: tuple[type[BaseException], ...] | None = None):
        self.handle, self.retries, self.backoff_s = handle, retries, backoff_s
        self.retry_on = retry_on if retry_on is not None else replica_died_errors()

    async def submit(self, request: dict) -> dict:
        return await call_again_if_replica_died(lambda: self.handle.submit.remote(request), "batcher", self.retries,
                                                self.backoff_s, self.retry_on)

    async def stream(self, request: dict) -> AsyncIterator[dict]:
        passed: list[dict] = []  # the events passed on so far, across attempts
        for attempt in itertools.count():
            try:
                async for item in self.handle.options(stream=True).stream.remote(_resumed(request, passed)):
                    if "event" in item:
                        passed.append(item["event"])
                    yield item
                return
            except self.retry_on as error:
                if passed and passed[-1].get("finish_reason") in FINAL:  # all but the result had come
                    yield {"result": _result_of(request, passed)}
                    return
                await pause_or_raise(attempt, error, "batcher", self.retries, self.backoff_s)


def _resumed(request: dict, passed: list[dict]) -> dict:
    """The request to send again after `passed` events: continuing after their tokens."""
    if not passed:
        return request
    tokens = [t for e in passed for t in e["token_ids"]]
    resumed = {**request, "resume_ids": list(request.get("resume_ids") or []) + tokens}
    if (request.get("params") or {}).get("logprobs") is not None:
        resumed["resume_logprobs"] = list(request.get("resume_logprobs") or []) + [
            lp for e in passed for lp in e.get("logprobs") or []]
    return resumed


def _result_of(request: dict, passed: list[dict]) -> dict:
    """The Result (as a dict) of an answer whose every event had come when its stream broke."""
    whole = _resumed(request, passed)
    logprobs = whole.get("resume_logprobs") if (request.get("params") or {}).get("logprobs") is not None else None
    return Result(request_id=request["id"], prompt_tokens=len(request["prompt_ids"]), token_ids=whole["resume_ids"],
                  text="".join(e["text"] for e in passed), finish_reason=passed[-1]["finish_reason"], ttft_s=0.0,
                  latency_s=0.0, logprobs=logprobs, stop_logprob=passed[-1].get("stop_logprob"),
                  prompt_logprobs=next((e["prompt_logprobs"] for e in passed if e.get("prompt_logprobs") is not None),
                                       None)).model_dump(mode="json")


class BatcherClient:
    """`batcher` has `async submit(dict) -> dict` and `stream(dict)` yielding {"event"} / {"result"}:
    a BatcherActor in-process, or a HandleBatcher."""

    def __init__(self, batcher, tokenizing: Tokenizing):
        self.batcher = batcher
        self.engine = tokenizing  # CompletionService reads model_name / max_model_len here

    async def call(self, fn):
        return fn(self.engine)

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.engine.encode_chat(messages, add_generation_prompt)

    async def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    async def generate(self, request: GenerationRequest) -> Result:
        return Result.model_validate(await self.batcher.submit(request.model_dump(mode="json")))

    async def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent | Result]:
        async for item in self.batcher.stream(request.model_dump(mode="json")):
            if "event" in item:
                yield TokenEvent.model_validate(item["event"])
            else:
                yield Result.model_validate(item["result"])

    def health(self) -> dict:
        return {"healthy": True, "note": "the decoders' health is checked by Serve on each replica"}
