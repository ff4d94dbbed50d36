"""The application's typed configuration, set from the `args` of a Serve config YAML."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deployments.chat_service import ApiLimits
from engine.config import EngineConfig


class AppConfig(BaseModel):
    """Everything `build_app` takes. Deployment resources (replicas, autoscaling, CPUs, GPUs) are set
    the Serve way, under `deployments:` in the same YAML."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig, description="Model and engine settings.")
    limits: ApiLimits = Field(default_factory=ApiLimits, description="Per-request limits of the API.")


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
