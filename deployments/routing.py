"""The ingress's two paths (../shared/DESIGN.md): a plain (`ar`) request is checked and tokenized in
the ingress and goes straight to the batcher; a question to plan (sot, plato, auto) goes to the
planner. Plain requests skip a hop that would pass on every streamed token once more, costing CPU
the decoders need (`python -m bench serve`)."""
from __future__ import annotations

from collections.abc import AsyncIterator

from deployments.api import CompletionBackend
from deployments.completion_service import CompletionService, is_planned
from deployments.openai_schema import DetokenizeRequest, OpenAIRequest, TokenizeRequest


class RoutedBackend:
    """A CompletionBackend: `plain` (a CompletionService over the batcher, without an orchestrator)
    answers what needs no plan, `planner` (the planner deployment's backend) the rest and the health."""

    def __init__(self, plain: CompletionService, planner: CompletionBackend):
        self.plain, self.planner = plain, planner

    def _for(self, request: OpenAIRequest):
        return self.planner if is_planned(request) else self.plain

    async def complete(self, request: OpenAIRequest):
        return await self._for(request).complete(request)

    def stream(self, request: OpenAIRequest) -> AsyncIterator[dict]:
        return self._for(request).stream(request)

    async def info(self) -> dict:
        return await self.plain.info()

    async def tokenize(self, request: TokenizeRequest) -> dict:
        return await self.plain.tokenize(request)

    async def detokenize(self, request: DetokenizeRequest) -> dict:
        return await self.plain.detokenize(request)

    async def tokenizer_info(self) -> dict:
        return await self.plain.tokenizer_info()

    async def health(self) -> dict:
        return await self.planner.health()
