"""Prefix caching changes no output and no cache row.

Greedy output of multi-turn conversations on a shared system prompt, with prefix caching on, is
token-for-token the output with it off (and without MTP): MTP k = 0..3, on the tiny fixture and
two configs of the family, under preemption and under eviction pressure. Greedy identity cannot
see a wrong MTP-cache row (drafts only change speed), so the MTP layer's rows after a hit are
also compared with a cold run's, including the case that the next token in a block's key exists
for: a prompt that leaves a cached prompt exactly at a block boundary.
"""

from __future__ import annotations

import pytest
import torch

import cluster.engine
from cluster.block_manager import BlockManager
from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from workers.tiny_model import make_tiny_model, random_config

BLOCK = 16  # small blocks, so short prompts span several
MAX_TOKENS = 10
SYSTEM_LEN = 40
NUM_CONVERSATIONS = 4
NUM_TURNS = 3


def _greedy() -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _user_turns(vocab_size: int, seed: int = 0) -> tuple[list[int], list[list[list[int]]]]:
    """A shared system prompt, and each turn's new user tokens per conversation."""
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(3, vocab_size, (SYSTEM_LEN,), generator=g).tolist()
    users = [
        [torch.randint(3, vocab_size, (3 + 5 * c + t,), generator=g).tolist() for c in range(4)]
        for t in range(NUM_TURNS)
    ]
    return system, users


def _converse(llm: LLM, system: list[int], users) -> list[list[int]]:
    """Each turn sends every conversation's history plus its new user tokens, all at once;
    returns every output in order (turn-major)."""
    histories = [list(system) for _ in range(NUM_CONVERSATIONS)]
    outputs = []
    for turn in users:
        prompts = [h + u for h, u in zip(histories, turn)]
        outs = llm.generate(prompts, _greedy())
        outputs += [o.token_ids for o in outs]
        histories = [p + o.token_ids for p, o in zip(prompts, outs)]
        if llm.engine.config.enable_prefix_caching and turn is not users[0]:
            # A later turn extends its own history: most of it is cached.
            assert all(o.num_cached_tokens >= SYSTEM_LEN // BLOCK * BLOCK for o in outs)
    return outputs


def _llm(model_dir: str, **options) -> LLM:
    # Chunks of 48 tokens: turn 1's prefills are admitted over several steps, so later
    # conversations hit the system prompt's blocks that earlier ones published.
    options = {"max_num_batched_tokens": 48, "max_num_seqs": 8, "num_draft_tokens": 0, **options}
    return LLM(model_dir, dtype="float32", block_size_tokens=BLOCK, **options)


@pytest.fixture(scope="module")
def turns():
    return _user_turns(512)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, turns):
    """Prefix caching off, MTP off (itself transformers' greedy: test_engine_greedy.py)."""
    return _converse(_llm(tiny_model_dir, enable_prefix_caching=False), *turns)


# MTP k = 0..3; k = 0 also with steps overlapping (each request keeping its next decode's slot)
STEP_MODES = pytest.mark.parametrize(
    "k, overlap", [(0, "auto"), (0, "on"), (1, "auto"), (2, "auto"), (3, "auto")]
)


@STEP_MODES
def test_greedy_identical_with_cache_hits(tiny_model_dir, turns, reference, k, overlap):
    llm = _llm(tiny_model_dir, num_draft_tokens=k, overlap_steps=overlap)
    assert _converse(llm, *turns) == reference
    stats = llm.stats()
    assert stats.prefix_cache_hit_tokens >= (NUM_TURNS * NUM_CONVERSATIONS - 1) * BLOCK * 2
    assert stats.num_free_blocks == stats.num_total_blocks


@STEP_MODES
def test_greedy_identical_under_preemption_and_eviction(
    tiny_model_dir, turns, reference, k, overlap
):
    # 11 usable blocks of 16 tokens for 4 conversations of up to ~110 tokens: requests are
    # preempted, and cached blocks evicted, over and over.
    llm = _llm(
        tiny_model_dir,
        num_draft_tokens=k,
        num_kv_blocks=12,
        max_model_len=160,
        overlap_steps=overlap,
    )
    preemptions = []
    scheduler = llm.engine.scheduler
    original = scheduler._preempt
    scheduler._preempt = lambda r, o: (preemptions.append(r.request_id), original(r, o))
    assert _converse(llm, *turns) == reference
    assert preemptions
    bm = scheduler.block_manager
    assert bm.stats.num_evicted_blocks > 0 and bm.stats.num_hit_tokens > 0
    bm.check_invariants([])


@pytest.mark.parametrize("seed", [3, 10])
def test_family_configs_identical_with_cache_hits(tmp_path_factory, seed):
    """Two configs of the family (tests/workers/test_config_family.py), their MTP layers made
    to echo the target so drafts are accepted too: MTP k = 2 with the cache = no MTP without."""
    model_dir = make_tiny_model(
        str(tmp_path_factory.mktemp(f"prefix-family-{seed}")),
        seed=seed,
        mtp_echo=0.1,
        **random_config(seed),
    )
    turns = _user_turns(512, seed)
    reference = _converse(_llm(model_dir, enable_prefix_caching=False), *turns)
    for k in (0, 2):
        llm = _llm(model_dir, num_draft_tokens=k)
        assert _converse(llm, *turns) == reference, k
        assert llm.stats().prefix_cache_hit_tokens > 0


