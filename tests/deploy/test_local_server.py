"""`deploy.local_server.shutdown` on a Ray where nothing was deployed (a Ctrl-C while the engine
loads, or a benchmark that ran only the offline engine): it stops Ray and raises nothing. In a
child process: the session's Ray (tests/deploy/conftest.py) must not be shut down here. And
`spare_ports`: the ports picked for servers that bind them later."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.local_server import SPARE_PORTS, spare_ports

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = """
import ray
from deploy.local_server import shutdown
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
shutdown()
print("ray up after shutdown:", ray.is_initialized())
"""


def test_shutdown_without_a_deployment_stops_ray_quietly():
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ray up after shutdown: False" in done.stdout


def test_spare_ports_are_distinct_free_and_outside_the_ephemeral_range():
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    low, high = (int(v) for v in ephemeral)
    ports = spare_ports("127.0.0.1", 5)
    assert len(set(ports)) == 5 and all(p in SPARE_PORTS for p in ports)
    if SPARE_PORTS.stop <= low or SPARE_PORTS.start > high:  # the host's ephemeral range
        assert not any(low <= p <= high for p in ports)
    for port in ports:  # free now
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_spare_ports_skip_a_taken_port(monkeypatch):
    """With the range's first pick taken, the next free one is chosen."""
    import deploy.local_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        monkeypatch.setattr(deploy.local_server, "SPARE_PORTS", range(port, port + 50))
        monkeypatch.setattr(deploy.local_server.random, "randrange", lambda n: 0)
        [got] = spare_ports("127.0.0.1")
        assert port < got < port + 50
    monkeypatch.setattr(deploy.local_server, "SPARE_PORTS", range(port, port))
    with pytest.raises(OSError, match="no 1 free ports"):
        spare_ports("127.0.0.1")
