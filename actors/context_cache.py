"""The shared context-cache actor: one per application, a thin async shell over
`graph.context_store.ContextStore` (and over `deployments.response_store.ResponseStore`, the Responses
API's stored responses, which every ingress replica must reach alike). Prefix KV payloads are Ray object references, handed around
inside a list so that Ray passes the reference instead of fetching the tensors into this actor."""
from __future__ import annotations

from pydantic import BaseModel, Field

from deployments.response_store import LocalResponses, ResponseStore
from graph.context_store import ContextStore


class ContextCacheConfig(BaseModel):
    """Bounds of the shared context cache."""

    max_bytes: int = Field(2 << 30, ge=1, description="Prefix KV bytes the index keeps before evicting the least recently used.")
    max_contexts: int = Field(10_000, ge=1, description="Request contexts (question, plan, node answers) kept.")
    max_response_bytes: int = Field(256 << 20, ge=1, description="Stored Responses API responses (each with its "
                                    "conversation) kept, in bytes of JSON, before the least recently used go.")
    max_responses: int = Field(10_000, ge=1, description="Stored Responses API responses kept, at most.")


class ContextCacheClient:
    """The context cache's Serve handle seen as the object itself (graph.journal.Contexts)."""

    def __init__(self, handle):
        self.handle = handle

    async def open(self, request_id: str, question: str, facts: dict | None = None) -> None:
        await self.handle.open.remote(request_id, question, facts)

    async def update(self, request_id: str, plan: dict | None = None, answers: dict | None = None,
                     failures: dict | None = None, prompts: dict | None = None, facts: dict | None = None) -> bool:
        return await self.handle.update.remote(request_id, plan, answers, failures, prompts, facts)

    async def get(self, request_id: str) -> dict | None:
        return await self.handle.get.remote(request_id)

    async def close(self, request_id: str) -> None:
        await self.handle.close.remote(request_id)

    async def put_response(self, response_id: str, record: dict) -> bool:
        return await self.handle.put_response.remote(response_id, record)

    async def get_response(self, response_id: str) -> dict | None:
        return await self.handle.get_response.remote(response_id)

    async def delete_response(self, response_id: str) -> bool:
        return await self.handle.delete_response.remote(response_id)


class ContextCache(LocalResponses):
    """Wrap with `serve.deployment` (num_replicas=1) or `ray.remote`. Also the stored responses'
    `put_response` / `get_response` / `delete_response`."""

    def __init__(self, config: dict | None = None):
        settings = ContextCacheConfig.model_validate(config or {})
        super().__init__(ResponseStore(settings.max_response_bytes, settings.max_responses))
        self.store = ContextStore(settings.max_bytes, settings.max_contexts)

    async def put_prefix(self, key: str, payload: list, nbytes: int, holder: str) -> list[str]:
        return self.store.put_prefix(key, payload, nbytes, holder)

    async def get_prefix(self, key: str, holder: str | None = None) -> list | None:
        return self.store.get_prefix(key, holder)

    async def open(self, request_id: str, question: str, facts: dict | None = None) -> None:
        self.store.open(request_id, question, facts)

    async def update(self, request_id: str, plan: dict | None = None, answers: dict | None = None,
                     failures: dict | None = None, prompts: dict | None = None, facts: dict | None = None) -> bool:
        return self.store.update(request_id, plan, answers, failures, prompts, facts)

    async def get(self, request_id: str) -> dict | None:
        return self.store.get(request_id)

    async def close(self, request_id: str) -> None:
        self.store.close(request_id)

    async def stats(self) -> dict:
        return {**self.store.stats(), **self.responses.stats()}
