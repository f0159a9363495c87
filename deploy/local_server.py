"""`mtpserve serve`: a local Ray, the Serve app on it, until Ctrl-C; then a clean shutdown.

On a Ray this process starts, the app's ingress replica serves HTTP itself (Ray Serve's direct
ingress) when it is the only one: a request then crosses no Ray hop at all (colocated app) or
one (ingress -> model server), not the proxy's extra one; benchmarks/bench_serve.py measured the
difference (BENCHMARKS.md, issue 15). Serve's proxy then listens on a spare loopback port. Apps
with several ingress replicas, and clusters this process joins, keep Serve's proxy.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Ray and Serve are imported where they are used: `mtpserve --help` stays quick
    from deploy.app import AppArgs

logger = logging.getLogger(__name__)

APP_NAME = "mtpserve"


def serves_directly(args: AppArgs, address: str = "local") -> bool:
    """Whether the app's ingress replica can serve HTTP on the user's port itself: a Ray this
    process starts (Ray reads the switch from its processes' environment) and one ingress
    replica (the two-deployment app's ingress always has one; a colocated app one replica)."""
    if address != "local":
        return False
    return not args.colocate or (args.num_replicas == 1 and not args.autoscaling_config)


class PortInUseError(RuntimeError):
    pass


def direct_ingress_env(port: int) -> dict[str, str]:
    """Ray Serve's switches for an ingress replica serving HTTP on `port` and no other (a port
    in use is then a failed start, not a server on a port nobody was told of)."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
    }


def start_local_ray(
    address: str = "local", num_cpus: int | None = None, direct_port: int | None = None
) -> None:
    """`address="local"` always starts a fresh single-node Ray (never attaches to another),
    with Ray's token auth on unless RAY_AUTH_MODE says otherwise (Ray's own servers listen on
    every interface: see cluster.ray_executor) and its dashboard on loopback. Any other address
    joins that cluster with its own auth. `direct_port`: the ingress replica will serve HTTP on
    that port itself (`serves_directly`); Ray's processes inherit the switch from here."""
    import ray

    from cluster.ray_executor import LOOPBACK

    if address != "local":
        ray.init(address=address)
        return
    if direct_port is not None:
        os.environ.update(direct_ingress_env(direct_port))
    ray.init(address="local", num_cpus=num_cpus, dashboard_host=LOOPBACK)


def _spare_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def deploy(args: AppArgs, host: str, port: int, direct: bool = False) -> str:
    """Deploy the app on the connected Ray; returns the base URL. `direct`: Ray was started
    with `direct_port=port`, so the ingress replica binds `port` and the proxy a spare one."""
    from ray import serve

    from deploy.app import build_app

    # The proxy's access log too: a log line per request costs the proxy ~20% of its CPU under
    # load on the 2-core box (measured with benchmarks/bench_serve.py).
    proxy_port = _spare_port(host) if direct else port
    serve.start(
        http_options={"host": host, "port": proxy_port},
        logging_config={"enable_access_log": args.access_log},
    )
    serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{shown_host}:{port}"


def _port_taken(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


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
    direct = serves_directly(args, address)
    if direct and _port_taken(host, port):  # before Ray starts, not a failed replica later
        raise PortInUseError(f"port {port} on {host} is in use: choose another --port")
    start_local_ray(address, direct_port=port if direct else None)
    try:
        url = deploy(args, host, port, direct=direct)
        print(
            f"mtpserve: serving an OpenAI-compatible API at {url}/v1 (Ctrl-C to stop)", flush=True
        )
        stop.wait()
        print("mtpserve: shutting down", flush=True)
    finally:
        shutdown()
