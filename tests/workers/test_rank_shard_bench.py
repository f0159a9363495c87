"""benchmarks/bench_rank_shard.py's accounting, on its tiny config's shard on the CPU (rank 0 of
TP=8/EP=8, simulated): the shard's bytes by dtype are `mtpserve plan`'s per rank, the
collectives the step's forward makes are the list the two-GPU timing replays, and the HBM
floor counts the bytes a step reads."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_rank_shard as bench


@pytest.fixture(scope="module")
def tiny_run():
    lines = []
    return bench.run_cpu_tiny(lines.append), lines


def test_shard_bytes_by_dtype_are_the_plans(tiny_run):
    checked, lines = tiny_run
    assert checked["bytes"] == checked["plan"]
    assert checked["worst_gap"] == 0.0
    # FP8 weights and scales, the bf16 embedding, head and norms, the fp32 router: all there.
    assert set(checked["bytes"]) == {"bfloat16", "float32", "float8_e4m3fn"}
    assert any("agree" in line for line in lines)


def test_the_shards_own_tensors_are_what_the_plan_counts():
    """Per dtype, from a second build: what the plan would hold for one rank, independently of
    bytes_by_dtype (every parameter once, by element size)."""
    config = bench.shard_config(tiny=True)
    with bench.simulated_rank():
        model = bench.build_shard(config, torch.device("cpu"), progress=lambda _: None)
    fp8 = sum(p.numel() for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn)
    # rank 0's routed experts: 16 / 8 = 2, each gate + up + down of 128 x 256
    assert model.model.layers[1].mlp.experts.w13.shape == (2, 256, 256)
    assert fp8 == bench.bytes_by_dtype(model)["float8_e4m3fn"]
    assert bench.plan_bytes_by_dtype(tiny=True)["float8_e4m3fn"] == fp8
    # random values, finite, in the sizes the loader keeps: weights N(0, 1), scales the power
    # of two nearest in**-0.5 (UE8M0, as DeepSeek-V3.2 ships them), noted by every FP8 layer
    w = model.model.layers[0].self_attn.q_b_proj
    assert w.weight.shape == (128, 128) and torch.isfinite(w.weight.float()).all()
    assert torch.all(w.weight_scale_inv == 2.0**-4)  # 128**-0.5 = 2**-3.5, rounded to even
    fp8_layers = [m for m in model.modules() if getattr(m, "is_fp8", False)]
    assert fp8_layers and all(m.pow2_scales for m in fp8_layers)
    assert 0.8 < w.weight.float().std().item() < 1.2


def test_recorded_collectives_are_the_ones_timed(tiny_run):
    checked, _ = tiny_run
    for (batch, k), (recorded, expected) in checked["collectives"].items():
        assert recorded == expected, (batch, k)
    recorded, _ = checked["collectives"][(2, 0)]
    # 2 layers: the embedding's all-reduce, 2 per layer, one broadcast per layer, the head's
    # gather of this rank's 2048 / 8 vocabulary columns.
    assert [op for op, _, _ in recorded].count("all_reduce") == 1 + 2 * 2
    assert ("all_gather", (2, 256), torch.bfloat16) in recorded


@pytest.mark.parametrize("share", [False, True])
def test_longer_mtp_proposals_record_what_step_collectives_lists(share):
    config = bench.shard_config(tiny=True)
    with bench.simulated_rank() as state:
        model = bench.build_shard(config, torch.device("cpu"), progress=lambda _: None)
        from workers.kv_cache import allocate_kv_caches

        model.bind_caches(*allocate_kv_caches(config, 2, 64, bench.BF16, "cpu", with_mtp=True))
        recorded = bench.recorded_collectives(model, state, 2, k=2, share_topk=share)
    assert recorded == bench.step_collectives(config, 2, k=2, share_topk=share)


def test_real_model_step_collectives_and_floor():
    config = bench.shard_config(tiny=False)
    ops = bench.step_collectives(config, 32)
    assert ops.count(("all_reduce", (32, 7168), torch.bfloat16)) == 1 + 2 * 61
    assert ops.count(("broadcast", (32, 2048), torch.int32)) == 61
    assert ops[-1] == ("all_gather", (32, 129280 // 8), torch.bfloat16)


def test_expected_experts_touched_per_rank():
    config = bench.shard_config(tiny=False)
    mean, busiest = bench.experts_touched(config, 1, trials=20)
    # one token picks 8 distinct experts, over 8 ranks: one a rank on average; the busiest
    # rank holds at least 2 of them (they lie in at most topk_group=4 groups = 4 ranks)
    assert mean == pytest.approx(1.0)
    assert 2 <= busiest <= 8
    mean, busiest = bench.experts_touched(config, 512, trials=5)
    assert mean > 31.5 and busiest == 32


def test_floor_reads_the_touched_experts_and_the_kv(tiny_run):
    config = bench.shard_config(tiny=True)
    with bench.simulated_rank():
        model = bench.build_shard(config, torch.device("cpu"), progress=lambda _: None)
    experts, other = 0, 0
    for name, p in model.model.layers.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            experts += nbytes
        else:
            other += nbytes
    head = model.lm_head.weight.numel() * 2
    floor = bench.floor_bytes(model, 1, 64)
    # one token touches 4 of 16 experts: a quarter of this rank's (uniform routing)
    assert floor["weights"] == pytest.approx(other + experts * 4 / 16 + head + 256 * 2)
    # per layer: min(index_topk, 64) = 16 latent rows of 128 + 64, and 64 indexer keys of 64
    assert floor["kv"] == 2 * (16 * (128 + 64) * 2 + 64 * 64 * 2)


@pytest.mark.parametrize("fp8", [True, False])
def test_shared_experts_compute_what_the_same_weights_held_apart_do(fp8):
    """`share_experts` (bench_decode's --share-experts, for a bf16 slice that fits no 80 GB GPU
    otherwise): every MoE layer holds the first one's expert tensors, one copy, and the
    forward's logits are those of a model that holds copies of them in every layer."""
    from workers.attention_metadata import AttentionMetadata
    from workers.kv_cache import allocate_kv_caches
    from workers.model import DeepseekV32ForCausalLM, Experts

    config = bench.shard_config(tiny=True)
    cpu = torch.device("cpu")
    shared = bench.build_shard(
        config, cpu, progress=lambda _: None, topk_source=None, fp8=fp8, share_experts=True
    )
    experts = [m for m in shared.modules() if isinstance(m, Experts)]
    assert len(experts) == 2  # layer 1 and the MTP layer
    assert experts[0].w13 is experts[1].w13 and experts[0].w2 is experts[1].w2
    assert (experts[0].w13.dtype == torch.float8_e4m3fn) == fp8
    assert (experts[0].w13_scale_inv is experts[1].w13_scale_inv) if fp8 else True
    alone = bench.build_shard(config, cpu, progress=lambda _: None, topk_source=None, fp8=fp8)
    held = bench.bytes_by_dtype(alone)
    dtype = "float8_e4m3fn" if fp8 else "bfloat16"
    one_set = sum(
        p.numel() * p.element_size()
        for p in experts[0].parameters()
        if str(p.dtype).removeprefix("torch.") == dtype
    )
    assert bench.bytes_by_dtype(shared)[dtype] == held[dtype] - one_set
    # the same values held apart: every name's tensor copied into a model of its own
    apart = bench.build_shard(config, cpu, progress=lambda _: None, topk_source=None, fp8=fp8)
    state = shared.state_dict(keep_vars=False)
    apart.load_state_dict({k: v.clone() for k, v in state.items()})
    apart_experts = [m for m in apart.modules() if isinstance(m, Experts)]
    assert apart_experts[0].w13.data_ptr() != apart_experts[1].w13.data_ptr()
    assert torch.equal(apart_experts[1].w13.float(), experts[0].w13.float())
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (40,))
    logits = []
    for model in (shared, apart):
        assert isinstance(model, DeepseekV32ForCausalLM)
        model.bind_caches(*allocate_kv_caches(config, 1, 64, bench.BF16, "cpu", with_mtp=True))
        meta = AttentionMetadata(
            torch.arange(40),
            torch.arange(40),
            torch.zeros(40, dtype=torch.int64),
            torch.zeros(1, 1, dtype=torch.int32),
        )
        with torch.no_grad():
            logits.append(model.compute_logits(model(ids, meta)).float())
    assert torch.isfinite(logits[0]).all() and logits[0].abs().max() > 0
    assert torch.equal(logits[0], logits[1])
