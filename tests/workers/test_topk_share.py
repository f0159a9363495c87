"""Top-k sharing across MTP draft steps: what is skipped, which row is kept, lifecycle flags."""

from __future__ import annotations

import pytest
import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from workers.attention_metadata import AttentionMetadata
from workers.model import Indexer
from workers.model_runner import ModelRunner
from workers.topk_share import DraftTopkShare


def _run(model_dir, prompts, k, share, monkeypatch, max_tokens=8):
    """Generate; return (MTP indexer calls, per-step drafts)."""
    llm = LLM(model_dir, num_draft_tokens=k, share_topk=share, dtype="float32")
    mtp_indexer = llm.engine.executor.worker.model.mtp.self_attn.indexer
    calls, drafts = [], []
    real_fwd, real_propose = Indexer.forward, ModelRunner._propose

    def counting(self, *a, **kw):
        if self is mtp_indexer:
            calls.append(a[0].shape[0])
        return real_fwd(self, *a, **kw)

    def recording(runner, step, seqs, states, *rest):
        real_propose(runner, step, seqs, states, *rest)
        drafts.append([r.next_draft_token_ids for r in rest[-1]])  # rest[-1]: the results

    monkeypatch.setattr(Indexer, "forward", counting)
    monkeypatch.setattr(ModelRunner, "_propose", recording)
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
    share = DraftTopkShare()
    topk = torch.arange(40, dtype=torch.int32).view(10, 4)  # row r = [4r .. 4r+3]
    meta = AttentionMetadata(torch.zeros(10), torch.zeros(10), torch.zeros(10), torch.zeros(1, 1))
    meta.computed_topk = topk
    with share.prefill(True):
        rows = share.keep_rows(meta, [3, 9])  # last accepted tokens of two requests
    assert torch.equal(rows, topk[[3, 9]])
    with share.multi_step_decode(True, rows):
        step2 = share.rows_for_step(2, torch.tensor([20, 31]))
    # The kept row, then the positions written by draft steps 1..2 (the step's own included).
    assert step2.tolist() == [[12, 13, 14, 15, 19, 20], [36, 37, 38, 39, 30, 31]]


def test_lifecycle_flags_reset_unconditionally():
    share = DraftTopkShare()
    with pytest.raises(RuntimeError):
        with share.prefill(True):
            assert share.capturing
            raise RuntimeError("step failed")
    assert not share.capturing
    with pytest.raises(RuntimeError):
        with share.multi_step_decode(True, torch.zeros(1, 4, dtype=torch.int32)):
            assert share.sharing
            raise RuntimeError("step failed")
    assert not share.sharing and share.rows is None
    with share.multi_step_decode(False, torch.zeros(1, 4, dtype=torch.int32)):
        assert share.rows_for_step(1, torch.tensor([3])) is None  # opt-in: off means off
