"""The engine interface every backend implements, and the chat-prompt helpers they share."""
from __future__ import annotations

from abc import ABC, abstractmethod

from engine.prefix_cache import PrefixHandle
from engine.types import GenerationRequest, Result, TokenEvent


class Engine(ABC):
    """A synchronous, single-threaded decoding engine with continuous batching.

    Streaming contract: `add` queues a request. Each `step` admits waiting requests (higher
    priority first) into free batch slots, then advances every running request by one token and
    returns one `TokenEvent` per request that produced output. A request's last event carries its
    `finish_reason`; its `Result` is then held until `pop_result` takes it. Callers on other
    threads must go through `AsyncEngine`, which owns the engine's thread.
    """

    tokenizer = None
    model_name: str = "unknown"
    max_model_len: int = 0

    @abstractmethod
    def add(self, request: GenerationRequest) -> None:
        """Queue a request; raises ValueError naming the field when it cannot be served."""

    @abstractmethod
    def step(self) -> list[TokenEvent]:
        """Run one scheduling and decode iteration."""

    @abstractmethod
    def has_work(self) -> bool:
        """True while any request is waiting or running."""

    @abstractmethod
    def abort(self, request_id: str) -> bool:
        """Stop a request; its result is kept with finish_reason ABORT. False if unknown."""

    @abstractmethod
    def pop_result(self, request_id: str) -> Result | None:
        """Take a finished request's result, or None if it has not finished."""

    @abstractmethod
    def prefill_prefix(self, token_ids: list[int]) -> PrefixHandle:
        """Compute and cache the KV of a shared prefix; requests starting with it reuse it."""

    @abstractmethod
    def stats(self) -> dict:
        """Counters for metrics and health: steps, tokens, queue sizes, prefix hits."""

    def generate(self, requests: list[GenerationRequest]) -> list[Result]:
        """Decode a list of requests to completion, in continuous batches; results in input order."""
        for request in requests:
            self.add(request)
        while self.has_work():
            self.step()
        return [self.pop_result(r.id) for r in requests]

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return chat_ids(self.tokenizer, messages, add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


def chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
             ) -> list[int]:
    """Token ids of a conversation, with the model's own chat template (given `tools`, for a template
    that renders them)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                        return_dict=False, tools=tools)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def template_renders_tools(tokenizer) -> bool:
    """True when the model's chat template writes the `tools` it is given into the prompt."""
    probe = [{"type": "function", "function": {"name": "probe_function_7f3a", "parameters": {"type": "object"}}}]
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe, tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # a template that cannot take tools at all (jinja errors of any kind)
        return False
    return "probe_function_7f3a" in text
