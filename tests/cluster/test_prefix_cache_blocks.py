"""Prefix caching in the block manager: keys, publication, sharing, eviction. Plain Python."""

from __future__ import annotations

from cluster.block_manager import BlockManager, block_key
from cluster.request import Request
from cluster.sampling_params import SamplingParams

BS = 4


def _request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams())


def _computed(bm: BlockManager, request: Request, num_tokens: int) -> None:
    """What the scheduler does around a step: blocks for the tokens, then publication."""
    bm.allocate(request, num_tokens)
    request.num_computed_tokens = num_tokens
    bm.cache_final_blocks(request)


def test_keys_chain_parent_and_tokens() -> None:
    a = block_key(None, [1, 2, 3, 4])
    assert a == block_key(None, [1, 2, 3, 4])
    assert block_key(a, [5, 6, 7, 8]) != block_key(None, [5, 6, 7, 8])
    assert block_key(a, [5, 6, 7, 8]) != block_key(block_key(None, [1, 2, 3, 5]), [5, 6, 7, 8])
    # int64 per token: (1, 256) and (256, 1) or a token >= 2**32 do not collide by packing.
    assert block_key(None, [1, 256]) != block_key(None, [256, 1])
    assert block_key(None, [2**32]) != block_key(None, [0])


def test_publish_lookup_share_and_release() -> None:
    bm = BlockManager(num_blocks=16, block_size_tokens=BS, enable_prefix_caching=True)
    first = _request("a", list(range(11)))  # blocks [0..3] [4..7] [8..10]
    assert bm.lookup(first) == []
    _computed(bm, first, 11)
    assert bm.num_cached_blocks == 2  # the partial third block is never published
    # A second prompt with the same first 8 tokens shares both full blocks.
    second = _request("b", list(range(8)) + [99, 98, 97])
    hits = bm.lookup(second)
    assert hits == first.block_ids[:2]
    assert bm.acquire(second, hits) == 8
    assert bm.is_shared_or_cached(hits[0]) and bm.is_shared_or_cached(hits[1])
    bm.allocate(second, 11)
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.block_ids[2] != first.block_ids[2]
    bm.check_invariants([first, second])
    num_free = bm.num_free_blocks
    bm.free(first)  # the shared blocks stay in use by `second`
    assert bm.num_free_blocks == num_free + 1
    bm.check_invariants([second])
    bm.free(second)  # now they wait, evictable, still published
    assert bm.num_free_blocks == bm.num_usable_blocks and bm.num_cached_blocks == 2
    bm.check_invariants([])
    third = _request("c", list(range(8)) + [5])
    assert len(bm.lookup(third)) == 2
    # Only admissions (acquire) count: `second` queried 11 tokens and hit 8.
    assert bm.stats.num_hit_tokens == 8 and bm.stats.num_queried_tokens == 11


def test_a_whole_cached_prompt_leaves_its_last_block_to_compute() -> None:
    bm = BlockManager(num_blocks=16, block_size_tokens=BS, enable_prefix_caching=True)
    first = _request("a", list(range(9)))
    _computed(bm, first, 9)
    assert bm.num_cached_blocks == 2
    # Exactly the first two blocks: (8 - 1) // 4 = 1 block may be a hit, so the step that
    # computes position 7 (in a block of its own) samples.
    assert len(bm.lookup(_request("b", list(range(8))))) == 1
    assert len(bm.lookup(_request("c", list(range(9))))) == 2


def test_key_with_next_token_covers_the_mtp_row_of_the_last_position() -> None:
    bm = BlockManager(
        num_blocks=16,
        block_size_tokens=BS,
        enable_prefix_caching=True,
        key_includes_next_token=True,
    )
    first = _request("a", list(range(12)))
    bm.allocate(first, 12)
    first.num_computed_tokens = 8
    # Block 1 ends at position 7; its MTP row pairs h_7 with token 8, written by the step that
    # computes position 8 at the latest: not final yet.
    bm.cache_final_blocks(first)
    assert bm.num_cached_blocks == 1
    first.num_computed_tokens = 9
    bm.cache_final_blocks(first)
    assert bm.num_cached_blocks == 2
    same_next = _request("b", list(range(9)) + [50, 51])
    other_next = _request("c", list(range(8)) + [50, 51, 52])
    assert bm.lookup(same_next) == first.block_ids[:2]
    assert bm.lookup(other_next) == first.block_ids[:1]  # token 8 differs: block 1 misses


def test_eviction_takes_never_cached_blocks_first_then_least_recently_freed() -> None:
    bm = BlockManager(num_blocks=7, block_size_tokens=BS, enable_prefix_caching=True)  # 6 usable
    old = _request("old", list(range(100, 109)))  # 2 full blocks + 1
    new = _request("new", list(range(200, 209)))
    _computed(bm, old, 9)
    _computed(bm, new, 9)
    bm.free(old)
    bm.free(new)
    assert bm.num_cached_blocks == 4 and bm.num_free_blocks == 6
    taker = _request("t", [1])
    bm.allocate(taker, 2 * BS)  # the two never-cached (partial) blocks go first
    assert bm.num_cached_blocks == 4
    bm.allocate(taker, 3 * BS)  # then `old`'s tail block (freed first, tail before head)
    assert len(bm.lookup(_request("o", list(range(100, 109))))) == 1
    assert len(bm.lookup(_request("n", list(range(200, 209))))) == 2
    assert bm.stats.num_evicted_blocks == 1
    bm.check_invariants([taker])


def test_acquired_evictable_blocks_are_not_free() -> None:
    bm = BlockManager(num_blocks=4, block_size_tokens=BS, enable_prefix_caching=True)  # 3 usable
    first = _request("a", list(range(9)))
    _computed(bm, first, 9)
    bm.free(first)
    second = _request("b", list(range(9)) + [1, 2, 3])  # 12 tokens: 3 blocks, 2 cached
    hits = bm.lookup(second)
    assert len(hits) == 2
    assert bm.can_acquire_and_allocate(second, hits, 12)
    assert not bm.can_acquire_and_allocate(second, hits, 13)  # 4 blocks > 3 usable
    bm.acquire(second, hits)
    bm.allocate(second, 12)
    assert bm.num_free_blocks == 0
    bm.check_invariants([second])


def test_disabled_caching_publishes_nothing() -> None:
    bm = BlockManager(num_blocks=16, block_size_tokens=BS)
    first = _request("a", list(range(12)))
    _computed(bm, first, 12)
    assert bm.num_cached_blocks == 0 and bm.lookup(_request("b", list(range(12)))) == []
    bm.free(first)
    bm.check_invariants([])
