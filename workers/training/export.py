"""Training model -> a servable checkpoint directory in DeepSeek's tensor names.

Writes config.json (transformers' DeepseekV32Config), bf16 safetensors shards below
MAX_SHARD_BYTES with model.safetensors.index.json, generation_config.json and the tokenizer
files. Routing-critical tensors (gate weight, e_score_correction_bias, the indexer's
weights_proj) stay fp32, as the serving model keeps them.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

MAX_SHARD_BYTES = 15 * 2**20  # shards under 16 MiB: small files to copy, diff and commit
FP32_SUFFIXES = ("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight")


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """Our state dict -> {DeepSeek checkpoint name: tensor}; experts unstacked, MTP renamed."""
    n = model.config.num_hidden_layers
    inter = model.config.moe_intermediate_size
    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu()
        if name.startswith("mtp."):
            name = f"model.layers.{n}." + name[len("mtp.") :]
        if name.endswith("experts.w13"):
            base = name[: -len("w13")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = t[e, inter:]
            continue
        if name.endswith("experts.w2"):
            base = name[: -len("w2")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
            continue
        out[name] = t
    return {
        k: (v.float() if k.endswith(FP32_SUFFIXES) else v.to(torch.bfloat16)).contiguous()
        for k, v in out.items()
    }


def write_safetensors(tensors: dict[str, torch.Tensor], out_dir: str) -> list[str]:
    from safetensors.torch import save_file

    shards, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > MAX_SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    weight_map = {}
    files = []
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
        files.append(fname)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(
            {"metadata": {"total_size": total}, "weight_map": weight_map},
            f,
            indent=1,
            sort_keys=True,
        )
    return files


def export(model, config_dict: dict, tokenizer_dir: str, out_dir: str) -> None:
    from transformers import DeepseekV32Config, GenerationConfig

    os.makedirs(out_dir, exist_ok=True)
    config = DeepseekV32Config(**config_dict)
    config.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)
    write_safetensors(checkpoint_tensors(model), out_dir)
    for fname in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, fname), os.path.join(out_dir, fname))


def load_training_model(model_dir: str):
    """A checkpoint directory -> DeepseekV32ForTraining in fp32 (the inverse of export)."""
    from types import SimpleNamespace

    from workers.loader import checkpoint_files, dequantize_fp8, iter_tensors
    from workers.training.model import DeepseekV32ForTraining

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = SimpleNamespace(**json.load(f))
    model = DeepseekV32ForTraining(cfg)
    n = cfg.num_hidden_layers
    ours = {}
    experts: dict[str, dict] = {}
    for name, t, scale in iter_tensors(checkpoint_files(model_dir)):
        if scale is not None:
            t = dequantize_fp8(t, scale)
        if name.startswith(f"model.layers.{n}."):
            name = "mtp." + name[len(f"model.layers.{n}.") :]
        if ".mlp.experts." in name:
            base, rest = name.split(".mlp.experts.")
            e, kind = rest.split(".")[0], rest.split(".")[1]
            experts.setdefault(base, {})[(int(e), kind)] = t.float()
            continue
        ours[name] = t.float()
    for base, parts in experts.items():
        num = cfg.n_routed_experts
        ours[f"{base}.mlp.experts.w13"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(num)]
        )
        ours[f"{base}.mlp.experts.w2"] = torch.stack([parts[(e, "down_proj")] for e in range(num)])
    model.load_state_dict(ours, strict=True)
    return model
