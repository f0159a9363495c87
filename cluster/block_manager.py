"""The KV block pool, with prefix caching. Plain Python: no torch.

One pool of fixed-size blocks backs every per-token cache of the model: the MLA latent cache, the
indexer key cache and the MTP layer's caches all index the same `[num_blocks, block_size_tokens]`
slot space through one block table per request, so one allocation covers all of them, and one
cached block id reuses all of them together.

Block 0 is reserved as the null block (when `reserve_null_block`, the default): it is never
handed to a request, so workers can point padded tokens (CUDA-graph padding, padded block-table
entries) at slot 0..block_size_tokens-1 and their writes land where nobody reads. Usable blocks
are therefore `num_blocks - 1`.

Prefix caching (`enable_prefix_caching`). A full block is named by its key: a hash of its
parent's key and its tokens, so equal keys mean equal token prefixes (`block_key`). Once every
cache row of a block is final (`cache_final_blocks`), the block is published under its key;
a later request whose prompt starts with the same blocks takes them (`lookup`, `acquire`)
instead of recomputing them. Shared blocks are reference counted; a block whose last reference
goes keeps its contents and its key and waits, least recently freed first, to be evicted by an
allocation that finds no never-cached free block.

The MTP layer's cache is why a key may cover one token more than its block
(`key_includes_next_token`, on whenever MTP runs). The MTP layer's row at position i holds its
state for the pair (h_i, t_{i+1}): the target's hidden state at i and the token after it. So
the row at a block's last position depends on the first token of the *next* block, and a block
reused under a different next token would hand the draft a wrong row. With the next token in
the key, a hit is valid in every row of every cache, and a prefill that starts after a cached
prefix needs no hidden state from before it (the pair that would need h_{p-1} is already in the
cached block). The cost: a prompt that diverges from a cached one exactly at a block boundary
misses that one block.

Rows become final in order, so a block is final once the caches past it have been computed:
  - target caches (latent, indexer keys) of positions < num_computed_tokens are final;
  - the MTP row at i is written once t_{i+1} is known and h_i computed; at the latest by the
    step that computes position i + 1 (a non-final prefill chunk holds h_i pending until then).
Hence a block ending at position e is final when num_computed_tokens >= e + 1, or >= e + 2 with
the next token in the key. Every later write of the request (verify tokens, rejected drafts, MTP
lookahead rows, a pending pair) lands at a position >= num_computed_tokens - 1, past every final
block: nothing ever writes into a published or shared block. (A preempted request starts over;
the workers drop the hidden state its last chunk left pending, whose pair would otherwise land
in a block the resumed request may now share: `StepInput.preempted_request_ids`.)
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cluster.request import Request

NULL_BLOCK_ID = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_key(parent_key: bytes | None, token_ids: Sequence[int]) -> bytes:
    """A block's name: sha256 over its parent's key and its tokens (int64, little-endian).

    A collision-resistant hash, not Python's `hash`: a crafted prompt must not be able to read
    another tenant's cached block."""
    digest = hashlib.sha256(parent_key or b"\x00")
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


