"""Two Ray nodes on one machine (1 CPU each), one TP/EP rank per node, in an interpreter of its
own: `python -m tests.parallel.two_node_check < request.json` prints, as JSON, the live nodes,
the node of each rank and the greedy tokens of TP=2/EP=2 with MTP k = 2 and top-k sharing, by
`LLM` and by an AsyncEngine that asks for an engine process (as a Serve replica does).

Run by test_multinode.py in a fresh process, so that the cluster starts in a process that has
never run Ray (the test session's process has started and stopped Ray several times by then).
Request: {"model": dir, "prompts": [[ids]], "step_timeout_s": s}.
"""

from __future__ import annotations

import asyncio
import json
import sys


async def _generate(engine, prompt) -> list[int]:
    from tests.parallel.conftest import greedy_params

    async for out in engine.generate(prompt, greedy_params()):  # noqa: B007
        pass
    return out.token_ids


def main() -> int:
    request = json.load(sys.stdin)
    import ray
    from ray.cluster_utils import Cluster

    from cluster.async_engine import AsyncEngine
    from cluster.config import EngineConfig
    from cluster.llm import LLM
    from tests.parallel.conftest import greedy_params

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        engine_args = dict(
            tp_size=2,
            ep_size=2,
            num_draft_tokens=2,
            share_topk=True,
            dtype="float32",
            actor_num_cpus=1,
            placement_strategy="STRICT_SPREAD",
            step_timeout_s=request["step_timeout_s"],
        )
        llm = LLM(request["model"], **engine_args)
        try:
            workers = llm.engine.executor.workers
            result = {
                "alive_nodes": len([n for n in ray.nodes() if n["Alive"]]),
                "rank_nodes": ray.get([w.node_id.remote() for w in workers], timeout=60),
                "transport": llm.engine.executor.transport,
                "tokens": [o.token_ids for o in llm.generate(request["prompts"], greedy_params())],
            }
        finally:
            llm.engine.shutdown()
        # As a Serve replica runs it: an engine process wanted, but the rank off this node has
        # no socket to it, so the engine runs on a thread and steps the ranks by calls.
        engine = AsyncEngine(EngineConfig(model=request["model"], **engine_args), own_process=True)
        try:
            result["served_in_own_process"] = engine.own_process
            result["served_tokens"] = [
                asyncio.run(_generate(engine, prompt)) for prompt in request["prompts"]
            ]
        finally:
            asyncio.run(engine.shutdown())
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
