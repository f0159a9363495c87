"""`mtpserve serve`: a local Ray, the Serve app on it, until Ctrl-C; then a clean shutdown.

On a Ray this process starts, the app's ingress replica serves HTTP itself (Ray Serve's direct
ingress) when it is the only one: a request then crosses no Ray hop at all (colocated app) or
one (ingress -> model server), not the proxy's extra one (benchmarks/bench_serve.py measures
both; BENCHMARKS.md, issue 15). Serve's proxy then listens on a spare loopback port. Apps with
several ingress replicas, and clusters this process joins, keep Serve's proxy.

What a user sees: one line per start-up stage with the time it took, the "serving at" line last
(printed only once the model is loaded and warm), and on Ctrl-C or SIGTERM a "shutting down"
line and exit status 0, with no traceback. Ray's and Serve's own INFO lines (cluster start,
controller, proxies) are left out; their warnings and errors still show.
"""

from __future__ import annotations

import logging
import os
import random
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Ray and Serve are imported where they are used: `mtpserve --help` stays quick
    from deploy.app import AppArgs

logger = logging.getLogger(__name__)

APP_NAME = "mtpserve"
STOP_POLL_S = 0.1  # how soon a served app sees Ctrl-C (a flag the signal handler sets)


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived before the server was up (a BaseException, as Ctrl-C's own, so
    that no `except Exception` inside Ray's start-up calls swallows it)."""


class PortInUseError(RuntimeError):
    pass


class DeployFailedError(RuntimeError):
    """The app's replicas failed to start (Serve gave up retrying them); the message has their
    own error's last line."""


class DoesNotFitError(RuntimeError):
    """The app asks for more than the local Ray's one node has: Serve would wait for a node
    that never comes (a local Ray has no autoscaler)."""


def check_fits(args: AppArgs) -> None:
    """Raise DoesNotFitError unless the engine replica's placement group (all of it on one node:
    STRICT_PACK) and the ingress fit the connected Ray's resources. For a local Ray, whose one
    node is all there is; a cluster may add nodes, so it is not checked."""
    import ray

    from deploy.app import placement_bundles

    need: dict[str, float] = {}
    for bundle in placement_bundles(args):
        for name, amount in bundle.items():
            need[name] = need.get(name, 0.0) + amount
    if not args.colocate:
        need["CPU"] = need.get("CPU", 0.0) + args.ingress_num_cpus
    have = ray.cluster_resources()
    short = {name: amount for name, amount in need.items() if amount > have.get(name, 0.0) + 1e-9}
    if not short:
        return
    ranks = args.num_worker_ranks
    wanted = ", ".join(f"{amount:g} {name}" for name, amount in sorted(short.items()))
    has = ", ".join(f"{have.get(name, 0.0):g} {name}" for name in sorted(short))
    raise DoesNotFitError(
        f"the engine ({ranks} rank{'s' if ranks > 1 else ''}) needs {wanted} on one machine and "
        f"this one has {has}: use fewer ranks (--tensor-parallel-size), smaller "
        "--actor-num-cpus / --replica-num-cpus, or join a cluster that has them (--address)"
    )


def serves_directly(args: AppArgs, address: str = "local") -> bool:
    """Whether the app's ingress replica can serve HTTP on the user's port itself: a Ray this
    process starts (Ray reads the switch from its processes' environment) and one ingress
    replica (the two-deployment app's ingress always has one; a colocated app one replica)."""
    if address != "local":
        return False
    return not args.colocate or (args.num_replicas == 1 and not args.autoscaling_config)


def direct_ingress_env(port: int) -> dict[str, str]:
    """Ray Serve's switches for an ingress replica serving HTTP on `port` and no other (a port
    in use is then a failed start, not a server on a port nobody was told of)."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),
        # The draining replica's wait (30 s by default) is for load balancers to take it out of
        # rotation; with none in front of the one replica, Ctrl-C would only wait for nothing.
        # Requests in flight are still waited for (graceful_shutdown_timeout_s).
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
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

    # Ray's and Serve's driver-side INFO lines (cluster started, Serve started, app ready) are
    # not for users; Serve's logger has its own handler, so it is set apart.
    quiet = logging.WARNING
    logging.getLogger("ray.serve").setLevel(quiet)
    if address != "local":
        ray.init(address=address, logging_level=quiet)
        return
    if direct_port is not None:
        os.environ.update(direct_ingress_env(direct_port))
    from deploy.app import APP_ENV_VARS

    for name, value in APP_ENV_VARS.items():  # a value the user set stays
        os.environ.setdefault(name, value)
    ray.init(address="local", num_cpus=num_cpus, dashboard_host=LOOPBACK, logging_level=quiet)


# Where a port is picked for a server that binds it later (Serve's proxy beside direct ingress;
# the tests' and benchmarks' servers): not the kernel's ephemeral range (32768-60999 by
# default), where Ray's own components bind port 0 as they start, so that a port picked there
# can be taken before its server binds it (Serve then marks it unavailable and the replica
# never starts); and not Ray's worker ports (10002-19999) or Serve's direct-ingress ranges
# (30000-31000, 40000-41000).
SPARE_PORTS = range(20000, 30000)


def spare_ports(host: str = "127.0.0.1", n: int = 1) -> list[int]:
    """`n` distinct ports of SPARE_PORTS free on `host` now (each held until all are chosen),
    from a random place in the range."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    start = random.randrange(len(SPARE_PORTS))
    chosen: list[int] = []
    with ExitStack() as held:
        for i in range(len(SPARE_PORTS)):
            port = SPARE_PORTS[(start + i) % len(SPARE_PORTS)]
            sock = socket.socket(family)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            held.enter_context(sock)
            chosen.append(port)
            if len(chosen) == n:
                return chosen
    raise OSError(f"no {n} free ports in {SPARE_PORTS.start}-{SPARE_PORTS.stop - 1} on {host}")


def _port_taken(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def deploy(args: AppArgs, host: str, port: int, direct: bool = False) -> str:
    """Deploy the app on the connected Ray; returns the base URL once it is ready (every
    replica's engine loaded and warmed up). `direct`: Ray was started with `direct_port=port`,
    so the ingress replica binds `port` and the proxy a spare one."""
    from ray import serve

    from deploy.app import build_app

    # The proxy's access log too: a log line per request costs the proxy ~20% of its CPU under
    # load on the 2-core box (measured with benchmarks/bench_serve.py). The controller's and
    # proxies' other INFO lines say what Serve does internally: warnings only.
    proxy_port = spare_ports(host)[0] if direct else port
    serve.start(
        http_options={"host": host, "port": proxy_port},
        logging_config={"enable_access_log": args.access_log, "log_level": "WARNING"},
    )
    try:
        serve.run(build_app(args), name=APP_NAME, route_prefix="/")
    except RuntimeError as exc:  # Serve's "Deploying application ... failed"
        raise DeployFailedError(f"the server failed to start: {_replicas_error(exc)}") from None
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{shown_host}:{port}"


_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit)\b.*:")


def _replicas_error(exc: BaseException) -> str:
    """The last `SomeError: ...` line of what Serve says about the app's deployments (their
    replicas' tracebacks, whose full text Ray has printed above), or Serve's own message."""
    from ray import serve

    try:
        app = serve.status().applications.get(APP_NAME)
        texts = [d.message for d in app.deployments.values()] + [app.message] if app else []
    except Exception:  # noqa: BLE001 - the controller may be going: say what serve.run said
        texts = []
    for text in texts:
        lines = [line.strip() for line in (text or "").splitlines()]
        errors = [line for line in lines if _ERROR_LINE.match(line)]
        if errors:
            return f"{errors[-1]} (the replicas' log above has the whole error)"
    return str(exc)


def shutdown() -> None:
    """Delete the app (each replica drains its requests, up to its graceful_shutdown_timeout_s),
    then leave Ray, which stops a local Ray with everything on it. Not serve.shutdown(): killing
    the controller makes Ray print a task-retry warning at every Ctrl-C. On a cluster that this
    process joined, the app is deleted and Serve itself keeps running for the cluster's other
    apps."""
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        if ray.is_initialized():  # else interrupted before Ray was up (serve.* would start it)
            serve.delete(APP_NAME)
    except RayServeException:
        pass  # Serve never started (interrupted first, or nothing was deployed): nothing to delete
    finally:
        ray.shutdown()  # also stops the processes of a local Ray interrupted while starting


def _say(message: str) -> None:
    print(f"mtpserve: {message}", flush=True)


@contextmanager
def _stage(doing: str, done: str) -> Iterator[None]:
    """Prints `doing...` now and `done in N s` after (stdout, so the two stay in order)."""
    _say(f"{doing} ...")
    started = time.perf_counter()
    yield
    _say(f"{done} in {time.perf_counter() - started:.1f} s")


def _describe(args: AppArgs) -> str:
    from workers.default_model import default_model_path

    model = args.model or f"the default model ({default_model_path()})"
    parallel = f", TP={args.tp_size}" if (args.tp_size or 1) > 1 else ""
    if (args.ep_size or 1) > 1:
        parallel += f", EP={args.ep_size}"
    device = args.device or "auto"
    if device == "auto":  # as the engine resolves it (on this node: replicas may land elsewhere)
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return f"{model} on {device}{parallel}"


def serve_until_interrupted(args: AppArgs, host: str, port: int, address: str = "local") -> int:
    """Start Ray, deploy, print the URL, block until SIGINT/SIGTERM, shut everything down.
    Returns the exit status: 0 after serving, 130 when interrupted during start-up."""
    # Plain flags, no locks: a handler runs on the main thread between two bytecodes, also
    # inside another handler (a second Ctrl-C, or a signal sent to the process and forwarded
    # by a parent such as `timeout`), where a threading.Event's lock, held by the first, hung
    # the server for ever.
    state = {"started": False, "stop": False}

    def on_signal(signum: int, _frame) -> None:
        if state["started"]:
            state["stop"] = True  # the main thread's wait below sees it and shuts down
        else:
            raise Interrupted(signal.Signals(signum).name)  # out of a blocking start-up call

    def handle_signals() -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, on_signal)

    handle_signals()
    direct = serves_directly(args, address)
    if direct and _port_taken(host, port):  # before Ray starts, not a failed replica later
        raise PortInUseError(f"port {port} on {host} is in use: choose another --port")
    try:
        if address == "local":
            ray_stage = ("starting a local Ray", "Ray started")
        else:
            ray_stage = (f"joining the Ray cluster at {address}", "joined")
        with _stage(*ray_stage):
            start_local_ray(address, direct_port=port if direct else None)
        handle_signals()  # ray.init installs its own SIGTERM handler (sys.exit)
        if address == "local":
            check_fits(args)
        # On a GPU the first start also compiles the Triton kernels (cached for later starts).
        with _stage(f"loading {_describe(args)} and warming it up", "model loaded and warmed up"):
            url = deploy(args, host, port, direct=direct)
        state["started"] = True
        _say(f"serving an OpenAI-compatible API at {url}/v1 (Ctrl-C to stop)")
        while not state["stop"]:
            time.sleep(STOP_POLL_S)
        return 0
    except Interrupted as why:
        print(f"\nmtpserve: {why} during start-up", file=sys.stderr, flush=True)
        return 130
    finally:
        # A second Ctrl-C while Serve drains must not cut the shutdown short with a traceback.
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        _say("shutting down")
        shutdown()
        _say("stopped")
