"""Every config in cluster/ against the schema of the tool that reads it (Serve, KubeRay's
RayService, the Ray cluster launcher), and every application's `args` against AppConfig."""
from __future__ import annotations

import copy
import importlib.resources
import json
from pathlib import Path

import pytest
import yaml

from deployments.app import Decoder, Ingress, build_app
from deployments.config import ConfigError, load_app_config

CLUSTER = Path(__file__).resolve().parent.parent / "cluster"
YAMLS = sorted(CLUSTER.glob("*.yaml"))


def _load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def _kind(document: dict) -> str:
    if document.get("kind") == "RayService":
        return "rayservice"
    if "applications" in document:
        return "serve"
    if "provider" in document:
        return "launcher"
    raise AssertionError("neither a Serve config, a RayService nor a cluster launcher config")


def _serve_config(document: dict) -> dict:
    """The Serve config inside a document: the document itself, or a RayService's serveConfigV2."""
    return yaml.safe_load(document["spec"]["serveConfigV2"]) if _kind(document) == "rayservice" else document


def _check_serve(config: dict) -> None:
    """What `serve run`/`serve deploy` and KubeRay would reject, plus what `build_app` would. The
    schema takes any dict as `autoscaling_config`; Serve checks it when it deploys, so do we."""
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    for app in schema.applications:
        assert app.import_path == "deployments.app:build_app"
        load_app_config(app.args)
        build_app(app.args)
        assert {d.name for d in app.deployments} <= {Decoder.name, Ingress.name}
        for deployment in app.deployments:
            if isinstance(deployment.autoscaling_config, dict):
                scaling = AutoscalingConfig.model_validate(deployment.autoscaling_config)
                if not scaling.policy.is_default_policy_function():
                    _check_policy(scaling.policy, app.args, deployment)
            if isinstance(deployment.request_router_config, dict):
                _check_router(deployment.request_router_config)


def _check_router(config: dict) -> None:
    """The router class imports (Serve pickles it when it deploys) and takes its kwargs."""
    import inspect

    from ray.serve.config import RequestRouterConfig
    from ray.serve.request_router import RequestRouter

    router = RequestRouterConfig(**config).get_request_router_class()
    assert issubclass(router, RequestRouter)
    inspect.signature(router.initialize_state).bind(None, **config.get("request_router_kwargs", {}))


def _check_policy(policy, args: dict, deployment) -> None:
    """A custom autoscaling policy builds from its kwargs (Serve does so in its controller), and for
    the sequence policy the batcher hands a replica more than its target (else a backlog held in
    the bins never adds one) and the replica takes that many micro-batches."""
    from deployments.autoscaling import SequenceLoadPolicy

    built = policy.get_policy()(**policy.policy_kwargs)
    if isinstance(built, SequenceLoadPolicy):
        per_replica = args["dispatch"]["requests_per_replica"]
        assert per_replica > built.target_sequences
        assert deployment.max_ongoing_requests >= per_replica


def _check_launcher(document: dict) -> None:
    import jsonschema

    schema = json.loads((importlib.resources.files("ray.autoscaler") / "ray-schema.json").read_text())
    jsonschema.validate(document, schema)
    assert document["head_node_type"] in document["available_node_types"]


def _decoder(config: dict) -> dict:
    [app] = config["applications"]
    return next(d for d in app["deployments"] if d["name"] == "Decoder")


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_every_cluster_config_passes_its_schema(path):
    document = yaml.safe_load(path.read_text())
    if _kind(document) == "launcher":
        _check_launcher(document)
    else:
        _check_serve(_serve_config(document))


def test_the_expected_configs_are_there():
    assert {p.name: _kind(yaml.safe_load(p.read_text())) for p in YAMLS} == {
        "local.yaml": "serve",
        "gpu.yaml": "serve",
        "ray-cluster.yaml": "launcher",
        "kuberay-rayservice.yaml": "rayservice",
    }


def test_a_router_kwarg_it_does_not_take_is_refused():
    with pytest.raises(TypeError, match="imbalance"):
        _check_router({"request_router_class": "deployments.prefix_router:PrefixAffinityRouter",
                       "request_router_kwargs": {"imbalance": 8}})


def test_gpu_config_runs_one_autoscaled_decoder_per_gpu_sized_to_its_batch():
    config = _load("gpu.yaml")
    engine = config["applications"][0]["args"]["engine"]
    assert engine["device"] == "cuda" and engine["dtype"] == "bfloat16" and "/" in engine["model"]
    decoder = _decoder(config)
    scaling = decoder["autoscaling_config"]
    assert decoder["ray_actor_options"]["num_gpus"] == 1
    assert scaling["min_replicas"] == 1 and scaling["max_replicas"] > 1
    assert scaling["policy"]["policy_function"] == "deployments.autoscaling:SequenceLoadPolicy"
    dispatch = config["applications"][0]["args"]["dispatch"]
    assert scaling["policy"]["policy_kwargs"]["target_sequences"] < engine["max_batch_size"] \
        <= dispatch["requests_per_replica"] <= decoder["max_ongoing_requests"]
    assert dispatch["max_requests_in_flight"] >= dispatch["requests_per_replica"] * scaling["max_replicas"]


