"""DeepSeek-V3.2 (MLA + lightning indexer + MoE) with its MTP layer, over a paged KV cache.

Module and parameter names follow DeepSeek's checkpoint names, so the loader maps almost 1:1.
Every op goes through `kernels.ops`; tensor parallelism lives inside the `parallel` layers.
Numerics match `transformers`' `DeepseekV32ForCausalLM` (our parity oracle, see tests/workers).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels import ops
from kernels.fp8 import (
    FP8_BLOCK,
    FP8_DTYPE,
    dequantize_fp8_reference,
    scale_grid,
    scales_are_powers_of_two,
)
from kernels.fp8_cache import is_fp8_cache, unpack_fp8_rows_reference
from kernels.fp8_mla_absorb import (
    ABSORB_FP8_MAX_ROWS,
    absorb_out_dense,
    absorb_q_dense,
    fp8_absorbable,
)
from kernels.moe_experts import SharedExpert
from kernels.sparse_mla import latent_cache_layout
from parallel.collectives import tp_all_reduce, tp_compute_on_one_rank
from parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from parallel.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    MergedReplicatedLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from parallel.state import get_parallel_state
from workers.attention_metadata import AttentionMetadata, DenseSpans

INDEXER_NUMERICS = ("exact", "fp8")


def check_indexer_numerics(numerics: str) -> None:
    if numerics not in INDEXER_NUMERICS:
        raise ValueError(f"indexer numerics must be one of {INDEXER_NUMERICS}, got {numerics!r}")


# DeepSeek builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps, not
# config.rms_norm_eps; the indexer's key LayerNorm also uses 1e-6.
LATENT_NORM_EPS = 1e-6
INDEXER_NORM_EPS = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); with no residual yet, (norm(x), x)."""
        if residual is None:
            return self(x), x
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(size, dtype=dtype))
        self.eps = eps


