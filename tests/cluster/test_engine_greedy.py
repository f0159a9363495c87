"""The first test of any engine change: greedy output with MTP is token-for-token greedy output
without it, and both are transformers' own greedy `generate`."""

from __future__ import annotations

import random

import pytest
import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from tests.preemptions import record_preemptions
from workers.mtp_proposer import MtpProposer

MAX_TOKENS = 20
PROMPT_LENS = [3, 41, 12, 27, 5, 33, 18, 9, 50, 2, 24, 15, 38, 7, 21, 30, 11, 44]  # 18 requests


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, prompts):
    """transformers' greedy generate, one prompt at a time."""
    from transformers import DeepseekV32ForCausalLM

    model = DeepseekV32ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=2,
            min_new_tokens=MAX_TOKENS,
        )
        out.append(ids[0, len(p) :].tolist())
    return out


def test_greedy_without_mtp_matches_transformers(tiny_model_dir, prompts, reference):
    outs = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32").generate(prompts, _greedy())
    assert [o.token_ids for o in outs] == reference


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("share_topk", [False, True])
def test_greedy_with_mtp_is_identical(tiny_model_dir, prompts, reference, k, share_topk):
    llm = LLM(tiny_model_dir, num_draft_tokens=k, share_topk=share_topk, dtype="float32")
    outs = llm.generate(prompts, _greedy())
    assert [o.token_ids for o in outs] == reference
    assert all(o.spec.num_rounds > 0 for o in outs)
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


@pytest.mark.parametrize("k", [0, 2])
def test_greedy_identical_under_preemption(tiny_model_dir, prompts, reference, k):
    # 5 usable blocks of 64 tokens for 18 requests of up to 70 tokens: requests must be
    # preempted (recomputed) over and over.
    llm = LLM(
        tiny_model_dir,
        num_draft_tokens=k,
        num_kv_blocks=6,
        max_model_len=256,
        max_num_seqs=16,
        dtype="float32",
    )
    preemptions = record_preemptions(llm)
    outs = llm.generate(prompts, _greedy())
    assert [o.token_ids for o in outs] == reference
    assert preemptions
    assert llm.stats().num_free_blocks == llm.stats().num_total_blocks


class OracleDrafts:
    """Replaces the MTP layer's proposals by the known greedy continuation, corrupted at random,
    so verification accepts long runs and rejects some: the acceptance, rollback and bonus-token
    paths run with real acceptance rates (the tiny random MTP layer is almost never right)."""

    def __init__(self, llm, prompts, reference, error_rate: float, seed: int = 0):
        self.sequences = {f"req-{i}": p + r for i, (p, r) in enumerate(zip(prompts, reference))}
        self.rng = random.Random(seed)
        self.error_rate = error_rate
        self.proposed = 0

    def install(self, monkeypatch):
        real = MtpProposer.propose
        oracle = self

        def propose(proposer, step, batch, hidden, results):
            real(proposer, step, batch, hidden, results)  # the real MTP work
            for s, res in zip(batch.seqs, results):
                if not s.samples:
                    continue
                length = (
                    s.start_position
                    + len(s.token_ids)
                    - s.num_draft_tokens
                    + len(res.sampled_token_ids)
                )
                truth = oracle.sequences[s.request_id][length : length + step.num_draft_tokens]
                truth += [3] * (step.num_draft_tokens - len(truth))
                res.next_draft_token_ids = [
                    (t + 1) % 512 if oracle.rng.random() < oracle.error_rate else t for t in truth
                ]
                oracle.proposed += 1

        monkeypatch.setattr(MtpProposer, "propose", propose)


