"""The engine on a GPU: Triton kernels, CUDA-graph decode steps, MTP — same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from kernels import ops

pytestmark = pytest.mark.gpu

PROMPT_LENS = [3, 41, 12, 27, 5, 33, 18, 9, 50, 2, 24, 15, 38, 7, 21, 30]


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _tokens(model_dir, prompts, **kw):
    llm = LLM(model_dir, device="cuda", **{"num_draft_tokens": 0, **kw})
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    stats = llm.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return [o.token_ids for o in outs], llm


def test_gpu_fp32_matches_cpu_reference(tiny_model_dir, prompts):
    reference = [
        o.token_ids
        for o in LLM(tiny_model_dir, num_draft_tokens=0, device="cpu", dtype="float32").generate(
            prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        )
    ]
    eager, _ = _tokens(tiny_model_dir, prompts, dtype="float32", enforce_eager=True)
    graphs, llm = _tokens(tiny_model_dir, prompts, dtype="float32")
    assert eager == reference
    assert graphs == reference
    assert llm.engine.executor.worker.runner.graphs.graphs  # decode steps really replayed graphs


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("share_topk", [False, True])
def test_gpu_bf16_mtp_with_graphs_is_identical(tiny_model_dir, prompts, k, share_topk):
    eager, _ = _tokens(tiny_model_dir, prompts, dtype="bfloat16", enforce_eager=True)
    graphs, _ = _tokens(tiny_model_dir, prompts, dtype="bfloat16")
    mtp, _ = _tokens(
        tiny_model_dir, prompts, dtype="bfloat16", num_draft_tokens=k, share_topk=share_topk
    )
    assert graphs == eager
    assert mtp == eager


def test_gpu_mtp_last_round_past_the_allocated_blocks(tiny_model_dir, prompts):
    """A request's last verify carries fewer than k drafts, so the scheduler allocates fewer
    slots than the graphed proposal's k + 1 padded rows span. Alone in its step, the request's
    block-table row is as short as its allocation: with 16-token blocks and every prompt length
    over a block, some padded row lies past it."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    options = dict(device="cuda", dtype="bfloat16", block_size_tokens=16)
    eager = LLM(tiny_model_dir, enforce_eager=True, num_draft_tokens=0, **options)
    mtp = LLM(tiny_model_dir, num_draft_tokens=3, **options)
    for n in range(8, 25):
        prompt = prompts[1][:n]  # 41 tokens
        want = eager.generate([prompt], params)[0].token_ids
        assert mtp.generate([prompt], params)[0].token_ids == want, n


def test_gpu_fp8_indexer_with_graphs_is_identical_to_eager(tiny_model_dir, prompts):
    """The FP8 indexer's cache write inside captured decode steps (no host sync, padded rows)."""
    eager, _ = _tokens(
        tiny_model_dir, prompts, dtype="bfloat16", indexer_numerics="fp8", enforce_eager=True
    )
    graphs, llm = _tokens(tiny_model_dir, prompts, dtype="bfloat16", indexer_numerics="fp8")
    assert graphs == eager
    assert llm.engine.executor.worker.runner.graphs.graphs


def test_gpu_graphed_proposals_match_eager_on_the_trained_model():
    """Drafts only change speed, so greedy identity cannot see a wrong draft: compare the
    acceptance of graphed proposals with eager ones on the trained default model."""
    from workers.default_model import default_model_path

    model = default_model_path()
    llm = LLM(model, num_draft_tokens=0, device="cuda", dtype="float32", enforce_eager=True)
    prompts = [
        llm.tokenizer.encode("import os\nimport sys\n\ndef main(argv):\n    ")[:64],
        llm.tokenizer.encode("class Parser:\n    def __init__(self, text):\n")[:64],
    ]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    stats = {}
    for eager in (True, False):
        llm = LLM(
            model,
            device="cuda",
            dtype="float32",
            enforce_eager=eager,
            num_draft_tokens=3,
            num_kv_blocks=64,
        )
        outs = llm.generate(prompts, params)
        stats[eager] = ([o.token_ids for o in outs], llm.stats().mean_tokens_per_round)
    assert stats[True][0] == stats[False][0]
    assert abs(stats[True][1] - stats[False][1]) < 0.05
    assert stats[False][1] > 1.5


