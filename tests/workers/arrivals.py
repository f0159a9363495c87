"""Requests arriving while others decode, as a server sees them, and a record of which steps
replayed a decode graph (`ModelRunner._graph_key`): shared by the CPU, GPU and warm-up tests."""

from __future__ import annotations

from workers.batch import SeqWork


def generate_staggered(llm, prompts, params, every: int) -> list[list[int]]:
    """One prompt added every `every` steps while the earlier ones decode -> token ids in
    prompt order."""
    engine = llm.engine
    ids, final, steps = [], {}, 0
    pending = list(zip(prompts, params))
    while pending or engine.has_unfinished:
        if pending and steps % every == 0:
            prompt, sp = pending.pop(0)
            ids.append(engine.add_request(prompt, sp))
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
        steps += 1
    return [final[i] for i in ids]


def is_prefill(seq: SeqWork) -> bool:
    return not seq.samples or len(seq.token_ids) != 1 + seq.num_draft_tokens


def record_graph_keys(runner, replay: bool = True) -> list[tuple[bool, bool, tuple | None]]:
    """Record each step's (a decode graph's own layout, carries a prefill, the graph key the
    runner chose) from now on; `replay=False` runs every step eagerly all the same (stand-in
    graphs that cannot replay). Undo with `del runner._graph_key`."""
    keys: list[tuple[bool, bool, tuple | None]] = []
    choose = runner._graph_key

    def record(seqs, graphable):
        key = choose(seqs, graphable)
        keys.append((graphable, any(is_prefill(s) for s in seqs), key))
        return key if replay else None

    runner._graph_key = record
    return keys
