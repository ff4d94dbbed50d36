"""The Serve application, on the request path of ../shared/DESIGN.md:

    Ingress (HTTP, OpenAI-compatible; checks and tokenizes) -> Planner (plans sot / plato / auto)
      -> Batcher (one; length prediction, bins, micro-batches, re-queues) -> Decoder replicas
    Plain (`ar`) requests go from the ingress to the batcher directly (deployments.routing).
    LengthPredictor feeds the Batcher; ContextCache holds plans and prefix KV shared by decoders.

Every request, plain or a plan node, goes through the batcher. Start it with
`serve run cluster/local.yaml`, or `serve run deployments.app:build_app` for defaults.
"""
from __future__ import annotations

import asyncio
import itertools
import uuid

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from actors.batcher import BatcherActor, DispatchConfig
from actors.context_cache import ContextCache, ContextCacheClient
from actors.decode_client import call_again_if_replica_died, pause_or_raise, replica_died_errors
from actors.decoder import DecoderReplica, exit_replica
from actors.length_predictor import LengthPredictorReplica
from actors.planner import PlannerReplica, batcher_service
from deployments.api import create_app
from deployments.config import AppConfig, load_app_config
from deployments.cpu_priority import RoutingPriority, lower_routing_priority
from deployments.metrics import AnswerMetrics, BatcherMetrics, DecoderMetrics
from deployments.openai_schema import OpenAIRequest, RequestError
from deployments.prefix_holders import holder_lookup
from deployments.prefix_router import PrefixAffinityRouter
from deployments.replica_count import RunningReplicaCount, deployment_status, replica_states
from deployments.routing import RoutedBackend

# Serve's own request limit on an ingress replica sits this far above limits.max_queued_requests, so
# every request reaches the ingress's count (and its quick 503) instead of waiting in Serve's proxy
# queue, and /healthz still answers while the count is full.
INGRESS_HEADROOM = 16


@serve.deployment(max_ongoing_requests=32, ray_actor_options={"num_cpus": 1},
                  request_router_config=RequestRouterConfig(request_router_class=PrefixAffinityRouter))
class Decoder(DecoderReplica):
    """One engine loop per replica. Its ongoing requests are micro-batches of any size, so the YAMLs
    autoscale it on the sequences each replica reports instead (deployments.autoscaling). Micro-batches
    go to the replica that was sent their prompts' longest start (deployments.prefix_router)."""

    def __init__(self, engine_config: dict, context_cache: DeploymentHandle | None):
        context = serve.get_replica_context()
        super().__init__(engine_config, context_cache, name=getattr(context, "replica_tag", "decoder"),
                         observer=DecoderMetrics(), on_engine_death=exit_replica, caller_alive=actor_alive)


async def actor_alive(actor) -> bool:
    """Whether a Ray actor answers (its handle, as the batcher names itself in a micro-batch): False only
    when Ray says it died, not when it is slow to answer."""
    try:
        await asyncio.wait_for(actor.__ray_ready__.remote(), timeout=30)
    except ray.exceptions.ActorDiedError:
        return False
    except (asyncio.TimeoutError, ray.exceptions.RayActorError):  # slow, or unreachable for now
        return True
    return True


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class ContextCacheDeployment(ContextCache):
    """The shared context cache: one replica, so every decoder sees the same index."""

    def __init__(self, config: dict, routing_priority: RoutingPriority = "normal"):
        lower_routing_priority(routing_priority)
        super().__init__(config)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class LengthPredictor(LengthPredictorReplica):
    """Predicted answer lengths; concurrent single calls are batched into one forward pass. Prompt KV
    it computes goes to the context cache for the decoders (see actors.length_predictor)."""

    def __init__(self, engine_config: dict, predictor_config: dict, context_cache: DeploymentHandle | None):
        context = serve.get_replica_context()
        super().__init__(engine_config, predictor_config, context_cache,
                         name=getattr(context, "replica_tag", "predictor"))

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def predict(self, prompts: list[list[int]]) -> list[int]:
        return await self.predict_many(prompts)

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01)
    async def predict_and_share(self, prompts: list[list[int]]) -> list[dict]:
        return await self.predict_and_share_many(prompts)


def _predict_through(predictor: DeploymentHandle):
    def predict(prompt_ids: list[int], share: bool):
        return (predictor.predict_and_share if share else predictor.predict).remote(prompt_ids)
    return predict


@serve.deployment(num_replicas=1, max_ongoing_requests=100_000, ray_actor_options={"num_cpus": 0})
class Batcher(BatcherActor):
    """The one central batcher; it pushes micro-batches to the decoders through Serve's router."""

    def __init__(self, config: dict, dispatch: dict, decoder: DeploymentHandle, predictor: DeploymentHandle | None,
                 routing_priority: RoutingPriority = "normal"):
        lower_routing_priority(routing_priority)
        stream = decoder.options(stream=True)
        # the decoders ask whether this replica still lives (actors.decoder: Ray would have them decode on)
        me = {"caller": ray.get_runtime_context().current_actor,
              "caller_check_s": DispatchConfig(**(dispatch or {})).caller_check_s}
        super().__init__(config, send_batch=lambda batch: stream.run_batch.remote({**batch, **me}),
                         predict=_predict_through(predictor) if predictor is not None else None,
                         dispatch=dispatch, observer=BatcherMetrics(),
                         abort_on_decoder=lambda call: decoder.abort.remote(call),
                         holder_of=holder_lookup(decoder.app_name, decoder.deployment_name),
                         decoder_replicas=RunningReplicaCount(decoder.app_name, decoder.deployment_name))


