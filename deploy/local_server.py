"""`mtpserve serve`: a local Ray, the Serve app on it, until Ctrl-C; then a clean shutdown."""

from __future__ import annotations

import logging
import signal
import threading

from cluster.ray_executor import LOOPBACK
from deploy.app import AppArgs, build_app

logger = logging.getLogger(__name__)

APP_NAME = "mtpserve"


def start_local_ray(address: str = "local", num_cpus: int | None = None) -> None:
    """`address="local"` always starts a fresh single-node Ray (never attaches to another),
    with Ray's token auth on unless RAY_AUTH_MODE says otherwise (Ray's own servers listen on
    every interface: see cluster.ray_executor) and its dashboard on loopback. Any other address
    joins that cluster with its own auth."""
    import ray

    if address != "local":
        ray.init(address=address)
        return
    ray.init(address="local", num_cpus=num_cpus, dashboard_host=LOOPBACK)


def deploy(args: AppArgs, host: str, port: int) -> str:
    """Deploy the app on the connected Ray; returns the base URL."""
    from ray import serve

    # The proxy's access log too: a log line per request costs the proxy ~20% of its CPU under
    # load on the 2-core box (measured with benchmarks/bench_serve.py).
    serve.start(
        http_options={"host": host, "port": port},
        logging_config={"enable_access_log": args.access_log},
    )
    serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{shown_host}:{port}"


def shutdown() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def serve_until_interrupted(args: AppArgs, host: str, port: int, address: str = "local") -> None:
    """Start Ray, deploy, print the URL, block until SIGINT/SIGTERM, shut everything down."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    start_local_ray(address)
    try:
        url = deploy(args, host, port)
        print(
            f"mtpserve: serving an OpenAI-compatible API at {url}/v1 (Ctrl-C to stop)", flush=True
        )
        stop.wait()
        print("mtpserve: shutting down", flush=True)
    finally:
        shutdown()
