"""One rank: its device, its process groups, its shard of the model, its runner.

The same class runs in-process (TP=1) and inside a Ray actor (workers.worker_actor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass

import torch

from kernels.ops import w8a8_warm_up_rows, warm_up_eager_kernels
from kernels.platform import (
    ensure_triton_cache_dir,
    stop_watching_late_compiles,
    watch_late_compiles,
)
from workers.batch import SamplingSpec, SeqWork, StepInput, StepOutput
from workers.kv_cache import CacheFormat, cache_bytes_per_block, max_blocks_per_seq
from workers.model import Experts, Gate, Indexer
from workers.model_runner import ModelRunner
from workers.step_ahead import overlap_on

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BLOCKS = 512  # 32Ki token slots: plenty for the tiny models served on CPU


def resolve_device(device: str, local_rank: int = 0) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


@dataclass(frozen=True)
class WorkerSpec:
    """What a rank needs to start; built by the executors from the engine config."""

    model: str  # checkpoint directory
    tp_size: int
    ep_size: int
    device: str  # "auto" | "cpu" | "cuda"
    dtype: str
    num_kv_blocks: int | None
    block_size_tokens: int
    gpu_memory_utilization: float
    cpu_threads: int | None
    topk_src_rank: int | None  # see workers.model.Indexer.src_tp_rank
    collective_timeout_s: float  # every collective of the group; a hung peer becomes an error
    cuda_graph_max_batch: int = 0  # 0: eager decode steps
    cuda_graph_max_rows: int = 0  # q = 1 graphs' rows, for steps that prefill (>= max batch)
    # KV slots one sequence may own: the context plus the MTP lookahead (block-table width)
    max_seq_slots: int = 8192
    max_num_seqs: int = 64
    indexer_numerics: str = "exact"
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "fp8" (the MLA latent cache)
    overlap_steps: str = "off"  # cluster.config.EngineConfig.overlap_steps


def bare_worker_spec(tp_size: int, **changes) -> WorkerSpec:
    """The spec of a CPU rank that loads no model (a WorkerActor whose worker a test or a
    benchmark sets itself): it still forms the process group and answers the executor's calls."""
    spec = WorkerSpec(
        model="",
        tp_size=tp_size,
        ep_size=1,
        device="cpu",
        dtype="float32",
        num_kv_blocks=None,
        block_size_tokens=64,
        gpu_memory_utilization=0.0,
        cpu_threads=1,
        topk_src_rank=None,
        collective_timeout_s=60.0,
    )
    return dataclasses.replace(spec, **changes)


def warm_up_prefill_lengths(
    block_size_tokens: int, on_gpu: bool, max_prompt_tokens: int
) -> tuple[int, ...]:
    """Prompt lengths of the warm-up's dummy prefills. Everywhere 16 and 17 tokens (on CPU that
    builds the first shapes' matmul primitives). On a GPU every Triton variant the eager path can
    pick must compile here, not in a served step (measured on the H200 before this: steps of 0.3
    to 3.4 s at 128 concurrent, one per kernel variant first met): Triton specializes integer
    arguments (16 or 17 tokens; a block table 1 block wide, 2 blocks, 16 blocks: strides == 1,
    neither, divisible by 16) and the launchers pick tiles by rows (the grouped MoE's prefill
    tiles past 256 token-expert pairs, the FP8 linears' by row count up to 2048).
    The lengths are capped at `max_prompt_tokens` (what the block tables leave room for, a
    sampled token and the drafts after it): a short context then warms its longest prompt."""
    lengths = (16, 17)
    if on_gpu:
        lengths += (block_size_tokens + 17, 16 * block_size_tokens)
    return tuple(n for n in dict.fromkeys(min(n, max_prompt_tokens) for n in lengths) if n >= 1)


WARM_UP_REQUEST_ID = "__warm_up__"
# The warm-up's decode steps sample (seeded, with top-p): the batched sampler's path and what
# it launches outside any graph (its noise, a request's own generator) then load before the
# first sampling request, as the greedy path does in the prefill before them.
WARM_UP_SAMPLING = SamplingSpec(temperature=1.0, top_p=0.9, seed=0)


