"""Two Ray nodes on one machine (1 CPU each), one rank per node: TP=2/EP=2 gives TP=1's tokens.

The cluster runs in a process of its own (`tests/parallel/two_node_check.py`): started inside
this test session's process, after the Rays of earlier modules had started and stopped there,
its start-up timed out now and then on the 2-core CI box (the head's GCS not answering within
Ray's 30 s). A start-up that still times out is retried once, in a new process; any other
failure, and any difference in the tokens, fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel.conftest import STEP_TIMEOUT_S

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
START_UP_TIMEOUT = "timed out during startup"  # ray._private.node's message


def _two_node_run(request: dict) -> dict:
    def run() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "tests.parallel.two_node_check"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            timeout=280,
        )

    done = run()
    if done.returncode != 0 and START_UP_TIMEOUT in done.stderr:
        done = run()  # Ray's start-up only, once
    if done.returncode != 0:
        pytest.fail(f"the two-node run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_tp2_ep2_one_rank_per_node(tiny_model_dir, prompts, tp1_tokens):
    result = _two_node_run(
        {"model": tiny_model_dir, "prompts": prompts, "step_timeout_s": STEP_TIMEOUT_S}
    )
    assert result["alive_nodes"] == 2
    assert len(set(result["rank_nodes"])) == 2  # the group really spans the two nodes
    assert result["transport"] == "calls"  # auto: a rank off the coordinator's node, on CPU
    assert result["tokens"] == tp1_tokens
    assert result["served_in_own_process"] is False  # no socket to a rank on another node
    assert result["served_tokens"] == tp1_tokens
