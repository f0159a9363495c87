"""The offline Python API: LLM(model_dir).generate(prompts, sampling_params)."""

from __future__ import annotations

from cluster.config import EngineConfig
from cluster.engine import LLMEngine
from cluster.outputs import RequestOutput
from cluster.sampling_params import SamplingParams
from workers.long_lived import frozen_for_the_call


class LLM:
    def __init__(self, model: str, **engine_options):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self, prompts: list[str] | list[list[int]] | str, params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Runs every prompt to completion (continuous batching); outputs in prompt order.
        No `params`: the checkpoint's sampling defaults (generation_config.json)."""
        params = params or self.engine.default_sampling_params()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = []
        for prompt in prompts:
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            ids.append(self.engine.add_request(token_ids, params))
        final: dict[str, RequestOutput] = {}
        # The model, the engine and the caller's objects out of the collector's full scans
        # while the steps run (workers/long_lived.py says why), back in them after.
        with frozen_for_the_call():
            while self.engine.has_unfinished:
                # Only the last output of each request is kept: none is built before it.
                for out in self.engine.step(_finished):
                    if out.finished:
                        final[out.request_id] = out
        return [final[i] for i in ids]

    def stats(self):
        return self.engine.stats()


def _finished(request) -> bool:
    return request.is_finished
