"""The MTP layer against an independent reference written from the DeepSeek-V3 report (sec. 2.2).

For the k=1 module: h'_i = M [RMSNorm(Emb(t_{i+1})); RMSNorm(h_i)], then one Transformer block over
h'_0..h'_{n-2} with causal attention, then the output head after the module's final norm predicts
t_{i+2}. The reference is assembled from transformers' own DeepSeek-V3.2 decoder layer, norms and
rotary embedding, run densely over the whole sequence; h_i is transformers' final-norm output.
"""

from __future__ import annotations

import copy

import torch
from safetensors import safe_open

from tests.workers.paged_harness import PagedHarness
from tests.workers.test_model_parity import ATOL
from workers.loader import checkpoint_files, load_model


def _mtp_tensors(model_dir: str, n: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, path in checkpoint_files(model_dir).items():
        if name.startswith(f"model.layers.{n}."):
            with safe_open(path, "pt") as f:
                out[name[len(f"model.layers.{n}.") :]] = f.get_tensor(name).float()
    return out


@torch.no_grad()
def reference_mtp_logits(model_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import DeepseekV32ForCausalLM
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as hf

    target = DeepseekV32ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = target.config
    n = config.num_hidden_layers
    w = _mtp_tensors(model_dir, n)
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = n + 1
    cfg.mlp_layer_types = config.mlp_layer_types + ["sparse"]
    block = hf.DeepseekV32DecoderLayer(cfg, n).float().eval()
    state = {
        k: v
        for k, v in w.items()
        if not k.startswith(("enorm", "hnorm", "eh_proj", "shared")) and ".experts." not in k
    }
    experts = range(config.n_routed_experts)
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [
            torch.cat(
                [w[f"mlp.experts.{e}.gate_proj.weight"], w[f"mlp.experts.{e}.up_proj.weight"]]
            )
            for e in experts
        ]
    )
    state["mlp.experts.down_proj"] = torch.stack(
        [w[f"mlp.experts.{e}.down_proj.weight"] for e in experts]
    )
    block.load_state_dict(state, strict=True)

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

    hidden = target.model(tokens[None]).last_hidden_state[0, :-1]  # h_0 .. h_{n-2}
    emb = target.model.embed_tokens(tokens[1:])  # t_1 .. t_{n-1}
    x = torch.cat([rms(emb, w["enorm.weight"]), rms(hidden, w["hnorm.weight"])], -1)
    x = (x @ w["eh_proj.weight"].t())[None]
    seq = x.shape[1]
    positions = torch.arange(seq)[None]
    cos_sin = target.model.rotary_emb(x, positions)
    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    x = block(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
    return rms(x[0], w["shared_head.norm.weight"]) @ target.lm_head.weight.t()


@torch.no_grad()
def test_mtp_layer_matches_independent_reference(tiny_model_dir):
    model, config = load_model(tiny_model_dir, dtype=torch.float32)
    tokens = torch.randint(3, config.vocab_size, (37,), generator=torch.Generator().manual_seed(3))
    expected = reference_mtp_logits(tiny_model_dir, tokens)  # [36, vocab]
    # Ours, paged: the target prefills 37 tokens; the MTP layer then sees (t_{i+1}, h_i) at
    # position i for i = 0..35, in two chunks to exercise its own cache.
    harness = PagedHarness(model, 1, 64)
    hidden = model(tokens, harness.metadata({0: 37}))
    mtp = PagedHarness(model, 1, 64)  # fresh positions 0.. for the MTP layer's cache
    mtp.block_tables = harness.block_tables
    logits = []
    for lo, hi in ((0, 20), (20, 36)):
        meta = mtp.metadata({0: hi - lo})
        logits.append(
            model.mtp_logits(model.mtp_forward(tokens[lo + 1 : hi + 1], hidden[lo:hi], meta)[0])
        )
    got = torch.cat(logits)
    assert 36 > config.index_topk
    assert (got - expected).abs().max() < ATOL
