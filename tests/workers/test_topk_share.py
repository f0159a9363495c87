"""Top-k sharing across MTP draft steps: what is skipped, which row is kept, what is added."""

from __future__ import annotations

import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from workers.model import Indexer
from workers.mtp_proposer import MtpProposer
from workers.topk_share import keep_rows, rows_for_step


def _run(model_dir, prompts, k, share, monkeypatch, max_tokens=8):
    """Generate; return (MTP indexer calls, per-step drafts)."""
    llm = LLM(model_dir, num_draft_tokens=k, share_topk=share, dtype="float32")
    mtp_indexer = llm.engine.executor.worker.model.mtp.self_attn.indexer
    calls, drafts = [], []
    real_fwd, real_propose = Indexer.forward, MtpProposer.propose

    def counting(self, *a, **kw):
        if self is mtp_indexer:
            calls.append(a[0].shape[0])
        return real_fwd(self, *a, **kw)

    def recording(proposer, step, batch, hidden, results):
        real_propose(proposer, step, batch, hidden, results)
        drafts.append([r.next_draft_token_ids for r in results])

    monkeypatch.setattr(Indexer, "forward", counting)
    monkeypatch.setattr(MtpProposer, "propose", recording)
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    )
    monkeypatch.undo()
    return calls, drafts, [o.token_ids for o in outs]


def test_sharing_skips_the_indexer_on_later_draft_steps(tiny_model_dir, monkeypatch):
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    k = 3
    calls_off, drafts_off, out_off = _run(tiny_model_dir, prompts, k, False, monkeypatch)
    calls_on, drafts_on, out_on = _run(tiny_model_dir, prompts, k, True, monkeypatch)
    num_proposals = len(drafts_on)
    assert len(calls_off) == k * num_proposals  # step 0 + k-1 single-token steps per round
    assert len(calls_on) == num_proposals  # only step 0 runs the MTP indexer
    # With no more than index_topk (16) tokens in context the indexer selects everything, so
    # sharing must not change a single draft.
    assert max(len(p) for p in prompts) + 8 + k <= 16
    assert drafts_on == drafts_off
    assert out_on == out_off


def test_kept_row_is_the_last_accepted_tokens_row():
    topk = torch.arange(40, dtype=torch.int32).view(10, 4)  # row r = [4r .. 4r+3]
    kept = keep_rows(topk, torch.tensor([3, 9]))  # last accepted tokens of two requests
    assert torch.equal(kept, topk[[3, 9]])
    step2 = rows_for_step(kept, 2, torch.tensor([20, 31]))
    # The kept row, then the positions written by draft steps 1..2 (the step's own included).
    assert step2.tolist() == [[12, 13, 14, 15, 19, 20], [36, 37, 38, 39, 30, 31]]


def test_attention_bounds_indexer_rows_by_position_and_walks_shared_rows_whole(
    tiny_model_dir, monkeypatch
):
    """Rows the indexer made go to the attention with their tokens' positions (a token at p
    uses the first p + 1 entries); a shared draft row (the kept row, then the draft steps' own
    positions after its -1 padding) goes without, and sharing still changes no draft."""
    from kernels import ops

    real = ops.sparse_mla_attention
    seen = []  # (row width, positions given)

    def recording(*args):
        seen.append((args[4].shape[1], args[8] is not None))
        return real(*args)

    monkeypatch.setattr(ops, "sparse_mla_attention", recording)
    llm = LLM(tiny_model_dir, num_draft_tokens=3, share_topk=True, dtype="float32")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    topk_width = llm.engine.executor.worker.model.config.index_topk
    assert (topk_width, True) in seen  # the target's and draft step 0's indexer rows
    assert any(width > topk_width and not given for width, given in seen)  # shared rows
    assert all(given for width, given in seen if width == topk_width)
    monkeypatch.undo()
    plain = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32")
    expected = plain.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    assert out[0].token_ids == expected[0].token_ids