def test_gpu_proposals_behind_the_draw_change_no_draw(tiny_model_dir, prompts):
    """Seeded sampling requests beside greedy ones, MTP k = 2, real CUDA graphs (verify,
    sampler, proposal): the proposal launched behind the batched draw leaves every token and
    every draft as the proposal made after the host's acceptance leaves them. (The hazard of
    a proposal graph replayed before the host reads the draws, a sampler graph output lying
    where a proposal graph captured earlier keeps its intermediates in the shared pool, did
    not show in this configuration; test_gpu_nothing_compiles_after_warm_up's sampled run at
    64 sequences caught it.)"""
    settings = [dict(temperature=1.0), dict(temperature=0.0), dict(temperature=0.8, top_k=20)]
    params = [
        SamplingParams(max_tokens=16, seed=40 + i, ignore_eos=True, **settings[i % 3])
        for i in range(len(prompts))
    ]

    def run(behind_draws: bool):
        llm = LLM(tiny_model_dir, device="cuda", dtype="float32", num_draft_tokens=2)
        runner = llm.engine.executor.worker.runner
        proposer, steps = runner.proposer, []
        execute = runner.execute

        def recording(step):
            out = execute(step)
            steps.append([(r.request_id, r.next_draft_token_ids) for r in out.results])
            return out

        runner.execute = recording
        if not behind_draws:
            proposer.after_draws = lambda *args: None
        engine = llm.engine
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        final = {}
        while engine.has_unfinished:
            final.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
        return [final[i] for i in ids], steps, proposer.num_proposed_again

    want, want_steps, _ = run(behind_draws=False)
    got, steps, again = run(behind_draws=True)
    assert got == want and steps == want_steps
    assert again == 0
    assert all(len(t) == 16 for t in got)


@pytest.mark.parametrize("heads", ["tiny", "whole-block", "whole-block-moe"])
@pytest.mark.parametrize("scales", ["amax", "ue8m0"])
def test_gpu_fp8_weights_engine(tiny_model_dir, prompts, tmp_path, scales, heads):
    """An FP8 checkpoint served with its weights FP8 in HBM (the FP8 linear kernel at the tiny
    model's odd shapes, inside CUDA graphs): fp32 greedy equals the CPU twins' greedy, and bf16
    greedy with MTP k = 3 equals bf16 greedy without it. With scales amax / 448 (DeepSeek-V3)
    and with UE8M0 scales (powers of two, V3.1 and later: the kernels' POW2_SCALES path). With
    heads whose nope and v parts are whole 128-row blocks, kv_b_proj stays FP8 too (the
    absorbed products of kernels/fp8_mla_absorb.py at 1 row, a few and a prefill's). With
    experts of whole blocks too (128 rows), a one-token step with UE8M0 scales runs the shared
    expert inside the routed experts' launches."""
    from tests.workers.test_fp8_engine import WHOLE_BLOCK_HEADS
    from tests.workers.test_loader import _quantize_checkpoint, _quantize_checkpoint_ue8m0, _rewrite
    from workers.tiny_model import make_tiny_model

    quantize = _quantize_checkpoint_ue8m0 if scales == "ue8m0" else _quantize_checkpoint
    src = tiny_model_dir
    if heads == "whole-block":
        src = make_tiny_model(str(tmp_path / "src"), seed=1, **WHOLE_BLOCK_HEADS)
    elif heads == "whole-block-moe":
        src = make_tiny_model(
            str(tmp_path / "src"), seed=1, **WHOLE_BLOCK_HEADS, moe_intermediate_size=128
        )
    fp8_dir = _rewrite(src, str(tmp_path / "fp8"), quantize)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    cpu = [
        o.token_ids
        for o in LLM(fp8_dir, num_draft_tokens=0, device="cpu", dtype="float32").generate(
            prompts, params
        )
    ]
    gpu, llm = _tokens(fp8_dir, prompts, dtype="float32")
    q_b = llm.engine.executor.worker.model.model.layers[1].self_attn.q_b_proj
    assert q_b.weight.dtype == torch.float8_e4m3fn and q_b.weight.is_cuda
    assert q_b.pow2_scales == (scales == "ue8m0")
    kv_b = llm.engine.executor.worker.model.model.layers[1].self_attn.kv_b_proj
    assert (kv_b.weight.dtype == torch.float8_e4m3fn) == heads.startswith("whole-block")
    moe = llm.engine.executor.worker.model.model.layers[1].mlp
    shared = moe._shared_expert()
    one_token = torch.zeros(1, moe.config.hidden_size, device="cuda")
    takes_shared = shared is not None and ops.moe_takes_shared(
        one_token, moe.experts.w13, moe.experts.w2, moe.experts.pow2_scales, shared
    )
    assert takes_shared == (heads == "whole-block-moe" and scales == "ue8m0")
    assert llm.engine.executor.worker.late_compiles.count == 0
    assert gpu == cpu
    # fp32 shows the identity; bf16 one-token steps and k + 1-row verifies take other kernels
    # (BENCHMARKS, "MTP against no MTP on the GPU"), so bf16 greedy with MTP may part from greedy
    # without it where the tiny model's flat logits tie to a bf16 step: only there (the bf16
    # prompt steps, w8a8 by default, are the same steps in both runs).
    fp32, _ = _tokens(fp8_dir, prompts, dtype="float32", num_draft_tokens=3)
    assert fp32 == gpu
    plain = LLM(fp8_dir, device="cuda", dtype="bfloat16", num_draft_tokens=0).generate(
        prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=20)
    )
    mtp, _ = _tokens(fp8_dir, prompts, dtype="bfloat16", num_draft_tokens=3)
    assert_equal_up_to_near_ties(plain, mtp)


