"""Two Ray nodes on one machine (1 CPU each), one rank per node: TP=2/EP=2 gives TP=1's tokens.

This module runs its own Ray cluster: it shuts the shared local Ray down first, and shuts its
cluster down at the end (the next module's `ray_local` starts the local one again).
"""

from __future__ import annotations

import pytest

from tests.parallel.conftest import STEP_TIMEOUT_S, greedy_params

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def two_node_ray():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        yield ray
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_tp2_ep2_one_rank_per_node(two_node_ray, tiny_model_dir, prompts, tp1_tokens):
    from cluster.llm import LLM

    ray = two_node_ray
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    llm = LLM(
        tiny_model_dir,
        tp_size=2,
        ep_size=2,
        num_draft_tokens=2,
        share_topk=True,
        dtype="float32",
        actor_num_cpus=1,
        placement_strategy="STRICT_SPREAD",
        step_timeout_s=STEP_TIMEOUT_S,
    )
    try:
        workers = llm.engine.executor.workers
        node_ids = ray.get([w.node_id.remote() for w in workers], timeout=60)
        assert len(set(node_ids)) == 2  # the group really spans the two nodes
        outs = llm.generate(prompts, greedy_params())
        assert [o.token_ids for o in outs] == tp1_tokens
    finally:
        llm.engine.shutdown()
