"""Loading a Hugging Face DeepSeek-V3.2 checkpoint: config.json + (sharded) safetensors.

DeepSeek's tensor names map onto our modules almost 1:1; the exceptions are the fused gate/up
projections, the per-expert tensors (packed into [E, ...] parameters), and the MTP layer
(model.layers.{num_hidden_layers}.* -> mtp.*). Which weights are FP8 follows the checkpoint: a
tensor with a `weight_scale_inv` beside it (128x128 blocks). Those of layers that multiply by
them stay FP8 in memory with their scales (parallel.linear); the rest are dequantized on load.
Every missing, unexpected or mis-shaped tensor is an error that names it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator

import torch

from kernels.fp8 import dequantize_fp8_reference

logger = logging.getLogger(__name__)

FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SUPPORTED_MODEL_TYPES = ("deepseek_v32",)
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the file or tensor at fault."""


def load_config(model_dir: str):
    from transformers import AutoConfig

    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{model_dir}: no config.json")
    with open(path) as f:
        model_type = json.load(f).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{path}: model_type {model_type!r} is not a DeepSeek-V3.2 model "
            f"(expected one of {SUPPORTED_MODEL_TYPES})"
        )
    return AutoConfig.from_pretrained(model_dir)


def open_safetensors(path: str):
    """`safe_open(path)`, with a file that is missing, cut short or not safetensors at all as a
    CheckpointError that names it (a download cut short is the usual cause)."""
    from safetensors import SafetensorError, safe_open

    if not os.path.isfile(path):
        raise CheckpointError(f"missing checkpoint file {path}")
    try:
        return safe_open(path, "pt")
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a whole safetensors file ({e})") from None


def checkpoint_files(model_dir: str) -> dict[str, str]:
    """tensor name -> safetensors file, from the index if there is one."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(model_dir, v) for k, v in json.load(f)["weight_map"].items()}
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    names = {}
    for fname in files:
        path = os.path.join(model_dir, fname)
        with open_safetensors(path) as f:
            names.update({k: path for k in f.keys()})
    return names


def check_checkpoint_files(model_dir: str, names: dict[str, str] | None = None) -> None:
    """Every safetensors file the checkpoint names (`names`: `checkpoint_files`, read here if
    not given) is there and whole (its header parses and its tensors' bytes are all in the
    file), before any weights load or any worker starts. Reads headers only."""
    names = names if names is not None else checkpoint_files(model_dir)
    for path in sorted(set(names.values())):
        with open_safetensors(path):
            pass


def has_mtp_layer(names, num_hidden_layers: int) -> bool:
    prefix = f"model.layers.{num_hidden_layers}."
    return any(n.startswith(prefix) for n in names)


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """weight (float8) * scale_inv broadcast over 128x128 blocks -> fp32."""
    return dequantize_fp8_reference(weight, scale_inv)


def iter_tensors(
    names: dict[str, str],
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None]]:
    """(name, tensor, its FP8 scale_inv or None) for every weight; scale tensors are consumed."""
    by_file: dict[str, list[str]] = {}
    for name, path in names.items():
        by_file.setdefault(path, []).append(name)
    for path, keys in sorted(by_file.items()):
        with open_safetensors(path) as f:
            for name in sorted(keys):
                if name.endswith("_scale_inv"):
                    continue
                t = f.get_tensor(name)
                scale = None
                if t.dtype in FP8_TYPES:
                    scale_name = name + "_scale_inv"
                    if scale_name not in names:
                        raise CheckpointError(f"{name} is FP8 but {scale_name} is missing")
                    with open_safetensors(names[scale_name]) as g:
                        scale = g.get_tensor(scale_name)
                yield name, t, scale


def keep_fp8_weights(model: torch.nn.Module, names: dict[str, str]) -> list[str]:
    """Turn every layer whose checkpoint weight is FP8 (has a `weight_scale_inv`) into an FP8
    layer where it can be one; returns their parameter names. Raises CheckpointError where a TP
    split would cut the checkpoint's scale blocks."""
    n = model.config.num_hidden_layers
    fp8_params: dict[str, int] = {}
    for name in names:
        if name.endswith(".weight") and name + "_scale_inv" in names:
            pname, _ = param_for(name, n)
            fp8_params[pname] = fp8_params.get(pname, 0) + 1
    kept = []
    for module_name, module in model.named_modules():
        if not hasattr(module, "use_fp8"):
            continue
        if hasattr(module, "w13"):  # routed experts: every expert's three weights FP8
            pname = f"{module_name}.w13"
            experts = module.num_experts
            if (
                fp8_params.get(pname) != 2 * experts
                or fp8_params.get(f"{module_name}.w2") != experts
            ):
                continue
        else:
            pname = f"{module_name}.weight"
            parts = len(getattr(module, "out_sizes", [None]))
            if fp8_params.get(pname) != parts:  # absent, or a merged layer partly FP8
                continue
        try:
            if module.use_fp8():
                kept.append(pname)
        except ValueError as e:
            raise CheckpointError(f"{_ckpt_name(pname, n)!r}: {e}") from None
    return kept


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"(.*\.mlp(?:\.shared_experts)?)\.(gate_proj|up_proj)\.weight$")
_MLA_A = re.compile(r"(.*\.self_attn)\.(q_a_proj|indexer\.wk|kv_a_proj_with_mqa)\.weight$")
# Our merged layers -> the checkpoint's parts, in shard order.
MERGED_PARTS = {
    "gate_up_proj": ("gate_proj", "up_proj"),
    "q_kv_a_proj": ("q_a_proj", "indexer.wk", "kv_a_proj_with_mqa"),
}


