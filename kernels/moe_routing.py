"""DeepSeek-V3 MoE routing: sigmoid scores, bias-corrected group-limited top-k."""

from __future__ import annotations

import torch

from kernels.launch import FLOAT_DTYPES, check_tensor, launch
from kernels.platform import tl, triton


def moe_route_reference(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    num_groups: int,
    topk_groups: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights fp32 [T, top_k], expert ids int32 [T, top_k]).

    The bias only chooses experts; weights are the unbiased sigmoid scores, renormalized when
    `norm_topk_prob`, times `routed_scaling_factor`. A group's score is the sum of its two best
    biased scores; only the `topk_groups` best groups are eligible.
    """
    num_tokens, num_experts = router_logits.shape
    scores = router_logits.float().sigmoid()
    biased = scores + correction_bias.float()
    group_scores = biased.view(num_tokens, num_groups, -1).topk(2, dim=-1).values.sum(-1)
    group_idx = group_scores.topk(topk_groups, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    expert_mask = group_mask.repeat_interleave(num_experts // num_groups, dim=1).bool()
    ids = biased.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


# --- Triton ---------------------------------------------------------------------------------------


@triton.jit
def _moe_route_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    logits_row_stride,
    routed_scaling_factor,
    NUM_EXPERTS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    TOP_K: tl.constexpr,
    NORM_TOPK_PROB: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_GS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    token = tl.program_id(0)
    group_size: tl.constexpr = NUM_EXPERTS // NUM_GROUPS
    neg_inf = float("-inf")
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    row = logits_ptr + token * logits_row_stride

    # Group scores from a [group, expert-in-group] view: sum of each group's two best.
    g = tl.arange(0, BLOCK_G)[:, None]
    j = tl.arange(0, BLOCK_GS)[None, :]
    mask2d = (g < NUM_GROUPS) & (j < group_size)
    logit2d = tl.load(row + g * group_size + j, mask=mask2d, other=0.0).to(tl.float32)
    bias2d = tl.load(bias_ptr + g * group_size + j, mask=mask2d, other=0.0).to(tl.float32)
    biased2d = tl.where(mask2d, tl.sigmoid(logit2d) + bias2d, neg_inf)
    best = tl.max(biased2d, axis=1)
    best_at = tl.argmax(biased2d, axis=1)
    second = tl.max(tl.where(j == best_at[:, None], neg_inf, biased2d), axis=1)
    group_ids = tl.arange(0, BLOCK_G)
    group_scores = tl.where(group_ids < NUM_GROUPS, best + second, neg_inf)

    # Experts of the TOPK_GROUPS best groups are eligible.
    e = tl.arange(0, BLOCK_E)
    e_mask = e < NUM_EXPERTS
    logits = tl.load(row + e, mask=e_mask, other=0.0).to(tl.float32)
    scores = tl.sigmoid(logits)
    candidates = scores + tl.load(bias_ptr + e, mask=e_mask, other=0.0).to(tl.float32)
    eligible = e < 0
    for _ in tl.static_range(TOPK_GROUPS):
        chosen = tl.argmax(group_scores, axis=0)
        group_scores = tl.where(group_ids == chosen, neg_inf, group_scores)
        eligible = eligible | ((e // group_size) == chosen)
    candidates = tl.where(eligible & e_mask, candidates, neg_inf)

    # Top-k by biased score; weights are the unbiased sigmoid scores.
    k = tl.arange(0, BLOCK_K)
    picked_ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    picked_weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        expert = tl.argmax(candidates, axis=0)
        weight = tl.sum(tl.where(e == expert, scores, 0.0), axis=0)
        candidates = tl.where(e == expert, neg_inf, candidates)
        picked_ids = tl.where(k == i, expert.to(tl.int32), picked_ids)
        picked_weights = tl.where(k == i, weight, picked_weights)
    if NORM_TOPK_PROB:
        picked_weights = picked_weights / (tl.sum(picked_weights, axis=0) + 1e-20)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    k_mask = k < TOP_K
    tl.store(weights_ptr + token * TOP_K + k, picked_weights * routed_scaling_factor, mask=k_mask)
    tl.store(ids_ptr + token * TOP_K + k, picked_ids, mask=k_mask)


def moe_route_triton(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    num_groups: int,
    topk_groups: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `moe_route_reference`: one program per token; ids in descending score."""
    check_tensor("router_logits", router_logits, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(
        "correction_bias", correction_bias, ndim=1, dtypes=FLOAT_DTYPES, device=router_logits.device
    )
    num_tokens, num_experts = router_logits.shape
    if correction_bias.shape[0] != num_experts:
        raise ValueError(
            f"correction_bias has {correction_bias.shape[0]} entries, not {num_experts}"
        )
    if num_experts % num_groups or num_experts // num_groups < 2:
        raise ValueError(f"{num_experts} experts do not split into {num_groups} groups of >= 2")
    if not 0 < topk_groups <= num_groups:
        raise ValueError(f"topk_groups {topk_groups} not in 1..{num_groups}")
    if not 0 < top_k <= topk_groups * (num_experts // num_groups):
        raise ValueError(f"top_k {top_k} exceeds the experts of {topk_groups} groups")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens > 0:
        launch(
            _moe_route_kernel,
            (num_tokens,),
            router_logits,
            router_logits,
            correction_bias,
            weights,
            ids,
            router_logits.stride(0),
            routed_scaling_factor,
            NUM_EXPERTS=num_experts,
            NUM_GROUPS=num_groups,
            TOPK_GROUPS=topk_groups,
            TOP_K=top_k,
            NORM_TOPK_PROB=bool(norm_topk_prob),
            BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_G=triton.next_power_of_2(num_groups),
            BLOCK_GS=triton.next_power_of_2(num_experts // num_groups),
            BLOCK_K=triton.next_power_of_2(top_k),
            num_warps=4,
        )
    return weights, ids
