"""`mtpserve plan`: per-rank weights from the model's real shards (FP8 where the checkpoint is),
the KV bytes per token the engine allocates, and DeepSeek-V3.2's own config at TP=8/EP=8."""

from __future__ import annotations

import json
import subprocess

import torch
from transformers import DeepseekV32Config

from tests.deploy.conftest import MTPSERVE
from tests.workers.test_fp8_engine import WHOLE_BLOCK_HEADS
from tests.workers.test_loader import _quantize_checkpoint, _rewrite
from workers.kv_cache import allocate_kv_caches
from workers.loader import load_model
from workers.memory_plan import plan_memory
from workers.model_config import DEEPSEEK_V32, DEEPSEEK_V32_QUANTIZATION
from workers.tiny_model import make_tiny_model


def test_plan_counts_what_the_loaded_model_holds(tiny_model_dir, tmp_path):
    fp8_dir = _rewrite(tiny_model_dir, str(tmp_path / "fp8"), _quantize_checkpoint)
    # Heads of whole 128-row blocks: kv_b_proj stays FP8 with a copy in the model's dtype beside
    # it (a buffer), which the plan must count too.
    whole_dir = make_tiny_model(str(tmp_path / "whole"), seed=1, **WHOLE_BLOCK_HEADS)
    whole_fp8_dir = _rewrite(whole_dir, str(tmp_path / "whole-fp8"), _quantize_checkpoint)
    for model_dir in (tiny_model_dir, fp8_dir, whole_fp8_dir):
        plan = plan_memory(model_dir, dtype=torch.float32)
        model, config = load_model(model_dir, dtype=torch.float32)
        held = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
        assert plan.weight_bytes_per_rank == sum(t.numel() * t.element_size() for t in held)
        kv_b = model.model.layers[0].self_attn.kv_b_proj
        if model_dir == whole_fp8_dir:
            copy = kv_b.get_buffer("dequantized")
            assert kv_b.is_fp8 and copy.dtype == torch.float32 and copy.shape == kv_b.weight.shape
        caches = allocate_kv_caches(config, 3, 64, torch.float32, "cpu", with_mtp=True)
        allocated = sum(c.numel() * c.element_size() for group in caches for c in group)
        assert plan.kv_bytes_per_token * 3 * 64 == allocated
    assert plan.weight_bytes_by_dtype["float8_e4m3fn"] > 0


def test_deepseek_v32_at_tp8_ep8_from_config_alone(tmp_path):
    config = DeepseekV32Config(**DEEPSEEK_V32).to_dict()
    config["quantization_config"] = DEEPSEEK_V32_QUANTIZATION
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = subprocess.run(
        [MTPSERVE, "plan", "--model", str(tmp_path), "--tp", "8", "--ep", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert 86e9 <= plan["weight_bytes_per_rank"] <= 90e9
    fp8 = plan["weight_bytes_by_dtype"]["float8_e4m3fn"]
    assert fp8 > 0.9 * sum(plan["weight_bytes_by_dtype"].values())
    # 61 layers + MTP, each a 576-wide latent row and a 128-wide indexer key, bf16.
    assert plan["kv_bytes_per_token"] == 62 * (512 + 64 + 128) * 2
    assert plan["fits"] and plan["max_cached_tokens"] > 163840
    for key in (
        "weight_bytes_per_rank",
        "weight_bytes_by_dtype",
        "kv_bytes_per_token",
        "max_cached_tokens",
        "fits",
    ):
        assert key in plan
