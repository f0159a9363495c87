"""A full-sequence, differentiable DeepSeek-V3.2 + MTP for training (batch-first, no KV cache).

Same math as the serving model (workers/model.py) and `transformers`' DeepseekV32: MLA with
interleaved RoPE on the last qk_rope_head_dim dims, the lightning indexer with half-split RoPE on
its first qk_rope_head_dim dims, sigmoid-gated group-limited MoE whose e_score_correction_bias
only chooses experts, and the MTP layer. Module names are DeepSeek's checkpoint names; the one
exception is the routed experts, stacked into `mlp.experts.w13` [E, 2I, D] / `w2` [E, D, I]
(export.py splits them into experts.{e}.{gate,up,down}_proj).

Attention is computed explicitly (not flash) because the indexer is distilled from its
head-summed probabilities. Every attention takes a boolean `allowed` mask [S, T] over its keys;
the MTP layer's second unrolled step attends to the first step's keys at earlier positions and to
its own key at the diagonal, which is what a serving draft step sees in the MTP KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm, as in DeepSeek (not rms_norm_eps)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """MLA RoPE: pairs (x0, x1), (x2, x3)... rotated; output laid out [evens', odds'] like
    transformers (q and k get the same permutation, so q.k is that of in-place rotation).
    x [..., S, *, r]; cos/sin [S, r/2] broadcast over the head axis given by the caller."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Indexer RoPE: NeoX half-split."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@dataclass
class Keys:
    """One attention's keys, kept so that MTP step 2 can attend to step 1's positions."""

    k_nope: torch.Tensor  # [B, T, H, nope]
    k_rope: torch.Tensor  # [B, T, r]
    v: torch.Tensor  # [B, T, H, v]
    index_k: torch.Tensor  # [B, T, index_head_dim]


@dataclass
class AttnAux:
    index_loss: torch.Tensor  # scalar: cross-entropy of the indexer against attention (= KL + H)
    index_kl: torch.Tensor  # scalar, for logging
    recall: torch.Tensor  # scalar: attention mass inside the indexer's top-k


class Indexer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope_dim, self.topk = cfg.qk_rope_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)

    def keys(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        k = self.k_norm(self.wk(x))  # [B, S, Di]
        r = self.rope_dim
        return torch.cat([rope_half(k[..., :r], cos, sin), k[..., r:]], -1)

    def scores(self, x, q_latent, index_k, cos, sin) -> torch.Tensor:
        """[B, S, T] index scores: sum_h w[s,h] * relu(q[s,h] . k[t] / sqrt(Di))."""
        b, s, _ = x.shape
        q = self.wq_b(q_latent).view(b, s, self.n_heads, self.head_dim)
        r = self.rope_dim
        q = torch.cat([rope_half(q[..., :r], cos[:, None], sin[:, None]), q[..., r:]], -1)
        logits = torch.einsum("bshd,btd->bsht", q, index_k) * self.head_dim**-0.5
        w = F.linear(x.float(), self.weights_proj.weight.float()) * self.n_heads**-0.5
        return torch.einsum("bsh,bsht->bst", w, F.relu(logits)).float()


class MLAAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h = cfg.num_attention_heads
        self.nope, self.rope, self.vdim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.h * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            cfg.hidden_size, cfg.kv_lora_rank + self.rope, bias=False
        )
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, self.h * (self.nope + self.vdim), bias=False)
        self.o_proj = nn.Linear(self.h * self.vdim, cfg.hidden_size, bias=False)
        self.indexer = Indexer(cfg)
        self.scale = (self.nope + self.rope) ** -0.5  # default RoPE: no YaRN mscale

    def forward(self, x, cos, sin, allowed, sparse: bool, ctx: Keys | None = None):
        """x [B, S, D]; allowed [S, T] bool over keys (T = S, or 2S with ctx prepended).

        Returns (out [B, S, D], this call's Keys, AttnAux)."""
        b, s, _ = x.shape
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).view(b, s, self.h, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], -1)
        q_rope = rope_interleaved(q_rope, cos[:, None], sin[:, None])
        kv_latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_latent)).view(
            b, s, self.h, self.nope + self.vdim
        )
        k_nope, v = kv.split([self.nope, self.vdim], -1)
        # The indexer learns only from its own loss: its inputs are cut from the graph.
        x_d, q_latent_d = x.detach(), q_latent.detach()
        own = Keys(k_nope, rope_interleaved(k_rope, cos, sin), v, self.indexer.keys(x_d, cos, sin))
        keys = (
            own
            if ctx is None
            else Keys(
                *(
                    torch.cat([c, o], 1)
                    for c, o in zip(
                        (ctx.k_nope, ctx.k_rope, ctx.v, ctx.index_k),
                        (own.k_nope, own.k_rope, own.v, own.index_k),
                    )
                )
            )
        )
        index = self.indexer.scores(x_d, q_latent_d, keys.index_k, cos, sin)  # [B, S, T]
        index = index.masked_fill(~allowed, float("-inf"))
        if sparse and index.shape[-1] > self.indexer.topk:
            top = index.topk(self.indexer.topk, dim=-1).indices
            selected = torch.zeros_like(index, dtype=torch.bool).scatter_(-1, top, True)
            selected &= allowed  # rows with fewer allowed keys than topk: all of them
        else:
            selected = allowed.expand_as(index)
        logits = (
            torch.einsum("bshd,bthd->bhst", q_nope, keys.k_nope)
            + torch.einsum("bshd,btd->bhst", q_rope, keys.k_rope)
        ).float() * self.scale
        logits = logits.masked_fill(~selected[:, None], float("-inf"))
        probs = logits.softmax(-1)  # [B, H, S, T] fp32
        out = torch.einsum("bhst,bthd->bshd", probs.to(v.dtype), keys.v).reshape(b, s, -1)
        # Indexer distillation target: head-summed attention, L1-normalized (DeepSeek-V3.2).
        target = probs.detach().sum(1)
        target = target / target.sum(-1, keepdim=True)
        logq = index.masked_fill(~selected, float("-inf")).log_softmax(-1)
        logq = logq.masked_fill(~selected, 0.0)
        ce = -(target * logq).sum(-1).mean()
        ent = (target * target.clamp_min(1e-30).log()).sum(-1).mean()
        with torch.no_grad():
            if index.shape[-1] > self.indexer.topk:
                top = index.topk(self.indexer.topk, dim=-1).indices
                recall = target.gather(-1, top).sum(-1).mean()
            else:
                recall = torch.ones((), device=x.device)
        return self.o_proj(out), own, AttnAux(ce, ce + ent, recall)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        # Aux-loss-free balancing (DeepSeek-V3): moved by sign(mean load - load), never by grad.
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))