def yarn_softmax_scale(config) -> float:
    """qk_head_dim ** -0.5, times mscale ** 2 under YaRN (DeepSeek's long-context scaling)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        if factor > 1:
            mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0
            scale *= mscale * mscale
    return scale


class Rotary(nn.Module):
    """Inverse frequencies and YaRN attention scaling, computed by `transformers` itself."""

    def __init__(self, config):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope = config.rope_parameters or {"rope_type": "default"}
        rope_type = rope.get("rope_type", "default")
        with torch.device("cpu"):  # also when the model is built on the meta device (a plan)
            inv_freq = self._inv_freq(config, rope, rope_type, ROPE_INIT_FUNCTIONS)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def _inv_freq(self, config, rope: dict, rope_type: str, init_functions) -> torch.Tensor:
        if rope_type == "default":
            dim = config.qk_rope_head_dim
            inv_freq = 1.0 / (
                rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
            )
            self.attention_scaling = 1.0
        else:
            inv_freq, self.attention_scaling = init_functions[rope_type](config, "cpu")
        return inv_freq

    def cos_sin(self, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # One computation per forward, shared by every layer (and the MTP layer's own pass).
        if "cos_sin" not in meta.rope_cache:
            meta.rope_cache["cos_sin"] = ops.rope_cos_sin(
                meta.positions, self.inv_freq, self.attention_scaling
            )
        return meta.rope_cache["cos_sin"]


class Indexer(nn.Module):
    """The lightning indexer: the min(index_topk, pos + 1) past positions each token attends to."""

    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        self.num_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.topk = config.index_topk
        self.wq_b = ReplicatedLinear(config.q_lora_rank, self.num_heads * self.head_dim, dtype)
        # wk (hidden -> one index key) is a part of the attention's q_kv_a_proj, which reads the
        # same input: its output comes in as `k` (see MLAAttention).
        self.k_norm = LayerNorm(self.head_dim, INDEXER_NORM_EPS, dtype)
        # fp32, as DeepSeek and transformers keep it: the head weights decide near-ties.
        self.weights_proj = ReplicatedLinear(config.hidden_size, self.num_heads, torch.float32)
        self.weights_proj.quantizable = False  # read by ops.linear_fp32, in fp32
        # None: every TP rank runs the indexer on its own cache. r: only TP rank r runs it and
        # broadcasts its top-k, so all ranks attend to one token set; the others skip the work
        # (and never write their indexer-key cache: the choice holds for a worker's lifetime).
        self.src_tp_rank: int | None = None
        # Score with FP8-rounded Hadamard-rotated q and k, as deployments do (exact by default).
        self.fp8 = False

    def forward(self, x, q_latent, k, cos_sin, meta, k_cache, rows=None) -> torch.Tensor:
        """-> the top-k positions of each row [T, K], or given `rows` (indices into the step's
        T) of those rows only [len(rows), K]; every row's index key goes into the cache."""
        if self.src_tp_rank is None:
            return self.compute(x, q_latent, k, cos_sin, meta, k_cache, rows)
        return tp_compute_on_one_rank(
            lambda: self.compute(x, q_latent, k, cos_sin, meta, k_cache, rows),
            (x.shape[0] if rows is None else rows.shape[0], self.topk),
            torch.int32,
            x.device,
            self.src_tp_rank,
        )

    def write_keys(self, k, cos_sin, meta, k_cache) -> None:
        """Only the step's index keys into the cache, for the steps after it: a dense step's
        (`AttentionMetadata.dense`), which selects nothing. Where one TP rank runs the indexer,
        only that rank does."""
        if self.src_tp_rank is None or get_parallel_state().tp_rank == self.src_tp_rank:
            self._write_keys(k, cos_sin, meta, k_cache)

    def _write_keys(self, k, cos_sin, meta, k_cache) -> None:
        cos, sin = cos_sin
        k_rows = ops.indexer_k_cache_write(
            k,
            self.k_norm.weight,
            self.k_norm.bias,
            self.k_norm.eps,
            cos,
            sin,
            None if self.fp8 else k_cache,
            meta.slot_mapping,
        )  # [T, index_head_dim]
        if self.fp8:  # the FP8 key cache (e4m3 + a scale per 128) holds what FP8 scoring sees
            ops.fp8_cache_write(
                k_cache, meta.slot_mapping, ops.hadamard_rotate(k_rows), self.head_dim
            )

    def compute(
        self,
        x: torch.Tensor,  # [T, hidden], the attention input (after input_layernorm)
        q_latent: torch.Tensor,  # [T, q_lora_rank], after q_a_layernorm
        k: torch.Tensor,  # [T, index_head_dim], x times wk (before k_norm)
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        # [num_blocks, block_size, index_head_dim]; FP8 rows (144 bytes a 128-wide key) with
        # the fp8 numerics (workers.kv_cache.CacheFormat)
        k_cache: torch.Tensor,
        rows: torch.Tensor | None = None,  # score these rows only (see `forward`)
    ) -> torch.Tensor:
        self._write_keys(k, cos_sin, meta, k_cache)
        cos, sin = cos_sin
        positions, seq_idx = meta.positions, meta.seq_idx
        if rows is not None:
            x, q_latent, cos, sin = x[rows], q_latent[rows], cos[rows], sin[rows]
            positions, seq_idx = positions[rows], seq_idx[rows]
        num_tokens = x.shape[0]
        q = self.wq_b(q_latent).view(num_tokens, self.num_heads, self.head_dim)
        q = ops.rope(q, cos, sin, False, self.rope_dim)  # the first rope_dim dims, half-split
        if self.fp8:
            q = ops.indexer_fp8(q)
        weights = ops.linear_fp32(x, self.weights_proj.weight, self.num_heads**-0.5)  # [T, H]
        return ops.indexer_topk(
            q,
            weights,
            k_cache,
            meta.block_tables,
            seq_idx,
            positions,
            self.topk,
            self.head_dim**-0.5,
        )


