"""`mtpserve make-tiny-model`: a complete, deterministic, tiny DeepSeek-V3.2 checkpoint.

config.json + safetensors in DeepSeek's tensor names (written by `transformers`' own
save_pretrained, plus the MTP layer at model.layers.{num_hidden_layers}) + a byte-level BPE
tokenizer with a chat template. Small enough for fast tests; sequences past `index_topk` (16)
make the indexer really drop tokens.
"""

from __future__ import annotations

import json
import os
import random

import torch

TINY_CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=16,
    v_head_dim=16,
    qk_nope_head_dim=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    index_topk=16,
    index_head_dim=32,
    index_n_heads=16,
    num_nextn_predict_layers=1,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
    tie_word_embeddings=False,
)


def random_config(seed: int) -> dict:
    """A small valid DeepSeek-V3.2 config drawn from `seed`: overrides of TINY_CONFIG.

    Varies what one fixture cannot: head counts (1, odd, even), LoRA ranks, nope/rope/v dims,
    index_topk below and above typical prompt lengths, indexer heads and dims (few heads make
    exact score ties common), dense-layer count, expert count / groups / top-k, norm_topk_prob,
    the scaling factor, YaRN or default RoPE. Every draw satisfies the constraints that
    `workers.model_config.check_model_config` enforces (at TP=1).
    """
    rng = random.Random(seed)
    rope_dim = rng.choice([4, 8, 16])
    num_groups = rng.choice([1, 2, 3, 4])
    per_group = rng.choice([2, 3, 4])  # a group's score sums its top 2: at least 2 experts
    topk_group = rng.randint(1, num_groups)
    layers = rng.randint(1, 3)
    heads = rng.choice([1, 2, 3, 4, 5])
    cfg = dict(
        hidden_size=rng.choice([32, 48, 64]),
        intermediate_size=rng.choice([48, 64, 96]),
        moe_intermediate_size=rng.choice([16, 24, 32]),
        num_hidden_layers=layers,
        first_k_dense_replace=rng.randint(0, layers - 1),  # the last layer is MoE (MTP copies it)
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=rng.choice([16, 24, 40]),
        kv_lora_rank=rng.choice([16, 24, 32]),
        qk_nope_head_dim=rng.choice([8, 16, 24]),
        qk_rope_head_dim=rope_dim,
        v_head_dim=rng.choice([8, 12, 16]),
        n_shared_experts=rng.choice([1, 2]),
        n_routed_experts=num_groups * per_group,
        n_group=num_groups,
        topk_group=topk_group,
        num_experts_per_tok=rng.randint(1, min(4, topk_group * per_group)),
        norm_topk_prob=rng.random() < 0.5,
        routed_scaling_factor=rng.choice([1.0, 1.5, 2.5]),
        index_topk=rng.choice([4, 8, 12, 20, 32]),
        index_n_heads=rng.choice([1, 2, 3, 4, 8]),
        index_head_dim=rope_dim + rng.choice([0, 8, 16]),  # the indexer ropes its first dims
    )
    if rng.random() < 0.4:
        factor = rng.choice([2.0, 4.0])
        cfg["rope_parameters"] = {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": factor,
            "original_max_position_embeddings": int(
                TINY_CONFIG["max_position_embeddings"] / factor
            ),
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        }
    return cfg


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = [
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]


def _tokenizer_corpus() -> list[str]:
    """Text every machine has: a few modules of Python's own standard library, read in order."""
    import json as json_mod
    import textwrap

    paths = [textwrap.__file__, json_mod.__file__]
    return [open(p, encoding="utf-8").read() for p in paths]


def train_tokenizer(vocab_size: int, out_dir: str, corpus: list[str] | None = None) -> None:
    """Byte-level BPE (deterministic for a given corpus) saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus if corpus is not None else _tokenizer_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def _init_(t: torch.Tensor, gen: torch.Generator, name: str) -> None:
    if name.endswith("norm.weight") or "layernorm" in name or "norm" in name.split(".")[-2]:
        t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=gen))
    elif name.endswith("bias"):
        t.copy_(0.1 * torch.randn(t.shape, generator=gen))
    else:
        fan_in = t.shape[-1]
        t.copy_(torch.randn(t.shape, generator=gen) * fan_in**-0.5)


def make_tiny_model(out_dir: str, seed: int = 0, mtp_echo: float | None = None, **overrides) -> str:
    """Write a complete tiny checkpoint to out_dir; the same seed gives the same bytes.

    The MTP layer is random, so its drafts are almost never accepted. `mtp_echo` (a noise scale)
    instead makes it pass the target's normed hidden state through (eh_proj = [noise | I +
    noise], the layer's output projections scaled by the noise): its draft is then close to the
    target's own next token, which a random model's greedy output often repeats, so verification
    accepts drafts as well as rejects them.
    """
    from safetensors.torch import save_file
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    cfg = dict(TINY_CONFIG, **overrides)
    config = DeepseekV32Config(**cfg)
    gen = torch.Generator().manual_seed(seed)
    model = DeepseekV32ForCausalLM(config).float()
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            _init_(p, gen, name)
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(out_dir)
    # save_pretrained writes no MTP layer: add it at model.layers.{N} from layer N-1's names.
    n = config.num_hidden_layers
    mtp = {}
    for key, t in _layer_tensors(out_dir, n - 1).items():
        mtp[key.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.")] = t
    hidden = config.hidden_size
    mtp[f"model.layers.{n}.enorm.weight"] = torch.empty(hidden)
    mtp[f"model.layers.{n}.hnorm.weight"] = torch.empty(hidden)
    mtp[f"model.layers.{n}.eh_proj.weight"] = torch.empty(hidden, 2 * hidden)
    mtp[f"model.layers.{n}.shared_head.norm.weight"] = torch.empty(hidden)
    for name in sorted(mtp):
        _init_(mtp[name], gen, name)
    if mtp_echo is not None:
        eh = mtp[f"model.layers.{n}.eh_proj.weight"]
        eh.mul_(mtp_echo)
        eh[:, hidden:] += torch.eye(hidden)
        for name, t in mtp.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                t.mul_(mtp_echo)
    save_file(mtp, os.path.join(out_dir, "model-mtp.safetensors"), metadata={"format": "pt"})
    _write_index(out_dir)
    train_tokenizer(cfg["vocab_size"], out_dir)
    return out_dir


def _layer_tensors(out_dir: str, layer: int) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    prefix = f"model.layers.{layer}."
    out = {}
    with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as f:
        for key in f.keys():
            if key.startswith(prefix):
                out[key] = f.get_tensor(key).clone()
    return out


def _write_index(out_dir: str) -> None:
    """Index every *.safetensors file in out_dir (replacing a single-file checkpoint's layout)."""
    from safetensors import safe_open

    weight_map = {}
    for fname in sorted(os.listdir(out_dir)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(out_dir, fname), "pt") as f:
                weight_map.update({k: fname for k in f.keys()})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1, sort_keys=True)