def param_for(name: str, num_hidden_layers: int) -> tuple[str, object]:
    """Checkpoint name -> (our parameter name, shard id for its weight_loader)."""
    mtp_prefix = f"model.layers.{num_hidden_layers}."
    if name.startswith(mtp_prefix):
        name = "mtp." + name[len(mtp_prefix) :]
    if m := _EXPERT.match(name):
        base, expert, kind = m.group(1), int(m.group(2)), m.group(3)
        if kind == "down_proj":
            return f"{base}.w2", expert
        return f"{base}.w13", (expert, 0 if kind == "gate_proj" else 1)
    if m := _FUSED.match(name):
        return f"{m.group(1)}.gate_up_proj.weight", 0 if m.group(2) == "gate_proj" else 1
    if m := _MLA_A.match(name):
        return f"{m.group(1)}.q_kv_a_proj.weight", MERGED_PARTS["q_kv_a_proj"].index(m.group(2))
    return name, None


def load_weights(model: torch.nn.Module, model_dir: str, names: dict[str, str] | None = None):
    """Fill every parameter of `model` from the checkpoint, or raise CheckpointError."""
    config = model.config
    n = config.num_hidden_layers
    names = names if names is not None else checkpoint_files(model_dir)
    params = dict(model.named_parameters())
    # Parts the MTP layer may borrow from the main model when its checkpoint omits them.
    optional = {"mtp.embed_tokens.weight", "mtp.shared_head.head.weight"}
    if model.mtp is None:
        names = {k: v for k, v in names.items() if not k.startswith(f"model.layers.{n}.")}
    filled: dict[str, set] = {}
    for ckpt_name, tensor, scale in iter_tensors(names):
        if _IGNORED.match(ckpt_name):
            continue
        if model.mtp is None and ckpt_name.startswith(f"model.layers.{n}."):
            continue
        pname, shard = param_for(ckpt_name, n)
        if pname in optional and pname not in params:
            _attach_mtp_part(model, pname, tensor.shape)
            params = dict(model.named_parameters())
        if pname not in params:
            raise CheckpointError(f"unexpected tensor {ckpt_name!r} in the checkpoint")
        param = params[pname]
        loader = getattr(param, "weight_loader", None)
        scale_name = pname.removesuffix(".weight") + (
            ".weight_scale_inv" if pname.endswith(".weight") else "_scale_inv"
        )
        scale_param = params.get(scale_name) if scale is not None else None
        if scale is not None and (param.dtype not in FP8_TYPES or scale_param is None):
            tensor = dequantize_fp8(tensor, scale)
        try:
            with torch.no_grad():
                if loader is not None:
                    loader(param, tensor.to(param.dtype), shard)
                elif tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"expected {tuple(param.shape)}, got {tuple(tensor.shape)}")
                else:
                    param.data.copy_(tensor)
                if scale_param is not None:
                    scale_param.weight_loader(scale_param, scale, shard)
                    filled.setdefault(scale_name, set()).add(shard)
        except ValueError as e:
            raise CheckpointError(f"tensor {ckpt_name!r}: {e}") from None
        filled.setdefault(pname, set()).add(shard)
    _check_complete(model, params, filled)
    _tie_mtp_parts(model)
    scales_loaded(model)


