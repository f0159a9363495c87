"""Checkpoint loading: FP8 copies, the MTP layer's optional parts, and bad checkpoints."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kernels.fp8 import FP8_BLOCK
from tests.workers.test_model_parity import ATOL, run_mixed_batch_parity
from workers.loader import CheckpointError, dequantize_fp8, keep_fp8_weights, load_model
from workers.tiny_model import _write_index


def _rewrite(src: str, dst: str, edit) -> str:
    """Copy a checkpoint, passing every tensor dict through edit(tensors) -> tensors."""
    shutil.copytree(src, dst)
    for fname in os.listdir(dst):
        if fname.endswith(".safetensors"):
            path = os.path.join(dst, fname)
            with safe_open(path, "pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            save_file(edit(tensors), path, metadata={"format": "pt"})
    _write_index(dst)
    return dst


def _quantize_fp8(w: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 as DeepSeek ships it: per 128x128 block, scale = amax / 448 (`pow2`:
    rounded up to a power of two, UE8M0, as DeepSeek-V3.1 and later ship it)."""
    rows, cols = w.shape
    br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(br * FP8_BLOCK, bc * FP8_BLOCK)
    padded[:rows, :cols] = w
    blocks = padded.view(br, FP8_BLOCK, bc, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def _is_quantized_linear(name: str, t: torch.Tensor) -> bool:
    skip = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "weights_proj", "eh_proj")
    return t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip)


def _quantize_checkpoint(tensors, pow2: bool = False):
    out = {}
    for k, t in tensors.items():
        if _is_quantized_linear(k, t):
            out[k], out[k + "_scale_inv"] = _quantize_fp8(t.float(), pow2)
        else:
            out[k] = t
    return out


def _quantize_checkpoint_ue8m0(tensors):
    return _quantize_checkpoint(tensors, pow2=True)


@pytest.fixture(scope="module")
def fp8_dir(tiny_model_dir, tmp_path_factory):
    return _rewrite(
        tiny_model_dir, str(tmp_path_factory.mktemp("fp8") / "ckpt"), _quantize_checkpoint
    )


