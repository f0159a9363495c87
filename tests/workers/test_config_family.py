"""The config family: MTP is lossless on every valid config, not on one fixture.

Each config is a small DeepSeek-V3.2 checkpoint drawn by `workers.tiny_model.random_config`
(transformers' own classes write it; the MTP layer passes the target's state through with noise,
so drafts are both accepted and rejected). For each: our logits against transformers',
greedy without MTP against transformers' greedy, and greedy with MTP (k = 1..3, top-k sharing on
and off) against greedy without it. A handful of configs run in CI; `pytest -m slow` runs 48.

The oracle breaks exact ties in the indexer's top-k to the earlier position, as our kernels and
twins do. Few indexer heads make exact ties common (a key whose every head scores below zero
scores exactly 0 after the ReLU), and among tied keys torch.topk's pick moves with the row's
width: that pick is no property of the model, and pinning it is what lets the two agree exactly.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from tests.workers.test_model_parity import ATOL, run_mixed_batch_parity
from workers.tiny_model import make_tiny_model, random_config

MAX_TOKENS = 16
PROMPT_LENS = (3, 41, 12, 27, 9)
# Varied on purpose: 5 heads, YaRN, 2 indexer heads, index_topk 8, 3 layers; 1 head, 1 indexer
# head; 3 heads, YaRN, 3 of 3 groups, unnormalized weights; 4 heads, no dense layer, one group.
# (Seeds whose drafts all missed over these prompts, such as 4 and 16, run in the slow tier.)
CI_SEEDS = (3, 10, 12, 1)
SLOW_SEEDS = tuple(s for s in range(48) if s not in CI_SEEDS)
# The issue's config A: 3 heads, q/kv LoRA 40/24, nope/rope/v 16/8/12, 6 experts top-2 in 3
# groups (2 kept), index_topk 12 under a 14-token prompt, 2 indexer heads x 16.
CONFIG_A = dict(
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=3,
    num_key_value_heads=3,
    q_lora_rank=40,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=6,
    num_experts_per_tok=2,
    n_group=3,
    topk_group=2,
    index_topk=12,
    index_n_heads=2,
    index_head_dim=16,
)


@contextlib.contextmanager
def ties_to_the_earlier_position():
    """transformers' indexer takes `scores.topk(k)`; inside this block that pick is a stable
    descending sort's first k (the same top-k values; among exact ties, the earlier keys)."""
    original = torch.Tensor.topk

    def stable_topk(self, k, dim=-1, largest=True, sorted=True):
        order = self.sort(dim=dim, descending=largest, stable=True)
        values, indices = order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)
        return torch.return_types.topk((values, indices))

    torch.Tensor.topk = stable_topk
    try:
        yield
    finally:
        torch.Tensor.topk = original


def _prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@torch.no_grad()
def _transformers_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import DeepseekV32ForCausalLM

    model = DeepseekV32ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with ties_to_the_earlier_position():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def check_config(model_dir: str) -> int:
    """Every check on one checkpoint; returns the drafts accepted over all MTP runs."""
    with ties_to_the_earlier_position():
        assert run_mixed_batch_parity(model_dir) < ATOL
    prompts = _prompts(512)
    reference = _transformers_greedy(model_dir, prompts)
    plain = LLM(model_dir, num_draft_tokens=0, dtype="float32").generate(prompts, _greedy())
    assert [o.token_ids for o in plain] == reference
    accepted = 0
    for k in (1, 2, 3):
        for share_topk in (False, True):
            llm = LLM(model_dir, num_draft_tokens=k, share_topk=share_topk, dtype="float32")
            outs = llm.generate(prompts, _greedy())
            assert [o.token_ids for o in outs] == reference, (k, share_topk)
            assert llm.stats().num_free_blocks == llm.stats().num_total_blocks
            accepted += sum(o.spec.num_accepted_drafts for o in outs)
    return accepted


def _checkpoint(tmp_path_factory, seed: int, **config) -> str:
    out = str(tmp_path_factory.mktemp(f"family-{seed}"))
    return make_tiny_model(out, seed=seed, mtp_echo=0.1, **config)


def test_issue_config_a(tmp_path_factory):
    """The checkpoint of the report: MTP changed greedy output from the 2nd token, every k."""
    check_config(_checkpoint(tmp_path_factory, 1, **CONFIG_A))  # raises on any mismatch


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_family(tmp_path_factory, seed):
    accepted = check_config(_checkpoint(tmp_path_factory, seed, **random_config(seed)))
    assert accepted > 0  # verification took the accept path too, not only the reject one


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_family_slow(tmp_path_factory, seed):
    check_config(_checkpoint(tmp_path_factory, seed, **random_config(seed)))


@torch.no_grad()
def test_rejection_sampling_keeps_the_target_distribution(tmp_path_factory):
    """Sampled with MTP (k = 2, temperature 0.4), the second token's distribution is the
    target's: sum over t1 of p(t1 | prompt) p(t2 | prompt, t1), from transformers. That token is
    the first one a verify emits (accepting or replacing the MTP layer's draft); a chi-square test
    over 2000 seeded requests at alpha = 1e-3 (a correct sampler fails with probability 1e-3)."""
    from scipy.stats import chisquare
    from transformers import DeepseekV32ForCausalLM

    seed, temperature, num_requests = 27, 0.4, 2000
    model_dir = _checkpoint(tmp_path_factory, seed, **random_config(seed))
    prompt = _prompts(512)[2]
    oracle = DeepseekV32ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with ties_to_the_earlier_position():
        p1 = (oracle(torch.tensor([prompt])).logits[0, -1] / temperature).softmax(-1)  # [V]
        seqs = torch.cat([torch.tensor(prompt).expand(512, -1), torch.arange(512)[:, None]], 1)
        p2 = (oracle(seqs).logits[:, -1] / temperature).softmax(-1)  # [V(t1), V(t2)]
    expected = (p1[:, None] * p2).sum(0) * num_requests  # [V]

    llm = LLM(model_dir, num_draft_tokens=2, dtype="float32", max_num_seqs=256)
    params = [
        SamplingParams(max_tokens=3, temperature=temperature, seed=i, ignore_eos=True)
        for i in range(num_requests)
    ]
    outs = [llm.generate([prompt], p)[0] for p in params[:1]]  # warm, then the rest together
    ids = [llm.engine.add_request(prompt, p) for p in params[1:]]
    final = {}
    while llm.engine.has_unfinished:
        for out in llm.engine.step():
            if out.finished:
                final[out.request_id] = out
    outs += [final[i] for i in ids]
    observed = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=512)
    # The verify after t1 emits t2: its first draft accepted, or replaced from the residual.
    accepted = sum(o.spec.num_accepted_per_position[0] for o in outs)
    assert min(accepted, num_requests - accepted) >= 50  # both outcomes, often (100 accepted)

    big = expected >= 5  # chi-square needs expected counts of 5 or more: lump the rest
    obs = torch.cat([observed[big].double(), observed[~big].sum()[None].double()])
    exp = torch.cat([expected[big].double(), expected[~big].sum()[None].double()])
    exp *= obs.sum() / exp.sum()
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3