def scales_loaded(model: torch.nn.Module) -> None:
    """Tell every FP8 layer its weights and scales are in place (it notes whether its scales
    are powers of two, as DeepSeek-V3.1 and later ship them); whoever fills FP8 weights some
    other way calls this too."""
    for module in model.modules():
        if getattr(module, "is_fp8", False) and hasattr(module, "scales_loaded"):
            module.scales_loaded()


def _attach_mtp_part(model, pname: str, shape) -> None:
    from parallel.embedding import ParallelLMHead, VocabParallelEmbedding

    cfg = model.config
    if pname == "mtp.embed_tokens.weight":
        model.mtp.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, model.dtype
        )
    else:
        model.mtp.shared_head.head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, model.dtype)


def _tie_mtp_parts(model) -> None:
    if model.mtp is None:
        return
    if model.mtp.embed_tokens is None:
        model.mtp.embed_tokens = model.model.embed_tokens
    if model.mtp.shared_head.head is None:
        model.mtp.shared_head.head = model.head


def _check_complete(model, params: dict, filled: dict[str, set]) -> None:
    n = model.config.num_hidden_layers
    cfg = model.config
    for pname in params:
        got = filled.get(pname)
        if got is None:
            raise CheckpointError(
                f"tensor for {_ckpt_name(pname, n)!r} missing from the checkpoint"
            )
        merged = pname.removesuffix(".weight").rsplit(".", 1)[-1]
        if merged in MERGED_PARTS and len(got) != len(MERGED_PARTS[merged]):
            part = next(p for i, p in enumerate(MERGED_PARTS[merged]) if i not in got)
            raise CheckpointError(f"{_ckpt_name(pname, n).replace(merged, part)!r} missing")
        if pname.endswith(("experts.w13", "experts.w2")):
            want = cfg.n_routed_experts * (2 if pname.endswith("w13") else 1)
            if len(got) != want:
                base = _ckpt_name(pname, n).rsplit(".", 1)[0]
                missing = _missing_experts(got, cfg.n_routed_experts, pname.endswith("w13"))
                raise CheckpointError(f"expert tensors missing under {base!r}: {missing}")


def _missing_experts(got: set, num_experts: int, w13: bool) -> list[str]:
    if w13:
        return [
            f"{e}.{p}"
            for e in range(num_experts)
            for i, p in enumerate(("gate_proj", "up_proj"))
            if (e, i) not in got
        ][:8]
    return [f"{e}.down_proj" for e in range(num_experts) if e not in got][:8]


def _ckpt_name(pname: str, num_hidden_layers: int) -> str:
    if pname.startswith("mtp."):
        return f"model.layers.{num_hidden_layers}." + pname[4:]
    return pname


def load_model(
    model_dir: str,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    enable_mtp: bool = True,
    keep_fp8: bool = True,
):
    """Build DeepseekV32ForCausalLM (this rank's shard) and load it. Returns (model, config)."""
    from workers.model import DeepseekV32ForCausalLM

    config = load_config(model_dir)
    names = checkpoint_files(model_dir)
    check_checkpoint_files(model_dir, names)  # a shard cut short: named before the model builds
    with_mtp = enable_mtp and has_mtp_layer(names, config.num_hidden_layers)
    if enable_mtp and not with_mtp:
        logger.warning(
            "%s has no MTP layer (model.layers.%d.*): speculative decoding is off",
            model_dir,
            config.num_hidden_layers,
        )
    model = DeepseekV32ForCausalLM(config, dtype=dtype, with_mtp=with_mtp)
    if keep_fp8:
        kept = keep_fp8_weights(model, names)
        if kept:
            logger.info("%d FP8 weights kept in FP8 with their block scales", len(kept))
    load_weights(model, model_dir, names)
    return model.to(device).eval(), config