# Two bf16 logits this close are a tie: a last-bit difference between two kernels' sums flips
# them (one bf16 step is 1/64 to 1/32 of a logit between 2 and 8).
NEAR_TIE = 1 / 32


def assert_equal_up_to_near_ties(plain, other: list[list[int]]) -> None:
    """`other`'s tokens equal `plain`'s (outputs with top-20 logprobs) up to where they part,
    and where they part the token `other` took is within NEAR_TIE of plain's best there (a
    wrong token, a draft accepted that greedy would not pick, lies further off)."""
    for out, tokens in zip(plain, other, strict=True):
        if tokens == out.token_ids:
            continue
        j = next(j for j, (a, b) in enumerate(zip(out.token_ids, tokens)) if a != b)
        best = out.logprobs[j]["logprob"]
        took = dict(out.logprobs[j]["top"]).get(tokens[j])
        assert took is not None and best - took < NEAR_TIE, (j, tokens[j], out.logprobs[j])


@pytest.mark.parametrize("weights", ["bf16", "fp8"])
@pytest.mark.parametrize("k", [0, 2])
def test_gpu_nothing_compiles_after_warm_up(tiny_model_dir, tmp_path, k, weights):
    """Warm before ready: prompts from 1 token to past two of the select's chunks of keys (so
    block tables 1, 2, 16 and more blocks wide, prefills above every tile threshold), 1 to 64 at
    once, greedy and sampled, in one engine after its warm-up: no Triton kernel compiles (or
    loads) in a step, and the sampler's graphs were all captured before. With FP8 weights in
    bf16, prompt-only steps take the w8a8 kernels at every row bucket and mixed steps the
    w8a16 ones."""
    g = torch.Generator().manual_seed(1)
    lengths = [1, 2, 15, 16, 17, 63, 64, 65, 100, 129, 700, 1023, 1024, 1500, 2100, 3900]
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    model_dir = tiny_model_dir
    if weights == "fp8":
        from tests.workers.test_loader import _quantize_checkpoint, _rewrite

        model_dir = _rewrite(tiny_model_dir, str(tmp_path / "fp8"), _quantize_checkpoint)
    llm = LLM(model_dir, device="cuda", num_draft_tokens=k, max_num_seqs=64)
    if weights == "fp8":
        assert llm.engine.executor.worker.runner.w8a8_prompt_rows == ops.W8A8_MIN_TOKENS
    late = llm.engine.executor.worker.late_compiles
    assert late is not None and late.count == 0
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for batch in (prompts[:1], prompts, prompts * 4):
        llm.generate(batch, params)
    sampler = llm.engine.executor.worker.runner.sampler_graphs
    captured = set(sampler.graphs)
    assert captured == set(sampler.keys())  # every sampler graph before ready
    sampled = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, ignore_eos=True)
    llm.generate(prompts, sampled)
    assert set(sampler.graphs) == captured
    assert late.count == 0, f"{late.count} kernel variants compiled after warm-up (see the log)"