@dataclass(frozen=True)
class WarmUp:
    """What `Worker.warm_up` did on one rank."""

    num_graphs: int
    seconds: float


def warm_up_keys(
    buckets: list[int],
    num_draft_tokens: int,
    share_topk: bool,
    with_proposals: bool,
    row_buckets: list[int] | None = None,
) -> list[tuple[str, tuple]]:
    """The graphs to capture, in the order every rank captures them: per batch bucket, the
    decode step at 1 + k tokens per sequence (k = 0: plain decode; k > 0: a verify) and, with
    MTP, the proposal after it (keys of DecodeGraphs and ProposeGraphs); then per row bucket
    the q = 1 graph not captured yet (steps that prefill replay them, their tokens as rows)
    and, with MTP, the proposal after such a step as rows (`ProposeGraphs.run_rows`). Other
    token counts (a verify whose drafts were cut near max_tokens) stay captured on first
    use."""
    keys: list[tuple[str, tuple]] = []
    for batch in buckets:
        keys.append(("decode", (batch, 1 + num_draft_tokens)))
        if num_draft_tokens and with_proposals:
            keys.append(("propose", (batch, 1 + num_draft_tokens, num_draft_tokens, share_topk)))
    for rows in row_buckets or []:
        if ("decode", (rows, 1)) not in keys:
            keys.append(("decode", (rows, 1)))
        if num_draft_tokens and with_proposals:
            keys.append(("propose_rows", (rows, num_draft_tokens, share_topk)))
    return keys


