"""The KV block pool. Plain Python: no torch.

One pool of fixed-size blocks backs every per-token cache of the model: the MLA latent cache, the
indexer key cache and the MTP layer's caches all index the same `[num_blocks, block_size_tokens]`
slot space through one block table per request, so one allocation covers all of them.

Block 0 is reserved as the null block (when `reserve_null_block`, the default): it is never
handed to a request, so workers can point padded tokens (CUDA-graph padding, padded block-table
entries) at slot 0..block_size_tokens-1 and their writes land where nobody reads. Usable blocks
are therefore `num_blocks - 1`. No prefix caching: every block has exactly one owner.
"""

from __future__ import annotations

from collections import deque

from cluster.request import Request

NULL_BLOCK_ID = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Owns the free list and each request's `block_ids`.

    Invariants: every block id is either free or in exactly one request's `block_ids`, never
    both; the null block is in neither; `num_free_blocks + sum(len(r.block_ids)) ==
    num_usable_blocks`.
    """

    def __init__(
        self, num_blocks: int, block_size_tokens: int = 64, reserve_null_block: bool = True
    ):
        first_block_id = 1 if reserve_null_block else 0
        if block_size_tokens < 1:
            raise ValueError(f"block_size_tokens must be >= 1, got {block_size_tokens}")
        if num_blocks <= first_block_id:
            raise ValueError(f"num_blocks={num_blocks} leaves no usable block")
        self.num_blocks = num_blocks
        self.block_size_tokens = block_size_tokens
        self.reserve_null_block = reserve_null_block
        self.num_usable_blocks = num_blocks - first_block_id
        # FIFO reuse: a freed block is handed out last, which keeps stale-slot bugs reproducible
        # (a use-after-free reads the old request's KV for a while instead of a fresh writer's).
        self._free_block_ids: deque[int] = deque(range(first_block_id, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks owned by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def capacity_tokens(self) -> int:
        """Token slots one request could hold if it owned every usable block."""
        return self.num_usable_blocks * self.block_size_tokens

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size_tokens)

    def num_new_blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Blocks `request` still lacks to hold `num_tokens` token slots in total."""
        return max(0, self.num_blocks_for(num_tokens) - len(request.block_ids))

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        return self.num_new_blocks_needed(request, num_tokens) <= self.num_free_blocks

    def allocate(self, request: Request, num_tokens: int) -> list[int]:
        """Grow `request.block_ids` to hold `num_tokens` slots in total; returns the new blocks.

        Idempotent: asking for no more than the request already holds allocates nothing (it
        never shrinks; that is `truncate`). Raises RuntimeError when the pool is short, leaving
        the request untouched.
        """
        num_new = self.num_new_blocks_needed(request, num_tokens)
        if num_new > self.num_free_blocks:
            raise RuntimeError(
                f"request {request.request_id} needs {num_new} blocks, {self.num_free_blocks} free"
            )
        new_block_ids = [self._free_block_ids.popleft() for _ in range(num_new)]
        request.block_ids.extend(new_block_ids)
        return new_block_ids

    def truncate(self, request: Request, num_tokens: int) -> int:
        """Keep only the blocks needed for the first `num_tokens` slots; free the rest.

        Used after rejected drafts: slots past the accepted prefix are stale and the blocks
        wholly beyond it go back to the pool. Returns the number of blocks freed.
        """
        num_keep = self.num_blocks_for(max(0, num_tokens))
        freed = request.block_ids[num_keep:]
        if freed:
            del request.block_ids[num_keep:]
            self._free_block_ids.extend(freed)
        return len(freed)

    def free(self, request: Request) -> int:
        """Return every block of `request` to the pool. Returns the number freed."""
        return self.truncate(request, 0)

    def slot(self, request: Request, position: int) -> int:
        """Flat cache slot of token `position`: block_ids[p // bs] * bs + p % bs."""
        block_index, offset = divmod(position, self.block_size_tokens)
        return request.block_ids[block_index] * self.block_size_tokens + offset

    def slots(self, request: Request, start_position: int, num_tokens: int) -> list[int]:
        """`slot()` for positions start_position .. start_position + num_tokens - 1."""
        return [self.slot(request, p) for p in range(start_position, start_position + num_tokens)]
