"""A step's device tensors and the host-side facts built with them (by ModelRunner._prepare),
read by the target forward, the sampler and the MTP proposer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.attention_metadata import AttentionMetadata
from workers.batch import SeqWork


@dataclass
class StepTensors:
    seqs: list[SeqWork]
    input_ids: torch.Tensor  # [T], every scheduled token of every request, flattened
    meta: AttentionMetadata  # meta.block_tables: [num_seqs, width] int32 on the device
    tables_cpu: torch.Tensor  # the same block tables, host copy (slots never wait on the device)
    offsets: list[int]  # first row of each request in the flattened batch
    logit_rows: list[int]  # rows whose logits are sampled: a verify's 1 + k, a last chunk's last
    graphable: bool  # a decode step that a CUDA graph replays
