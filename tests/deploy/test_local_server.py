"""`deploy.local_server.shutdown` on a Ray where nothing was deployed (a Ctrl-C while the engine
loads, or a benchmark that ran only the offline engine): it stops Ray and raises nothing. In a
child process: the session's Ray (tests/deploy/conftest.py) must not be shut down here."""

from __future__ import annotations

import os
import subprocess
import sys

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
