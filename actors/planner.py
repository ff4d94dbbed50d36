"""The planner actor: checks and tokenizes requests, answers `ar` with one batcher request and
`sot` / `plato` / `auto` by planning (graph.orchestrator): it streams the plan from the decoders,
parses it as it comes and sends each node through the batcher once its parents are answered.

A thin shell: the work is in deployments.completion_service and graph.orchestrator; the Serve
deployment (deployments.app.Planner) adds the health report."""
from __future__ import annotations

from actors.decode_client import BatcherClient, HandleBatcher, Tokenizing
from deployments.completion_service import ApiLimits, CompletionService, PlannedCall
from deployments.openai_schema import OpenAIRequest, RequestError
from graph.orchestrator import AnswerConfig, Orchestrator


def batcher_service(engine_config: dict, limits: dict, batcher, answer: dict | None = None,
                    observer=None, contexts=None) -> CompletionService:
    """A CompletionService whose every request goes to the batcher (`batcher`: the batcher
    deployment's handle), tokenized here with the served model's tokenizer. With `answer` it also
    plans (sot / plato / auto); without, every request is answered plainly. `contexts`: where planned
    answers are journaled (actors.context_cache), or None."""
    from engine.config import EngineConfig
    from engine.loader import load_tokenizer_and_context

    config = EngineConfig(**engine_config)
    tokenizer, max_model_len = load_tokenizer_and_context(config)
    name = config.served_model_name or config.model
    client = BatcherClient(HandleBatcher(batcher), Tokenizing(tokenizer, name, max_model_len))
    orchestrator = Orchestrator(client, AnswerConfig(**answer)) if answer is not None else None
    return CompletionService(client, ApiLimits(**limits), orchestrator, observer=observer, contexts=contexts)


class PlannerReplica:
    """`batcher` is the batcher deployment's handle (or anything with its `submit` and `stream`);
    `contexts` the context cache (its handle wrapped in `ContextCacheClient`, or the actor class itself),
    where answers asked with a `call` (deployments.completion_service.PlannedCall, as a dict) are journaled,
    so that another replica can take one up when this one dies."""

    def __init__(self, engine_config: dict, limits: dict, answer: dict, batcher, observer=None, contexts=None):
        self.service = batcher_service(engine_config, limits, batcher, answer, observer, contexts)

    async def complete(self, request: OpenAIRequest, call: dict | None = None) -> dict:
        try:
            response = await self.service.complete(request, PlannedCall(**call) if call else None)
        except RequestError as exc:  # returned, not raised: Ray would wrap the exception type
            return exc.to_data()
        return response.model_dump()

    async def stream(self, request: OpenAIRequest, call: dict | None = None):
        """Chunks of a streamed answer; a refused request yields one error dict instead."""
        try:
            async for chunk in self.service.stream(request, PlannedCall(**call) if call else None):
                yield chunk
        except RequestError as exc:
            yield exc.to_data()

    async def resumed(self) -> dict:
        """Planned answers this replica took up from the context cache, and the node answers it kept."""
        return dict(self.service.resumed)

    async def info(self) -> dict:
        return await self.service.info()
