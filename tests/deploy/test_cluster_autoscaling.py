"""Cluster autoscaling on Ray's fake multi-node provider: a model-server replica that does not fit
the head makes the autoscaler add a GPU worker node; once Serve is gone the idle node is removed.

The cluster config is written here (the PyPI wheel lacks the provider's `example.yaml`, and
`ray.cluster_utils.AutoscalingCluster` would `ray stop --force` every Ray on the machine). Its
node types are `deploy/cluster-launcher.yaml`'s, shrunk to a 2-core box: a head with no GPU
(Serve controller, proxy, ingress; no engines) and a `gpu_worker` type whose nodes carry a GPU
*resource* (the fake nodes are raylets on this machine; the engine runs on CPU), so a replica
whose placement group asks for {GPU: 1} fits only on a worker node. The head is our own
`RAY_FAKE_CLUSTER=1 ray start --head --autoscaling-config=...`; the fake worker nodes are
raylets under its temp dir, so stopping the head and what is under that dir stops everything.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import BIN_DIR, free_port, ray_head

pytestmark = pytest.mark.timeout(300)

LAUNCHER = Path(__file__).resolve().parents[2] / "deploy" / "cluster-launcher.yaml"
FAKE_HEAD_TYPE = "ray.head.default"  # the fake provider tags its head node with this type
WORKER_TYPE = "gpu_worker"
HEAD_NUM_CPUS = 1
IDLE_TIMEOUT_MINUTES = 0.1  # 6 s
PROMPT = "The capital of France is"


def fake_cluster_config(gcs_address: str) -> dict:
    launcher = yaml.safe_load(LAUNCHER.read_text())
    gpu_worker = launcher["available_node_types"][WORKER_TYPE]
    assert gpu_worker["resources"]["GPU"] >= 1
    assert (
        launcher["available_node_types"][launcher["head_node_type"]]["resources"].get("GPU", 0) == 0
    )
    return {
        "cluster_name": "mtpserve-fake",
        "max_workers": 2,
        "upscaling_speed": launcher["upscaling_speed"],
        "idle_timeout_minutes": IDLE_TIMEOUT_MINUTES,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs_address,  # else the provider assumes port 6379
        },
        "available_node_types": {
            FAKE_HEAD_TYPE: {
                "resources": {"CPU": HEAD_NUM_CPUS},
                "node_config": {},
                "max_workers": 0,
            },
            # One TP=1 engine per node: one {CPU: 0.2, GPU: 1} bundle.
            WORKER_TYPE: {
                "resources": {"CPU": 1, "GPU": 1},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 2,
            },
        },
        "head_node_type": FAKE_HEAD_TYPE,
        "auth": {},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def serve_config(model_dir: str, port: int) -> dict:
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": "mtpserve",
                "route_prefix": "/",
                "import_path": "deploy.app:build_app",
                "args": {
                    "model": model_dir,
                    "device": "cpu",
                    "gpus_per_worker": 1.0,
                    "replica_num_cpus": 0.1,
                    "actor_num_cpus": 0.1,
                    "ingress_num_cpus": 0.1,
                    "engine": {"max_num_seqs": 4, "num_kv_blocks": 64},
                },
            }
        ],
    }


def _nodes(dashboard_url: str) -> list[dict]:
    body = httpx.get(f"{dashboard_url}/api/v0/nodes", timeout=10).json()
    return body["data"]["result"]["result"]


def _alive_workers(dashboard_url: str) -> list[dict]:
    return [n for n in _nodes(dashboard_url) if n["state"] == "ALIVE" and not n["is_head_node"]]


def _serve_app(dashboard_url: str) -> dict | None:
    details = httpx.get(f"{dashboard_url}/api/serve/applications/", timeout=10).json()
    return details.get("applications", {}).get("mtpserve")


def _serve(head, *args: str) -> None:
    subprocess.run(
        [str(BIN_DIR / "serve"), *args, "--address", head.dashboard_url],
        env=head.env,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_replica_that_does_not_fit_adds_a_gpu_node_and_idle_node_goes(
    tiny_model_dir, tmp_path, offline_llm
):
    from ray._private.services import get_node_ip_address

    from cluster.sampling_params import SamplingParams

    gcs_port = free_port()
    cluster_path = tmp_path / "fake-cluster.yaml"
    cluster_path.write_text(
        yaml.safe_dump(fake_cluster_config(f"{get_node_ip_address()}:{gcs_port}"))
    )
    fake_env = {"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
    with ray_head(
        HEAD_NUM_CPUS,
        extra_args=(f"--autoscaling-config={cluster_path}",),
        extra_env=fake_env,
        gcs_port=gcs_port,
    ) as head:
        deadline = time.monotonic() + 60
        while not (nodes := _nodes(head.dashboard_url)):  # the dashboard can beat the raylet
            assert time.monotonic() < deadline, "the head node never registered"
            time.sleep(0.5)
        [head_node] = nodes
        assert head_node["is_head_node"] and "GPU" not in head_node["resources_total"]
        assert _alive_workers(head.dashboard_url) == []

        port = free_port()
        config_path = tmp_path / "serve.yaml"
        config_path.write_text(yaml.safe_dump(serve_config(tiny_model_dir, port)))
        _serve(head, "deploy", str(config_path))
        started = time.monotonic()
        while (app := _serve_app(head.dashboard_url)) is None or app["status"] != "RUNNING":
            assert app is None or app["status"] not in ("DEPLOY_FAILED", "UNHEALTHY"), app
            assert time.monotonic() - started < 150, (app, _nodes(head.dashboard_url))
            time.sleep(1)
        upscale_s = time.monotonic() - started

        # Exactly one worker node of the launcher's GPU type (the only type with a GPU) was
        # added, and the engine is on it.
        [worker] = _alive_workers(head.dashboard_url)
        assert worker["resources_total"]["GPU"] == 1
        deployments = app["deployments"]
        [server_replica] = deployments["ModelServer"]["replicas"]
        [ingress_replica] = deployments["OpenAIIngress"]["replicas"]
        assert server_replica["node_id"] == worker["node_id"]
        assert ingress_replica["node_id"] == head_node["node_id"]

        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            timeout=60,
            json={"model": tiny_model_dir, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0},
        )
        [reference] = offline_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6))
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == reference.text

        # Serve gone: the worker node idles, and after idle_timeout_minutes it is terminated.
        # Timed from before the shutdown: the node can go idle before the command returns (on
        # a loaded box that return took over a second), never before it starts.
        started = time.monotonic()
        _serve(head, "shutdown", "-y")
        while _alive_workers(head.dashboard_url):
            assert time.monotonic() - started < 90, _nodes(head.dashboard_url)
            time.sleep(1)
        downscale_s = time.monotonic() - started
        assert downscale_s >= IDLE_TIMEOUT_MINUTES * 60 - 1
        dead = [n for n in _nodes(head.dashboard_url) if n["node_id"] == worker["node_id"]]
        assert [n["state"] for n in dead] == ["DEAD"]
        print(
            f"node added and app running in {upscale_s:.1f} s; "
            f"idle node removed {downscale_s:.1f} s after serve shutdown"
        )