class AbsorbedKvB(ColumnParallelLinear):
    """MLA's kv_b_proj, absorbed into q and the output: read per head, never multiplied as a
    linear. An FP8 checkpoint's weight stays FP8 where each head's nope and v parts are whole
    scale blocks (`quantizable`), read by kernels/fp8_mla_absorb.py in steps
    of up to ABSORB_FP8_MAX_ROWS rows; a copy dequantized to the model's dtype is kept beside it
    (a buffer, counted by the memory plan) for larger steps, where the tensor-core bmm wins by far.
    Otherwise the weight is dequantized on load."""

    def __init__(
        self, kv_lora_rank: int, heads: int, nope_dim: int, v_dim: int, dtype: torch.dtype
    ):
        super().__init__(kv_lora_rank, heads * (nope_dim + v_dim), dtype)
        self.quantizable = fp8_absorbable(nope_dim, v_dim)

    def use_fp8(self) -> bool:
        dtype = self.weight.dtype
        if not super().use_fp8():
            return False
        copy = torch.empty(self.weight.shape, dtype=dtype, device=self.weight.device)
        self.register_buffer("dequantized", copy, persistent=False)
        return True

    def scales_loaded(self) -> None:
        super().scales_loaded()
        if self.is_fp8:
            deq = dequantize_fp8_reference(self.weight, self.weight_scale_inv)
            self.dequantized.copy_(deq.to(self.dequantized.dtype))

    def reads_fp8(self, num_rows: int) -> bool:
        return self.is_fp8 and num_rows <= ABSORB_FP8_MAX_ROWS

    def model_dtype_weight(self) -> torch.Tensor:
        return self.dequantized if self.is_fp8 else self.weight


