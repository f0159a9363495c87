"""Fixtures (the tiny checkpoint comes from tests/conftest.py): one local Ray (2 CPUs),
one Serve app over HTTP.

Ray starts once for this package (`ray.init` ~6 s on the 2-core CI box, Serve app up ~4 s later)
and stops after its last test, so the Serve app's processes (an engine process among them) do not
load the box while later packages start Ray clusters of their own;
every actor and replica asks for 0.1 CPU so engine + ingress + a second app fit in 2 cores.
`address="local"` always starts a fresh cluster, never attaching to another session's Ray.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest

SMALL_CPU = 0.1
APP_NAME = "mtpserve"


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports, as `mtpserve serve` picks its proxy's (ports taken one at a time
    can repeat, and Ray refuses two components on one port)."""
    from deploy.local_server import spare_ports

    return spare_ports("127.0.0.1", n)


def app_args(model_dir: str, **engine) -> dict:
    """Build args for a CPU-only test deployment of the tiny model, MTP off unless asked."""
    return {
        "model": model_dir,
        "num_draft_tokens": engine.pop("num_draft_tokens", 0),
        "device": "cpu",
        "replica_num_cpus": SMALL_CPU,
        "actor_num_cpus": SMALL_CPU,
        "ingress_num_cpus": SMALL_CPU,
        "gpus_per_worker": 0,
        "engine": engine,
    }


@pytest.fixture(scope="package")
def ray_session():
    import ray
    from ray import serve

    from deploy.app import APP_ENV_VARS

    saved = {name: os.environ.get(name) for name in APP_ENV_VARS}
    os.environ.update(APP_ENV_VARS)  # as `mtpserve serve` starts Ray
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="package")
def serve_url(ray_session, tiny_model_dir) -> str:
    """The main app at `/`: the tiny model, no MTP drafts."""
    from ray import serve

    from deploy.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(app_args(tiny_model_dir)), name=APP_NAME, route_prefix="/")
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="package")
def model_server(serve_url):
    from ray import serve

    from deploy.app import MODEL_SERVER_NAME

    return serve.get_deployment_handle(MODEL_SERVER_NAME, app_name=APP_NAME)


@pytest.fixture(scope="package")
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


BIN_DIR = Path(sys.executable).parent
MTPSERVE = str(BIN_DIR / "mtpserve")


def processes_under(root: str) -> list[tuple[int, str]]:
    """(pid, command line) of live processes whose command line names `root` (a Ray temp dir:
    every process of a Ray started under it carries the path)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if root in cmdline and state != "Z":
            found.append((int(proc.name), cmdline[:200]))
    return found


def kill_processes_under(root: str) -> None:
    for pid, _ in processes_under(root):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class RayHead:
    """A `ray start --head --block` process of our own (own temp dir, every port chosen free)."""

    dashboard_url: str  # also the job server and Serve's REST API (`serve deploy --address`)
    gcs_address: str
    temp_dir: str
    env: dict[str, str]  # for `ray`/`serve` commands aimed at this head
    process: subprocess.Popen
    log_path: Path


@contextlib.contextmanager
def ray_head(
    num_cpus: float,
    extra_args: tuple[str, ...] = (),
    extra_env: dict | None = None,
    gcs_port: int | None = None,
    timeout_s: float = 120.0,
    stop_timeout_s: float = 10.0,
):
    """Start a fresh single-node Ray head; stop it by signalling its process group, then kill
    whatever is left under its temp dir; never `ray stop`, which would kill every Ray on the
    machine (the other tests' and other engineers'). `ray start --block` often takes over 30 s
    to finish on SIGTERM on the 2-core box, hence SIGKILL after `stop_timeout_s`."""
    temp_dir = tempfile.mkdtemp(prefix="rayhead", dir="/tmp")  # short: unix socket path limit
    ports = iter([p for p in free_ports(10) if p != gcs_port][:9])
    gcs_port, dashboard_port = gcs_port or next(ports), next(ports)
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        **(extra_env or {}),
        "PATH": f"{BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("RAY_ADDRESS", None)
    command = [
        str(BIN_DIR / "ray"),
        "start",
        "--head",
        "--block",
        "--disable-usage-stats",
        "--num-cpus",
        str(num_cpus),
        "--temp-dir",
        temp_dir,
        "--port",
        str(gcs_port),
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(dashboard_port),
        "--include-dashboard",
        "true",
        "--dashboard-agent-listen-port",
        str(next(ports)),
        "--dashboard-agent-grpc-port",
        str(next(ports)),
        "--metrics-export-port",
        str(next(ports)),
        "--runtime-env-agent-port",
        str(next(ports)),
        "--node-manager-port",
        str(next(ports)),
        "--object-manager-port",
        str(next(ports)),
        "--ray-client-server-port",
        str(next(ports)),
        *extra_args,
    ]
    log_path = Path(temp_dir) / "ray-start.log"
    log = open(log_path, "w")  # noqa: SIM115 - the head writes to it until the finally
    process = subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    import httpx

    dashboard_url = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert process.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{dashboard_url}/api/version", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "ray head did not come up"
            time.sleep(1)
        from ray._private.services import get_node_ip_address

        gcs_ip = get_node_ip_address()
        yield RayHead(dashboard_url, f"{gcs_ip}:{gcs_port}", temp_dir, env, process, log_path)
    finally:
        for sig, wait_s in ((signal.SIGTERM, stop_timeout_s), (signal.SIGKILL, 10)):
            try:
                os.killpg(process.pid, sig)
                process.wait(timeout=wait_s)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        kill_processes_under(temp_dir)
        log.close()


@pytest.fixture(scope="session")
def offline_llm(tiny_model_dir):
    """The reference the served paths must match: the offline engine on the same checkpoint."""
    from cluster.llm import LLM

    return LLM(tiny_model_dir, num_draft_tokens=0, device="cpu")
