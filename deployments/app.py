"""The Serve application: an OpenAI-compatible ingress in front of autoscalable decoder replicas.

Start it with `serve run cluster/local.yaml`, or `serve run deployments.app:build_app` for defaults.
"""
from __future__ import annotations

from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from deployments.api import create_app
from deployments.completion_service import ApiLimits, CompletionService
from deployments.config import AppConfig, load_app_config
from deployments.openai_schema import OpenAIRequest, RequestError
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig

# Serve's own request limit on an ingress replica sits this far above limits.max_queued_requests, so
# every request reaches the ingress's count (and its quick 503) instead of waiting in Serve's proxy
# queue, and /healthz still answers while the count is full.
INGRESS_HEADROOM = 16


@serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 1})
class Decoder:
    """One engine loop per replica; every concurrent request joins its continuous batch."""

    def __init__(self, engine_config: dict, limits: dict):
        from engine.engine import LLMEngine

        engine = LLMEngine.from_config(EngineConfig(**engine_config))
        self.service = CompletionService(AsyncEngine(engine), ApiLimits(**limits))

    async def complete(self, request: OpenAIRequest) -> dict:
        try:
            response = await self.service.complete(request)
        except RequestError as exc:  # returned, not raised: Ray would wrap the exception type
            return exc.to_data()
        return response.model_dump()

    async def stream(self, request: OpenAIRequest):
        """Chunks of a streamed answer; a refused request yields one error dict instead."""
        try:
            async for chunk in self.service.stream(request):
                yield chunk
        except RequestError as exc:
            yield exc.to_data()

    async def info(self) -> dict:
        return await self.service.info()

    async def health(self) -> dict:
        return await self.service.health()

    def check_health(self) -> None:
        """Called by Serve; a stuck or dead engine loop gets the replica replaced."""
        health = self.service.engine.health()
        if not health["healthy"]:
            raise RuntimeError(f"engine loop unhealthy: {health}")


class HandleBackend:
    """The ingress's view of the decoder deployment (see deployments.api.CompletionBackend)."""

    def __init__(self, decoder: DeploymentHandle):
        self.decoder = decoder

    async def complete(self, request: OpenAIRequest) -> dict:
        out = await self.decoder.complete.remote(request)
        if "error" in out:
            raise RequestError(**out["error"])
        return out

    async def stream(self, request: OpenAIRequest):
        async for chunk in self.decoder.options(stream=True).stream.remote(request):
            if "error" in chunk:
                raise RequestError(**chunk["error"])
            yield chunk

    async def info(self) -> dict:
        return await self.decoder.info.remote()

    async def health(self) -> dict:
        return await self.decoder.health.remote()


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """HTTP entry point: checks the API key and the replica's load, validates OpenAI requests and
    forwards them to the decoders."""

    def __init__(self, decoder: DeploymentHandle, config: dict):
        self.decoder = decoder
        self.config = AppConfig.model_validate(config)
        self.api_key = self.config.resolve_api_key()  # a missing key fails the replica's start, loudly

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Called by Serve on each replica after `__init__`: the routes over the decoder handle."""
        backend = HandleBackend(self.decoder)
        return create_app(backend, api_key=self.api_key, max_in_flight=self.config.limits.max_queued_requests)


def build_app(args: dict | None = None) -> Application:
    """Serve application builder: `args` are the YAML's `args`, checked before anything starts."""
    config = load_app_config(args)
    decoder = Decoder.bind(config.engine.model_dump(), config.limits.model_dump())
    ingress = Ingress.options(max_ongoing_requests=config.limits.max_queued_requests + INGRESS_HEADROOM)
    return ingress.bind(decoder, config.model_dump())
