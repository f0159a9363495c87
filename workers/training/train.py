"""`python -m workers.training.train --out DIR`: train the default model and export it.

Schedule (by progress = max(step / max_steps, elapsed / time_budget_s)):
  - progress < dense_frac: dense attention; every indexer learns by KL to its attention's
    head-summed distribution, on inputs cut from the graph (DeepSeek-V3.2's dense warm-up,
    run alongside pre-training because we train from scratch: the detach keeps the indexer
    loss from moving the main model, which is what freezing it achieves there).
  - after: sparse attention over the indexer's top-k (index_topk); the indexer keeps its KL on
    the selected set (DeepSeek-V3.2's sparse stage).
  - loss = main CE + lambda / D * sum_d MTP_d CE + indexer KL + alpha * sequence balance loss,
    lambda = 0.3 for the first 70% and 0.1 after (DeepSeek-V3); D = 2 unrolled MTP steps with the
    serving recurrence (step 2 is fed step 1's output after shared_head.norm).
  - after every step, e_score_correction_bias += gamma * sign(mean load - load) per MoE layer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from types import SimpleNamespace

import numpy as np
import torch

from workers.training.export import export
from workers.training.model import DeepseekV32ForTraining

DEFAULT_CONFIG = {
    "vocab_size": 4096,
    "hidden_size": 320,
    "intermediate_size": 896,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "n_shared_experts": 1,
    "n_routed_experts": 16,
    "routed_scaling_factor": 1.0,
    "kv_lora_rank": 96,
    "q_lora_rank": 160,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
    "qk_nope_head_dim": 32,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "index_topk": 128,
    "index_head_dim": 64,
    "index_n_heads": 8,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
}
# For debugging the script on CPU in seconds; sequences (128) still longer than index_topk (32).
DEBUG_OVERRIDES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "kv_lora_rank": 32,
    "q_lora_rank": 48,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "qk_nope_head_dim": 16,
    "max_position_embeddings": 128,
    "index_topk": 32,
    "index_head_dim": 32,
    "index_n_heads": 4,
}
MTP_STEPS = 2


def load_stream(path: str) -> torch.Tensor:
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))


def sample_batch(stream, batch: int, window: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - window, (batch,), generator=gen)
    return torch.stack([stream[s : s + window] for s in starts.tolist()])


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


@torch.no_grad()
def evaluate(model, stream, seq_len: int, batch: int, device, max_windows: int) -> dict:
    """Held-out loss over non-overlapping windows, with sparse attention as served."""
    window = seq_len + 1 + MTP_STEPS
    n = min(stream.numel() // window, max_windows)
    windows = stream[: n * window].view(n, window)
    sums = {"main": 0.0, "mtp1": 0.0, "mtp2": 0.0, "acc1": 0.0, "acc2": 0.0, "recall": 0.0}
    for i in range(0, n, batch):
        chunk = windows[i : i + batch].to(device)
        with autocast(device):
            out = model(chunk, sparse=True, mtp_steps=MTP_STEPS)
        w = chunk.shape[0]
        for key, val in (
            ("main", out.main),
            ("mtp1", out.mtp[0]),
            ("mtp2", out.mtp[1]),
            ("acc1", out.mtp_acc[0]),
            ("acc2", out.mtp_acc[1]),
            ("recall", out.index_recall),
        ):
            sums[key] += float(val) * w
    for moe in model.moe_layers():
        moe.last_load = None
    res = {k: v / n for k, v in sums.items()}
    res["ppl"] = math.exp(res["main"])
    res["num_tokens"] = n * seq_len
    return res


def autocast(device):
    dev = torch.device(device)
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--data", default="build/train_data", help="output of workers.training.corpus")
    p.add_argument("--debug-config", action="store_true", help="tiny model for CPU debugging")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--max-steps", type=int, default=100_000)
    p.add_argument("--time-budget-s", type=float, default=300.0)
    p.add_argument("--dense-frac", type=float, default=0.25)
    p.add_argument("--balance-alpha", type=float, default=1e-4)
    p.add_argument("--bias-gamma", type=float, default=1e-3)
    p.add_argument("--eval-windows", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    cfg_dict = dict(DEFAULT_CONFIG, **(DEBUG_OVERRIDES if a.debug_config else {}))
    seq_len = a.seq_len or cfg_dict["max_position_embeddings"]
    cfg = SimpleNamespace(**cfg_dict)
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model = DeepseekV32ForTraining(cfg)
    model.init_weights(a.seed)
    model.to(device)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"params {num_params / 1e6:.2f} M, seq {seq_len}, batch {a.batch_size}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    train = load_stream(os.path.join(a.data, "train.u16"))
    heldout = load_stream(os.path.join(a.data, "heldout.u16"))
    gen = torch.Generator().manual_seed(a.seed)
    window = seq_len + 1 + MTP_STEPS
    log = []
    t0 = time.time()
    step = 0
    while step < a.max_steps:
        progress = max(step / a.max_steps, (time.time() - t0) / a.time_budget_s)
        if progress >= 1.0:
            break
        sparse = progress >= a.dense_frac
        lam = 0.3 if progress < 0.7 else 0.1
        lr = lr_at(step, progress, a.lr, a.warmup_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = sample_batch(train, a.batch_size, window, gen).to(device, non_blocking=True)
        with autocast(device):
            out = model(batch, sparse=sparse, mtp_steps=MTP_STEPS)
        loss = out.main + lam / MTP_STEPS * sum(out.mtp) + out.index + a.balance_alpha * out.balance
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        model.update_balance_bias(a.bias_gamma)
        if step % 50 == 0:
            rec = {
                "step": step,
                "t": round(time.time() - t0, 1),
                "lr": lr,
                "sparse": sparse,
                "main": float(out.main),
                "mtp1": float(out.mtp[0]),
                "mtp2": float(out.mtp[1]),
                "acc1": float(out.mtp_acc[0]),
                "acc2": float(out.mtp_acc[1]),
                "index_kl": float(out.index_kl),
                "recall": float(out.index_recall),
                "tok_s": round((step + 1) * a.batch_size * seq_len / (time.time() - t0)),
            }
            log.append(rec)
            print(json.dumps(rec), flush=True)
        step += 1
    train_time = time.time() - t0
    ev = evaluate(model, heldout, seq_len, a.batch_size, device, a.eval_windows)
    ev_train = evaluate(model, train, seq_len, a.batch_size, device, min(a.eval_windows, 100))
    summary = {
        "steps": step,
        "train_time_s": round(train_time, 1),
        "train_tokens": step * a.batch_size * seq_len,
        "params": num_params,
        "heldout": ev,
        "train_sample": ev_train,
        "seq_len": seq_len,
        "batch_size": a.batch_size,
        "lr": a.lr,
        "dense_frac": a.dense_frac,
        "argv": argv or os.sys.argv[1:],
    }
    print(json.dumps(summary), flush=True)
    export(model, cfg_dict, os.path.join(a.data, "tokenizer"), a.out)
    with open(os.path.join(a.out, "training_summary.json"), "w") as f:
        json.dump(dict(summary, log=log), f, indent=1)


if __name__ == "__main__":
    main()