def test_a_sequence_policy_the_batcher_never_shows_a_backlog_is_refused():
    config = _load("local.yaml")
    _decoder(config)["autoscaling_config"]["policy"]["policy_kwargs"]["target_sequences"] = 40
    with pytest.raises(AssertionError):
        _check_serve(config)
    _decoder(config)["autoscaling_config"]["policy"]["policy_kwargs"]["target_sequences"] = 0
    with pytest.raises(ValueError, match="target_sequences"):
        _check_serve(config)


def test_rayservice_serves_the_gpu_application_on_one_gpu_per_worker_pod():
    document = _load("kuberay-rayservice.yaml")
    assert document["apiVersion"] == "ray.io/v1"
    assert _serve_config(document)["applications"] == _load("gpu.yaml")["applications"]
    cluster = document["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    groups = cluster["workerGroupSpecs"]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert sum(g["maxReplicas"] for g in groups) >= _decoder(_load("gpu.yaml"))["autoscaling_config"]["max_replicas"]


def test_launcher_installs_this_project_on_every_node_and_has_room_for_every_decoder():
    document = _load("ray-cluster.yaml")
    assert document["file_mounts"]["~/plato-serve"] == "."
    head, workers = document["head_setup_commands"], document["worker_setup_commands"]
    assert any("cd ~/plato-serve && pip install" in c and " -e ." in c for c in head)
    assert any("cd ~/plato-serve && pip install" in c and " -e '.[gpu]'" in c for c in workers)
    workers_max = sum(t["max_workers"] for name, t in document["available_node_types"].items()
                      if name != document["head_node_type"])
    assert workers_max >= _decoder(_load("gpu.yaml"))["autoscaling_config"]["max_replicas"]


def _gpu_args() -> dict:
    return copy.deepcopy(_load("gpu.yaml")["applications"][0]["args"])


@pytest.mark.parametrize(
    "change, field",
    [
        ({"engine": {"dtype": "bf16"}}, r"engine\.dtype"),
        ({"engine": {"max_batch_size": 0}}, r"engine\.max_batch_size"),
        ({"engine": {"nonsense": 1}}, r"engine\.nonsense"),
        ({"limits": {"default_max_tokens": "many"}}, r"limits\.default_max_tokens"),
        ({"limits": {"max_queued_requests": 0}}, r"limits\.max_queued_requests"),
        ({"limits": {"max_prompt_tokens": -1}}, r"limits\.max_prompt_tokens"),
        ({"limits": {"max_queue": 5}}, r"limits\.max_queue"),
        ({"api_key": "k", "api_key_env": "KEY"}, r"api_key_env"),
        ({"routing_priority": "low"}, r"routing_priority"),
    ],
)
def test_a_wrong_app_setting_fails_naming_the_field(change, field):
    args = _gpu_args()
    for key, value in change.items():
        args[key] = {**args[key], **value} if isinstance(value, dict) else value
    with pytest.raises(ConfigError, match=field):
        load_app_config(args)


def test_a_wrong_deployment_or_launcher_setting_fails_naming_the_field():
    import jsonschema
    from pydantic import ValidationError

    config = _load("gpu.yaml")
    _decoder(config)["autoscaling_config"]["max_replicas"] = "many"
    with pytest.raises(ValidationError, match="max_replicas"):
        _check_serve(config)
    launcher = _load("ray-cluster.yaml")
    launcher["max_workers"] = "many"
    with pytest.raises(jsonschema.ValidationError, match="many") as error:
        _check_launcher(launcher)
    assert list(error.value.absolute_path) == ["max_workers"]


def test_api_key_env_is_read_where_the_ingress_starts(monkeypatch):
    config = load_app_config({"api_key_env": "PLATO_TEST_API_KEY"})
    monkeypatch.delenv("PLATO_TEST_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="api_key_env: the environment variable PLATO_TEST_API_KEY"):
        config.resolve_api_key()
    monkeypatch.setenv("PLATO_TEST_API_KEY", "k3y")
    assert config.resolve_api_key() == "k3y"
    assert load_app_config({"api_key": "direct"}).resolve_api_key() == "direct"
    assert load_app_config({}).resolve_api_key() is None


@pytest.mark.parametrize("name", ["local.yaml", "gpu.yaml"])
def test_serve_configs_run_throughput_optimized_replicas_behind_the_proxy(name):
    [app] = _load(name)["applications"]
    env = app["runtime_env"]["env_vars"]
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "0"  # on, no proxy would serve http_options' port


def test_routing_priority_reaches_every_routing_replica_and_never_the_decoders():
    from deployments.app import build_app

    args = {**_load("local.yaml")["applications"][0]["args"], "predictor": None, "routing_priority": "idle"}
    priority = {}

    def walk(app):
        bound = app._bound_deployment
        given = [a for a in bound.init_args if a in ("idle", "normal")]
        config = next((a for a in bound.init_args if isinstance(a, dict) and "routing_priority" in a), None)
        priority[bound.name] = given[0] if given else (config or {}).get("routing_priority")
        for child in bound.init_args:
            if type(child).__name__ == "Application":
                walk(child)

    walk(build_app(args))
    assert priority == {"Ingress": "idle", "Planner": "idle", "Batcher": "idle", "ContextCacheDeployment": "idle",
                        "Decoder": None}
    for name in ("local.yaml", "gpu.yaml"):  # autoscaled decoders can fill every core: idle would starve routing
        assert load_app_config(_load(name)["applications"][0]["args"]).routing_priority == "normal"
