"""The Serve application: an OpenAI-compatible ingress in front of autoscalable decoder replicas.

Start it with `serve run cluster/local.yaml`, or `serve run deployments.app:build_app` for defaults.
"""
from __future__ import annotations

from ray import serve
from ray.serve import Application
from ray.serve.handle import DeploymentHandle

from deployments.api import create_app
from deployments.chat_service import ApiLimits, ChatService
from deployments.config import load_app_config
from deployments.openai_schema import ChatCompletionRequest, RequestError
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig

@serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 1})
class Decoder:
    """One engine loop per replica; every concurrent request joins its continuous batch."""

    def __init__(self, engine_config: dict, limits: dict):
        from engine.engine import LLMEngine

        engine = LLMEngine.from_config(EngineConfig(**engine_config))
        self.service = ChatService(AsyncEngine(engine), ApiLimits(**limits))

    async def complete(self, body: dict) -> dict:
        try:
            response = await self.service.complete(ChatCompletionRequest.model_validate(body))
        except RequestError as exc:  # returned, not raised: Ray would wrap the exception type
            return exc.to_data()
        return response.model_dump()

    async def stream(self, body: dict):
        """Chunks of a streamed answer; a refused request yields one error dict instead."""
        try:
            async for chunk in self.service.stream(ChatCompletionRequest.model_validate(body)):
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
    """The ingress's view of the decoder deployment (see deployments.api.ChatBackend)."""

    def __init__(self, decoder: DeploymentHandle):
        self.decoder = decoder

    async def complete(self, request: ChatCompletionRequest) -> dict:
        out = await self.decoder.complete.remote(request.model_dump())
        if "error" in out:
            raise RequestError(**out["error"])
        return out

    async def stream(self, request: ChatCompletionRequest):
        async for chunk in self.decoder.options(stream=True).stream.remote(request.model_dump()):
            if "error" in chunk:
                raise RequestError(**chunk["error"])
            yield chunk

    async def info(self) -> dict:
        return await self.decoder.info.remote()

    async def health(self) -> dict:
        return await self.decoder.health.remote()


def _build_api():
    """Evaluated by Serve on each ingress replica. The decoder handle is looked up here because
    Serve pickles the ingress app by value, so nothing set from `Ingress.__init__` can reach it."""
    app = create_app()
    app_name = serve.get_replica_context().app_name
    app.state.backend = HandleBackend(serve.get_deployment_handle(Decoder.name, app_name=app_name))
    return app


@serve.deployment(max_ongoing_requests=512, ray_actor_options={"num_cpus": 0})
@serve.ingress(_build_api)
class Ingress:
    """HTTP entry point: validates OpenAI requests and forwards them to the decoders."""

    def __init__(self, decoder: DeploymentHandle):
        self.decoder = decoder  # bound so the decoder deployment is part of the application


def build_app(args: dict | None = None) -> Application:
    """Serve application builder: `args` are the YAML's `args`, checked before anything starts."""
    config = load_app_config(args)
    decoder = Decoder.bind(config.engine.model_dump(), config.limits.model_dump())
    return Ingress.bind(decoder)
