"""Logits processors (logit_bias, presence / frequency / repetition penalties, min_tokens).

References: a closed form on hand-made logits; and, end to end, a greedy loop over
`transformers`' own DeepseekV32ForCausalLM with the processor written out in plain Python. The
engine without MTP must equal that loop, and the engine with MTP (k = 2, drafts verified against
the processed distribution) must equal it too, token for token. Each case also differs from
plain greedy, so a processor that does nothing fails. End to end runs the shipped default model:
its MTP layer is trained, so drafts are accepted and rows past the first of a verify (the ones
that count earlier drafts) decide tokens; the tiny random model's drafts almost never land.
"""

from __future__ import annotations

import math

import pytest
import torch

from cluster.llm import LLM
from cluster.sampling_params import InvalidRequestError, SamplingParams
from tests.preemptions import record_preemptions
from workers.batch import SamplingSpec
from workers.default_model import SHIPPED_DIR
from workers.logits_processors import (
    OutputCounts,
    process_logits,
    prompt_token_mask,
    record_step_tokens,
)

MAX_TOKENS = 16
PROMPT_TEXTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def "]


def test_process_logits_closed_form():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 3)
    spec = SamplingSpec(
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logit_bias=((4, 10.0),),
        min_tokens=3,
        min_tokens_masked_ids=(5,),
        num_prompt_tokens=2,
    )
    # prompt [1, 2], output [3, 3]; drafts [0, 4]: row j counts drafts[:j]
    out = process_logits(logits, spec, [1, 2, 3, 3], [0, 4])

    def expected(row: int) -> list[float]:
        output = [3, 3] + [0, 4][:row]
        seen = set(output) | {1, 2}
        values = []
        for t, x in enumerate(logits[row].tolist()):
            if t in seen:
                x = x / 2.0 if x > 0 else x * 2.0
            count = output.count(t)
            x -= 0.5 * (count > 0) + 0.25 * count
            x += 10.0 if t == 4 else 0.0
            if t == 5 and len([3, 3]) + row < 3:  # output so far shorter than min_tokens
                x = -math.inf
            values.append(x)
        return values

    assert out.tolist() == [expected(r) for r in range(3)]
    # The runner's mask of the prompt, built once per request, gives the same logits.
    mask = prompt_token_mask([1, 2], logits.shape[-1], logits.device)
    assert mask.tolist() == [False, True, True, False, False, False]
    assert torch.equal(process_logits(logits, spec, [1, 2, 3, 3], [0, 4], mask), out)
    # And so do the runner's output counts, kept up step by step.
    counts = OutputCounts(logits.shape[-1], logits.device)
    counts.update([1, 2, 3], 2, 3)
    kept = counts.update([1, 2, 3, 3, 9], 2, 4)  # past `end`: not counted
    assert kept.tolist() == [0, 0, 0, 2, 0, 0]
    assert torch.equal(process_logits(logits, spec, [1, 2, 3, 3], [0, 4], mask, kept), out)
    # The runner's history with the drafts after the context, read up to the context's end.
    history = [1, 2, 3, 3, 0, 4]
    assert torch.equal(process_logits(logits, spec, history, [0, 4], context_len=4), out)
    assert torch.equal(process_logits(logits, spec, history, [0, 4], mask, kept, 4), out)


