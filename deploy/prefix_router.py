"""Prefix-aware routing of model-server requests across Serve replicas.

Each replica has its own prefix cache, so a conversation's next turn is cheap only on the replica
that served the last one. `PrefixAffinityRouter` is a Serve request router (Ray Serve's
`RequestRouter` API, the handle side: it runs in each caller of the model server, i.e. each
ingress replica) that sends a request to the replica it recently sent the longest prefix of the
request's tokens to, unless that replica's queue is much longer than the shortest one.

The anchor is Ray Serve LLM's `PrefixCacheAffinityRouter`, which matches prompt *text* in a
prefix tree held by a detached actor. Here the request already carries its token ids
(`GenerateRequest.prompt_token_ids`), so the table is keyed by the same chained block keys the
block manager uses (`cluster.block_manager.block_key`, without the MTP next token: routing
only has to be right about which replica probably holds a prefix, not exact), and it lives in
the router itself (no actor call per request). Each ingress replica therefore learns on its own;
with one ingress replica (the default) that is exact.

The policy is `rank_replicas`, a pure function:
  1. no candidate was sent any block of the prompt: power of two choices (two at random; Serve
     takes the shorter queue);
  2. otherwise the replicas holding the most leading blocks form the first rank (Serve takes
     the shortest queue among them, so replicas that all hold a shared system prompt still
     share its load), everyone else the second (used when the first rank is full);
  3. unless the preferred replicas' shortest known queue exceeds the shortest overall by more
     than `max_imbalance` requests: then load wins, as in 1.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from ray.serve.request_router import FIFOMixin, RequestRouter

from cluster.block_manager import block_key
from cluster.config import EngineConfig

DEFAULT_BLOCK_SIZE_TOKENS = EngineConfig.default("block_size_tokens")
# Keys remembered per router: 200k blocks of 64 tokens = 12.8M tokens of prompts (~40 MB).
DEFAULT_MAX_KEYS = 200_000
DEFAULT_MAX_IMBALANCE = 8  # requests


def prefix_keys(token_ids: Sequence[int], block_size_tokens: int) -> list[bytes]:
    """The chained keys of the full blocks of `token_ids`."""
    keys: list[bytes] = []
    for start in range(0, len(token_ids) - block_size_tokens + 1, block_size_tokens):
        keys.append(
            block_key(keys[-1] if keys else None, token_ids[start : start + block_size_tokens])
        )
    return keys


class PrefixAffinityTable:
    """Which replicas were recently sent each block key. Plain Python.

    Invariants: at most `max_keys` keys, least recently recorded dropped first; a key's set of
    replicas is never empty (a key whose last replica is removed goes too)."""

    def __init__(self, max_keys: int = DEFAULT_MAX_KEYS):
        self.max_keys = max_keys
        self._replicas_by_key: OrderedDict[bytes, set[Hashable]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replicas_by_key)

    def match(self, keys: Sequence[bytes], replica_ids: Sequence[Hashable]) -> dict[Hashable, int]:
        """Leading blocks of `keys` that each of `replica_ids` was sent."""
        depth = dict.fromkeys(replica_ids, 0)
        alive = set(replica_ids)
        for key in keys:
            alive &= self._replicas_by_key.get(key, set())
            if not alive:
                break
            for replica_id in alive:
                depth[replica_id] += 1
        return depth

    def record(self, keys: Sequence[bytes], replica_id: Hashable) -> None:
        for key in keys:
            holders = self._replicas_by_key.pop(key, None) or set()
            holders.add(replica_id)
            self._replicas_by_key[key] = holders  # most recently recorded last
        while len(self._replicas_by_key) > self.max_keys:
            self._replicas_by_key.popitem(last=False)

    def remove_replica(self, replica_id: Hashable) -> None:
        for key in [k for k, holders in self._replicas_by_key.items() if replica_id in holders]:
            holders = self._replicas_by_key[key]
            holders.discard(replica_id)
            if not holders:
                del self._replicas_by_key[key]


def rank_replicas(
    depth: dict[Hashable, int],
    queue_lens: dict[Hashable, int | None],
    max_imbalance: int,
    rng: random.Random | None = None,
) -> list[list[Hashable]]:
    """The policy of the module docstring: ranks of replica ids, most preferred first."""
    rng = rng or random
    replica_ids = list(depth)
    best = max(depth.values(), default=0)
    if best > 0:
        preferred = [r for r in replica_ids if depth[r] == best]
        known = [q for q in queue_lens.values() if q is not None]
        preferred_known = [queue_lens[r] for r in preferred if queue_lens.get(r) is not None]
        balanced = not (known and preferred_known) or (
            min(preferred_known) - min(known) <= max_imbalance
        )
        if balanced:
            others = [r for r in replica_ids if depth[r] != best]
            return [preferred, others] if others else [preferred]
    return [rng.sample(replica_ids, min(2, len(replica_ids)))]


def _prompt_token_ids(pending_request) -> list[int] | None:
    for arg in getattr(pending_request, "args", None) or ():
        token_ids = getattr(arg, "prompt_token_ids", None)
        if token_ids is not None:
            return list(token_ids)
    return None


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Serve request router with the policy of this module (see its docstring); enabled by
    `deploy.app.build_app` for the model server (`AppArgs.prefix_aware_routing`)."""

    def initialize_state(
        self,
        block_size_tokens: int = DEFAULT_BLOCK_SIZE_TOKENS,
        max_keys: int = DEFAULT_MAX_KEYS,
        max_imbalance: int = DEFAULT_MAX_IMBALANCE,
    ) -> None:
        self.block_size_tokens = block_size_tokens
        self.max_imbalance = max_imbalance
        self.table = PrefixAffinityTable(max_keys)

    def _keys(self, pending_request) -> list[bytes]:
        token_ids = _prompt_token_ids(pending_request)
        return prefix_keys(token_ids, self.block_size_tokens) if token_ids else []

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        depth = self.table.match(self._keys(pending_request), list(by_id))
        queue_lens = {rid: self._replica_queue_len_cache.get(rid) for rid in by_id}
        ranks = rank_replicas(depth, queue_lens, self.max_imbalance)
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request, replica_id, result) -> None:
        self.table.record(self._keys(pending_request), replica_id)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.remove_replica(replica_id)

    def update_replicas(self, replicas) -> None:
        old = set(self._replica_id_set)
        super().update_replicas(replicas)
        for replica_id in old - set(self._replica_id_set):
            self.table.remove_replica(replica_id)