@pytest.mark.parametrize("k", [1, 3])
def test_accepted_drafts_keep_output_identical(tiny_model_dir, prompts, reference, k, monkeypatch):
    llm = LLM(tiny_model_dir, num_draft_tokens=k, dtype="float32")
    oracle = OracleDrafts(llm, prompts, reference, error_rate=0.2)
    oracle.install(monkeypatch)
    outs = llm.generate(prompts, _greedy())
    assert [o.token_ids for o in outs] == reference
    stats = llm.stats()
    assert stats.mean_tokens_per_round > 1.5  # most drafts were right and were accepted
    # Position i is accepted only if 0..i were: a non-increasing profile, per closed form
    # (1 - error_rate) ** (i + 1) within sampling noise.
    acc = stats.acceptance_per_position
    assert len(acc) == k and all(a >= b for a, b in zip(acc, acc[1:]))
    assert abs(acc[0] - 0.8) < 0.1
    assert stats.num_free_blocks == stats.num_total_blocks


def test_chunked_prefill_gives_the_mtp_layer_every_position():
    """A prompt prefilled in chunks hands the MTP layer the hidden state of each chunk's last
    token at the next chunk. The MTP layer's cache after a chunked prefill must hold what a
    single-chunk prefill writes, at every position (greedy identity alone could not see a lost
    position: drafts only change speed)."""
    from workers.default_model import default_model_path

    model = default_model_path()
    text = (
        "import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n        print(name)\n"
    )
    prompt = LLM(model, num_draft_tokens=0, dtype="float32").tokenizer.encode(text * 4)[:100]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    caches, tokens = {}, {}
    assert len(prompt) > 64  # at least three chunks of 32
    for budget in (2048, 32):  # one chunk vs chunks of 32 tokens
        llm = LLM(
            model,
            dtype="float32",
            num_draft_tokens=2,
            max_num_batched_tokens=budget,
            max_num_seqs=4,
        )
        tokens[budget] = llm.generate([prompt], params)[0].token_ids
        worker_model = llm.engine.executor.worker.model
        n = worker_model.config.num_hidden_layers
        caches[budget] = worker_model.kv_caches[n][1:3].reshape(
            -1, worker_model.kv_caches[n].shape[-1]
        )
    assert tokens[32] == tokens[2048]
    # Blocks 1-2 (the first two allocated) hold positions 0..127 in both runs; the MTP layer
    # has written every prompt position but the last (its pair needs the sampled token).
    num = len(prompt) - 1
    written = caches[2048][:num]
    assert written.abs().amax(-1).min() > 0
    torch.testing.assert_close(caches[32][:num], written, atol=1e-4, rtol=1e-4)


def test_stats_count_steps_and_those_that_carry_a_prompt(tiny_model_dir):
    """a prefills alone, b's prompt rides with a's first decode, then two decode steps: four
    steps, two with a prompt. The time inside steps counts the steps, not the time between
    them, nor a call with nothing to run."""
    import time

    from cluster.config import EngineConfig
    from cluster.engine import LLMEngine

    engine = LLMEngine(
        EngineConfig(model=tiny_model_dir, num_draft_tokens=0, dtype="float32", device="cpu")
    )
    started = time.perf_counter()
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), "a")
    engine.step()
    time.sleep(0.3)  # the engine idles between steps
    engine.add_request([8, 9, 10, 11, 12], SamplingParams(max_tokens=2, ignore_eos=True), "b")
    while engine.has_unfinished:
        engine.step()
    wall_s = time.perf_counter() - started
    assert engine.step() == []  # nothing to run: not a step
    stats = engine.stats()
    assert (stats.num_steps, stats.num_prefill_steps) == (4, 2)
    assert 0.0 < stats.step_time_s <= wall_s - 0.3
    assert 0.0 < stats.prefill_step_time_s < stats.step_time_s  # the two of four with a prompt
    engine.shutdown()


