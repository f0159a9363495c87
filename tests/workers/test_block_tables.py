"""A rank's block tables between steps (workers.block_tables) and the engine's side of the
protocol: a step carries only the entries a rank does not hold, and what the ranks rebuild from
those is the scheduler's table at every step, through growth, rejected drafts and preemption."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cluster.llm import LLM
from cluster.sampling_params import SamplingParams
from tests.preemptions import record_preemptions
from workers.batch import SeqWork
from workers.block_tables import BlockTables


def _seq(rid: str, block_ids: list[int], start: int = 0) -> SeqWork:
    return SeqWork(rid, [1], 0, block_ids, 0, samples=True, block_table_start=start)


def test_updates_grow_replace_and_forget():
    tables = BlockTables()
    assert tables.update(_seq("a", [4, 9])).tolist() == [4, 9]
    assert tables.update(_seq("a", [], start=2)).tolist() == [4, 9]  # nothing new
    assert tables.update(_seq("a", list(range(20, 40)), start=2)).tolist() == [4, 9] + list(
        range(20, 40)
    )  # grown past the first capacity, the kept entries copied
    assert tables.update(_seq("a", [7], start=1)).tolist() == [4, 7]  # truncated, then a new one
    assert tables.update(_seq("b", [3])).tolist() == [3]
    tables.forget(["a"])
    assert len(tables) == 1
    assert tables.update(_seq("a", [5])).tolist() == [5]


def test_an_update_applied_twice_gives_the_same_table():
    """A step re-run without its failed request sends the same SeqWork again."""
    tables = BlockTables()
    tables.update(_seq("a", [1, 2, 3]))
    once = tables.update(_seq("a", [8, 9], start=2)).copy()
    assert np.array_equal(tables.update(_seq("a", [8, 9], start=2)), once)
    assert once.tolist() == [1, 2, 8, 9]


def test_keeping_entries_the_rank_never_had_is_an_error():
    tables = BlockTables()
    with pytest.raises(ValueError, match="first 2 entries .* holds 0"):
        tables.update(_seq("a", [1], start=2))
    tables.update(_seq("a", [1]))
    with pytest.raises(ValueError, match="holds 1"):
        tables.update(_seq("a", [], start=3))


@pytest.mark.parametrize("k", [0, 2])
def test_ranks_rebuild_the_schedulers_tables_from_the_steps(tiny_model_dir, k):
    """Small blocks (many per request), a KV pool that forces preemption, MTP drafts that are
    rejected (tables truncated): at every step, the tables a rank rebuilds from what the steps
    sent equal the scheduler's, and decode steps send a small fraction of the entries."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (40, 7, 63, 25, 90, 12)]
    llm = LLM(
        tiny_model_dir,
        num_draft_tokens=k,
        block_size_tokens=16,
        num_kv_blocks=24,
        max_model_len=256,
        dtype="float32",
    )
    engine = llm.engine
    mirror = BlockTables()
    counts = {"sent": 0, "held": 0, "steps": 0}
    execute = engine.executor.execute

    def checking_execute(step):
        mirror.forget(step.finished_request_ids)
        for s in step.seqs:
            table = mirror.update(s)
            assert table.tolist() == engine.scheduler.get(s.request_id).block_ids
            counts["sent"] += len(s.block_ids)
            counts["held"] += len(table)
        counts["steps"] += 1
        return execute(step)

    engine.executor.execute = checking_execute
    # What the runner hands the step's readers (the MTP proposer's slots) is each sequence's
    # table on the host, as the ranks hold it, not the device's padded rows.
    runner = engine.executor.worker.runner
    prepare = runner._prepare

    def checking_prepare(seqs, tables):
        batch = prepare(seqs, tables)
        assert len(batch.block_tables) == len(seqs)
        for s, table in zip(seqs, batch.block_tables):
            assert isinstance(table, np.ndarray)
            assert table.tolist() == engine.scheduler.get(s.request_id).block_ids
        return batch

    runner._prepare = checking_prepare
    preemptions = record_preemptions(llm)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert preemptions, "the pool was meant to force preemption"
    assert all(len(o.token_ids) == 60 for o in outs)
    assert counts["sent"] < counts["held"] / 4, counts

    reference = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32").generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
