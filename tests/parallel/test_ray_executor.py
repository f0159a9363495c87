"""The Ray executor inside a Serve-replica-like actor: the ranks go into the replica's own
placement group (bundles 1..N after the replica's bundle 0) and die with the replica."""

from __future__ import annotations

import sys

import pytest

from tests.parallel.conftest import STEP_TIMEOUT_S, all_dead

pytestmark = pytest.mark.timeout(240)


class ReplicaStandIn:
    """What a Serve replica with placement_group_bundles does: owns an engine in-process."""

    def start(self, model_dir: str) -> dict:
        import ray

        from cluster.llm import LLM

        self.llm = LLM(
            model_dir,
            tp_size=2,
            ep_size=2,
            num_draft_tokens=2,
            dtype="float32",
            actor_num_cpus=0.5,
            step_timeout_s=STEP_TIMEOUT_S,
        )
        executor = self.llm.engine.executor
        workers = executor.workers
        pg = ray.util.get_current_placement_group()
        return {
            "own_pg_created": executor._owned_pg is not None,
            "replica_pg": pg.id.hex() if pg else None,
            "worker_handles": workers,
        }

    def generate(self, prompts) -> list[list[int]]:
        from tests.parallel.conftest import greedy_params as params

        return [o.token_ids for o in self.llm.generate(prompts, params())]


def _placement_group_id(actor) -> str | None:
    import ray

    pg = ray.util.get_current_placement_group()
    return pg.id.hex() if pg else None


def test_ranks_live_in_the_replicas_placement_group(ray_local, tiny_model_dir, prompts, tp1_tokens):
    ray = ray_local
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    pg = placement_group([{"CPU": 0.2}, {"CPU": 0.5}, {"CPU": 0.5}], strategy="STRICT_PACK")
    ray.get(pg.ready(), timeout=60)
    replica = (
        ray.remote(ReplicaStandIn)
        .options(
            num_cpus=0.2,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg,
                placement_group_bundle_index=0,
                placement_group_capture_child_tasks=True,
            ),
        )
        .remote()
    )
    try:
        info = ray.get(replica.start.remote(tiny_model_dir), timeout=120)
        assert not info["own_pg_created"]
        assert info["replica_pg"] == pg.id.hex()
        workers = info["worker_handles"]
        worker_pgs = ray.get([w.run.remote(_placement_group_id) for w in workers], timeout=60)
        assert worker_pgs == [pg.id.hex()] * 2
        assert ray.get(replica.generate.remote(prompts[:3]), timeout=120) == tp1_tokens[:3]

        ray.kill(replica)  # the replica goes: its workers (it owns them) go with it
        assert all_dead(ray, workers, within_s=60)
    finally:
        ray.kill(replica)
        remove_placement_group(pg)


REFUSED = """
import sys, time
from cluster.executor import WorkerError
from cluster.llm import LLM
started = time.monotonic()
try:
    LLM(sys.argv[1], tp_size=2, device="cuda", num_draft_tokens=0)
except WorkerError as exc:
    print("REFUSED", round(time.monotonic() - started, 1), exc)
"""


def test_ranks_a_local_ray_cannot_place_are_refused_at_once(tiny_model_dir):
    """A Ray this process starts has one node and no autoscaler: two GPU ranks on a machine
    without two GPUs (here: none) are an error that says so at once, not after the 300 s
    placement wait. In a child process: no Ray of the test session's in it."""
    from tests.child_process import marked_line, run_child

    line = marked_line(run_child(REFUSED, tiny_model_dir, timeout_s=180), "REFUSED")
    seconds = float(line.split()[0])
    assert seconds < 60, line
    assert "2 ranks need" in line and "'GPU': 2" in line and "'GPU': 0.0" in line, line