@serve.deployment(max_ongoing_requests=256, ray_actor_options={"num_cpus": 0})
class Planner(PlannerReplica):
    """The planner actor (actors.planner), with the app's health report."""

    def __init__(self, engine_config: dict, limits: dict, answer: dict, batcher: DeploymentHandle,
                 context_cache: DeploymentHandle | None = None, routing_priority: RoutingPriority = "normal"):
        lower_routing_priority(routing_priority)
        contexts = ContextCacheClient(context_cache) if context_cache is not None else None
        super().__init__(engine_config, limits, answer, batcher, observer=AnswerMetrics(), contexts=contexts)

    async def health(self) -> dict:
        """Healthy while the decoder deployment is: Serve marks it unhealthy when replicas fail their
        `check_health`, which fails when a replica's engine loop is stuck or dead."""
        decoder = await asyncio.to_thread(deployment_status, serve.get_replica_context().app_name, "Decoder")
        state = decoder.status.value if decoder else "MISSING"
        replicas = replica_states(decoder) if decoder else {}
        return {"healthy": state == "HEALTHY", "decoder": state, "decoder_replicas": replicas}


class HandleBackend:
    """The ingress's view of the planner deployment (see deployments.api.CompletionBackend).

    Each planned answer is asked under a key of its own, the planner journaling it under that key in the
    context cache as it is made. When the planner replica dies under a call, the call is made again (up
    to `retries` times, `backoff_s` doubling between; Serve starts a fresh replica if none is left), and
    the replica that gets it takes the answer up from the journal: the answered nodes are kept, and a
    stream goes on after the text its client already has, under the same chunk id."""

    def __init__(self, planner: DeploymentHandle, retries: int = 4, backoff_s: float = 0.5,
                 retry_on: tuple[type[BaseException], ...] | None = None):
        self.planner, self.retries, self.backoff_s = planner, retries, backoff_s
        self.retry_on = retry_on if retry_on is not None else replica_died_errors()

    async def complete(self, request: OpenAIRequest) -> dict:
        key, attempts = uuid.uuid4().hex, itertools.count()
        out = await call_again_if_replica_died(
            lambda: self.planner.complete.remote(request, {"key": key, "retry": next(attempts) > 0}), "planner",
            self.retries, self.backoff_s, self.retry_on)
        if "error" in out:
            raise RequestError(**out["error"])
        return out

    async def stream(self, request: OpenAIRequest):
        call = {"key": uuid.uuid4().hex, "sent": "", "opened": False}
        first: dict | None = None  # the first chunk's id and time, which every later one keeps
        for attempt in itertools.count():
            try:
                asked = {**call, "retry": attempt > 0}
                async for chunk in self.planner.options(stream=True).stream.remote(request, asked):
                    if "error" in chunk:
                        raise RequestError(**chunk["error"])
                    first = first or {"id": chunk["id"], "created": chunk["created"]}
                    for choice in chunk["choices"]:
                        delta = choice.get("delta") or {}
                        call["sent"] += delta.get("content") or ""
                        call["opened"] = call["opened"] or "role" in delta
                    yield {**chunk, **first}
                return
            except self.retry_on as error:
                await pause_or_raise(attempt, error, "planner", self.retries, self.backoff_s)

    async def info(self) -> dict:
        return await self.planner.info.remote()

    async def health(self) -> dict:
        return await self.planner.health.remote()


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """HTTP entry point: checks the API key and the replica's load, validates OpenAI requests,
    answers plain ones through the batcher and forwards questions to plan to the planner."""

    def __init__(self, planner: DeploymentHandle, batcher: DeploymentHandle, config: dict,
                 context_cache: DeploymentHandle | None = None):
        self.config = AppConfig.model_validate(config)
        # the Responses API's stored responses, in the one actor every ingress replica reaches
        self.responses = ContextCacheClient(context_cache) if context_cache is not None else None
        lower_routing_priority(self.config.routing_priority)
        self.api_key = self.config.resolve_api_key()  # a missing key fails the replica's start, loudly
        plain = batcher_service(self.config.engine.model_dump(), self.config.limits.model_dump(), batcher,
                                observer=AnswerMetrics())
        self.backend = RoutedBackend(plain, HandleBackend(planner))

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Called by Serve on each replica after `__init__`: the routes over both paths."""
        return create_app(self.backend, api_key=self.api_key, max_in_flight=self.config.limits.max_queued_requests,
                          responses=self.responses)


def build_app(args: dict | None = None) -> Application:
    """Serve application builder: `args` are the YAML's `args`, checked before anything starts."""
    config = load_app_config(args)
    engine = config.engine.model_dump()
    cache = ContextCacheDeployment.bind(config.context_cache.model_dump(), config.routing_priority)
    decoder = Decoder.bind(engine, cache)
    predictor = LengthPredictor.bind(engine, config.predictor.model_dump(), cache) if config.predictor else None
    batcher = Batcher.bind(config.batcher.model_dump(), config.dispatch.model_dump(), decoder, predictor,
                          config.routing_priority)
    planner = Planner.bind(engine, config.limits.model_dump(), config.answer.model_dump(), batcher, cache,
                           config.routing_priority)
    ingress = Ingress.options(max_ongoing_requests=config.limits.max_queued_requests + INGRESS_HEADROOM)
    return ingress.bind(planner, batcher, config.model_dump(), cache)
