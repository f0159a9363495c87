"""An executor without a model, for measuring the serving path alone: every step sleeps as a
device step would (the GIL is free meanwhile, as while a CUDA graph runs) and samples one fixed
token per sequence. With it, what a server delivers is bounded by its own host work, not by a
model: `EngineConfig(executor="benchmarks.null_executor:NullExecutor")`, step time from
NULL_STEP_S (seconds, default 0.001).

NULL_AHEAD_EXTRA_S (seconds, default 0: off) models steps that overlap on a GPU
(`EngineConfig.overlap_steps`): the executor then says it overlaps steps, and a step that
prefills beside decodes sleeps that much more, for the forward of their own that the prompts
cost there (the decodes were launched before they came). A model, not a measurement: what the
admission window (`EngineConfig.admission_window_ms`) trades, on a machine without a GPU."""

from __future__ import annotations

import os
import time

from cluster.executor import Executor
from workers.batch import SeqResult, StepInput, StepOutput

TOKEN_ID = 100  # never EOS in the shipped tokenizers: requests run to max_tokens


class NullExecutor(Executor):
    def __init__(self, config):
        self.num_kv_blocks = 4096
        self.has_mtp = False
        self.step_s = float(os.environ.get("NULL_STEP_S", "0.001"))
        self.ahead_extra_s = float(os.environ.get("NULL_AHEAD_EXTRA_S", "0"))
        self.overlaps_steps = self.ahead_extra_s > 0

    def execute(self, step: StepInput) -> StepOutput:
        step_s = self.step_s
        if self.ahead_extra_s > 0:
            prefills = [s.start_position == 0 or len(s.token_ids) > 1 for s in step.seqs]
            if any(prefills) and not all(prefills):
                step_s += self.ahead_extra_s
        if step.seqs and step_s > 0:  # sleep(0) would still yield the CPU
            time.sleep(step_s)
        return StepOutput(
            [SeqResult(seq.request_id, [TOKEN_ID] if seq.samples else []) for seq in step.seqs]
        )

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
