"""Ray for the distributed tests: one local instance (num_cpus=2, like the CI box) shared by the
modules that need it, started once and stopped when the session ends. test_multinode.py's
two-node cluster runs in a process of its own and leaves this one alone."""

from __future__ import annotations

import os
import sys
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

# Greedy tokens at every parallel layout; some prompts are longer than index_topk=16, so the
# indexer really drops tokens (and the broadcast top-k really decides what is attended to).
PROMPT_LENS = [3, 41, 12, 27, 5, 33]
MAX_TOKENS = 16
# A TP=2 step on the tiny model takes ~20 ms; a loaded 2-core box can stall a rank for seconds.
STEP_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def ray_local():
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False)
    yield ray


def pytest_sessionfinish(session, exitstatus):
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def greedy_params():
    from cluster.sampling_params import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="session")
def tp1_tokens(tiny_model_dir, prompts) -> list[list[int]]:
    """The reference: greedy tokens at TP=1, in-process, without MTP."""
    from cluster.llm import LLM

    llm = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32")
    return [o.token_ids for o in llm.generate(prompts, greedy_params())]


def all_dead(ray, actors, within_s: float = 30.0) -> bool:
    """Whether every actor in `actors` stops answering within `within_s` (ray.kill returns
    before the actor is gone)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = 0
        for actor in actors:
            try:
                ray.get(actor.ping.remote(), timeout=5)
                alive += 1
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
        if not alive:
            return True
        time.sleep(0.2)
    return False
