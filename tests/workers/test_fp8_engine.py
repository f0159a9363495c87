"""An FP8 checkpoint served with its weights FP8 in memory (CPU, fp32 activations): greedy equals
transformers' greedy on the dequantized weights, with MTP off and on."""

from __future__ import annotations

import pytest
import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from tests.workers.test_config_family import MAX_TOKENS, _prompts, _transformers_greedy
from tests.workers.test_loader import _quantize_checkpoint, _quantize_checkpoint_ue8m0, _rewrite
from workers.loader import dequantize_fp8
from workers.tiny_model import make_tiny_model

# Heads whose nope and v parts are whole 128-row scale blocks, as DeepSeek-V3.2's (128, 128): MLA's
# kv_b_proj then stays FP8 and is read by kernels/fp8_mla_absorb.py (the tiny model's 16 and 16
# are dequantized on load). And q_a and the indexer's wk of whole blocks (DeepSeek-V3.2's 1536 and
# 128): the merged q_a + wk + kv_a stays FP8, its three parts' scale grids stacked. A hidden size
# of two blocks gives each part's rows two scales: wk's output is layer-normed, so a single scale
# read from the wrong part would not show.
WHOLE_BLOCK_HEADS = dict(
    num_attention_heads=2,
    qk_nope_head_dim=128,
    v_head_dim=128,
    q_lora_rank=128,
    index_head_dim=128,
    hidden_size=256,
)


def _dequantize(tensors):
    return {
        k: dequantize_fp8(t, tensors[k + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
        for k, t in tensors.items()
        if not k.endswith("_scale_inv")
    }


@pytest.mark.parametrize(
    "heads, quantize",
    [
        ("tiny", _quantize_checkpoint),
        ("whole-block", _quantize_checkpoint_ue8m0),
        ("whole-block", _quantize_checkpoint),  # scales that differ block to block
    ],
    ids=["tiny-heads-amax", "whole-block-heads-ue8m0", "whole-block-heads-amax"],
)
def test_fp8_checkpoint_greedy_equals_transformers_on_the_dequantized_weights(
    tiny_model_dir, tmp_path, heads, quantize
):
    src = tiny_model_dir
    if heads == "whole-block":
        src = make_tiny_model(str(tmp_path / "src"), seed=1, **WHOLE_BLOCK_HEADS)
    fp8_dir = _rewrite(src, str(tmp_path / "fp8"), quantize)
    reference = _transformers_greedy(
        _rewrite(fp8_dir, str(tmp_path / "deq"), _dequantize), _prompts(512)
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for k in (0, 2):
        llm = LLM(fp8_dir, dtype="float32", num_draft_tokens=k)
        layers = llm.engine.executor.worker.model.model.layers
        assert layers[1].mlp.experts.w13.dtype == torch.float8_e4m3fn  # served from FP8
        kv_b = layers[0].self_attn.kv_b_proj.weight
        assert (kv_b.dtype == torch.float8_e4m3fn) == (heads == "whole-block")
        q_kv_a = layers[0].self_attn.q_kv_a_proj.weight
        assert (q_kv_a.dtype == torch.float8_e4m3fn) == (heads == "whole-block")
        assert [o.token_ids for o in llm.generate(_prompts(512), params)] == reference, k


def test_moe_runs_its_fp8_shared_expert_inside_the_routed_launches_where_they_take_it(
    tmp_path, monkeypatch
):
    """Where the one-token kernels take the shared expert (`ops.moe_takes_shared`, on the GPU),
    MoE hands it to them as one more expert, laid out from the loaded merged linears (gate and
    up scale grids stacked), and runs no MLP of its own: the output is the MLP path's, but for
    the one rounding of the routed sum it saves (here fp32)."""
    from kernels import ops

    src = make_tiny_model(
        str(tmp_path / "src"), seed=2, **WHOLE_BLOCK_HEADS, moe_intermediate_size=128
    )
    fp8_dir = _rewrite(src, str(tmp_path / "fp8"), _quantize_checkpoint_ue8m0)
    llm = LLM(fp8_dir, dtype="float32", num_draft_tokens=0)
    moe = llm.engine.executor.worker.model.model.layers[1].mlp
    assert moe.shared_experts.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    x = torch.randn(1, moe.config.hidden_size, generator=torch.Generator().manual_seed(3))
    unfused = moe(x)
    passed, mlp_calls = [], []
    real_moe, real_mlp = ops.grouped_moe, type(moe.shared_experts).forward
    monkeypatch.setattr(ops, "moe_takes_shared", lambda *args: True)
    monkeypatch.setattr(
        ops, "grouped_moe", lambda *a, **kw: passed.append(kw["shared"]) or real_moe(*a, **kw)
    )
    monkeypatch.setattr(
        type(moe.shared_experts), "forward", lambda *a: mlp_calls.append(1) or real_mlp(*a)
    )
    fused = moe(x)
    assert passed[0] is not None and passed[0].pow2_scales and not mlp_calls
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5 * unfused.abs().max().item())
    shared_out = real_mlp(moe.shared_experts, x)  # it counts: without it the output moves
    assert (shared_out.abs().max() > 1e-3 * unfused.abs().max()).item()
    assert not torch.allclose(fused, unfused - shared_out, atol=1e-4)
