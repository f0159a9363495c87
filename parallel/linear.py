"""Linear layers that own their sharding and their checkpoint weight loaders.

Column-parallel layers split output features across TP ranks; row-parallel layers split input
features and all-reduce their output. Each parameter carries `weight_loader(param, full_tensor,
shard_id=None)`, which takes the checkpoint's full tensor and keeps this rank's part, so the
checkpoint loader never knows about sharding.

A layer whose checkpoint weight is DeepSeek's block-scaled FP8 keeps it FP8 (`use_fp8()`): the
weight stays float8_e4m3fn and a float32 `weight_scale_inv` holds this rank's 128x128 blocks'
scales; the matmul dequantizes in registers (kernels.ops.fp8_linear). A TP split must fall on
block boundaries: one that would cut a block is an error naming the sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import ops
from kernels.fp8 import FP8_BLOCK, FP8_DTYPE, scale_grid, scales_are_powers_of_two
from parallel.collectives import tp_all_reduce
from parallel.state import get_parallel_state


class _Fp8Capable(nn.Module):
    """What every linear here shares: an optional FP8 weight and the matmul that reads it."""

    # False where the model reads the weight itself rather than multiplying by it and has no
    # FP8 kernel for that reading (MLA's kv_b_proj of head dims that are not whole 128-blocks,
    # absorbed into q and the output): such a weight is dequantized on load.
    quantizable = True
    # Every scale a power of two (DeepSeek-V3.1 and later, UE8M0): set by `scales_loaded`.
    pow2_scales = False

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == FP8_DTYPE

    def use_fp8(self) -> bool:
        """Store the weight as FP8 with block scales; False (stay in the model's dtype) where
        this layer's weight cannot be FP8. Raises ValueError where a TP split cuts a block."""
        if not self.quantizable or not self._fp8_blocks_align():
            return False
        rows, cols = self.weight.shape
        self.weight = nn.Parameter(
            torch.empty(rows, cols, dtype=FP8_DTYPE, device=self.weight.device),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader
        self.weight_scale_inv = nn.Parameter(
            torch.empty(scale_grid(rows, cols), dtype=torch.float32, device=self.weight.device),
            requires_grad=False,
        )
        self.weight_scale_inv.weight_loader = self.scale_loader
        return True

    def _fp8_blocks_align(self) -> bool:
        return True

    def scales_loaded(self) -> None:
        """Once the weight and its scales are in place: note whether every scale is a power
        of two (then the kernel scales partial products, not weight elements)."""
        self.pow2_scales = self.is_fp8 and scales_are_powers_of_two(self.weight_scale_inv)

    def scale_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param, loaded.float(), "weight_scale_inv")

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_fp8:
            return ops.fp8_linear(
                x, self.weight, self.weight_scale_inv, pow2_scales=self.pow2_scales
            )
        return F.linear(x, self.weight)


def _check_block_split(size: int, tp_size: int, what: str) -> None:
    if tp_size > 1 and (size // tp_size) % FP8_BLOCK:
        raise ValueError(
            f"{what}={size} split over tp_size={tp_size} gives {size // tp_size} per rank, which "
            f"cuts the checkpoint's {FP8_BLOCK}x{FP8_BLOCK} FP8 scale blocks unevenly"
        )


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


class ReplicatedLinear(_Fp8Capable):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_fp8:
            return self._matmul(x)
        return F.linear(x.to(self.weight.dtype), self.weight)


class MergedReplicatedLinear(ReplicatedLinear):
    """Several replicated outputs that share an input (MLA's q_a and kv_a projections) as one
    matmul: part i of the checkpoint is rows [sum(sizes[:i]), sum(sizes[:i + 1])) of the weight,
    and `split` cuts the output back into the parts.

    FP8 only where every part but the last fills whole 128-row blocks (DeepSeek-V3.2: q_a's 1536
    rows, then kv_a's 576), so the parts' scale grids stack into the merged weight's; otherwise
    (a tiny model's) the layer stays in the model's dtype.
    """

    def __init__(self, in_features: int, out_sizes: list[int], dtype: torch.dtype | None = None):
        super().__init__(in_features, sum(out_sizes), dtype)
        self.out_sizes = list(out_sizes)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        size = self.out_sizes[shard_id]
        if loaded.shape[0] != size:
            raise ValueError(f"expected {size} rows for part {shard_id}, got {tuple(loaded.shape)}")
        _copy_checked(param.data.narrow(0, sum(self.out_sizes[:shard_id]), size), loaded)

    def _fp8_blocks_align(self) -> bool:
        return all(size % FP8_BLOCK == 0 for size in self.out_sizes[:-1])

    def scale_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        offset = sum(self.out_sizes[:shard_id]) // FP8_BLOCK
        blocks = -(-self.out_sizes[shard_id] // FP8_BLOCK)
        _copy_checked(param.data.narrow(0, offset, blocks), loaded.float(), "weight_scale_inv")

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[T, sum(out_sizes)] -> one view per part, [T, out_sizes[i]] (rows strided)."""
        return y.split(self.out_sizes, dim=-1)


class ColumnParallelLinear(_Fp8Capable):
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

    def _fp8_blocks_align(self) -> bool:
        _check_block_split(self.out_features, self.tp_size, "out_features")
        return True

    def scale_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        blocks = param.shape[0]
        _copy_checked(param, loaded.float().narrow(0, self.tp_rank * blocks, blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x)


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

    def _fp8_blocks_align(self) -> bool:
        """Each part's rows must fill whole blocks so the parts' scale grids stack; at TP=1
        a misaligned part (a tiny model's) keeps the layer in the model's dtype instead."""
        if self.tp_size == 1:
            return all(size % FP8_BLOCK == 0 for size in self.out_sizes[:-1])
        for size in self.out_sizes:
            _check_block_split(size, self.tp_size, "out_features")
        return True

    def scale_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        per_rank = self.out_sizes[shard_id] // self.tp_size
        blocks = -(-per_rank // FP8_BLOCK)
        offset = sum(self.out_sizes[:shard_id]) // self.tp_size // FP8_BLOCK
        _copy_checked(
            param.data.narrow(0, offset, blocks),
            loaded.float().narrow(0, self.tp_rank * blocks, blocks),
        )


class RowParallelLinear(_Fp8Capable):
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

    def _fp8_blocks_align(self) -> bool:
        _check_block_split(self.in_features, self.tp_size, "in_features")
        return True

    def scale_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        blocks = param.shape[1]
        _copy_checked(param, loaded.float().narrow(1, self.tp_rank * blocks, blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return tp_all_reduce(y) if self.reduce_results else y
