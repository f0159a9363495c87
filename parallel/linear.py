"""Linear layers that own their sharding and their checkpoint weight loaders.

Column-parallel layers split output features across TP ranks; row-parallel layers split input
features and all-reduce their output. Each parameter carries `weight_loader(param, full_tensor,
shard_id=None)`, which takes the checkpoint's full tensor and keeps this rank's part, so the
checkpoint loader never knows about sharding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel.collectives import tp_all_reduce
from parallel.state import get_parallel_state


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {d}")
    return n // d


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch{' for ' + name if name else ''}: "
            f"expected {tuple(param.shape)}, got {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's rows (output features) split across TP ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.out_features = out_features
        self.out_per_rank = _divide(out_features, self.tp_size, "out_features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, dtype=dtype))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.out_features:
            raise ValueError(f"expected {self.out_features} rows, got {tuple(loaded.shape)}")
        _copy_checked(param, loaded.narrow(0, self.tp_rank * self.out_per_rank, self.out_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs that share an input (gate and up) as one matmul.

    Shard i of the checkpoint goes to rows [sum(sizes[:i]) / tp, ...) of this rank's weight, so
    each rank holds its slice of every part, in order.
    """

    def __init__(self, in_features: int, out_sizes: list[int], dtype: torch.dtype | None = None):
        super().__init__(in_features, sum(out_sizes), dtype)
        self.out_sizes = out_sizes

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        size = self.out_sizes[shard_id]
        if loaded.shape[0] != size:
            raise ValueError(f"expected {size} rows for part {shard_id}, got {tuple(loaded.shape)}")
        per_rank = _divide(size, self.tp_size, "out_features")
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size
        _copy_checked(
            param.data.narrow(0, offset, per_rank),
            loaded.narrow(0, self.tp_rank * per_rank, per_rank),
        )


class RowParallelLinear(nn.Module):
    """y = x W^T with W's columns (input features) split; partial sums all-reduced over TP."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dtype: torch.dtype | None = None,
        reduce_results: bool = True,
    ):
        super().__init__()
        state = get_parallel_state()
        self.tp_rank, self.tp_size = state.tp_rank, state.tp_size
        self.in_features = in_features
        self.in_per_rank = _divide(in_features, self.tp_size, "in_features")
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, dtype=dtype))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[1] != self.in_features:
            raise ValueError(f"expected {self.in_features} columns, got {tuple(loaded.shape)}")
        _copy_checked(param, loaded.narrow(1, self.tp_rank * self.in_per_rank, self.in_per_rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return tp_all_reduce(y) if self.reduce_results else y
