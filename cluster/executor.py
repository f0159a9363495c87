"""Executors run a step on every rank. The interface is five methods; two implementations:
in-process (TP=1, the worker lives in this process) and Ray (workers are actors)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

from cluster.config import EngineConfig
from workers.batch import StepFailure, StepInput, StepOutput

if TYPE_CHECKING:
    from workers.worker import WarmUp


class Executor(abc.ABC):
    num_kv_blocks: int
    has_mtp: bool
    # Whether the ranks launch the next step's decodes ahead (EngineConfig.overlap_steps, as
    # their device settled "auto"): the scheduler then keeps each request's lookahead slot.
    overlaps_steps: bool = False

    @abc.abstractmethod
    def execute(self, step: StepInput) -> StepOutput:
        """Run one step on every rank; rank 0's output. Raises WorkerError if a rank fails."""

    def warm_up(self, num_draft_tokens: int, share_topk: bool) -> WarmUp:
        """Capture every rank's CUDA graphs (compiling their kernels) before serving; rank 0's
        account of it. This default has nothing to warm (executors without graphs)."""
        from workers.worker import WarmUp

        return WarmUp(0, 0.0)

    @abc.abstractmethod
    def check_health(self) -> None:
        """Raise WorkerError unless every rank answers."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...


def worker_spec(config: EngineConfig):
    """The engine config (resolved: `cluster.config.resolve_config`) as one rank sees it (a
    workers.worker.WorkerSpec)."""
    from workers.worker import WorkerSpec

    return WorkerSpec(
        model=config.model,
        tp_size=config.tp_size,
        ep_size=config.ep_size,
        device=config.device,
        dtype=config.dtype,
        num_kv_blocks=config.num_kv_blocks,
        block_size_tokens=config.block_size_tokens,
        gpu_memory_utilization=config.gpu_memory_utilization,
        cpu_threads=config.cpu_threads,
        topk_src_rank=config.topk_src_rank,
        collective_timeout_s=config.step_timeout_s,
        cuda_graph_max_batch=config.cuda_graph_max_batch,
        cuda_graph_max_rows=config.cuda_graph_max_rows,
        max_seq_slots=config.max_seq_slots,
        max_num_seqs=config.max_num_seqs,
        indexer_numerics=config.indexer_numerics,
        kv_cache_dtype=config.kv_cache_dtype,
        overlap_steps=config.overlap_steps,
    )


class WorkerError(RuntimeError):
    """A rank died, hung past the step timeout, or raised.

    `step_raised`: the step's code raised on some rank and every rank has finished the step
    (none died or hangs), so the workers are fine and the step may be re-run without a request
    (`LLMEngine` isolates a failing request that way). False for anything else."""

    def __init__(self, message: str, step_raised: bool = False):
        super().__init__(message)
        self.step_raised = step_raised


def first_answer(answers: list):
    """Rank 0's answer once every rank has answered; a rank's StepFailure raises (with
    `step_raised`: every rank finished the step, so it can be re-run)."""
    failures = [out for out in answers if isinstance(out, StepFailure)]
    if failures:
        raise WorkerError(f"a worker raised: {failures[0].error}", step_raised=True)
    return answers[0]


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig):
        from workers.worker import Worker

        self.worker = Worker.from_spec(worker_spec(config))
        self.num_kv_blocks = self.worker.num_kv_blocks
        self.has_mtp = self.worker.has_mtp
        self.overlaps_steps = self.worker.runner.overlap

    def execute(self, step: StepInput) -> StepOutput:
        try:
            return self.worker.execute(step)
        except Exception as e:  # the engine turns this into per-request errors
            raise WorkerError(f"step failed: {type(e).__name__}: {e}", step_raised=True) from e

    def warm_up(self, num_draft_tokens: int, share_topk: bool) -> WarmUp:
        return self.worker.warm_up(num_draft_tokens, share_topk)

    def check_health(self) -> None:
        self.worker.ping()

    def shutdown(self) -> None:
        self.worker = None


def executor_kind(executor: str, tp_size: int) -> str:
    """`EngineConfig.executor` resolved: "inprocess" | "ray" | "package.module:Class"; "auto" is
    in-process at TP=1 and Ray above."""
    if executor == "auto":
        return "inprocess" if tp_size == 1 else "ray"
    return executor


def make_executor(config: EngineConfig) -> Executor:
    kind = executor_kind(config.executor, config.tp_size)
    if kind == "inprocess":
        if config.tp_size != 1:
            raise ValueError("the in-process executor runs TP=1 only; use executor='ray'")
        return InProcessExecutor(config)
    if kind == "ray":
        from cluster.ray_executor import RayExecutor

        return RayExecutor(config)
    if ":" in kind:  # "package.module:Class", an executor of one's own (tests script outputs)
        import importlib

        module_name, _, class_name = kind.partition(":")
        return getattr(importlib.import_module(module_name), class_name)(config)
    raise ValueError(f"unknown executor {kind!r}")
