"""Prefix-aware routing across Serve replicas: the table and the policy against hand-worked
cases (plain Python), then two CPU replicas over HTTP, where every later turn of a
conversation must reach the replica holding its history (its `cached_tokens` shows it: the
other replica has none of it)."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import app_args

from deploy.prefix_router import PrefixAffinityTable, prefix_keys, rank_replicas

BLOCK = 16


def test_prefix_keys_chain_full_blocks_only() -> None:
    tokens = list(range(40))
    keys = prefix_keys(tokens, BLOCK)
    assert len(keys) == 2  # 40 tokens: two full blocks of 16
    assert prefix_keys(tokens[:32] + [999], BLOCK) == keys
    assert prefix_keys([7] + tokens[1:], BLOCK)[1] != keys[1]  # a key names the whole prefix


def test_table_matches_leading_blocks_per_replica() -> None:
    table = PrefixAffinityTable()
    system = list(range(32))
    conv_a = system + list(range(100, 132))
    conv_b = system + list(range(200, 232))
    table.record(prefix_keys(conv_a, BLOCK), "r1")
    table.record(prefix_keys(conv_b, BLOCK), "r2")
    # conv_a's next turn: r1 holds all 4 blocks, r2 only the shared system prompt.
    assert table.match(prefix_keys(conv_a + [5] * 20, BLOCK), ["r1", "r2", "r3"]) == {
        "r1": 5 - 1,
        "r2": 2,
        "r3": 0,
    }
    table.remove_replica("r1")
    assert table.match(prefix_keys(conv_a, BLOCK), ["r1", "r2"]) == {"r1": 0, "r2": 2}
    assert len(table) == 4  # conv_a's own two blocks went with r1


def test_table_forgets_least_recently_recorded_keys() -> None:
    table = PrefixAffinityTable(max_keys=3)
    old, new = list(range(32)), list(range(50, 82))
    table.record(prefix_keys(old, BLOCK), "r1")
    table.record(prefix_keys(new, BLOCK), "r2")
    assert len(table) == 3
    assert table.match(prefix_keys(old, BLOCK), ["r1"]) == {"r1": 0}  # its first key went
    assert table.match(prefix_keys(new, BLOCK), ["r2"]) == {"r2": 2}


def test_rank_prefers_the_longest_prefix_then_load() -> None:
    rng = random.Random(0)
    depth = {"a": 3, "b": 1, "c": 3}
    assert rank_replicas(depth, {"a": 2, "b": 0, "c": 5}, max_imbalance=8) == [["a", "c"], ["b"]]
    # The holders' shortest queue is 9 longer than the shortest: load wins (two at random).
    ranks = rank_replicas(depth, {"a": 12, "b": 3, "c": 20}, max_imbalance=8, rng=rng)
    assert len(ranks) == 1 and len(ranks[0]) == 2 and set(ranks[0]) <= set(depth)
    # Unknown queue lengths do not block affinity; nothing matched: two at random.
    assert rank_replicas(depth, {"a": None, "b": None, "c": None}, 8) == [["a", "c"], ["b"]]
    ranks = rank_replicas({"a": 0, "b": 0}, {}, 8, rng=rng)
    assert sorted(ranks[0]) == ["a", "b"]


APP = "routingapp"
TURNS = 3
CONVERSATIONS = 6
MAX_TOKENS = 6


@pytest.mark.timeout(300)
def test_two_replicas_route_each_conversation_to_its_prefix(serve_url, tiny_model_dir):
    """6 conversations x 3 turns over two replicas. A turn sent to the replica without its
    history would report 0 cached tokens: with Serve's default router (power of two choices,
    a coin flip between two idle replicas) all 12 later turns land right with probability
    1/4096."""
    import openai
    from ray import serve
    from test_prefix_cache_http import expected_cached_tokens

    from cluster.llm import LLM
    from cluster.sampling_params import SamplingParams
    from deploy.app import build_app

    reference = LLM(
        tiny_model_dir, num_draft_tokens=0, dtype="float32", enable_prefix_caching=False
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    args = {**app_args(tiny_model_dir, block_size_tokens=BLOCK), "num_replicas": 2}
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    try:
        client = openai.OpenAI(
            base_url=f"{serve_url}/{APP}/v1", api_key="unused", max_retries=0, timeout=120
        )
        model = client.models.list().data[0].id
        g = torch.Generator().manual_seed(3)
        histories = [
            torch.randint(3, 512, (40,), generator=g).tolist() for _ in range(CONVERSATIONS)
        ]
        num_computed = [0] * CONVERSATIONS
        for turn in range(TURNS):
            for c in range(CONVERSATIONS):
                prompt = histories[c] + torch.randint(3, 512, (5,), generator=g).tolist()
                [expected_out] = reference.generate([prompt], params)
                response = client.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=MAX_TOKENS,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
                assert response.choices[0].text == expected_out.text
                cached = response.usage.prompt_tokens_details.cached_tokens
                if turn == 0:
                    assert cached == 0
                else:
                    expected = expected_cached_tokens(
                        histories[c], num_computed[c], prompt, mtp=False
                    )
                    assert expected >= 32
                    assert cached == expected, (turn, c)
                histories[c] = prompt + list(expected_out.token_ids)
                num_computed[c] = len(histories[c]) - 1
    finally:
        serve.delete(APP)