@pytest.mark.parametrize("k", [0, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_prompts_arriving_mid_decode_replay_the_decode_graph(tiny_model_dir, prompts, dtype, k):
    """Prompts added one every other step while earlier ones decode (k = 0) or verify (MTP
    k = 2), as a server sees them: the steps that prefill them beside the others replay the
    q = 1 decode graph (their tokens as rows; with MTP the proposal after runs eagerly);
    greedy tokens equal the eager engine's without MTP (and in fp32 the CPU reference's)."""
    from tests.workers.arrivals import generate_staggered, record_graph_keys

    params = [
        SamplingParams(max_tokens=8 + i, temperature=0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    options = dict(device="cuda", dtype=dtype, num_draft_tokens=0, max_num_seqs=64)
    eager = generate_staggered(
        LLM(tiny_model_dir, enforce_eager=True, **options), prompts, params, 2
    )
    llm = LLM(tiny_model_dir, **{**options, "num_draft_tokens": k})
    keys = record_graph_keys(llm.engine.executor.worker.runner)
    graphed = generate_staggered(llm, prompts, params, 2)
    assert graphed == eager
    assert any(prefill and key is not None for _, prefill, key in keys)  # prefill rows
    if dtype == "float32":
        cpu = LLM(tiny_model_dir, device="cpu", dtype="float32", num_draft_tokens=0)
        assert graphed == generate_staggered(cpu, prompts, params, 2)


def test_gpu_a_second_engines_warm_up_is_not_the_firsts_late_compile(tiny_model_dir):
    """Two engines in one process (Triton's hooks are per process): the second one's warm-up,
    which compiles its own variants (fp32), is not logged as the first one's late compiles."""
    first = LLM(tiny_model_dir, device="cuda", num_draft_tokens=0, max_num_seqs=4)
    late = first.engine.executor.worker.late_compiles
    assert late is not None and late.count == 0
    second = LLM(tiny_model_dir, device="cuda", num_draft_tokens=0, max_num_seqs=4, dtype="float32")
    assert late.count == 0
    assert second.engine.executor.worker.late_compiles.count == 0


def _first_token_logprobs(llm, prompts) -> list[dict[int, float]]:
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=20)
    return [dict(o.logprobs[0]["top"]) for o in llm.generate(prompts, params)]


def _logprob_error(reference, rows) -> float:
    """Mean over prompts of the largest |logprob - reference's| among the top-20 both hold."""
    worst = [max(abs(r[t] - x[t]) for t in r.keys() & x.keys()) for r, x in zip(reference, rows)]
    return sum(worst) / len(worst)


@pytest.mark.parametrize("k", [0, 3])
def test_gpu_dense_prompt_steps(tiny_model_dir, prompts, monkeypatch, k):
    """MTPSERVE_DENSE_PROMPTS=on: prompt tokens before index_topk attend densely on the GPU
    (PyTorch's flash kernel in bf16, the twin in fp32). fp32 greedy equals the CPU's, with MTP
    k and without. In bf16 the dense path is a different rounding of the same attention: the
    prompts' first-token logprobs are as close to fp32's as the sparse path's are (bf16 itself
    moves this random model's by up to ~0.7), and greedy with MTP k equals greedy without it up
    to near ties (the prompts take one path in both). Nothing compiles after warm-up."""
    from kernels.settings import reload_settings

    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    cpu_llm = LLM(tiny_model_dir, num_draft_tokens=0, device="cpu", dtype="float32")
    cpu = [o.token_ids for o in cpu_llm.generate(prompts, params)]
    reference = _first_token_logprobs(cpu_llm, prompts)
    sparse_llm = LLM(tiny_model_dir, device="cuda", dtype="bfloat16", num_draft_tokens=0)
    assert not sparse_llm.engine.executor.worker.runner.dense_prompts  # the default on CUDA
    sparse = _first_token_logprobs(sparse_llm, prompts)
    monkeypatch.setenv("MTPSERVE_DENSE_PROMPTS", "on")
    reload_settings()
    try:
        fp32, llm = _tokens(tiny_model_dir, prompts, dtype="float32", num_draft_tokens=k)
        assert llm.engine.executor.worker.runner.dense_prompts
        assert llm.engine.executor.worker.late_compiles.count == 0
        plain = LLM(tiny_model_dir, device="cuda", dtype="bfloat16", num_draft_tokens=0)
        dense = _first_token_logprobs(plain, prompts)
        plain_out = plain.generate(
            prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=20)
        )
        mtp, llm = _tokens(tiny_model_dir, prompts, dtype="bfloat16", num_draft_tokens=k)
        assert llm.engine.executor.worker.late_compiles.count == 0
    finally:
        monkeypatch.delenv("MTPSERVE_DENSE_PROMPTS")
        reload_settings()
    assert fp32 == cpu
    dense_error, sparse_error = _logprob_error(reference, dense), _logprob_error(reference, sparse)
    assert 0 < dense_error <= 1.5 * sparse_error + 0.02, (dense_error, sparse_error)
    assert_equal_up_to_near_ties(plain_out, mtp)