def test_generate_keeps_what_was_alive_out_of_the_full_collections(tiny_model_dir, monkeypatch):
    """While `LLM.generate` steps, the model, the engine and the caller's objects are frozen
    (a full collection of them is a 100-270 ms stall of every sequence: workers/long_lived.py);
    a cycle the steps drop is still collected; after the call nothing stays frozen."""
    import gc
    import weakref

    llm = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32", device="cpu")
    gc.unfreeze()  # whatever froze before (a library may): the call must freeze by itself
    step, seen = llm.engine.step, []
    callers = []  # an object of the caller's, alive before the call

    def frozen(obj) -> bool:  # frozen objects are in none of the generations gc walks
        return all(o is not obj for o in gc.get_objects())

    class Cycle:
        pass

    def step_and_look(*args, **kwargs):
        made = Cycle()
        made.me = made
        gone = weakref.ref(made)
        del made
        gc.collect()  # a full collection inside the call
        seen.append((frozen(callers), frozen(llm.engine.scheduler), gone() is None))
        return step(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "step", step_and_look)
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.token_ids) == 3
    assert seen and all(seen_at_step == (True, True, True) for seen_at_step in seen), seen
    assert not frozen(callers) and not frozen(llm.engine.scheduler)
    assert gc.get_freeze_count() == 0


def test_logprobs_follow_the_rows_of_accepted_drafts(
    tiny_model_dir, prompts, reference, monkeypatch
):
    """Each emitted token's logprob and top tokens come from the target row that predicted
    it: with drafts accepted (several tokens per round, from verify rows), the same as one
    token per step without MTP."""
    params = _greedy(logprobs=3)
    plain = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32").generate(prompts, params)
    llm = LLM(tiny_model_dir, num_draft_tokens=2, dtype="float32")
    OracleDrafts(llm, prompts, reference, error_rate=0.2).install(monkeypatch)
    drafted = llm.generate(prompts, params)
    assert llm.stats().mean_tokens_per_round > 1.5
    for a_out, b_out in zip(plain, drafted, strict=True):
        assert a_out.token_ids == b_out.token_ids == [e["token_id"] for e in b_out.logprobs]
        for a, b in zip(a_out.logprobs, b_out.logprobs, strict=True):
            assert b["logprob"] == pytest.approx(a["logprob"], abs=1e-4)
            assert [t for t, _ in b["top"]] == [t for t, _ in a["top"]] and len(a["top"]) == 3


@torch.no_grad()
def test_logprobs_in_steps_that_draw_are_the_models(tiny_model_dir):
    """Seeded sampling requests with logprobs beside others that draw, MTP k = 2 (every step
    draws; the logprobs are read after the draw): each emitted token's logprob is the
    log-softmax of transformers' logits at its position, teacher-forced on the prompt and the
    output (contexts within the indexer's top-k, so every key is selected on both sides)."""
    from transformers import DeepseekV32ForCausalLM

    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (3, 5, 4, 6)]
    params = [
        SamplingParams(max_tokens=8, temperature=1.0, seed=i, ignore_eos=True, logprobs=2)
        if i % 2 == 0
        else SamplingParams(max_tokens=8, temperature=0.7, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    engine = LLM(tiny_model_dir, num_draft_tokens=2, dtype="float32").engine
    execute, failed = engine.executor.execute, []

    def recording(step):  # a failing step would be re-run in halves and hide a wrong row
        try:
            return execute(step)
        except Exception as exc:
            failed.append(exc)
            raise

    engine.executor.execute = recording
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    final = {}
    while engine.has_unfinished:
        final.update((o.request_id, o) for o in engine.step() if o.finished)
    assert not failed
    model = DeepseekV32ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert max(len(p) for p in prompts) + 8 + 2 <= model.config.index_topk
    for prompt, sp, rid in zip(prompts, params, ids):
        out = final[rid]
        assert len(out.token_ids) == 8 and out.finish_reason == "length"
        if sp.logprobs is None:
            assert out.logprobs is None
            continue
        assert [e["token_id"] for e in out.logprobs] == out.token_ids
        sequence = torch.tensor([prompt + out.token_ids])
        logp = model(sequence).logits[0].float().log_softmax(-1)
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert entry["logprob"] == pytest.approx(
                logp[len(prompt) - 1 + j, token].item(), abs=1e-4
            )
