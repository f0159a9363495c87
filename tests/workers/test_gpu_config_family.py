"""The config family on a GPU: Triton kernels at the family's odd shapes (1, 3 or 5 heads, RoPE
dims of 4, indexer dims of 4 or 20, ...), CUDA-graph decode steps and proposals, PDL where the
gate allows it.

fp32: graphed greedy without MTP equals the CPU twins' greedy (the CPU tier ties those to
transformers). bf16: greedy with MTP (k = 1..3, top-k sharing on and off) equals greedy without.
"""

from __future__ import annotations

import pytest
import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from tests.workers.test_config_family import CI_SEEDS, MAX_TOKENS, _checkpoint, _prompts
from workers.tiny_model import random_config

pytestmark = pytest.mark.gpu

GPU_SEEDS = CI_SEEDS + (0, 2, 4, 5, 6, 8, 16, 27)


def _greedy(model_dir, prompts, **options) -> list[list[int]]:
    llm = LLM(model_dir, **options)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("seed", GPU_SEEDS)
def test_gpu_family(tmp_path_factory, seed):
    model_dir = _checkpoint(tmp_path_factory, seed, **random_config(seed))
    prompts = _prompts(512)
    cpu = _greedy(model_dir, prompts, device="cpu", dtype="float32")
    assert _greedy(model_dir, prompts, device="cuda", dtype="float32") == cpu
    plain = _greedy(model_dir, prompts, device="cuda", dtype="bfloat16")
    for k in (1, 2, 3):
        for share_topk in (False, True):
            got = _greedy(
                model_dir,
                prompts,
                device="cuda",
                dtype="bfloat16",
                num_draft_tokens=k,
                share_topk=share_topk,
            )
            assert got == plain, (k, share_topk)
    torch.cuda.empty_cache()
