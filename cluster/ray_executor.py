"""The Ray executor: one WorkerActor per rank, in one placement group, driven SPMD.

Start-up (each stage launched on every rank before any is awaited):
  placement group -> actors -> rank 0 opens the rendezvous store -> every rank joins the
  process group -> every rank loads its shard.
Each step sends the same StepInput to every rank and returns rank 0's StepOutput: one message
per step whatever the MTP draft length (a rank runs the verify and all its draft sub-steps in one
`execute`). Three transports (`EngineConfig.step_transport`):
  socket every rank on this process's node: a Unix socket to each rank, whose step loop
         (`WorkerActor.serve_steps`) blocks on it between steps (cluster.step_sockets).
  graph  a Ray Compiled Graph (`ray.dag`): the driver writes the step once into shared-memory
         channels that every rank's execution loop reads; rank 0's output comes back the same way.
  calls  one actor call per rank with the step inline in the call (no `ray.put`: a put plus the
         ranks fetching the object cost 3.5 ms per step against 1.25 ms inline, two CPU ranks).
Measured on the 2-core CPU box, an empty step's round trip to two ranks: 0.06 ms by socket,
0.18 ms by graph, 1.0 ms by calls (BENCHMARKS.md, session 32). The graph's readers poll their
channels, a core per rank while idle there; a socket's reader blocks. "auto" picks the socket
where every rank is on this node, else the graph on GPUs (cores to spare) and calls on CPU.
A rank that dies, raises, or hangs past `step_timeout_s` becomes a WorkerError; the engine then
fails its requests and can be rebuilt (`shutdown` kills the actors and frees the placement group).

`hand_off` gives the connected sockets to another process, which then steps the ranks (a Serve
replica's engine process: cluster/step_sockets.py); this executor keeps only the actors.

Inside a Serve replica that has a placement group, the ranks go into that group (bundles 1..N
when the replica reserved one per rank after its own), so they start and die with the replica.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from cluster.config import EngineConfig
from cluster.executor import Executor, WorkerError, first_answer, worker_spec
from workers.batch import StepInput, StepOutput

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # placement, actor start, rendezvous, and loading the shard
# The ranks run at the normal priority, not at Ray's worker niceness of 15: a rank's host work
# is every step's critical path (deploy.app.ENGINE_PRIORITY_ENV says more). An actor's
# runtime_env env_vars are merged into its parent's.
RANK_ENV_VARS = {"RAY_worker_niceness": "0"}
HEALTH_TIMEOUT_S = 10.0
HANDED_OFF = "handed off"  # RayExecutor.transport once another process steps the ranks


LOOPBACK = "127.0.0.1"
# Ray's gRPC servers (GCS, raylet, object manager, core workers, agents) listen on every
# interface whatever the node address (Ray 2.60, measured with `ss -ltnp`), so a local Ray
# cannot be bound to loopback; Ray's token auth is what keeps other hosts from running code
# here. Ray >= 2.59 turns it on for a new local cluster unless RAY_AUTH_MODE says otherwise
# (its token: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, made if missing), so a
# Ray that mtpserve starts leaves RAY_AUTH_MODE alone (the test suite sets "disabled").


# The GCS address of the Ray this process started itself (ensure_ray), if any: one node and no
# autoscaler, so a placement group bigger than the machine never becomes ready there and is
# refused at once.
_LOCAL_RAY: str | None = None


def ensure_ray(config: EngineConfig) -> None:
    """Connect this process to Ray if it is not yet: to the cluster RAY_ADDRESS names (what
    `ray job submit` sets in a job's driver, or a user who points at a cluster), else to a
    local Ray started here."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        # The cluster's resources are its own: Ray refuses num_cpus when connecting.
        ray.init(log_to_driver=True)
        logger.info("connected to the Ray cluster at %s", os.environ["RAY_ADDRESS"])
        return
    # The ranks plus room for the coordinator; a GPU box reports its GPUs itself.
    num_cpus = max(os.cpu_count() or 1, int(config.tp_size * config.actor_num_cpus) + 1)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    global _LOCAL_RAY
    _LOCAL_RAY = ray.get_runtime_context().gcs_address
    logger.info("started a local Ray with %d CPUs", num_cpus)


def resolve_step_transport(choice: str, device: str, ranks_on_this_node: bool) -> str:
    """-> "socket" | "graph" | "calls"; "auto" is the socket where every rank is on this
    process's node, else the graph on GPU ranks and calls on CPU ranks."""
    if choice not in ("auto", "socket", "graph", "calls"):
        raise ValueError(f"step_transport must be auto, socket, graph or calls, got {choice!r}")
    if choice == "socket" and not ranks_on_this_node:
        raise ValueError(
            "step_transport socket needs every rank on the coordinator's node; "
            "use graph or calls (or auto) for ranks on other nodes"
        )
    if choice == "auto":
        if ranks_on_this_node:
            return "socket"
        return "graph" if device == "cuda" else "calls"
    return choice


def _wants_gpu(config: EngineConfig) -> bool:
    if config.device == "cpu":
        return False
    if config.device == "cuda":
        return True
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from workers.step_ahead import overlap_on
        from workers.worker_actor import WorkerActor

        ensure_ray(config)
        self.config = config
        self.workers: list = []
        self._owned_pg = None
        num_gpus = 1 if _wants_gpu(config) else 0
        device = config.device if config.device != "auto" else ("cuda" if num_gpus else "cpu")
        pg, first_bundle = self._placement_group(ray, placement_group, num_gpus)
        spec = dataclasses.replace(worker_spec(config), device=device)
        self.overlaps_steps = overlap_on(spec.overlap_steps, device)
        actor_cls = ray.remote(WorkerActor)
        try:
            for rank in range(config.tp_size):
                bundle = first_bundle + rank if first_bundle is not None else -1
                self.workers.append(
                    actor_cls.options(
                        num_cpus=config.actor_num_cpus,
                        num_gpus=num_gpus,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=pg,
                            placement_group_bundle_index=bundle,
                            placement_group_capture_child_tasks=True,
                        ),
                        max_restarts=0,
                        max_concurrency=2,  # ping while a step runs
                        runtime_env={"env_vars": RANK_ENV_VARS},
                    ).remote(rank, spec)
                )
            address = self._get(self.workers[0].open_store.remote(), STARTUP_TIMEOUT_S)
            # All at once: init_process_group returns only when every rank has joined.
            self._get_all(
                [w.init_distributed.remote(address) for w in self.workers], STARTUP_TIMEOUT_S
            )
            loaded = self._get_all([w.load.remote() for w in self.workers], STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        # Every rank holds every block's slots (the latent cache is replicated across TP ranks):
        # the engine may use only what the smallest rank can hold.
        self.num_kv_blocks = min(n for n, _ in loaded)
        self.has_mtp = loaded[0][1]
        here = ray.get_runtime_context().get_node_id()
        nodes = self._get_all([w.node_id.remote() for w in self.workers], STARTUP_TIMEOUT_S)
        try:
            self.transport = resolve_step_transport(
                config.step_transport, device, all(node == here for node in nodes)
            )
        except ValueError as e:
            self.shutdown()
            raise WorkerError(str(e)) from None
        # Compiled, or connected, at the first step, which warm_up sends after its calls.
        self._graph = None
        self._sockets = None
        src = config.topk_src_rank
        logger.info(
            "Ray executor: tp=%d ep=%d, %s, %d KV blocks, top-k from %s, steps by %s",
            config.tp_size,
            config.ep_size,
            device,
            self.num_kv_blocks,
            "every rank" if src is None else f"rank {src}",
            self.transport,
        )

    def _compile_graph(self):
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as step:
            dag = MultiOutputNode([w.answer.bind(step) for w in self.workers])
        return dag.experimental_compile(_submit_timeout=self.config.step_timeout_s)

    def _placement_group(self, ray, placement_group, num_gpus: int):
        """-> (placement group, bundle index of rank 0 or None for "any bundle")."""
        current = ray.util.get_current_placement_group()
        if current is not None:
            # A Serve replica's group: bundle 0 is the replica; one bundle per rank after it.
            per_rank = len(current.bundle_specs) >= self.config.tp_size + 1
            return current, (1 if per_rank else None)
        bundle = {"CPU": self.config.actor_num_cpus}
        if num_gpus:
            bundle["GPU"] = num_gpus
        if _LOCAL_RAY is not None and _LOCAL_RAY == ray.get_runtime_context().gcs_address:
            have = ray.cluster_resources()
            need = {k: v * self.config.tp_size for k, v in bundle.items()}
            if any(v > have.get(k, 0.0) for k, v in need.items()):
                raise WorkerError(
                    f"{self.config.tp_size} ranks need {need} and this machine has "
                    f"{ {k: have.get(k, 0.0) for k in need} }: use fewer ranks or a smaller "
                    "actor_num_cpus, or run on a Ray cluster that has them (RAY_ADDRESS)"
                )
        pg = placement_group(
            [dict(bundle) for _ in range(self.config.tp_size)],
            strategy=self.config.placement_strategy,
        )
        self._owned_pg = pg
        try:
            ray.get(pg.ready(), timeout=STARTUP_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(
                f"placement group {[bundle] * self.config.tp_size} "
                f"({self.config.placement_strategy}) not placeable within {STARTUP_TIMEOUT_S}s; "
                f"cluster resources: {ray.cluster_resources()}"
            ) from None
        return pg, 0

    # --- waiting on ranks -----------------------------------------------------------------------

    @staticmethod
    def _get(ref, timeout_s: float):
        return RayExecutor._get_all([ref], timeout_s)[0]

    @staticmethod
    def _get_all(refs: list, timeout_s: float) -> list:
        """Results in rank order. Fails as soon as any rank fails (not when the last rank's
        collective times out), or when the deadline passes."""
        import ray

        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(remaining, 0))
            if not ready:
                raise WorkerError(f"{len(pending)} rank(s) did not answer within {timeout_s:.0f}s")
            try:
                ray.get(ready)
            except ray.exceptions.RayActorError as e:
                raise WorkerError(f"a worker actor died: {e}") from e
            except ray.exceptions.RayTaskError as e:
                raise WorkerError(f"a worker raised: {e}") from e
        return ray.get(refs)

    # --- the Executor interface -----------------------------------------------------------------

    def execute(self, step: StepInput) -> StepOutput:
        if not self.workers:
            raise WorkerError("the executor is shut down")
        if self.transport == "socket":
            return self._execute_sockets(step)
        if self.transport == HANDED_OFF:
            raise WorkerError("these ranks are stepped by another process (hand_off)")
        if self.transport == "graph":
            if self._graph is None:
                try:
                    self._graph = self._compile_graph()
                except Exception as e:
                    raise WorkerError(f"compiling the step graph failed: {e}") from e
            return self._execute_graph(step)
        refs = [w.execute.remote(step) for w in self.workers]
        deadline = time.monotonic() + self.config.step_timeout_s
        try:
            return self._get_all(refs, self.config.step_timeout_s)[0]
        except WorkerError as exc:
            if self._all_raised_or_done(refs, deadline):
                raise WorkerError(str(exc), step_raised=True) from exc
            raise

    def _all_raised_or_done(self, refs: list, deadline: float) -> bool:
        """After a failed step: True when every rank finished it (returned or raised; none
        died) before the deadline, so the ranks are idle and the step can be re-run."""
        import ray

        _, pending = ray.wait(
            refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic())
        )
        if pending:
            return False
        for ref in refs:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                return False
            except ray.exceptions.RayTaskError:
                pass
        return True

    def _execute_sockets(self, step: StepInput) -> StepOutput:
        from cluster.step_sockets import StepSockets

        if self._sockets is None:
            self._sockets = StepSockets.connect(self.workers, STARTUP_TIMEOUT_S)
        return first_answer(self._sockets.execute(step, self.config.step_timeout_s))

    def hand_off(self):
        """The ranks' connected step sockets for another process to step them (a
        cluster.step_sockets.LoadedRanks; the transport must be the socket). This executor then
        steps no more; `shutdown` still kills the ranks."""
        from cluster.step_sockets import LoadedRanks, StepSockets

        if self.transport != "socket":
            raise ValueError(f"ranks stepped by {self.transport} cannot be handed off")
        sockets, self._sockets = self._sockets, None
        if sockets is None:
            sockets = StepSockets.connect(self.workers, STARTUP_TIMEOUT_S)
        self.transport = HANDED_OFF
        return LoadedRanks(
            tuple(sockets.detach()), self.num_kv_blocks, self.has_mtp, self.overlaps_steps
        )

    def _execute_graph(self, step: StepInput) -> StepOutput:
        """The ranks answer a failed step with a StepFailure rather than raising, so the graph's
        result arrives only once every rank has finished the step: a failure in it is then one
        the step can be re-run after (`step_raised`), like a raise on every rank by calls."""
        import ray

        try:
            outputs = ray.get(self._graph.execute(step), timeout=self.config.step_timeout_s)
        except ray.exceptions.RayChannelTimeoutError as e:
            raise WorkerError(
                f"a rank did not answer within {self.config.step_timeout_s:.0f}s: {e}"
            ) from e
        except ray.exceptions.RayActorError as e:
            raise WorkerError(f"a worker actor died: {e}") from e
        except ray.exceptions.RayTaskError as e:
            raise WorkerError(f"a worker raised: {e}") from e
        except ray.exceptions.RayChannelError as e:  # a reader or writer went away
            raise WorkerError(f"the step channel failed: {e}") from e
        return first_answer(outputs)

    def warm_up(self, num_draft_tokens: int, share_topk: bool):
        """Every rank at once (a capture's collectives need them all); then one empty step sets
        the transport up (the ranks' sockets connected, or the step graph compiled), so the
        first request does not pay for that either."""
        refs = [w.warm_up.remote(num_draft_tokens, share_topk) for w in self.workers]
        result = self._get_all(refs, STARTUP_TIMEOUT_S)[0]
        self.execute(StepInput([]))
        return result

    def check_health(self) -> None:
        if not self.workers:
            raise WorkerError("the executor is shut down")
        self._get_all([w.ping.remote() for w in self.workers], HEALTH_TIMEOUT_S)

    def shutdown(self) -> None:
        import ray

        # Killing (not a graceful call): a rank may be stuck in a collective with a dead peer.
        # The compiled graph's loops end with their actors; its teardown then finds them gone.
        graph, self._graph = getattr(self, "_graph", None), None
        sockets, self._sockets = getattr(self, "_sockets", None), None
        if sockets is not None:
            sockets.close()  # the ranks' loops return (a rank stuck in a step is killed below)
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                logger.debug("killing a worker actor", exc_info=True)
        self.workers = []
        if graph is not None:
            try:
                graph.teardown()
            except Exception:
                logger.debug("tearing down the step graph", exc_info=True)
        if self._owned_pg is not None:
            try:
                ray.util.remove_placement_group(self._owned_pg)
            except Exception:
                logger.debug("removing the placement group", exc_info=True)
            self._owned_pg = None
