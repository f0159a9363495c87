"""CUDA graphs' memory pools (workers.cuda_graph.DecodeGraphs.capture_graph): the warm-up's
graphs share one pool; a graph captured on first use after it gets a pool of its own, so no
replay of an earlier graph can overwrite its outputs."""

from __future__ import annotations

import pytest
import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from workers.cuda_graph import DecodeGraphs

pytestmark = pytest.mark.gpu


def _early(x: torch.Tensor) -> torch.Tensor:
    """A forward whose intermediate (x + 7, and its double) is freed after its capture."""
    return ((x + 7) * 2).sum()


def _late(x: torch.Tensor) -> torch.Tensor:
    """A forward whose output has that intermediate's size: captured in the same pool after
    `_early`, it may be placed there."""
    return x * 3


def test_a_graph_captured_after_the_warm_up_keeps_its_outputs():
    """The late graph replays, then the warm-up's graph: the late output is still x * 3."""
    graphs = DecodeGraphs(None, 1, 1, torch.device("cuda"))
    x = torch.randn(1 << 20, device="cuda")
    with graphs.shared_pool():
        early, _ = graphs.capture_graph(lambda: _early(x))
    late, out = graphs.capture_graph(lambda: _late(x))
    assert late.pool() != early.pool()
    late.replay()
    early.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 3)


def test_the_warm_ups_graphs_share_one_pool():
    """Inside `shared_pool` the graphs' intermediates take the same memory (one pool), which
    is also why a graph's outputs there are safe only from graphs captured after it: shown
    here, the early graph's replay overwrites the later one's output."""
    graphs = DecodeGraphs(None, 1, 1, torch.device("cuda"))
    x = torch.randn(1 << 20, device="cuda")
    with graphs.shared_pool():
        early, _ = graphs.capture_graph(lambda: _early(x))
        late, out = graphs.capture_graph(lambda: _late(x))
    assert early.pool() == late.pool() == graphs.pool
    late.replay()
    early.replay()
    torch.cuda.synchronize()
    # the hazard `shared_pool`'s capture order avoids: the output lies where the early
    # graph's (x + 7) or its double was
    assert not torch.equal(out, x * 3)


def test_gpu_logprobs_on_a_requests_last_rounds_are_the_models(tiny_model_dir):
    """Seeded sampling requests with logprobs, MTP k = 3, CUDA graphs, fp32: near max_tokens
    the drafts are cut, so verifies of fewer rows replay graphs captured after the warm-up,
    and the sampler's graph replays after them in the same step. Each emitted token's logprob
    is the log-softmax of transformers' logits (CPU, fp32) at its position, teacher-forced."""
    from transformers import DeepseekV32ForCausalLM

    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 5, 4, 2, 5, 1)]
    params = [
        SamplingParams(max_tokens=8, temperature=1.0, seed=i, ignore_eos=True, logprobs=2)
        for i in range(len(prompts))
    ]
    llm = LLM(tiny_model_dir, device="cuda", dtype="float32", num_draft_tokens=3)
    graphs = llm.engine.executor.worker.runner.graphs
    warm = set(graphs.graphs)
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = {}
    while engine.has_unfinished:
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    outs = [final[i] for i in ids]
    assert {q for _, q in set(graphs.graphs) - warm} & {2, 3}  # verifies captured late
    model = DeepseekV32ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert max(len(p) for p in prompts) + 8 + 3 <= model.config.index_topk
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 8
        assert [e["token_id"] for e in out.logprobs] == out.token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids])).logits[0]
        logp = logits.float().log_softmax(-1)
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            # fp32 on both sides; the GPU's kernels reduce in another order (and the MLA's
            # Triton dots may run in tf32): 1e-3, where a wrong row is off by whole units
            assert entry["logprob"] == pytest.approx(
                logp[len(prompt) - 1 + j, token].item(), abs=1e-3
            )
