"""Invalid configs and TP/EP splits fail when the engine is configured, naming the numbers."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from cluster.llm import LLM
from tests.deploy.conftest import MTPSERVE
from workers.model_config import ModelConfigError, check_model_config
from workers.tiny_model import TINY_CONFIG, random_config


def _config(**overrides):
    from transformers import DeepseekV32Config

    return DeepseekV32Config(**dict(TINY_CONFIG, **overrides))


@pytest.mark.parametrize("seed", range(48))
def test_the_family_is_valid(seed):
    check_model_config(_config(**random_config(seed)))


@pytest.mark.parametrize(
    "overrides, tp, ep, message",
    [
        (dict(num_attention_heads=3), 2, 1, "num_attention_heads=3 does not split over tp_size=2"),
        (dict(intermediate_size=100), 8, 1, "intermediate_size=100 does not split over tp_size=8"),
        (dict(n_routed_experts=8), 4, 4, None),  # valid: 2 experts per EP rank
        (
            dict(n_routed_experts=6, n_group=3),
            4,
            4,
            "n_routed_experts=6 does not split over ep_size=4",
        ),
        (
            dict(moe_intermediate_size=18),
            4,
            1,
            "moe_intermediate_size=18 does not split over tp_size // ep_size=4",
        ),
        (dict(moe_intermediate_size=20), 4, 2, None),  # 2 ranks share an expert: 10 rows each
        (
            dict(n_shared_experts=1, moe_intermediate_size=36),
            8,
            8,
            "moe_intermediate_size * n_shared_experts=36 does not split over tp_size=8",
        ),
        (
            dict(num_experts_per_tok=5),
            1,
            1,
            "num_experts_per_tok=5 is outside 1..4, the experts that topk_group=2 groups of 2 hold",
        ),
        (dict(n_routed_experts=9), 1, 1, "n_routed_experts=9 does not split into n_group=4 groups"),
        (
            dict(n_routed_experts=4),
            1,
            1,
            "leaves 1 expert per group; a group's score sums its top 2",
        ),
        (dict(topk_group=5), 1, 1, "topk_group=5 is outside 1..n_group=4"),
        (dict(index_head_dim=8), 1, 1, "index_head_dim=8 is smaller than qk_rope_head_dim=16"),
        (
            dict(first_k_dense_replace=3),
            1,
            1,
            "first_k_dense_replace=3 is outside 0..num_hidden_layers=2",
        ),
        (dict(), 4, 3, "ep_size=3 must divide tp_size=4"),
    ],
)
def test_each_constraint_names_its_fields(overrides, tp, ep, message):
    config = _config(**overrides)
    if message is None:
        check_model_config(config, tp, ep)
        return
    with pytest.raises(ModelConfigError) as e:
        check_model_config(config, tp, ep)
    assert message in str(e.value)


def test_every_violation_is_listed_at_once():
    with pytest.raises(ModelConfigError) as e:
        check_model_config(_config(num_attention_heads=3, intermediate_size=127), 2, 1)
    assert "num_attention_heads=3" in str(e.value) and "intermediate_size=127" in str(e.value)


def _config_only(tmp_path, **overrides) -> str:
    """A checkpoint directory holding config.json and a tokenizer, but no weights at all."""
    from workers.tiny_model import train_tokenizer

    config = _config(**overrides).to_dict()
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump(config, f)
    train_tokenizer(512, str(tmp_path))
    return str(tmp_path)


def test_the_engine_checks_before_any_weights_load(tmp_path):
    # No safetensors in the directory: a check after loading would fail on the missing weights.
    with pytest.raises(
        ModelConfigError, match="num_attention_heads=3 does not split over tp_size=2"
    ):
        LLM(_config_only(tmp_path, num_attention_heads=3), tp_size=2, dtype="float32")


def test_serve_refuses_before_starting_ray(tmp_path):
    model = _config_only(tmp_path, num_attention_heads=3)
    done = subprocess.run(
        [MTPSERVE, "serve", "--model", model, "--tp", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "num_attention_heads=3 does not split over tp_size=2" in done.stderr
    assert "ray" not in done.stderr.lower()  # it never got as far as starting Ray
