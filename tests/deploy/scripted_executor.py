"""An executor that plays back given token ids instead of running a model, so the serving path
(scheduler, detokenizer, ingress, parsers) can be tested on exact model text.

Engine option `executor="tests.deploy.scripted_executor:ScriptedExecutor"`. It reads
`script.json` from the checkpoint directory: {seed: [token ids]}. A request sampled with seed
s is answered with script[s], one token per step, then the EOS token; a seed not in the script
is answered with EOS at once.
"""

from __future__ import annotations

import json
import os
import time

from cluster.executor import Executor
from workers.batch import SeqResult, StepInput, StepOutput

SCRIPT_FILE = "script.json"
EOS_TOKEN_ID = 1
NUM_KV_BLOCKS = 1024
# A step takes this long, as a model's would: a stream then sees its tokens step by step (a
# stream that falls behind the engine gets several steps joined into one chunk, by design).
STEP_DELAY_S = 0.02


class ScriptedExecutor(Executor):
    def __init__(self, config):
        with open(os.path.join(config.model, SCRIPT_FILE)) as f:
            self.script = {int(seed): ids for seed, ids in json.load(f).items()}
        self.num_kv_blocks = NUM_KV_BLOCKS
        self.has_mtp = False
        self._num_emitted: dict[str, int] = {}

    def execute(self, step: StepInput) -> StepOutput:
        if step.seqs:
            time.sleep(STEP_DELAY_S)
        for request_id in step.finished_request_ids:
            self._num_emitted.pop(request_id, None)
        results = []
        for seq in step.seqs:
            if not seq.samples:
                results.append(SeqResult(seq.request_id))
                continue
            position = self._num_emitted.get(seq.request_id, 0)
            script = self.script.get(seq.sampling.seed, [])
            token = script[position] if position < len(script) else EOS_TOKEN_ID
            self._num_emitted[seq.request_id] = position + 1
            logprobs = None
            if seq.sampling.num_logprobs is not None:
                logprobs = [{"token_id": token, "logprob": 0.0, "top": [(token, 0.0)]}]
            results.append(SeqResult(seq.request_id, [token], logprobs=logprobs))
        return StepOutput(results)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
