"""An FP8 checkpoint served with its weights FP8 in memory (CPU, fp32 activations): greedy equals
transformers' greedy on the dequantized weights, with MTP off and on."""

from __future__ import annotations

import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from tests.workers.test_config_family import MAX_TOKENS, _prompts, _transformers_greedy
from tests.workers.test_loader import _quantize_checkpoint, _rewrite
from workers.loader import dequantize_fp8


def test_fp8_checkpoint_greedy_equals_transformers_on_the_dequantized_weights(
    tiny_model_dir, tmp_path
):
    fp8_dir = _rewrite(tiny_model_dir, str(tmp_path / "fp8"), _quantize_checkpoint)

    def dequantize(tensors):
        return {
            k: dequantize_fp8(t, tensors[k + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
            for k, t in tensors.items()
            if not k.endswith("_scale_inv")
        }

    reference = _transformers_greedy(
        _rewrite(fp8_dir, str(tmp_path / "deq"), dequantize), _prompts(512)
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for k in (0, 2):
        llm = LLM(fp8_dir, dtype="float32", num_draft_tokens=k)
        experts = llm.engine.executor.worker.model.model.layers[1].mlp.experts
        assert experts.w13.dtype == torch.float8_e4m3fn  # served from FP8, not dequantized
        assert [o.token_ids for o in llm.generate(_prompts(512), params)] == reference, k