def test_record_step_tokens_drops_rejected_drafts():
    history = [1, 2, 3]
    record_step_tokens(history, 3, [4, 50, 51])  # verify: last token 4, drafts 50, 51
    assert history == [1, 2, 3, 4, 50, 51]
    record_step_tokens(history, 5, [9, 60])  # draft 50 accepted, 51 rejected for 9
    assert history == [1, 2, 3, 4, 50, 9, 60]
    record_step_tokens(history, 0, [1, 2, 3, 4, 50, 9])  # recompute after preemption
    assert history == [1, 2, 3, 4, 50, 9]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logit_bias": {512: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ],
)
def test_bad_processor_values_are_refused(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(max_tokens=16, **kwargs).validate(vocab_size=512)
    assert info.value.param == param


# --- end to end ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_model():
    from transformers import DeepseekV32ForCausalLM

    return DeepseekV32ForCausalLM.from_pretrained(SHIPPED_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engines():
    return {k: LLM(SHIPPED_DIR, num_draft_tokens=k, dtype="float32", device="cpu") for k in (0, 2)}


@pytest.fixture(scope="module")
def prompts(engines):
    return [engines[0].tokenizer.encode(text) for text in PROMPT_TEXTS]


def _reference(model, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding with the processor written out in Python, one full forward per token."""
    output: list[int] = []
    with torch.no_grad():
        while len(output) < params.max_tokens:
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float().tolist()
            for t in range(len(logits)):
                if params.repetition_penalty != 1.0 and t in prompt + output:
                    r = params.repetition_penalty
                    logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
                count = output.count(t)
                logits[t] -= params.presence_penalty * (count > 0)
                logits[t] -= params.frequency_penalty * count
                logits[t] += params.logit_bias.get(t, 0.0)
                if len(output) < params.min_tokens and t in params.stop_token_ids:
                    logits[t] = -math.inf
            token = max(range(len(logits)), key=logits.__getitem__)
            output.append(token)
            if token in params.stop_token_ids:
                break
    return output


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def plain(engines, prompts):
    return [o.token_ids for o in engines[0].generate(prompts, _greedy())]


CASES = {
    "repetition_penalty": dict(repetition_penalty=1.8),
    "presence_penalty": dict(presence_penalty=1.5),
    "frequency_penalty": dict(frequency_penalty=0.7),
    "logit_bias": None,  # made from the plain output: see below
}


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_with_processor_is_the_reference_with_and_without_mtp(
    engines, hf_model, prompts, plain, name
):
    # logit_bias bans a token plain greedy emits and pushes down another one.
    kwargs = CASES[name] or dict(logit_bias={plain[0][3]: -100.0, plain[1][2]: -5.0})
    params = _greedy(**kwargs)
    reference = [_reference(hf_model, p, params) for p in prompts]
    assert reference != plain  # the processor changes the output
    for k, llm in engines.items():
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == reference, f"k={k}"
        if k:
            assert sum(o.spec.num_accepted_drafts for o in outs) > 0  # drafts really verified


def test_min_tokens_masks_stop_tokens_with_and_without_mtp(engines, hf_model, prompts, plain):
    # Stop at the token plain greedy emits third: without min_tokens the output ends there.
    stops = [[out[2]] for out in plain]
    for prompt, stop, base in zip(prompts, stops, plain):
        params = _greedy(stop_token_ids=stop, min_tokens=8)
        reference = _reference(hf_model, prompt, params)
        cut = base[: base.index(stop[0]) + 1]
        assert len(reference) >= 8 and reference != cut
        for k, llm in engines.items():
            [out] = llm.generate([prompt], params)
            assert out.token_ids == reference, f"k={k}"


def test_logit_bias_steers_sampling_with_and_without_mtp(engines, prompts):
    params = SamplingParams(
        max_tokens=8, temperature=1.0, seed=3, ignore_eos=True, logit_bias={77: 100.0}
    )
    for llm in engines.values():
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [[77] * 8] * len(prompts)


def test_penalties_kept_across_steps_match_under_mtp_and_preemption(tiny_model_dir):
    """The runner keeps a request's output counts and prompt mask across steps. Long greedy
    outputs with every penalty: MTP k = 2 in a pool small enough to preempt give the same
    tokens as k = 0 with room for all."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (30, 9, 55, 21)]
    params = SamplingParams(
        max_tokens=80,
        temperature=0.0,
        ignore_eos=True,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.3,
    )
    roomy = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32")
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    tight = LLM(
        tiny_model_dir,
        num_draft_tokens=2,
        block_size_tokens=16,
        num_kv_blocks=14,
        max_model_len=256,
        dtype="float32",
    )
    preemptions = record_preemptions(tight)
    assert [o.token_ids for o in tight.generate(prompts, params)] == want
    assert preemptions, "the pool was meant to force preemption"
    plain = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in roomy.generate(prompts, plain)] != want  # penalties did act


@pytest.mark.parametrize("k", [0, 2])
def test_requests_sampled_together_each_draw_from_their_own_rows(tiny_model_dir, k):
    """Unseeded sampling requests draw together (one batched sampler): requests whose logit
    bias makes one token certain, each a different one, between requests without processors,
    all in the same steps; each biased request emits only its own token."""
    llm = LLM(tiny_model_dir, num_draft_tokens=k, dtype="float32")
    engine = llm.engine
    forced = [17, 230, 401]
    ids = []
    for n, token in enumerate(forced):
        plain = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
        ids.append((None, engine.add_request([5 + n, 9, 13], plain)))
        biased = SamplingParams(
            max_tokens=12, temperature=1.0, ignore_eos=True, logit_bias={token: 100.0}
        )
        ids.append((token, engine.add_request([7 + n, 11], biased)))
    final = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    for token, request_id in ids:
        out = final[request_id]
        assert len(out.token_ids) == 12
        if token is not None:
            assert out.token_ids == [token] * 12
