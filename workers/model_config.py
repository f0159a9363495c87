"""What a DeepSeek-V3.2 config must satisfy to be built, and split over TP/EP ranks.

Checked when the engine is configured, before any weights load: a config that breaks one of
these would otherwise fail inside the first step (a reshape of a head count that does not split)
or pick experts from groups that do not hold them. Each error names the fields and the numbers.
"""

from __future__ import annotations

# DeepSeek-V3.2's published config.json (the fields a model is built from; its FP8 weights are
# described by `quantization_config`), for plans and for benchmarks at the real dimensions.
DEEPSEEK_V32 = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    index_topk=2048,
    index_head_dim=128,
    index_n_heads=64,
    num_nextn_predict_layers=1,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)
DEEPSEEK_V32_QUANTIZATION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}


class ModelConfigError(ValueError):
    pass


def context_len(config) -> int:
    """The whole context a checkpoint was made for: `max_position_embeddings`. transformers
    takes it as the context after RoPE scaling, not before: YaRN's factor, when the config gives
    none, is `max_position_embeddings / original_max_position_embeddings`, and no factor is
    applied on top of it (DeepSeek-V3.2: 163840 = 40 x 4096)."""
    return int(config.max_position_embeddings)


def _split(errors: list[str], what: str, value: int, size: int, parallel: str) -> None:
    if value % size:
        errors.append(f"{what}={value} does not split over {parallel}={size}")


def check_model_config(config, tp_size: int = 1, ep_size: int = 1) -> None:
    """Raise ModelConfigError listing every violated constraint of `config` (a transformers
    DeepseekV32Config) for tp_size ranks of which ep_size split the routed experts."""
    errors: list[str] = []
    c = config
    if c.q_lora_rank is None:
        errors.append("q_lora_rank is None: DeepSeek-V3.2's indexer reads the q latent")
    if c.qk_rope_head_dim % 2:
        errors.append(f"qk_rope_head_dim={c.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    if c.index_head_dim < c.qk_rope_head_dim:
        errors.append(
            f"index_head_dim={c.index_head_dim} is smaller than qk_rope_head_dim="
            f"{c.qk_rope_head_dim} (the indexer ropes its first qk_rope_head_dim dims)"
        )
    if c.index_topk < 1:
        errors.append(f"index_topk={c.index_topk} must be at least 1")
    if not 0 <= c.first_k_dense_replace <= c.num_hidden_layers:
        errors.append(
            f"first_k_dense_replace={c.first_k_dense_replace} is outside 0..num_hidden_layers="
            f"{c.num_hidden_layers}"
        )
    experts, groups = c.n_routed_experts, c.n_group
    if experts % groups:
        errors.append(f"n_routed_experts={experts} does not split into n_group={groups} groups")
    elif experts // groups < 2 and groups > 1:
        errors.append(
            f"n_routed_experts={experts} in n_group={groups} groups leaves "
            f"{experts // groups} expert per group; a group's score sums its top 2"
        )
    if not 1 <= c.topk_group <= groups:
        errors.append(f"topk_group={c.topk_group} is outside 1..n_group={groups}")
    elif groups and not experts % groups:
        selectable = c.topk_group * (experts // groups)
        if not 1 <= c.num_experts_per_tok <= selectable:
            errors.append(
                f"num_experts_per_tok={c.num_experts_per_tok} is outside 1..{selectable}, the "
                f"experts that topk_group={c.topk_group} groups of {experts // groups} hold"
            )
    if ep_size < 1 or tp_size < 1 or tp_size % ep_size:
        errors.append(f"ep_size={ep_size} must divide tp_size={tp_size}")
    else:
        _split(errors, "num_attention_heads", c.num_attention_heads, tp_size, "tp_size")
        _split(errors, "intermediate_size", c.intermediate_size, tp_size, "tp_size")
        _split(
            errors,
            "moe_intermediate_size * n_shared_experts",
            c.moe_intermediate_size * c.n_shared_experts,
            tp_size,
            "tp_size",
        )
        _split(errors, "n_routed_experts", experts, ep_size, "ep_size")
        _split(
            errors,
            "moe_intermediate_size",
            c.moe_intermediate_size,
            tp_size // ep_size,
            "tp_size // ep_size",
        )
    if errors:
        raise ModelConfigError("invalid model config: " + "; ".join(errors))
