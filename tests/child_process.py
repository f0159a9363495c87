"""Python code run in a child interpreter of its own (a test that needs a Ray of its own while the
session's Ray runs in the test process), with this checkout importable and Ray's auth off."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(code: str, *argv: str, timeout_s: float) -> subprocess.CompletedProcess:
    """`python -c code argv...`; never attached to another Ray (RAY_ADDRESS unset) and with the
    host's GPUs unnamed (CUDA_VISIBLE_DEVICES unset), whatever the test process has."""
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def marked_line(done: subprocess.CompletedProcess, marker: str) -> str:
    """The one line of the child's stdout that starts with `marker `, without the marker; the
    child's stderr in the failure message if it exited badly or printed no such line."""
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [s for s in done.stdout.splitlines() if s.startswith(marker + " ")]
    assert len(lines) == 1, done.stdout[-2000:] + done.stderr[-3000:]
    return lines[0].removeprefix(marker + " ")