class Worker:
    def __init__(
        self,
        model_dir: str,
        device: str = "auto",
        dtype: str = "auto",
        num_kv_blocks: int | None = None,
        block_size_tokens: int = 64,
        enable_mtp: bool = True,
        gpu_memory_utilization: float = 0.85,
        local_rank: int = 0,
        cpu_threads: int | None = None,
        topk_src_rank: int | None = None,
        cuda_graph_max_batch: int = 0,
        max_seq_slots: int = 8192,
        max_num_seqs: int = 64,
        cuda_graph_max_rows: int = 0,
        indexer_numerics: str = "exact",
        kv_cache_dtype: str = "auto",
        overlap_steps: str = "off",
    ):
        from workers.loader import load_model

        ensure_triton_cache_dir()  # before the first kernel compiles
        self.device = resolve_device(device, local_rank)
        # Measured on a 2-core box under load: a 10x64 @ 64x64 matmul took 0.9 ms with 2 intra-op
        # threads and 4 us with 1 (OpenMP threads fighting the other processes for the cores).
        torch.set_num_threads(cpu_threads or max(1, min(8, (os.cpu_count() or 2) // 2)))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model, self.config = load_model(model_dir, self.dtype, self.device, enable_mtp)
        self.model.set_topk_source(topk_src_rank)
        self.model.set_indexer_numerics(indexer_numerics)
        self.cache_format = CacheFormat.of(kv_cache_dtype, indexer_numerics)
        if num_kv_blocks is None:
            num_kv_blocks = self._kv_blocks_from_memory(
                block_size_tokens,
                gpu_memory_utilization,
                max_num_seqs,
                max_seq_slots,
            )
        self.num_kv_blocks = num_kv_blocks
        self.max_seq_slots = max_seq_slots
        self.late_compiles = None  # kernels.platform.LateCompileLog once warm (GPU)
        self.runner = ModelRunner(
            self.model,
            num_kv_blocks,
            block_size_tokens,
            self.device,
            cuda_graph_max_batch,
            max_seq_slots,
            self.cache_format,
            cuda_graph_max_rows,
            overlap=overlap_on(overlap_steps, self.device.type),
        )

    @classmethod
    def from_spec(cls, spec: WorkerSpec) -> Worker:
        return cls(
            spec.model,
            spec.device,
            spec.dtype,
            spec.num_kv_blocks,
            spec.block_size_tokens,
            enable_mtp=True,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            cpu_threads=spec.cpu_threads,
            topk_src_rank=spec.topk_src_rank,
            cuda_graph_max_batch=spec.cuda_graph_max_batch,
            cuda_graph_max_rows=spec.cuda_graph_max_rows,
            max_seq_slots=spec.max_seq_slots,
            max_num_seqs=spec.max_num_seqs,
            indexer_numerics=spec.indexer_numerics,
            kv_cache_dtype=spec.kv_cache_dtype,
            overlap_steps=spec.overlap_steps,
        )

    @property
    def has_mtp(self) -> bool:
        return self.model.mtp is not None

    def _kv_blocks_from_memory(
        self,
        block_size_tokens: int,
        utilization: float,
        max_num_seqs: int,
        max_seq_slots: int,
    ) -> int:
        """Blocks for max_num_seqs full-length sequences, or what memory allows if less (on
        CPU, CPU_DEFAULT_KV_BLOCKS). The engine lowers a context that does not fit the pool
        (cluster.config.fit_context), so memory bounds the pool, not the context."""
        per_seq = max_blocks_per_seq(max_seq_slots, block_size_tokens)
        wanted = max_num_seqs * per_seq + 1
        floor = 2  # the null block and one more
        if self.device.type != "cuda":
            return max(min(wanted, CPU_DEFAULT_KV_BLOCKS), floor)
        free, total = torch.cuda.mem_get_info(self.device)
        # Leave room for activations and graphs: utilization of total minus what is in use.
        budget = max(0, int(total * utilization) - (total - free))
        per_block = cache_bytes_per_block(
            self.config, block_size_tokens, self.dtype, self.has_mtp, self.cache_format
        )
        blocks = max(min(budget // per_block, wanted), floor)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB; GPU free %.1f of %.1f GiB)",
            blocks,
            block_size_tokens,
            blocks * per_block / 2**30,
            free / 2**30,
            total / 2**30,
        )
        return int(blocks)

    def execute(self, step: StepInput) -> StepOutput:
        """Run one step. If it raises, the per-request state of its requests (seeded random
        streams, pending hidden states) is put back as it was before, and state made by this step
        is dropped: the engine may re-run the step without a failing request, and the others
        then compute and draw exactly what they would have."""
        saved = self.runner.checkpoint(step)
        try:
            return self.runner.execute(step)
        except BaseException:
            self.runner.restore(step, saved)
            raise

    def warm_up(self, num_draft_tokens: int, share_topk: bool) -> WarmUp:
        """Compile and capture now, before the engine reports ready, what the first requests
        would otherwise pay for: a CUDA graph of the decode step for every batch bucket of the
        graph table, of the MTP proposal after a verify and of the batched sampler for every
        row bucket (Triton compiles each kernel variant while the graph warms it up,
        `DecodeGraphs.capture_graph`; eager runners, CPU and `enforce_eager`, have nothing to
        capture), then a few dummy steps of the eager path (`_warm_up_prefill`). Every rank
        calls this at once with the same arguments: a capture runs the forward, whose
        collectives need every rank."""
        started = time.perf_counter()
        stop_watching_late_compiles()  # this warm-up's compiles are not another engine's late ones
        graphs = self.runner.graphs
        propose = self.runner.proposer.graphs if self.runner.proposer is not None else None
        keys = warm_up_keys(
            graphs.buckets if graphs is not None else [],
            num_draft_tokens if self.has_mtp else 0,
            share_topk,
            propose is not None,
            graphs.row_buckets if graphs is not None else [],
        )
        sampler = self.runner.sampler_graphs
        sampler_keys = sampler.keys() if sampler is not None else []
        with graphs.shared_pool() if graphs is not None else contextlib.nullcontext():
            for kind, key in keys:
                if kind == "decode" and key not in graphs.graphs:
                    graphs.capture(*key)
                elif kind == "propose" and key not in propose.graphs:
                    propose.capture(*key)
                elif kind == "propose_rows" and key not in propose.row_graphs:
                    propose.capture_rows(*key)
            for key in sampler_keys:  # no collectives: any rank; last (`shared_pool`)
                if key not in sampler.graphs:
                    sampler.capture(*key)
        self._warm_up_prefill(num_draft_tokens if self.has_mtp else 0, share_topk)
        modules = list(self.model.modules())
        experts = next((m for m in modules if isinstance(m, Experts)), None)
        fp32_weights = [m.weight for m in modules if isinstance(m, Gate)]
        fp32_weights += [m.weights_proj.weight for m in modules if isinstance(m, Indexer)]
        warm_up_eager_kernels(
            self.device,
            self.dtype,
            self.max_seq_slots,
            self.config.index_topk,
            experts.num_local if experts is not None else 0,
            sorted({tuple(w.shape) for w in fp32_weights}),
        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.late_compiles = watch_late_compiles()
        return WarmUp(len(keys) + len(sampler_keys), time.perf_counter() - started)

    def _warm_up_prefill(self, num_draft_tokens: int, share_topk: bool) -> None:
        """Prefill one dummy prompt of each `warm_up_prefill_lengths` length (greedy) and decode
        one token after it (sampled; with MTP: a verify step, and a proposal after each), so
        that the first request does not compile or load the eager path's kernels (GPU) or
        build the matmul primitives of its shapes (CPU). Its KV goes to blocks after the null
        block that no request holds yet; the runner then forgets the dummy request. The
        prefills run eagerly even where a prefill step could replay the decode graph
        (`ModelRunner.prefill_in_graphs`): a chunk past the graphs' largest bucket still runs
        the eager path. Where prompt-only steps take the w8a8 kernels (an FP8 model,
        `ModelRunner.w8a8_prompt_rows`), one prompt per w8a8 row bucket first
        (`kernels.ops.w8a8_warm_up_rows`)."""
        block_size = self.runner.block_size
        table_slots = max_blocks_per_seq(self.max_seq_slots, block_size) * block_size
        max_prompt = table_slots - 1 - num_draft_tokens
        on_gpu = self.device.type == "cuda"
        lengths = warm_up_prefill_lengths(block_size, on_gpu, max_prompt)
        w8a8_rows = self.runner.w8a8_prompt_rows  # None: prompt steps take no other kernels
        dense = self.runner.dense_prompts
        self.runner.prefill_in_graphs = False
        try:
            if w8a8_rows is not None:
                # Prompt-only steps take the w8a8 kernels (ModelRunner._w8a8_prompt_step):
                # every row bucket of theirs. Then the usual lengths with w8a8 off, for the
                # w8a16 variants of eager steps that mix prompts with decodes.
                for num_tokens in sorted({min(n, max_prompt) for n in w8a8_warm_up_rows()}):
                    self._warm_up_request(num_tokens, num_draft_tokens, share_topk)
                self.runner.w8a8_prompt_rows = None
            if dense:
                # Prompt tokens before index_topk attend densely (ModelRunner._dense_rows), as
                # these would: the first so, the rest on the sparse path, whose prefill
                # variants a longer prompt's chunks or a mixed step take.
                self._warm_up_request(lengths[0], num_draft_tokens, share_topk)
                self.runner.dense_prompts = False
            for num_tokens in lengths:
                self._warm_up_request(num_tokens, num_draft_tokens, share_topk)
        finally:
            self.runner.prefill_in_graphs = True
            self.runner.w8a8_prompt_rows = w8a8_rows
            self.runner.dense_prompts = dense

    def _warm_up_request(self, num_tokens: int, num_draft_tokens: int, share_topk: bool) -> None:
        """One dummy prompt of `num_tokens` (greedy), one decode after it (sampled), forgotten."""
        block_size = self.runner.block_size
        num_blocks = -(-(num_tokens + 1 + num_draft_tokens) // block_size)
        if num_blocks + 1 > self.num_kv_blocks:
            return
        block_ids = list(range(1, num_blocks + 1))
        prefill = SeqWork(WARM_UP_REQUEST_ID, [0] * num_tokens, 0, block_ids, 0, samples=True)
        [result] = self.runner.execute(StepInput([prefill], num_draft_tokens, share_topk)).results
        drafts = result.next_draft_token_ids
        decode = SeqWork(
            WARM_UP_REQUEST_ID,
            result.sampled_token_ids[-1:] + drafts,
            num_tokens,
            block_ids,
            len(drafts),
            samples=True,
            sampling=WARM_UP_SAMPLING,
        )
        self.runner.execute(StepInput([decode], num_draft_tokens, share_topk))
        self.runner.execute(StepInput([], finished_request_ids=[WARM_UP_REQUEST_ID]))

    def ping(self) -> bool:
        return True