def test_fp8_checkpoint_dequantizes_exactly(tiny_model_dir, fp8_dir, tmp_path):

    # The oracle is transformers on the dequantized weights: our loader must reproduce exactly
    # those numbers (then the model parity bound applies unchanged).
    def dequantize(tensors):
        return {
            k: dequantize_fp8(t, tensors[k + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
            for k, t in tensors.items()
            if not k.endswith("_scale_inv")
        }

    deq_dir = _rewrite(fp8_dir, str(tmp_path / "deq"), dequantize)
    fp8_model, _ = load_model(fp8_dir, dtype=torch.float32, keep_fp8=False)
    deq_model, _ = load_model(deq_dir, dtype=torch.float32)
    for (name, a), (_, b) in zip(fp8_model.named_parameters(), deq_model.named_parameters()):
        assert torch.equal(a, b), name
    assert run_mixed_batch_parity(fp8_dir, (40, 9), 2, oracle_dir=deq_dir) < ATOL
    # And FP8 is close to the original weights: block scales keep every element within e4m3's
    # 3-bit mantissa (relative step 2**-3, so at most 1/16 relative error after rounding).
    original, _ = load_model(tiny_model_dir, dtype=torch.float32)
    orig = dict(original.named_parameters())
    for name, p in fp8_model.named_parameters():
        err = (p - orig[name]).abs()
        assert (err <= orig[name].abs() / 16 + 1e-3).all(), name


@torch.no_grad()
def test_fp8_weights_stay_fp8_and_compute_the_dequantized_model(fp8_dir):
    """The layers whose checkpoint weight is FP8 keep it FP8 with its block scales (half the
    bytes of bf16); their matmuls dequantize exactly, so in fp32 the model computes what the
    load-time-dequantized model does."""
    from tests.workers.paged_harness import PagedHarness

    kept, config = load_model(fp8_dir, dtype=torch.float32)
    dequantized, _ = load_model(fp8_dir, dtype=torch.float32, keep_fp8=False)
    fp8 = {n for n, p in kept.named_parameters() if p.dtype == torch.float8_e4m3fn}
    layer = "model.layers.1"
    assert f"{layer}.self_attn.indexer.wq_b.weight" in fp8  # replicated
    assert f"{layer}.self_attn.q_b_proj.weight" in fp8  # column-parallel
    assert f"{layer}.self_attn.o_proj.weight" in fp8  # row-parallel
    assert "model.layers.0.mlp.gate_up_proj.weight" in fp8  # merged, parts of 128 rows
    assert {f"{layer}.mlp.experts.w13", f"{layer}.mlp.experts.w2"} <= fp8  # routed experts
    # Read by the model rather than multiplied, or parts that do not fill whole blocks:
    # dequantized on load.
    assert f"{layer}.self_attn.kv_b_proj.weight" not in fp8
    assert f"{layer}.mlp.shared_experts.gate_up_proj.weight" not in fp8  # 32-row parts
    assert f"{layer}.self_attn.q_kv_a_proj.weight" not in fp8  # q_a + kv_a: a 48-row q_a part
    assert all(
        n.replace(".weight", ".weight_scale_inv") in dict(kept.named_parameters()) for n in fp8
    )
    tokens = torch.randint(3, config.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    logits = [
        model.compute_logits(model(tokens, PagedHarness(model, 1, 64).metadata({0: 40})))
        for model in (kept, dequantized)
    ]
    assert (logits[0] - logits[1]).abs().max() < 1e-4


def test_fp8_layers_note_whether_their_scales_are_powers_of_two(fp8_dir, tmp_path):
    """Every FP8 layer learns at load whether its scales are powers of two (UE8M0): the exact
    amax / 448 scales are not; the same checkpoint with UE8M0 scales is, and one layer's
    scale off a power of two turns that layer (only) back to the per-element kernels."""
    fp8_layers = [m for m in load_model(fp8_dir, dtype=torch.float32)[0].modules()]
    fp8_layers = [m for m in fp8_layers if getattr(m, "is_fp8", False)]
    assert fp8_layers and not any(m.pow2_scales for m in fp8_layers)

    ue8m0_dir = _rewrite(
        fp8_dir,
        str(tmp_path / "ue8m0"),
        lambda tensors: {
            k: torch.exp2(torch.ceil(torch.log2(t))) if k.endswith("_scale_inv") else t
            for k, t in tensors.items()
        },
    )
    model, _ = load_model(ue8m0_dir, dtype=torch.float32)
    layers = {n: m for n, m in model.named_modules() if getattr(m, "is_fp8", False)}
    assert set(layers) and all(m.pow2_scales for m in layers.values())
    assert "model.layers.1.mlp.experts" in layers  # the routed experts too

    off = "model.layers.1.self_attn.o_proj.weight_scale_inv"

    def one_off(tensors):
        if off in tensors:
            tensors = dict(tensors)
            tensors[off] = tensors[off].clone()
            tensors[off].view(-1)[0] *= 1.5
        return tensors

    mixed, _ = load_model(_rewrite(ue8m0_dir, str(tmp_path / "mixed"), one_off), torch.float32)
    noted = {n: m.pow2_scales for n, m in mixed.named_modules() if getattr(m, "is_fp8", False)}
    assert noted.pop("model.layers.1.self_attn.o_proj") is False
    assert all(noted.values())


def test_a_tp_split_that_cuts_fp8_blocks_is_an_error(fp8_dir):
    from parallel.state import ParallelState, get_parallel_state, set_parallel_state
    from workers.loader import checkpoint_files, load_config
    from workers.model import DeepseekV32ForCausalLM

    previous = get_parallel_state()
    set_parallel_state(ParallelState(tp_rank=0, tp_size=2))
    try:
        model = DeepseekV32ForCausalLM(load_config(fp8_dir), torch.float32)
        with pytest.raises(CheckpointError, match="cuts the checkpoint's 128x128 FP8 scale"):
            keep_fp8_weights(model, checkpoint_files(fp8_dir))
    finally:
        set_parallel_state(previous)


def test_mtp_layer_borrows_embedding_and_head_when_absent(tiny_model_dir):
    model, config = load_model(tiny_model_dir, dtype=torch.float32)
    assert model.mtp.embed_tokens is model.model.embed_tokens
    assert model.mtp.shared_head.head is model.lm_head


def test_mtp_layer_own_embedding_and_head(tiny_model_dir, tmp_path):
    n = 2

    def add(tensors):
        if "lm_head.weight" in tensors:
            return tensors
        tensors = dict(tensors)
        tensors[f"model.layers.{n}.embed_tokens.weight"] = torch.full((512, 64), 0.5)
        tensors[f"model.layers.{n}.shared_head.head.weight"] = torch.full((512, 64), 0.25)
        return tensors

    model, _ = load_model(_rewrite(tiny_model_dir, str(tmp_path / "own"), add), torch.float32)
    assert model.mtp.embed_tokens is not model.model.embed_tokens
    assert torch.all(model.mtp.embed_tokens.weight == 0.5)
    assert torch.all(model.mtp.shared_head.head.weight == 0.25)


def test_missing_mtp_layer_turns_mtp_off_with_warning(tiny_model_dir, tmp_path, caplog):
    def drop(tensors):
        return {k: t for k, t in tensors.items() if not k.startswith("model.layers.2.")}

    with caplog.at_level(logging.WARNING):
        model, _ = load_model(_rewrite(tiny_model_dir, str(tmp_path / "nomtp"), drop))
    assert model.mtp is None
    assert "no MTP layer" in caplog.text


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda t: {
                k: v for k, v in t.items() if k != "model.layers.1.self_attn.q_b_proj.weight"
            },
            "model.layers.1.self_attn.q_b_proj.weight",
        ),
        (
            lambda t: {
                k: v for k, v in t.items() if k != "model.layers.1.mlp.experts.3.up_proj.weight"
            },
            "3.up_proj",
        ),
        (
            lambda t: {
                k: (v[:-1] if k == "model.layers.0.self_attn.kv_b_proj.weight" else v)
                for k, v in t.items()
            },
            "model.layers.0.self_attn.kv_b_proj.weight",
        ),
        (
            lambda t: (
                {**t, "model.layers.0.self_attn.surprise.weight": torch.zeros(2)}
                if "model.embed_tokens.weight" in t
                else t
            ),
            "model.layers.0.self_attn.surprise.weight",
        ),
        (  # a part of a merged layer (q_a and kv_a are one matmul)
            lambda t: {
                k: v
                for k, v in t.items()
                if k != "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
            },
            "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
        ),
        (
            lambda t: {
                k: (v[:-1] if k == "model.layers.0.self_attn.q_a_proj.weight" else v)
                for k, v in t.items()
            },
            "model.layers.0.self_attn.q_a_proj.weight",
        ),
    ],
    ids=["missing", "missing-expert", "wrong-shape", "unexpected", "missing-part", "part-shape"],
)
def test_bad_tensors_are_named(tiny_model_dir, tmp_path, edit, message):
    bad = _rewrite(tiny_model_dir, str(tmp_path / "bad"), edit)
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.")):
        load_model(bad)


def test_config_that_is_not_deepseek_v32(tiny_model_dir, tmp_path):
    bad = str(tmp_path / "llama")
    shutil.copytree(tiny_model_dir, bad)
    with open(os.path.join(bad, "config.json")) as f:
        cfg = json.load(f)
    cfg["model_type"] = "llama"
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match="not a DeepSeek-V3.2 model"):
        load_model(bad)