@dataclass
class PrefixCacheStats:
    """Cumulative counters, in tokens: each admission of a request queries its whole known
    sequence, and hits the part it took from the cache."""

    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    num_evicted_blocks: int = 0  # published blocks whose contents an allocation overwrote

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class BlockManager:
    """Owns the free blocks, the cached (published) blocks and each request's `block_ids`.

    Invariants (`check_invariants` asserts them):
    - every usable block is in exactly one of: the never-cached free list (reference count 0,
      no key), the evictable cache (reference count 0, a key), or in use (reference count > 0);
      the null block is in none of them;
    - a block's reference count is the number of its occurrences in requests' `block_ids`;
    - keys and published blocks are one-to-one (`_block_by_key` and `_key_by_block` are
      inverse), and a published block's rows hold exactly what its key names;
    - `num_free_blocks` (never-cached + evictable) + blocks in use == `num_usable_blocks`;
    - without prefix caching no block has a key, and every block in use has one owner.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size_tokens: int = 64,
        reserve_null_block: bool = True,
        enable_prefix_caching: bool = False,
        key_includes_next_token: bool = False,
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
        self.enable_prefix_caching = enable_prefix_caching
        self.num_key_extra_tokens = 1 if key_includes_next_token else 0
        # FIFO reuse: a freed block is handed out last, which keeps stale-slot bugs reproducible
        # (a use-after-free reads the old request's KV for a while instead of a fresh writer's).
        self._free_block_ids: deque[int] = deque(range(first_block_id, num_blocks))
        self._ref_counts = [0] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._block_by_key: dict[bytes, int] = {}
        self._key_by_block: dict[int, bytes] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never-cached ones and evictable cached ones."""
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_by_key)

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
        the request untouched. Takes never-cached blocks first, then evicts cached ones, least
        recently freed first.
        """
        num_new = self.num_new_blocks_needed(request, num_tokens)
        if num_new > self.num_free_blocks:
            raise RuntimeError(
                f"request {request.request_id} needs {num_new} blocks, {self.num_free_blocks} free"
            )
        new_block_ids = [self._take_free_block() for _ in range(num_new)]
        for block_id in new_block_ids:
            self._ref_counts[block_id] = 1
        request.block_ids.extend(new_block_ids)
        return new_block_ids

    def _take_free_block(self) -> int:
        if self._free_block_ids:
            return self._free_block_ids.popleft()
        block_id, _ = self._evictable.popitem(last=False)
        self.stats.num_evicted_blocks += 1
        del self._block_by_key[self._key_by_block.pop(block_id)]
        return block_id

    def truncate(self, request: Request, num_tokens: int) -> int:
        """Keep only the blocks needed for the first `num_tokens` slots; drop the rest.

        Used after rejected drafts: slots past the accepted prefix are stale and the blocks
        wholly beyond it are released. Returns the number of blocks the request dropped.
        """
        num_keep = self.num_blocks_for(max(0, num_tokens))
        dropped = request.block_ids[num_keep:]
        if dropped:
            del request.block_ids[num_keep:]
            # Entries from num_keep on may hold other blocks by the next step: sent again then.
            request.num_blocks_sent = min(request.num_blocks_sent, num_keep)
            # Last block first: a chain's tail is evicted before its head, which more requests
            # share.
            self._release(reversed(dropped))
            request.num_final_blocks = min(request.num_final_blocks, num_keep)
        return len(dropped)

    def _release(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                if block_id in self._key_by_block:
                    self._evictable[block_id] = None
                else:
                    self._free_block_ids.append(block_id)

    def free(self, request: Request) -> int:
        """Release every block of `request`. Returns the number it dropped."""
        return self.truncate(request, 0)

    def slot(self, request: Request, position: int) -> int:
        """Flat cache slot of token `position`: block_ids[p // bs] * bs + p % bs."""
        block_index, offset = divmod(position, self.block_size_tokens)
        return request.block_ids[block_index] * self.block_size_tokens + offset

    def slots(self, request: Request, start_position: int, num_tokens: int) -> list[int]:
        """`slot()` for positions start_position .. start_position + num_tokens - 1."""
        return [self.slot(request, p) for p in range(start_position, start_position + num_tokens)]

    # ---- prefix caching --------------------------------------------------------------------

    def _keys(self, request: Request, num_blocks: int) -> list[bytes]:
        """The keys of the request's first `num_blocks` full blocks (memoized on the request:
        its tokens only ever grow, so a computed key never changes)."""
        keys, bs = request.block_keys, self.block_size_tokens
        while len(keys) < num_blocks:
            b = len(keys)
            span = request.token_slice(b * bs, (b + 1) * bs + self.num_key_extra_tokens)
            keys.append(block_key(keys[-1] if keys else None, span))
        return keys

    def lookup(self, request: Request) -> list[int]:
        """The published blocks that hold the longest prefix of `request`'s tokens; no state
        changes. At most (num_tokens - 1) // block_size blocks: at least one token is left to
        compute (a step must sample), and it never lies in a shared block."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size_tokens
        hits = []
        for key in self._keys(request, max_blocks):
            block_id = self._block_by_key.get(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def can_acquire_and_allocate(
        self, request: Request, cached_block_ids: list[int], num_tokens: int
    ) -> bool:
        """Whether `acquire(request, cached_block_ids)` then `allocate(request, num_tokens)`
        would succeed (cached blocks taken from the evictable set are no longer free)."""
        num_new = max(0, self.num_blocks_for(num_tokens) - len(cached_block_ids))
        num_taken = sum(1 for b in cached_block_ids if self._ref_counts[b] == 0)
        return num_new <= self.num_free_blocks - num_taken

    def acquire(self, request: Request, cached_block_ids: list[int]) -> int:
        """Give a request with no blocks the cached prefix `lookup` found: its first blocks,
        their KV computed. Returns the number of cached tokens (the request's new
        `num_computed_tokens`)."""
        if request.block_ids:
            raise RuntimeError(f"request {request.request_id} already holds blocks")
        for block_id in cached_block_ids:
            if self._ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1
        request.block_ids.extend(cached_block_ids)
        request.num_final_blocks = len(cached_block_ids)
        num_cached_tokens = len(cached_block_ids) * self.block_size_tokens
        if self.enable_prefix_caching:
            self.stats.num_queried_tokens += request.num_tokens
            self.stats.num_hit_tokens += num_cached_tokens
        return num_cached_tokens

    def cache_final_blocks(self, request: Request) -> int:
        """Publish the request's blocks whose every row is now final (see the module docstring).
        A block whose key is already published (another request computed the same prefix at
        the same time) stays private. Returns the number newly published."""
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size_tokens
        num_final = min(
            (request.num_computed_tokens - self.num_key_extra_tokens) // bs,
            len(request.block_ids),
        )
        if num_final <= request.num_final_blocks:
            return 0
        keys = self._keys(request, num_final)
        num_published = 0
        for b in range(request.num_final_blocks, num_final):
            block_id = request.block_ids[b]
            if keys[b] in self._block_by_key or block_id in self._key_by_block:
                continue
            self._block_by_key[keys[b]] = block_id
            self._key_by_block[block_id] = keys[b]
            num_published += 1
        request.num_final_blocks = num_final
        return num_published

    def is_shared_or_cached(self, block_id: int) -> bool:
        """True when a write into `block_id` could be seen by another request."""
        return self._ref_counts[block_id] > 1 or block_id in self._key_by_block

    def check_invariants(self, requests: Iterable[Request]) -> None:
        """Assert the class invariants, given every request that holds blocks."""
        counts = [0] * self.num_blocks
        for request in requests:
            for block_id in request.block_ids:
                counts[block_id] += 1
        first = 1 if self.reserve_null_block else 0
        assert counts == self._ref_counts, "reference counts disagree with the block tables"
        if self.reserve_null_block:
            assert counts[NULL_BLOCK_ID] == 0, "the null block was handed out"
        free = set(self._free_block_ids)
        assert len(free) == len(self._free_block_ids), "a block is free twice"
        evictable = set(self._evictable)
        for block_id in range(first, self.num_blocks):
            in_use = counts[block_id] > 0
            places = [in_use, block_id in free, block_id in evictable]
            assert sum(places) == 1, f"block {block_id}: in use/free/evictable = {places}"
            if block_id in free:
                assert block_id not in self._key_by_block
            if block_id in evictable:
                assert block_id in self._key_by_block
            if not self.enable_prefix_caching:
                assert counts[block_id] <= 1 and block_id not in self._key_by_block
        assert len(self._block_by_key) == len(self._key_by_block)
        for key, block_id in self._block_by_key.items():
            assert self._key_by_block[block_id] == key
        assert self.num_free_blocks + sum(c > 0 for c in counts) == self.num_usable_blocks
