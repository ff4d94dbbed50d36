"""The application's typed configuration, set from the `args` of a Serve config YAML."""
from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from actors.batcher import DispatchConfig
from actors.context_cache import ContextCacheConfig
from deployments.completion_service import ApiLimits
from deployments.cpu_priority import RoutingPriority
from engine.config import EngineConfig
from graph.orchestrator import AnswerConfig
from predictor.batcher import BatcherConfig
from predictor.predict import PredictorConfig


class AppConfig(BaseModel):
    """Everything `build_app` takes. Deployment resources (replicas, autoscaling, CPUs, GPUs) are set
    the Serve way, under `deployments:` in the same YAML."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig, description="Model and engine settings.")
    limits: ApiLimits = Field(default_factory=ApiLimits, description="Per-request limits of the API.")
    batcher: BatcherConfig = Field(default_factory=BatcherConfig, description="The central batcher: length bins, "
                                   "token budget per micro-batch, failure recompute, aging.")
    dispatch: DispatchConfig = Field(default_factory=DispatchConfig, description="How micro-batches reach the decoders.")
    predictor: PredictorConfig | None = Field(
        default_factory=PredictorConfig,
        description="The length predictor (a trained adapter on the serving model); null: no prediction, every "
        "request goes to the batcher's default bin.")
    answer: AnswerConfig = Field(default_factory=AnswerConfig, description="Planned answers (sot, plato, auto).")
    context_cache: ContextCacheConfig = Field(default_factory=ContextCacheConfig,
                                              description="The shared context cache of plans and prefix KV.")
    routing_priority: RoutingPriority = Field(
        "normal",
        description="CPU scheduling of the replicas that only route (ingress, planner, batcher, context cache): "
        "`idle` puts their threads in Linux's SCHED_IDLE class, so on a CPU host they run on what the decoders "
        "leave and never pre-empt a decoder's torch threads (deployments.cpu_priority): only for one CPU decoder "
        "that leaves a core partly free, since decoders that fill every core (autoscaled, one per core) starve "
        "them; `normal` (default) leaves them as Ray starts them.")
    api_key: str | None = Field(
        None,
        min_length=1,
        description="Key every /v1 request must send as `Authorization: Bearer <key>`; none: the API is open. "
        "Serve shows `args` in its dashboard, so prefer api_key_env.",
    )
    api_key_env: str | None = Field(
        None,
        min_length=1,
        description="Name of an environment variable holding the key, read by each ingress replica when it "
        "starts (it refuses to start when the variable is unset or empty). Instead of api_key.",
    )

    @field_validator("api_key_env")
    @classmethod
    def _one_key_source(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("api_key") is not None:
            raise ValueError("set api_key or api_key_env, not both")
        return value

    def resolve_api_key(self) -> str | None:
        """The key the ingress checks; reads api_key_env from this process's environment."""
        if self.api_key_env is None:
            return self.api_key
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ConfigError(
                f"api_key_env: the environment variable {self.api_key_env} is not set on this node; set it "
                "wherever Ray runs (e.g. from a Kubernetes Secret) or remove api_key_env for an open API"
            )
        return key


class ConfigError(ValueError):
    """A wrong application setting, named by its dotted path."""


def load_app_config(args: dict | None) -> AppConfig:
    try:
        return AppConfig.model_validate(args or {})
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid application config: {problems}") from None
