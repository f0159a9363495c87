"""The shipped YAMLs pass Ray's own schema validation and agree with what the code builds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.timeout(60)

DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy"
SERVE_CONFIGS = [DEPLOY_DIR / "serve.yaml", DEPLOY_DIR / "configs" / "serve-cpu.yaml"]


def _serve_schema(config: dict):
    from ray.serve.schema import ServeDeploySchema

    return ServeDeploySchema.model_validate(config)


def _deployment(app_config, name: str):
    [deployment] = [d for d in app_config.deployments if d.name == name]
    return deployment


def _check_serve_app(app_config) -> None:
    from deploy.app import (
        APP_ENV_VARS,
        INGRESS_NAME,
        MODEL_SERVER_NAME,
        AppArgs,
        placement_bundles,
        replica_actor_options,
    )

    assert app_config.import_path == "deploy.app:build_app"
    # The replicas get Serve's request-path switches and the engine's priority as `mtpserve
    # serve` sets them.
    env_vars = (app_config.runtime_env or {}).get("env_vars", {})
    assert {k: env_vars.get(k) for k in APP_ENV_VARS} == APP_ENV_VARS
    args = AppArgs.model_validate(app_config.args)  # the builder accepts exactly these args
    server = _deployment(app_config, MODEL_SERVER_NAME)
    # Bundles spelled out in YAML equal the ones the builder derives: 1 + one per TP rank.
    assert server.placement_group_bundles == placement_bundles(args)
    # ... and so does the replica's own share of bundle 0 where the YAML spells it out (a TP=1
    # engine's GPU is the replica's); left out, the builder's applies.
    actor_options = server.ray_actor_options
    if hasattr(actor_options, "num_cpus"):
        expected = replica_actor_options(args)
        assert {k: getattr(actor_options, k) or 0 for k in ("num_cpus", "num_gpus")} == {
            "num_cpus": expected["num_cpus"],
            "num_gpus": expected.get("num_gpus", 0),
        }
    # 1 + one per TP rank; one for a TP=1 engine, which runs in the replica's process tree.
    assert len(server.placement_group_bundles) == (1 if args.tp_size == 1 else 1 + args.tp_size)
    assert server.placement_group_strategy == "STRICT_PACK"
    scaling = server.autoscaling_config
    assert 1 <= scaling["min_replicas"] < scaling["max_replicas"]
    assert 0 < scaling["target_ongoing_requests"] <= server.max_ongoing_requests
    # The ingress must never be the bottleneck in front of the engines.
    ingress = _deployment(app_config, INGRESS_NAME)
    assert ingress.max_ongoing_requests >= server.max_ongoing_requests * scaling["max_replicas"]


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_serve_config_passes_ray_schema(path):
    schema = _serve_schema(yaml.safe_load(path.read_text()))
    [app_config] = schema.applications
    _check_serve_app(app_config)


def test_gpu_serve_config_asks_one_gpu_per_tp_rank():
    [app_config] = _serve_schema(yaml.safe_load(SERVE_CONFIGS[0].read_text())).applications
    bundles = _deployment(app_config, "ModelServer").placement_group_bundles
    assert [b.get("GPU", 0) for b in bundles] == [0] + [1.0] * app_config.args["tp_size"]


def test_kuberay_rayservice_embeds_a_valid_serve_config():
    manifest = yaml.safe_load((DEPLOY_DIR / "kuberay-rayservice.yaml").read_text())
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayService"
    [app_config] = _serve_schema(yaml.safe_load(manifest["spec"]["serveConfigV2"])).applications
    _check_serve_app(app_config)
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    [gpu_group] = cluster["workerGroupSpecs"]
    assert 0 <= gpu_group["minReplicas"] <= gpu_group["replicas"] <= gpu_group["maxReplicas"]
    [container] = gpu_group["template"]["spec"]["containers"]
    gpus_per_pod = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus_per_pod % app_config.args["tp_size"] == 0  # whole engines per pod
    # The GPU pods' /dev/shm is a memory volume, not the container's 64 MiB: Ray's object store
    # and NCCL between the pod's ranks need it.
    volumes = {v["name"]: v for v in gpu_group["template"]["spec"]["volumes"]}
    [shm] = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"


def test_cluster_launcher_passes_ray_schema():
    import jsonschema
    import ray
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DEPLOY_DIR / "cluster-launcher.yaml").read_text())
    schema_path = os.path.join(os.path.dirname(ray.__file__), "autoscaler", "ray-schema.json")
    with open(schema_path) as f:
        jsonschema.validate(config, json.load(f))
    validate_config(prepare_config(config))  # what `ray up` runs
    node_types = config["available_node_types"]
    gpu = node_types["gpu_worker"]
    assert gpu["resources"]["GPU"] >= 1 and 0 <= gpu["min_workers"] < gpu["max_workers"]
    assert node_types[config["head_node_type"]]["resources"].get("GPU", 0) == 0
    assert config["max_workers"] >= gpu["max_workers"]


def test_cluster_configs_start_every_ray_worker_at_the_normal_priority():
    """On a cluster Ray is started by `ray start` (the launcher's commands, KubeRay's pods), not
    by `mtpserve serve`: each node's raylet gets RAY_worker_niceness=0 there, so Serve's
    controller and proxies run at the normal priority as the app's replicas do."""
    from deploy.app import ENGINE_PRIORITY_ENV

    [(name, value)] = ENGINE_PRIORITY_ENV.items()
    launcher = yaml.safe_load((DEPLOY_DIR / "cluster-launcher.yaml").read_text())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        [start] = [c for c in launcher[key] if "ray start" in c]
        assert f"{name}={value} " in start, key
    manifest = yaml.safe_load((DEPLOY_DIR / "kuberay-rayservice.yaml").read_text())
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        for container in group["template"]["spec"]["containers"]:
            assert {"name": name, "value": value} in container.get("env", []), container["name"]