class MLAAttention(nn.Module):
    """Multi-head latent attention, absorbed: attention runs in the kv_lora_rank latent space."""

    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        tp_size = get_parallel_state().tp_size
        self.num_heads = config.num_attention_heads // tp_size
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        heads = config.num_attention_heads
        # q_a_proj, the indexer's wk and kv_a_proj_with_mqa read the same hidden state: one
        # matmul (one pass over x, one launch at decode), the checkpoint's three tensors its
        # parts. In this order DeepSeek-V3.2's parts but the last fill whole 128-row FP8 blocks
        # (1536, 128, then 576), so the merged weight stays FP8; a checkpoint whose q_a does but
        # whose wk does not would have the three dequantized (the layer is FP8 whole or not).
        self.q_kv_a_proj = MergedReplicatedLinear(
            config.hidden_size,
            [config.q_lora_rank, config.index_head_dim, self.kv_lora_rank + self.rope_dim],
            dtype,
        )
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS, dtype)
        self.q_b_proj = ColumnParallelLinear(
            config.q_lora_rank, heads * (self.nope_dim + self.rope_dim), dtype
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = AbsorbedKvB(self.kv_lora_rank, heads, self.nope_dim, self.v_dim, dtype)
        self.o_proj = RowParallelLinear(heads * self.v_dim, config.hidden_size, dtype)
        self.indexer = Indexer(config, dtype)
        self.softmax_scale = yarn_softmax_scale(config)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        # [num_blocks, block_size, kv_lora_rank + rope_dim], or FP8 rows (kv_cache_dtype="fp8":
        # e4m3 latent + scales + RoPE part in the model's dtype); ops write and read either
        kv_cache: torch.Tensor,
        index_cache: torch.Tensor,  # [num_blocks, block_size, index_head_dim] (or FP8 rows)
        topk: torch.Tensor | None = None,  # [T, K] positions to attend to; None: the indexer's
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (output [T, hidden], the top-k positions attended to [T, K], None in a step with
        dense rows, `meta.dense`). Given `topk`, the indexer does no work at all (MTP draft
        steps that share step 0's selection)."""
        cos, sin = cos_sin
        num_tokens = x.shape[0]
        # [T, q_lora], [T, index_head_dim], [T, kv_lora + rope]
        q_a, index_k, kv_a = self.q_kv_a_proj.split(self.q_kv_a_proj(x))
        q_latent = self.q_a_layernorm(q_a)
        q = self.q_b_proj(q_latent).view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = ops.rope(q_rope, cos, sin, True)
        ops.mla_kv_cache_write(
            kv_a,
            self.kv_a_layernorm.weight,
            self.kv_a_layernorm.eps,
            cos,
            sin,
            kv_cache,
            meta.slot_mapping,
        )
        dense = meta.dense if topk is None else None
        if dense is not None and dense.sparse_rows is None:  # every row dense
            self.indexer.write_keys(index_k, cos_sin, meta, index_cache)
            return self.o_proj(self._dense(q_nope, q_rope, kv_cache, dense)), None
        # The rows on the sparse path: every row, or where a step mixes dense prompt chunks
        # with other work, the others (their top-k, their attention).
        rows = None if dense is None else dense.sparse_rows
        seq_idx, whole_q = meta.seq_idx, (q_nope, q_rope)
        if rows is not None:
            q_nope, q_rope, seq_idx = q_nope[rows], q_rope[rows], seq_idx[rows]
        # A token at p uses only the first min(K, p + 1) entries of the indexer's row (its picks
        # come first, then -1): the attention walks no further. A row shared across draft steps
        # has the steps' own positions after the kept row's padding, so it is walked whole.
        used_positions = None
        if topk is None:
            topk = self.indexer(x, q_latent, index_k, cos_sin, meta, index_cache, rows)
            used_positions = meta.positions if rows is None else meta.positions[rows]
        q_absorbed = self._absorb_q(q_nope)  # [T, H, kv_lora]
        out_latent = ops.sparse_mla_attention(
            q_absorbed,  # read in place beside q_rope: no [T, H, kv_lora + rope] copy
            kv_cache,
            meta.block_tables,
            seq_idx,
            topk,
            self.softmax_scale,
            self.kv_lora_rank,
            q_rope,
            used_positions,
        )  # [T, H, kv_lora_rank]
        out = self._absorb_out(out_latent).reshape(q_nope.shape[0], -1)  # [T, H * v]
        if dense is not None:  # the dense rows' attention beside the sparse rows'
            whole = out.new_empty(num_tokens, out.shape[1])
            whole[rows] = out
            dense_q = (part[dense.rows] for part in whole_q)
            whole[dense.rows] = self._dense(*dense_q, kv_cache, dense)
            return self.o_proj(whole), None
        return self.o_proj(out), topk

    def _dense(self, q_nope, q_rope, kv_cache, dense: DenseSpans) -> torch.Tensor:
        """The attention of a step's rows that see no more positions than the indexer keeps
        (`AttentionMetadata.dense`; q_nope and q_rope theirs, [R, H, .]): every such token
        attends to every position up to its own, so the sparse attention is plain causal
        attention. It runs unabsorbed, as DeepSeek's reference prefills: each sequence's
        latents up-projected through kv_b_proj into keys and values (576 + 512 multiply-adds
        per query head and key become 192 + 128), then one flash-attention launch over all of
        them. -> [R, H * v]."""
        num_tokens, num_heads = q_nope.shape[:2]
        rows = kv_cache.view(-1, kv_cache.shape[-1])
        if is_fp8_cache(kv_cache):
            width = self.kv_lora_rank + self.rope_dim
            layout = latent_cache_layout(self.kv_lora_rank, width, q_nope.dtype)
            picked = unpack_fp8_rows_reference(rows[dense.key_slots], layout).to(q_nope.dtype)
        else:
            picked = rows[dense.key_slots]  # [S, kv_lora + rope]
        latent, k_rope = picked.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        weight = self.kv_b_proj.model_dtype_weight()  # [H * (nope + v), kv_lora]
        kv = torch.matmul(latent, weight.t()).view(-1, num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        num_keys = kv.shape[0]
        k = torch.cat([k_nope, k_rope[:, None, :].expand(num_keys, num_heads, self.rope_dim)], -1)
        q = torch.cat([q_nope, q_rope], -1)
        out = ops.varlen_causal_attention(
            q, k, v, dense.cu_q, dense.cu_k, dense.q_lens, dense.k_lens, self.softmax_scale
        )  # [T, H, v]
        return out.reshape(num_tokens, num_heads * self.v_dim)

    def _absorb_q(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, nope] -> [T, H, kv_lora]: each head's q times its W_UK."""
        kv_b = self.kv_b_proj
        if kv_b.reads_fp8(q_nope.shape[0]):
            return ops.mla_absorb_q(
                q_nope, kv_b.weight, kv_b.weight_scale_inv, self.v_dim, kv_b.pow2_scales
            )
        return absorb_q_dense(q_nope, kv_b.model_dtype_weight(), self.v_dim)

    def _absorb_out(self, out_latent: torch.Tensor) -> torch.Tensor:
        """[T, H, kv_lora] -> [T, H, v]: each head's attention output times its W_UV^T."""
        kv_b = self.kv_b_proj
        if kv_b.reads_fp8(out_latent.shape[0]):
            return ops.mla_absorb_out(
                out_latent, kv_b.weight, kv_b.weight_scale_inv, self.nope_dim, kv_b.pow2_scales
            )
        return absorb_out_dense(out_latent, kv_b.model_dtype_weight(), self.nope_dim)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, reduce_results=True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate, intermediate], dtype)
        self.down_proj = RowParallelLinear(intermediate, hidden, dtype, reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class Gate(nn.Module):
    def __init__(self, config):
        super().__init__()
        # fp32 as in DeepSeek's reference: routing decisions are discontinuous.
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.n_routed_experts), requires_grad=False
        )


