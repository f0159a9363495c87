"""An executor without a model, for measuring the serving path alone: every step sleeps as a
device step would (the GIL is free meanwhile, as while a CUDA graph runs) and samples one fixed
token per sequence. With it, what a server delivers is bounded by its own host work, not by a
model: `EngineConfig(executor="benchmarks.null_executor:NullExecutor")`, step time from
NULL_STEP_S (seconds, default 0.001)."""

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

    def execute(self, step: StepInput) -> StepOutput:
        if step.seqs and self.step_s > 0:  # sleep(0) would still yield the CPU
            time.sleep(self.step_s)
        return StepOutput(
            [SeqResult(seq.request_id, [TOKEN_ID] if seq.samples else []) for seq in step.seqs]
        )

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
