"""The engine: one scheduler, one executor, and the step loop.

step() = schedule -> execute on every rank -> update (append tokens, stop, free blocks)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from cluster.block_manager import BlockManager
from cluster.config import (
    Checkpoint,
    ConfigError,
    EngineConfig,
    fit_context,
    read_checkpoint,
    resolve_config,
)
from cluster.executor import Executor, WorkerError, make_executor
from cluster.outputs import (
    EngineCounters,
    RequestOutput,
    SpecDecodeStats,
    make_request_delta,
    make_request_output,
)
from cluster.request import Request, RequestStatus
from cluster.sampling_params import InvalidRequestError, SamplingParams
from cluster.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from workers.batch import SamplingSpec, SeqResult, SeqWork, StepInput

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Gauges now, and counters cumulative since the engine started (a restarted engine counts
    from zero again, which Prometheus reads as a counter reset)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    # Prefix caching, cumulative, in tokens: what admissions looked up, and found cached.
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_finished: dict[str, int] = dataclasses.field(default_factory=dict)  # by finish_reason
    num_draft_tokens: int = 0  # the k the engine runs with; 0: MTP off
    num_steps: int = 0  # steps that ran
    num_prefill_steps: int = 0  # of them, steps that carried a prompt (a chunk of one)
    # Wall time inside those steps (schedule, execute, update, outputs). Over an interval,
    # its growth / the interval is how busy the engine was; / the steps, a step's mean time.
    step_time_s: float = 0.0
    prefill_step_time_s: float = 0.0  # of it, inside the steps that carried a prompt
    spec: SpecDecodeStats = dataclasses.field(default_factory=SpecDecodeStats)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(self.num_total_blocks, 1)

    # Every verify round so far (1.0 and [] with MTP off: a round then gains exactly one token).
    @property
    def mean_tokens_per_round(self) -> float:
        return self.spec.mean_tokens_per_round

    @property
    def acceptance_per_position(self) -> list[float]:
        return self.spec.acceptance_per_position


def load_tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def eos_token_ids(model_dir: str, tokenizer) -> set[int]:
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    for value in (eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids


def checked_config(config: EngineConfig) -> tuple[Checkpoint, EngineConfig]:
    """`config`'s checkpoint and `config` resolved for it (what its executor is made for),
    after the checks that come before any weights load."""
    from workers.model_config import check_model_config

    checkpoint = read_checkpoint(config.model)
    check_model_config(checkpoint.model_config, config.tp_size, config.ep_size)
    return checkpoint, resolve_config(config, checkpoint)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, deltas_only: bool = False, executor: Executor | None = None
    ):
        """`config` as the user gave it; `self.config` is it resolved (cluster/config.py): the
        draft length, and the context fitted to the KV pool the workers sized. `deltas_only`:
        outputs are deltas, for a caller that keeps the cumulative fields (`_output`).
        `executor`: ranks already loaded for `checked_config(config)` (the engine process's
        SocketExecutor), else the config's own executor is made here."""
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        checkpoint, resolved = checked_config(config)
        self.vocab_size = checkpoint.model_config.vocab_size
        # SamplingParams fields for a request that leaves them out (generation_config.json).
        self.sampling_defaults = checkpoint.sampling_defaults
        self.executor = executor if executor is not None else make_executor(resolved)
        if resolved.num_draft_tokens and not self.executor.has_mtp:
            # config.json names an MTP layer that the weights lack (the loader logged it).
            if config.num_draft_tokens is not None:
                self.executor.shutdown()
                raise ConfigError(
                    f"num_draft_tokens={config.num_draft_tokens}: {config.model} has no MTP "
                    "layer weights; serve it with num_draft_tokens 0"
                )
            resolved = resolved.replace(num_draft_tokens=0)
        num_drafts = resolved.num_draft_tokens
        # "auto" settled by the ranks' device: a request owns the slot of a decode launched
        # ahead only where one is.
        resolved = resolved.replace(
            overlap_steps="on" if self.executor.overlaps_steps and not num_drafts else "off"
        )
        # Before the engine exists for anyone: the first request must not pay for compilation.
        self.warm_up = self.executor.warm_up(num_drafts, config.share_topk)
        num_blocks = self.executor.num_kv_blocks
        block_manager = BlockManager(
            num_blocks,
            config.block_size_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            # The MTP layer's row at a block's last position depends on the next block's first
            # token (cluster/block_manager.py says why and what it costs).
            key_includes_next_token=num_drafts > 0,
        )
        max_model_len = fit_context(config, resolved, block_manager.capacity_tokens)
        self.config = resolved.replace(max_model_len=max_model_len)
        self.max_model_len = max_model_len
        self.num_draft_tokens = num_drafts
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max(
                    config.max_num_batched_tokens, config.max_num_seqs, 1 + num_drafts
                ),
                num_draft_tokens=num_drafts,
                block_size_tokens=config.block_size_tokens,
                num_blocks=num_blocks,
                max_model_len=max_model_len,
                overlap_steps=resolved.overlap_steps,
            ),
            block_manager,
            tokenizer=self.tokenizer,
        )
        self.counters = EngineCounters()
        self.deltas_only = deltas_only
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        self._counter = itertools.count()

    def default_sampling_params(self, **explicit) -> SamplingParams:
        """SamplingParams with the checkpoint's defaults (generation_config.json) where
        `explicit` leaves a field out; explicit values win."""
        return SamplingParams(**{**self.sampling_defaults, **explicit})

    # --- requests ------------------------------------------------------------------------------

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        request_id = request_id or f"req-{next(self._counter)}"
        params.validate(self.vocab_size)
        # min/max run in C; a generator over every token is a Python loop on the turn's path
        # (it showed in a profile of a cached 8k-token turn on the H200).
        if prompt_token_ids and (
            min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size
        ):
            raise InvalidRequestError("prompt token ids must be in [0, vocab_size)", "prompt")
        if len(prompt_token_ids) + 1 > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context is "
                f"{self.max_model_len} tokens, including at least one generated token",
                "prompt",
            )
        request = Request(request_id, prompt_token_ids, params, self.eos_token_ids)
        request.sampling_spec = self._sampling_spec(request)  # fixed for the request's life
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        if request is None:
            return None
        self._finished_ids.append(request_id)
        return self._output(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # --- the step ------------------------------------------------------------------------------

    def step(self, wants_output: Callable[[Request], bool] | None = None) -> list[RequestOutput]:
        """Schedule, execute, update. A request that fails inside the step fails alone (its
        output has finish_reason "error"); WorkerError only when the workers themselves failed.
        `wants_output(request)`, asked for each request the step changed: False leaves its
        output for a later step (its next output then carries every token since the last);
        None: an output for each (what offline callers get)."""
        started_s = time.perf_counter()
        scheduled = self.scheduler.schedule()
        # Told to the workers with the next step that runs (this one may schedule nothing).
        self._preempted_ids += scheduled.preempted_ids
        if scheduled.is_empty:
            return []
        self.counters.num_steps += 1
        # Decodes come first, then prefills (SchedulerOutput): the last says whether any is one.
        carries_prompt = scheduled.scheduled[-1].is_prefill
        self.counters.num_prefill_steps += carries_prompt
        step_input = self._step_input(scheduled)
        results, failures = self._execute_isolating(step_input)
        changed = self.scheduler.update(scheduled, results)
        outputs = [self._fail_one(request_id, error) for request_id, error in failures.items()]
        for request in changed:
            if request.is_finished:
                self._finished_ids.append(request.request_id)
            if wants_output is None or wants_output(request):
                outputs.append(self._output(request))
            else:
                self.counters.observe(request)  # its tokens count now, its output comes later
        step_s = time.perf_counter() - started_s
        self.counters.step_time_s += step_s
        if carries_prompt:
            self.counters.prefill_step_time_s += step_s
        return outputs

    def _output(self, request: Request) -> RequestOutput | tuple:
        """Every output the engine yields is built here, and counted: a RequestOutput, or with
        `deltas_only` its deltas (`cluster.outputs.make_request_delta`), for a caller that keeps
        the cumulative fields itself (the engine in its own process)."""
        self.counters.observe(request)
        return make_request_delta(request) if self.deltas_only else make_request_output(request)

    def _execute_isolating(self, step: StepInput) -> tuple[dict[str, SeqResult], dict[str, str]]:
        """Run the step; if its code raised on the ranks and every rank finished it and still
        answers, re-run it in halves (the workers put each request's state back after a failed
        step) until the requests that fail alone are found; a step that fails only with many
        requests (memory) succeeds in parts the same way. -> (results by request id, error by
        failed request id). Raises WorkerError when a rank died or hangs: then the whole engine
        has failed. Cost: a step that fails for one request of n runs about 2 log2(n) times."""
        try:
            output = self.executor.execute(step)
        except WorkerError as exc:
            if not exc.step_raised:
                raise  # a rank died or hangs: the engine's failure, not one request's
            self.executor.check_health()
            if len(step.seqs) == 1:
                logger.warning("request %s failed alone: %s", step.seqs[0].request_id, exc)
                return {}, {step.seqs[0].request_id: str(exc)}
            half = len(step.seqs) // 2
            results, failures = {}, {}
            for seqs in (step.seqs[:half], step.seqs[half:]):
                part = dataclasses.replace(step, seqs=seqs, finished_request_ids=[])
                part_results, part_failures = self._execute_isolating(part)
                results.update(part_results)
                failures.update(part_failures)
            return results, failures
        return {r.request_id: r for r in output.results}, {}

    def _fail_one(self, request_id: str, error: str) -> RequestOutput:
        """Finish one request with finish_reason "error"; frees its blocks."""
        request = self.scheduler.get(request_id)
        self.scheduler.abort(request_id)
        request.status = RequestStatus.FINISHED_ERROR
        # The details (which may name actors and hosts) go to the log, not to the client.
        request.error = "the request failed inside an engine step (the server log has why)"
        self._finished_ids.append(request_id)
        return self._output(request)

    def _step_input(self, scheduled: SchedulerOutput) -> StepInput:
        seqs = []
        for s in scheduled.scheduled:
            request = s.request
            # Only the table's entries the workers do not hold yet (a decode step: most often
            # none): resending every table every step cost O(context) per request.
            table_start = request.num_blocks_sent
            request.num_blocks_sent = len(request.block_ids)
            seqs.append(
                SeqWork(
                    request_id=s.request_id,
                    token_ids=s.token_ids,
                    start_position=s.start_position,
                    block_ids=request.block_ids[table_start:],
                    num_draft_tokens=s.num_draft_tokens,
                    samples=s.samples,
                    sampling=request.sampling_spec,
                    block_table_start=table_start,
                )
            )
        finished, self._finished_ids = self._finished_ids, []
        preempted, self._preempted_ids = self._preempted_ids, []
        return StepInput(
            seqs,
            self.num_draft_tokens,
            self.config.share_topk,
            finished,
            preempted_request_ids=preempted,
        )

    def _sampling_spec(self, request: Request) -> SamplingSpec:
        p = request.sampling_params
        if not p.has_logits_processors:
            return SamplingSpec(p.temperature, p.top_p, p.top_k, p.seed, p.logprobs)
        masked = set(p.stop_token_ids) | (set() if p.ignore_eos else request.eos_token_ids)
        return SamplingSpec(
            p.temperature,
            p.top_p,
            p.top_k,
            p.seed,
            p.logprobs,
            logit_bias=tuple(sorted(p.logit_bias.items())),
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            min_tokens=p.min_tokens,
            min_tokens_masked_ids=tuple(sorted(masked)),
            num_prompt_tokens=request.num_prompt_tokens,
        )

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every unfinished request with an error (a rank failed); frees their blocks."""
        outputs = []
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.abort(request.request_id)
            request.status = RequestStatus.FINISHED_ERROR
            request.error = error
            outputs.append(self._output(request))
        return outputs

    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Every verify round so far, aborted requests' included."""
        return self.scheduler.spec_stats

    def stats(self) -> EngineStats:
        """Safe to call from another thread while the engine steps (copies, never locks)."""
        bm = self.scheduler.block_manager
        spec = self.scheduler.spec_stats.snapshot()
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_usable_blocks,
            prefix_cache_queried_tokens=bm.stats.num_queried_tokens,
            prefix_cache_hit_tokens=bm.stats.num_hit_tokens,
            num_prompt_tokens=self.counters.num_prompt_tokens,
            num_generation_tokens=self.counters.num_generation_tokens,
            num_finished=dict(self.counters.num_finished),
            num_draft_tokens=self.num_draft_tokens,
            num_steps=self.counters.num_steps,
            num_prefill_steps=self.counters.num_prefill_steps,
            step_time_s=self.counters.step_time_s,
            prefill_step_time_s=self.counters.prefill_step_time_s,
            spec=spec,
        )

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()


__all__ = ["LLMEngine", "EngineStats", "WorkerError"]
