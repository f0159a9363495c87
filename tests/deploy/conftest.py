"""Session fixtures (the tiny checkpoint comes from tests/conftest.py): one local Ray (2 CPUs), one Serve app over HTTP.

Ray starts once per session (`ray.init` ~6 s on the 2-core CI box, Serve app up ~4 s later);
every actor and replica asks for 0.1 CPU so engine + ingress + a second app fit in 2 cores.
`address="local"` always starts a fresh cluster, never attaching to another session's Ray.
"""

from __future__ import annotations

import os
import socket

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest  # noqa: E402

SMALL_CPU = 0.1
APP_NAME = "mtpserve"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def app_args(model_dir: str, **engine) -> dict:
    """Build args for a CPU-only test deployment of the tiny model."""
    return {
        "model": model_dir,
        "device": "cpu",
        "replica_num_cpus": SMALL_CPU,
        "actor_num_cpus": SMALL_CPU,
        "ingress_num_cpus": SMALL_CPU,
        "gpus_per_worker": 0,
        "engine": engine,
    }


@pytest.fixture(scope="session")
def ray_session():
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def serve_url(ray_session, tiny_model_dir) -> str:
    """The main app at `/`: the tiny model, no MTP drafts."""
    from ray import serve

    from deploy.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(app_args(tiny_model_dir)), name=APP_NAME, route_prefix="/")
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def model_server(serve_url):
    from ray import serve

    from deploy.app import MODEL_SERVER_NAME

    return serve.get_deployment_handle(MODEL_SERVER_NAME, app_name=APP_NAME)


@pytest.fixture(scope="session")
def served_model(serve_url) -> dict:
    import httpx

    card = httpx.get(f"{serve_url}/v1/models", timeout=30).json()["data"][0]
    return card


@pytest.fixture
def client(serve_url):
    import openai

    return openai.OpenAI(base_url=f"{serve_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def async_client(serve_url):
    import openai

    return openai.AsyncOpenAI(
        base_url=f"{serve_url}/v1", api_key="unused", max_retries=0, timeout=60
    )
