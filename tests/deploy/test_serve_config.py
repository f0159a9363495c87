"""`serve deploy deploy/configs/serve-cpu.yaml` on a Ray head of our own: the YAML deploys and
answers over HTTP, and its Serve autoscaling adds a model-server replica under concurrent load
and removes it after the load stops.

The config is the shipped one with two fields changed by the test: the checkpoint (the tiny
model) and the HTTP port (a free one). Replica counts come from Serve's REST API on the head's
dashboard (what `serve status` reads), so the test process never joins that cluster.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import BIN_DIR, free_port, ray_head

pytestmark = pytest.mark.timeout(300)

CPU_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "serve-cpu.yaml"
APP = "mtpserve"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def deployed_cpu_config(tiny_model_dir, tmp_path_factory):
    """Yields (base URL of the app, head, the config as deployed)."""
    config = yaml.safe_load(CPU_CONFIG.read_text())
    port = free_port()
    config["http_options"]["port"] = port
    [app] = config["applications"]
    app["args"]["model"] = tiny_model_dir
    config_path = tmp_path_factory.mktemp("serve-config") / "serve-cpu.yaml"
    config_path.write_text(yaml.safe_dump(config))
    with ray_head(num_cpus=1) as head:
        subprocess.run(
            [str(BIN_DIR / "serve"), "deploy", str(config_path), "--address", head.dashboard_url],
            env=head.env,
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        deadline = time.monotonic() + 150
        while (status := _app_status(head.dashboard_url)) != "RUNNING":
            assert status not in ("DEPLOY_FAILED", "UNHEALTHY"), _serve_details(head.dashboard_url)
            assert time.monotonic() < deadline, _serve_details(head.dashboard_url)
            time.sleep(1)
        yield f"http://127.0.0.1:{port}", head, config


def _serve_details(dashboard_url: str) -> dict:
    return httpx.get(f"{dashboard_url}/api/serve/applications/", timeout=10).json()


def _app_status(dashboard_url: str) -> str | None:
    app = _serve_details(dashboard_url).get("applications", {}).get(APP)
    return app and app["status"]


def _running_replicas(dashboard_url: str, deployment: str = "ModelServer") -> int:
    replicas = _serve_details(dashboard_url)["applications"][APP]["deployments"][deployment][
        "replicas"
    ]
    return sum(replica["state"] == "RUNNING" for replica in replicas)


def _wait_for_replicas(dashboard_url: str, count: int, timeout_s: float) -> float:
    """Seconds until exactly `count` ModelServer replicas are RUNNING."""
    started = time.monotonic()
    while (running := _running_replicas(dashboard_url)) != count:
        assert time.monotonic() - started < timeout_s, f"{running} replicas, wanted {count}"
        time.sleep(0.5)
    return time.monotonic() - started


def test_cpu_config_deploys_and_answers_greedy_like_offline(
    deployed_cpu_config, tiny_model_dir, offline_llm
):
    import openai

    from cluster.sampling_params import SamplingParams

    url, _, _ = deployed_cpu_config
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    [model] = client.models.list().data
    response = client.completions.create(
        model=model.id, prompt=PROMPT, max_tokens=8, temperature=0.0
    )
    [reference] = offline_llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8))
    assert response.choices[0].text == reference.text
    assert response.usage.completion_tokens == 8
    health = httpx.get(f"{url}/health", timeout=30).json()
    # The config's engine settings reached the replica: num_kv_blocks less the null block 0.
    num_kv_blocks = deployed_cpu_config[2]["applications"][0]["args"]["engine"]["num_kv_blocks"]
    assert health["status"] == "ok"
    assert health["engine"]["num_total_blocks"] == num_kv_blocks - 1


def test_serve_autoscaling_adds_a_replica_under_load_and_removes_it(deployed_cpu_config):
    url, head, config = deployed_cpu_config
    [app] = config["applications"]
    [server] = [d for d in app["deployments"] if d["name"] == "ModelServer"]
    scaling = server["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 2)
    assert _running_replicas(head.dashboard_url) == 1
    # 4x target_ongoing_requests streams: Serve wants ceil(8 / 2) = 4 replicas, capped at 2.
    num_streams = 4 * scaling["target_ongoing_requests"]
    stop = threading.Event()
    streams_served: set[int] = set()
    errors: list[BaseException] = []

    def stream_until_stopped(index: int) -> None:
        body = {
            "model": app["args"]["model"],
            "prompt": PROMPT,
            "max_tokens": 1000,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        # Load until stopped: a stream that finishes its tokens (the serving path is fast enough
        # for that on a quiet box) is followed by another, so the load ends when the test says.
        try:
            while not stop.is_set():
                with httpx.stream(
                    "POST", f"{url}/v1/completions", json=body, timeout=60
                ) as response:
                    assert response.status_code == 200, response.read()
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            streams_served.add(index)
                        if stop.is_set():
                            return  # closing the stream cancels the request
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=stream_until_stopped, args=(i,)) for i in range(num_streams)]
    for thread in threads:
        thread.start()
    try:
        upscale_s = _wait_for_replicas(head.dashboard_url, 2, timeout_s=90)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    assert not errors, errors
    assert len(streams_served) == num_streams  # every stream was served while scaling
    # Load gone: back to min_replicas once downscale_delay_s has passed with no load.
    downscale_s = _wait_for_replicas(head.dashboard_url, 1, timeout_s=90)
    assert downscale_s >= scaling["downscale_delay_s"] - 1
    print(f"upscaled in {upscale_s:.1f} s, downscaled {downscale_s:.1f} s after the load")
    # The surviving replica still answers.
    ok = httpx.post(
        f"{url}/v1/completions",
        timeout=60,
        json={"model": app["args"]["model"], "prompt": PROMPT, "max_tokens": 3},
    )
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