class Experts(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, d))  # gate rows then up rows
        self.w2 = nn.Parameter(torch.empty(e, d, i))


class MoE(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.gate = Gate(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
        self.last_load: torch.Tensor | None = None  # [E] token counts of the last forward

    def route(self, x: torch.Tensor):
        """x [N, D] -> (weights [N, K], ids [N, K], scores [N, E]); as transformers' router."""
        c = self.cfg
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()  # [N, E]
        choice = scores.detach() + self.gate.e_score_correction_bias
        n, e = choice.shape
        grouped = choice.view(n, c.n_group, e // c.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
        keep = group_scores.topk(c.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(e // c.n_group, 1), float("-inf"))
        ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, ids, scores

    def forward(self, x: torch.Tensor):
        """x [B, S, D] -> (out, sequence-wise balance loss)."""
        c = self.cfg
        b, s, d = x.shape
        flat = x.reshape(-1, d)
        weights, ids, scores = self.route(flat)
        e = c.n_routed_experts
        combine = torch.zeros(flat.shape[0], e, device=x.device, dtype=weights.dtype)
        combine = combine.scatter(1, ids, weights)  # [N, E], differentiable in weights
        # Dense over experts: at this size an all-expert batched GEMM beats gather/scatter, and
        # unselected experts get exactly zero gradient through combine == 0.
        h = torch.einsum("nd,efd->nef", flat, self.experts.w13.to(flat.dtype))  # [N, E, 2I]
        g, u = h.chunk(2, dim=-1)
        act = F.silu(g) * u * combine.to(h.dtype)[..., None]
        routed = torch.einsum("nei,edi->nd", act, self.experts.w2.to(act.dtype))
        out = routed.view(b, s, d) + self.shared_experts(x)
        with torch.no_grad():
            load = torch.zeros(e, device=x.device).scatter_add_(
                0, ids.reshape(-1), torch.ones(ids.numel(), device=x.device)
            )
            self.last_load = load if self.last_load is None else self.last_load + load
        # Sequence-wise balance loss (DeepSeek-V3 eq. 17-20), weighted by alpha outside.
        k = c.num_experts_per_tok
        counts = torch.zeros(b, e, device=x.device).scatter_add_(
            1, ids.view(b, s * k), torch.ones(b, s * k, device=x.device)
        )
        f = counts * e / (k * s)
        p = (scores / scores.sum(-1, keepdim=True)).view(b, s, e).mean(1)
        return out, (f * p).sum(-1).mean()


def is_moe_layer(cfg, layer_idx: int) -> bool:
    return layer_idx >= cfg.first_k_dense_replace


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = (
            MoE(cfg)
            if is_moe_layer(cfg, layer_idx)
            else MLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(self, h, cos, sin, allowed, sparse, ctx=None):
        a, keys, aux = self.self_attn(self.input_layernorm(h), cos, sin, allowed, sparse, ctx)
        h = h + a
        if isinstance(self.mlp, MoE):
            m, bal = self.mlp(self.post_attention_layernorm(h))
        else:
            m, bal = self.mlp(self.post_attention_layernorm(h)), h.new_zeros((), dtype=torch.float)
        return h + m, keys, aux, bal


class SharedHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    def __init__(self, cfg, layer_idx: int):
        super().__init__(cfg, layer_idx)
        d = cfg.hidden_size
        self.enorm = RMSNorm(d, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(cfg)

    def forward(self, emb, prev_hidden, cos, sin, allowed, sparse, ctx=None):
        """emb: embeddings of the shifted tokens; prev_hidden: the main model's hidden state
        after its final norm (step 1) or this layer's previous output after shared_head.norm
        (later steps). Returns the output after shared_head.norm, as served."""
        h = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(prev_hidden)], -1))
        h, keys, aux, bal = super().forward(h, cos, sin, allowed, sparse, ctx)
        return self.shared_head.norm(h), keys, aux, bal


@dataclass
class Losses:
    main: torch.Tensor
    mtp: list[torch.Tensor]  # one per unrolled MTP step
    index: torch.Tensor  # sum over attentions
    index_kl: torch.Tensor
    index_recall: torch.Tensor
    balance: torch.Tensor
    mtp_acc: list[torch.Tensor]  # greedy accuracy of each MTP step (acceptance proxy)


class DeepseekV32ForTraining(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        n = cfg.num_hidden_layers
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList([DecoderLayer(cfg, i) for i in range(n)])
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MTPLayer(cfg, n)
        dim = cfg.qk_rope_head_dim
        theta = cfg.rope_parameters["rope_theta"]
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_weights(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        n_resid = 2 * (self.config.num_hidden_layers + 1)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "norm" in name:
                    if name.endswith("bias"):
                        p.zero_()
                    else:
                        p.fill_(1.0)
                    continue
                std = 0.02
                if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2")):
                    std = 0.02 / n_resid**0.5
                p.copy_(torch.randn(p.shape, generator=gen) * std)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def cos_sin(self, seq_len: int, device):
        pos = torch.arange(seq_len, device=device, dtype=torch.float)
        freqs = pos[:, None] * self.inv_freq.to(device)[None]  # [S, r/2]
        return freqs.cos(), freqs.sin()

    def forward(self, tokens: torch.Tensor, sparse: bool, mtp_steps: int = 2) -> Losses:
        """tokens [B, S + 1 + mtp_steps]: main predicts tokens[:, 1:S+1] from tokens[:, :S];
        MTP step d (1-based) at position i takes token i+d and predicts token i+d+1."""
        _b, total = tokens.shape
        s = total - 1 - mtp_steps
        cos, sin = self.cos_sin(s, tokens.device)
        causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()
        embed = self.model.embed_tokens
        h = embed(tokens[:, :s])
        index_losses, kls, recalls, bals = [], [], [], []
        for layer in self.model.layers:
            h, _, aux, bal = layer(h, cos, sin, causal, sparse)
            index_losses.append(aux.index_loss), kls.append(aux.index_kl)
            recalls.append(aux.recall), bals.append(bal)
        h = self.model.norm(h)
        main = F.cross_entropy(
            self.lm_head(h).float().flatten(0, 1), tokens[:, 1 : s + 1].flatten()
        )
        mtp_losses, accs = [], []
        prev, ctx = h, None
        # Step 2 sees step 1's keys before its own position, and its own key at the diagonal.
        mixed = torch.cat(
            [causal.tril(-1), torch.eye(s, dtype=torch.bool, device=causal.device)], 1
        )
        for d in range(1, mtp_steps + 1):
            allowed = causal if ctx is None else mixed
            g, keys, aux, bal = self.mtp(
                embed(tokens[:, d : s + d]), prev, cos, sin, allowed, sparse, ctx
            )
            logits = self.lm_head(g).float()
            target = tokens[:, d + 1 : s + d + 1]
            mtp_losses.append(F.cross_entropy(logits.flatten(0, 1), target.flatten()))
            accs.append((logits.argmax(-1) == target).float().mean())
            index_losses.append(aux.index_loss), kls.append(aux.index_kl)
            recalls.append(aux.recall), bals.append(bal)
            if ctx is None:
                ctx = keys
            prev = g
        return Losses(
            main,
            mtp_losses,
            torch.stack(index_losses).sum(),
            torch.stack(kls).mean(),
            torch.stack(recalls).mean(),
            torch.stack(bals).sum(),
            accs,
        )

    @torch.no_grad()
    def update_balance_bias(self, gamma: float) -> None:
        """DeepSeek-V3's aux-loss-free balancing: bias += gamma * sign(mean load - load)."""
        for moe in self.moe_layers():
            if moe.last_load is not None:
                load = moe.last_load
                moe.gate.e_score_correction_bias += gamma * torch.sign(load.mean() - load)
                moe.last_load = None