class Experts(nn.Module):
    """This rank's routed experts: w13 [E_local, 2 * I_local, hidden], w2 [E_local, hidden,
    I_local]."""

    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        state = get_parallel_state()
        self.num_experts = config.n_routed_experts
        if self.num_experts % state.ep_size:
            raise ValueError(
                f"{self.num_experts} experts do not split over ep_size={state.ep_size}"
            )
        self.num_local = self.num_experts // state.ep_size
        self.first_expert = state.ep_rank * self.num_local
        inter = config.moe_intermediate_size
        if inter % state.expert_tp_size:
            raise ValueError(f"moe_intermediate_size={inter} does not split over TP")
        self.inter_full = inter
        self.inter_local = inter // state.expert_tp_size
        self.inter_offset = state.expert_tp_rank * self.inter_local
        hidden = config.hidden_size
        self.w13 = nn.Parameter(
            torch.empty(self.num_local, 2 * self.inter_local, hidden, dtype=dtype)
        )
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden, self.inter_local, dtype=dtype))
        self.w13.weight_loader = self.load_w13
        self.w2.weight_loader = self.load_w2

    # Every scale a power of two (DeepSeek-V3.1 and later, UE8M0): set by `scales_loaded`.
    pow2_scales = False

    @property
    def is_fp8(self) -> bool:
        return self.w13.dtype == FP8_DTYPE

    def scales_loaded(self) -> None:
        """Once the weights and scales are in place: note whether every scale is a power of two
        (then the kernels scale partial products, not weight elements)."""
        self.pow2_scales = (
            self.is_fp8
            and scales_are_powers_of_two(self.w13_scale_inv)
            and scales_are_powers_of_two(self.w2_scale_inv)
        )

    def use_fp8(self) -> bool:
        """Keep the experts' weights FP8 with their 128x128 block scales (gate and up each in
        its own grid: I need not fill whole blocks). Raises ValueError where expert TP would cut
        a block."""
        if self.inter_full != self.inter_local and self.inter_local % FP8_BLOCK:
            ways = self.inter_full // self.inter_local
            raise ValueError(
                f"moe_intermediate_size={self.inter_full} split {ways} ways gives "
                f"{self.inter_local} rows, which cuts the checkpoint's "
                f"{FP8_BLOCK}x{FP8_BLOCK} FP8 scale blocks unevenly"
            )
        e, i, h = self.num_local, self.inter_local, self.w13.shape[2]
        blocks_i, blocks_h = scale_grid(i, h)
        device = self.w13.device

        def frozen(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), False)

        self.w13 = frozen(e, 2 * i, h, dtype=FP8_DTYPE)
        self.w2 = frozen(e, h, i, dtype=FP8_DTYPE)
        self.w13_scale_inv = frozen(e, 2, blocks_i, blocks_h, dtype=torch.float32)
        self.w2_scale_inv = frozen(e, blocks_h, blocks_i, dtype=torch.float32)
        self.w13.weight_loader = self.load_w13
        self.w2.weight_loader = self.load_w2
        self.w13_scale_inv.weight_loader = self.load_w13_scale
        self.w2_scale_inv.weight_loader = self.load_w2_scale
        return True

    def load_w13_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        expert, part = shard_id
        if (e := self._local(expert)) is not None:
            blocks = param.shape[2]
            rows = loaded.float().narrow(0, self.inter_offset // FP8_BLOCK, blocks)
            param.data[e, part].copy_(rows)

    def load_w2_scale(self, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        if (e := self._local(shard_id)) is not None:
            blocks = param.shape[2]
            param.data[e].copy_(loaded.float().narrow(1, self.inter_offset // FP8_BLOCK, blocks))

    def _local(self, expert: int) -> int | None:
        e = expert - self.first_expert
        return e if 0 <= e < self.num_local else None

    def load_w13(self, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        expert, part = shard_id  # part 0 = gate_proj, 1 = up_proj
        expected = (self.inter_full, param.shape[2])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expected {expected}, got {tuple(loaded.shape)}")
        if (e := self._local(expert)) is not None:
            rows = loaded.narrow(0, self.inter_offset, self.inter_local)
            param.data[e, part * self.inter_local : (part + 1) * self.inter_local].copy_(rows)

    def load_w2(self, param: torch.Tensor, loaded: torch.Tensor, shard_id) -> None:
        expected = (param.shape[1], self.inter_full)
        if tuple(loaded.shape) != expected:
            raise ValueError(f"expected {expected}, got {tuple(loaded.shape)}")
        if (e := self._local(shard_id)) is not None:
            param.data[e].copy_(loaded.narrow(1, self.inter_offset, self.inter_local))


class MoE(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.gate = Gate(config)
        self.experts = Experts(config, dtype)
        self.shared_experts = MLP(
            config.hidden_size,
            config.moe_intermediate_size * config.n_shared_experts,
            dtype,
            reduce_results=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        router_logits = ops.linear_fp32(x, self.gate.weight)  # [T, E]
        weights, ids = ops.moe_route(
            router_logits,
            self.gate.e_score_correction_bias,
            c.n_group,
            c.topk_group,
            c.num_experts_per_tok,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )
        experts = self.experts
        shared = self._shared_expert()
        if shared is not None and not ops.moe_takes_shared(
            x, experts.w13, experts.w2, experts.pow2_scales, shared
        ):
            shared = None
        routed = ops.grouped_moe(
            x,
            experts.w13,
            experts.w2,
            weights,
            ids,
            experts.first_expert,
            getattr(experts, "w13_scale_inv", None),
            getattr(experts, "w2_scale_inv", None),
            pow2_scales=experts.pow2_scales,
            num_experts=c.n_routed_experts,
            shared=shared,
        )
        if shared is None:
            routed = routed + self.shared_experts(x)
        # One all-reduce sums the shared expert's row-parallel partials and every rank's experts.
        return tp_all_reduce(routed)

    def _shared_expert(self) -> SharedExpert | None:
        """The shared expert's FP8 weights as one more expert, for the routed experts' one-token
        launches (None: bf16, or its shape is not this rank's routed experts')."""
        mlp = self.shared_experts
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        if not (gate_up.is_fp8 and down.is_fp8):
            return None
        return SharedExpert(
            gate_up.weight,
            down.weight,
            gate_up.weight_scale_inv,
            down.weight_scale_inv,
            gate_up.pow2_scales and down.pow2_scales,
        )


def is_moe_layer(config, layer_idx: int) -> bool:
    types = getattr(config, "mlp_layer_types", None)
    if types is not None and layer_idx < len(types):
        return types[layer_idx] == "sparse"
    return layer_idx >= config.first_k_dense_replace


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = MLAAttention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if is_moe_layer(config, layer_idx):
            self.mlp = MoE(config, dtype)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, dtype)

    def forward(
        self, h, residual, cos_sin, meta, kv_cache, index_cache, topk=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual stream is `residual + h` (residual None: `h`); returns the MLP output
        and the stream before it, so each residual add is fused into the next norm, and the
        top-k positions its attention used."""
        x, residual = self.input_layernorm.add_forward(h, residual)
        h, topk = self.self_attn(x, cos_sin, meta, kv_cache, index_cache, topk)
        x, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(x), residual, topk


class SharedHead(nn.Module):
    def __init__(self, config, dtype: torch.dtype):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.head: ParallelLMHead | None = None  # set to the checkpoint's or the main lm_head


class MTPLayer(DecoderLayer):
    """DeepSeek-V3's multi-token-prediction module (checkpoint prefix model.layers.{N}).

    h' = eh_proj([enorm(embed(token_{i+1})), hnorm(h_i)]), one full decoder layer (its own indexer
    and MoE), then shared_head.norm; logits through shared_head.head. The output after the norm is
    also the hidden state the next draft step is fed.
    """

    def __init__(self, config, layer_idx: int, dtype: torch.dtype):
        super().__init__(config, layer_idx, dtype)
        hidden = config.hidden_size
        self.embed_tokens: VocabParallelEmbedding | None = None
        self.enorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps, dtype)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, dtype)
        self.shared_head = SharedHead(config, dtype)

    def forward(self, input_ids, prev_hidden, cos_sin, meta, kv_cache, index_cache, topk=None):
        e = self.enorm(self.embed_tokens(input_ids))
        h = self.eh_proj(torch.cat([e, self.hnorm(prev_hidden)], dim=-1))
        h, residual, topk = super().forward(h, None, cos_sin, meta, kv_cache, index_cache, topk)
        return self.shared_head.norm.add_forward(h, residual)[0], topk


class DeepseekV32ForCausalLM(nn.Module):
    """Target model plus (optionally) its MTP layer; caches are bound by the model runner.

    `kv_caches[i]` / `index_caches[i]` are layer i's latent and indexer-key caches; index
    num_hidden_layers is the MTP layer's.
    """

    def __init__(self, config, dtype: torch.dtype = torch.bfloat16, with_mtp: bool = True):
        super().__init__()
        self.config = config
        self.dtype = dtype
        n = config.num_hidden_layers
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, dtype
        )
        self.model.layers = nn.ModuleList([DecoderLayer(config, i, dtype) for i in range(n)])
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head = None
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, dtype)
        self.rotary = Rotary(config)
        self.mtp = MTPLayer(config, n, dtype) if with_mtp else None
        self.kv_caches: list[torch.Tensor] = []
        self.index_caches: list[torch.Tensor] = []

    @property
    def head(self) -> nn.Module:
        return self.lm_head if self.lm_head is not None else self.model.embed_tokens

    def bind_caches(self, kv_caches: list[torch.Tensor], index_caches: list[torch.Tensor]) -> None:
        self.kv_caches, self.index_caches = kv_caches, index_caches

    def set_indexer_numerics(self, numerics: str) -> None:
        """ "exact" (transformers' numerics, the default) or "fp8" (DeepSeek's deployed indexer)."""
        check_indexer_numerics(numerics)
        for module in self.modules():
            if isinstance(module, Indexer):
                module.fp8 = numerics == "fp8"

    def set_topk_source(self, src_tp_rank: int | None) -> None:
        """Which TP rank runs the indexers (None: every rank); see Indexer.src_tp_rank."""
        for module in self.modules():
            if isinstance(module, Indexer):
                module.src_tp_rank = src_tp_rank

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids [T] -> hidden states after the final norm [T, hidden]."""
        cos_sin = self.rotary.cos_sin(meta)
        h, residual = self.model.embed_tokens(input_ids), None
        for i, layer in enumerate(self.model.layers):
            h, residual, _ = layer(
                h, residual, cos_sin, meta, self.kv_caches[i], self.index_caches[i]
            )
        return self.model.norm.add_forward(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return ParallelLMHead.forward(self.head, hidden).float()

    def mtp_forward(
        self,
        input_ids: torch.Tensor,  # [T] token i+1
        prev_hidden: torch.Tensor,  # [T, hidden] hidden state i
        meta: AttentionMetadata,
        topk: torch.Tensor | None = None,  # [T, K] to skip the MTP indexer; None: run it
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP step -> (MTP hidden after shared_head.norm [T, hidden], top-k used [T, K])."""
        n = self.config.num_hidden_layers
        return self.mtp(
            input_ids,
            prev_hidden,
            self.rotary.cos_sin(meta),
            meta,
            self.kv_caches[n],
            self.index_caches[n],
            topk,
        )

    def mtp_logits(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        return ParallelLMHead.forward(self.mtp.shared_head.head, mtp_hidden).float()