def _mtp_rows(llm: LLM, block_ids: list[int], num_positions: int) -> torch.Tensor:
    """The MTP layer's latent and indexer-key rows of positions 0..num_positions-1."""
    model = llm.engine.executor.worker.model
    n = model.config.num_hidden_layers
    rows = []
    for cache in (model.kv_caches[n], model.index_caches[n]):
        flat = cache[torch.tensor(block_ids)].reshape(-1, cache.shape[-1])  # [blocks * bs, w]
        rows.append(flat[:num_positions])
    return torch.cat(rows, -1)


def _run_capturing_blocks(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Generate the prompts one after another; each request's block table at its end."""
    bm = llm.engine.scheduler.block_manager
    tables = {}
    original = bm.free

    def free(request):
        tables[request.request_id] = list(request.block_ids)
        return original(request)

    bm.free = free
    ids = []
    for p in prompts:
        ids.append(llm.engine.add_request(p, _greedy()))
        while llm.engine.has_unfinished:
            llm.engine.step()
    return [tables[i] for i in ids]


@pytest.mark.parametrize("next_token_in_key", [True, False])
def test_mtp_rows_after_a_hit_equal_a_cold_run(
    tiny_model_dir, monkeypatch, next_token_in_key: bool
):
    """P1 is cached; P2 extends it (hits both blocks of the shared 32 tokens), P3 leaves it at
    the block boundary (token 32 differs). The MTP rows of P2 and P3 must equal a cold engine's.
    Without the next token in the key, P3 reuses the row of position 31 that pairs h_31 with
    P1's token 32: the control run shows the comparison sees that."""
    if not next_token_in_key:

        def without_next_token(*args, **kwargs):
            kwargs["key_includes_next_token"] = False
            return BlockManager(*args, **kwargs)

        monkeypatch.setattr(cluster.engine, "BlockManager", without_next_token)
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 512, (2 * BLOCK,), generator=g).tolist()
    tail = torch.randint(3, 512, (10,), generator=g).tolist()
    other = [(t + 1) % 509 + 3 for t in tail]
    p1, p2, p3 = shared + tail, shared + tail[:3] + other[3:], shared + other

    warm = _llm(tiny_model_dir, num_draft_tokens=2)
    cold = _llm(tiny_model_dir, num_draft_tokens=2, enable_prefix_caching=False)
    _run_capturing_blocks(warm, [p1])
    for prompt in (p2, p3):
        # Rows 0..len-1 (the last pairs h_{len-1} with the sampled token), read before the
        # next request can take the request's private blocks.
        num = len(prompt)
        [table] = _run_capturing_blocks(warm, [prompt])
        warm_rows = _mtp_rows(warm, table, num)
        [cold_table] = _run_capturing_blocks(cold, [prompt])
        cold_rows = _mtp_rows(cold, cold_table, num)
        assert warm_rows.abs().amax(-1).min() > 0  # every row written
        bad = ((warm_rows - cold_rows).abs().amax(-1) > 1e-4).nonzero().flatten().tolist()
        if next_token_in_key or prompt is p2:
            assert bad == []
        else:
            assert bad == [2 * BLOCK - 1]  # P3's row 31 pairs h_31 with P1's token 32
    # P2 hits blocks 0-1; P3 hits block 0 (block 1's key holds token 32), or both without it.
    assert warm.stats().prefix_cache_hit_tokens == (3 if next_token_in_key else 4) * BLOCK


def test_preemption_drops_the_pending_hidden_state(tiny_model_dir):
    """A request preempted between prefill chunks resumes from a cached prefix or from 0; the
    hidden state its last chunk left pending belongs to the thrown-away computation, and its
    pair's row may now lie in a shared block: the engine tells the workers with the next step
    that runs (even when the step that preempted schedules nothing), and they drop it."""
    from cluster.scheduler import SchedulerOutput
    from workers.batch import StepInput

    llm = _llm(tiny_model_dir, num_draft_tokens=2, max_num_batched_tokens=32)
    engine = llm.engine
    runner = engine.executor.worker.runner
    g = torch.Generator().manual_seed(7)
    request_id = engine.add_request(torch.randint(3, 512, (80,), generator=g).tolist(), _greedy())
    engine.step()  # a 32-token chunk: h_31 is pending
    assert runner.proposer.pending[request_id].position == 31

    # The runner drops a preempted request's pending state, even in a step with no work.
    runner.execute(StepInput([], 2, preempted_request_ids=[request_id]))
    assert request_id not in runner.proposer.pending

    # The engine sends the ids of a step that scheduled nothing with the next one that runs.
    scheduler = engine.scheduler
    [request] = scheduler.running
    original = scheduler.schedule

    def schedule_preempting() -> SchedulerOutput:
        scheduler.schedule = original
        output = SchedulerOutput()
        scheduler._preempt(request, output)
        return output

    sent: list[list[str]] = []
    execute = engine.executor.execute
    engine.executor.execute = lambda step: (sent.append(step.preempted_request_ids), execute(step))[
        1
    ]
    scheduler.schedule = schedule_preempting
    assert engine.step() == [] and sent == []
    while engine.has_unfinished:
        engine.step()
    assert sent[0] == [request_id] and all(ids == [] for ids in sent[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("k", [0, 2])
def test_gpu_greedy_identical_with_cache_hits(tiny_model_dir, turns, reference, k):
    """On the GPU (fp32, Triton kernels, CUDA-graph decode steps and proposals): hits change
    no token against the CPU reference without the cache."""
    llm = _llm(tiny_model_dir, num_draft_tokens=k, device="cuda")
    assert _converse(llm, *turns) == reference
    assert llm.stats().prefix_cache_hit_tokens > 0
