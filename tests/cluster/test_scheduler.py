"""Scheduler behaviour on hand-built scenarios whose expected schedules are worked out by hand."""

from __future__ import annotations

import pytest

from cluster.outputs import SpecDecodeStats, make_request_output
from cluster.request import Request, RequestStatus
from cluster.sampling_params import InvalidRequestError, SamplingParams
from cluster.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from workers.batch import SeqResult

EOS = 99


class CharTokenizer:
    """Token id t decodes to chr(ord('a') + t): one character per token."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + t) for t in ids)


def make_scheduler(**overrides) -> Scheduler:
    kwargs = dict(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        block_size_tokens=4,
        num_blocks=65,
        max_model_len=64,
    )
    kwargs.update(overrides)
    return Scheduler(SchedulerConfig(**kwargs), tokenizer=CharTokenizer())


def make_request(request_id: str, prompt_len: int, arrival: float, **params) -> Request:
    return Request(
        request_id,
        [(3 * i + len(request_id)) % 20 for i in range(prompt_len)],
        SamplingParams(**params),
        eos_token_ids={EOS},
        arrival_time=arrival,
    )


def step(
    sched: Scheduler, tokens: dict[str, list[int]] | None = None, **drafts: list[int]
) -> tuple[SchedulerOutput, list[Request]]:
    """Schedule and update, answering each sampling request with `tokens[id]` (default one
    token, 5) and accepting every scheduled draft; `drafts[id]` become its next drafts."""
    tokens = tokens or {}
    output = sched.schedule()
    results = {}
    for s in output.scheduled:
        rid = s.request_id
        if not s.samples:
            results[rid] = SeqResult(rid)
            continue
        sampled = tokens.get(rid, [5])
        results[rid] = SeqResult(
            rid,
            sampled_token_ids=sampled,
            num_accepted_drafts=len(sampled) - 1,
            next_draft_token_ids=drafts.get(rid, []),
        )
    return output, sched.update(output, results)


def test_decodes_come_first_then_prefills_by_arrival() -> None:
    sched = make_scheduler()
    a = make_request("a", 6, arrival=0.0)
    sched.add(a)
    step(sched)  # a prefills and samples
    b, c = make_request("b", 3, arrival=1.0), make_request("c", 2, arrival=2.0)
    sched.add(c)  # added out of arrival order on purpose: the queue is FIFO by add()
    sched.add(b)
    out = sched.schedule()
    assert [(s.request_id, s.is_prefill) for s in out.scheduled] == [
        ("a", False),
        ("c", True),
        ("b", True),
    ]
    decode = out.scheduled[0]
    assert decode.start_position == 6 and decode.token_ids == [5] and decode.samples
    assert out.num_batched_tokens == 1 + 2 + 3


def test_chunked_prefill_start_positions_and_samples_only_on_last_chunk() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=4)
    r = make_request("r", 10, arrival=0.0)
    sched.add(r)
    chunks = []
    for _ in range(3):
        out, changed = step(sched)
        (s,) = out.scheduled
        chunks.append((s.start_position, s.token_ids, s.is_prefill, s.samples))
        assert changed == ([r] if s.samples else [])
    prompt = r.prompt_token_ids
    assert chunks == [
        (0, prompt[0:4], True, False),
        (4, prompt[4:8], True, False),
        (8, prompt[8:10], True, True),
    ]
    assert r.num_computed_tokens == 10 and r.output_token_ids == [5]
    out = sched.schedule()
    assert [(s.start_position, s.token_ids, s.is_prefill) for s in out.scheduled] == [
        (10, [5], False)
    ]


def test_chunk_budget_is_shared_with_decodes() -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=5, num_draft_tokens=2)
    a = make_request("a", 3, arrival=0.0)
    sched.add(a)
    step(sched, a=[7, 8])
    sched.add(make_request("b", 9, arrival=1.0))
    out = sched.schedule()
    # a verifies 1 + 2 drafts; b gets the remaining 2 tokens of budget.
    assert [(s.request_id, len(s.token_ids), s.num_draft_tokens) for s in out.scheduled] == [
        ("a", 3, 2),
        ("b", 2, 0),
    ]
    assert out.scheduled[0].token_ids == [5, 7, 8]


def test_without_chunking_a_prompt_waits_for_a_whole_step() -> None:
    sched = make_scheduler(
        max_num_seqs=2, max_num_batched_tokens=8, max_model_len=8, enable_chunked_prefill=False
    )
    sched.add(make_request("a", 2, arrival=0.0))
    step(sched)
    sched.add(make_request("b", 8, arrival=1.0))
    out = sched.schedule()  # a's decode takes 1 token; b's 8 do not fit in the other 7
    assert [s.request_id for s in out.scheduled] == ["a"]


def _tight_scheduler() -> Scheduler:
    # 4 usable blocks of 2 tokens = 8 slots.
    return make_scheduler(
        max_num_seqs=2,
        max_num_batched_tokens=4,
        block_size_tokens=2,
        num_blocks=5,
        max_model_len=8,
    )


def test_preemption_by_recompute_then_resume() -> None:
    sched = _tight_scheduler()
    bm = sched.block_manager
    a = make_request("a", 3, arrival=0.0, max_tokens=3)
    b = make_request("b", 4, arrival=1.0, max_tokens=3)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched, {"a": [10]})  # a prefills 3; b gets the last token of budget
    summary = [(s.request_id, s.start_position, len(s.token_ids), s.samples) for s in out.scheduled]
    assert summary == [
        ("a", 0, 3, True),
        ("b", 0, 1, False),
    ]
    out, _ = step(sched, {"a": [12], "b": [11]})  # a decodes at 3; b fills positions 1..3
    assert [(s.request_id, s.start_position, len(s.token_ids)) for s in out.scheduled] == [
        ("a", 3, 1),
        ("b", 1, 3),
    ]
    assert bm.num_free_blocks == 0 and len(a.block_ids) == len(b.block_ids) == 2
    # a (older) needs a third block for position 4: it preempts b (younger).
    out, _ = step(sched, {"a": [14]})
    assert out.preempted_ids == ["b"] and [s.request_id for s in out.scheduled] == ["a"]
    assert b.status is RequestStatus.PREEMPTED and b.num_preemptions == 1
    assert b.block_ids == [] and b.num_computed_tokens == 0 and b.draft_token_ids == []
    assert list(sched.waiting) == [b] and b.output_token_ids == [11]
    assert a.status is RequestStatus.FINISHED_LENGTH  # max_tokens=3; its blocks are back
    assert bm.num_free_blocks == 4
    # b recomputes prompt + output (5 tokens) in chunks of 4 and 1; samples only on the last.
    out, changed = step(sched)
    (s,) = out.scheduled
    assert (s.start_position, s.token_ids, s.is_prefill, s.samples) == (
        0,
        b.prompt_token_ids,
        True,
        False,
    )
    assert changed == []
    out, changed = step(sched, {"b": [15]})
    (s,) = out.scheduled
    assert (s.start_position, s.token_ids, s.is_prefill, s.samples) == (4, [11], True, True)
    assert changed == [b] and b.output_token_ids == [11, 15] and b.num_computed_tokens == 5
    out, _ = step(sched, {"b": [16]})
    assert [(s.start_position, s.token_ids, s.is_prefill) for s in out.scheduled] == [
        (5, [15], False)
    ]
    assert b.output_token_ids == [11, 15, 16] and b.status is RequestStatus.FINISHED_LENGTH
    assert bm.num_free_blocks == 4


def test_decode_preempts_itself_when_no_younger_request_is_left() -> None:
    sched = _tight_scheduler()
    c = make_request("c", 1, arrival=0.0)
    d = make_request("d", 3, arrival=1.0)
    sched.add(c)
    sched.add(d)
    step(sched)  # c: 1 block, d: 2 blocks, 1 free
    step(sched)  # c decodes at 1, d at 3: both fit in the blocks they own
    assert (c.num_computed_tokens, d.num_computed_tokens) == (2, 4)
    assert sched.block_manager.num_free_blocks == 1
    # Both need a new block; c (older) goes first and takes the last one. d has nobody
    # younger to preempt, so it preempts itself.
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["c"] and out.preempted_ids == ["d"]
    assert d.status is RequestStatus.PREEMPTED and d.block_ids == []
    assert len(c.block_ids) == 2 and sched.block_manager.num_free_blocks == 2


def test_eos_stops_and_is_kept_in_ids_not_text() -> None:
    sched = make_scheduler(num_draft_tokens=3)
    r = make_request("r", 3, arrival=0.0, max_tokens=10)
    sched.add(r)
    step(sched, {"r": [1]}, r=[2, EOS, 4])
    out, changed = step(sched, {"r": [2, EOS, 4, 6]})  # all 3 drafts accepted
    assert out.scheduled[0].num_draft_tokens == 3
    assert changed == [r]
    assert r.output_token_ids == [1, 2, EOS]  # tokens after EOS are discarded
    assert r.output_text == "bc"
    assert r.status is RequestStatus.FINISHED_STOPPED and r.finish_reason == "stop"
    assert r.stop_reason == EOS and r.block_ids == [] and not sched.has_unfinished


def test_ignore_eos_keeps_going() -> None:
    sched = make_scheduler()
    r = make_request("r", 3, arrival=0.0, max_tokens=3, ignore_eos=True)
    sched.add(r)
    for _ in range(3):
        step(sched, {"r": [EOS]})
    assert r.output_token_ids == [EOS] * 3
    assert r.status is RequestStatus.FINISHED_LENGTH and r.finish_reason == "length"


def test_stop_token_ids() -> None:
    sched = make_scheduler(num_draft_tokens=2)
    r = make_request("r", 3, arrival=0.0, max_tokens=10, stop_token_ids=[7])
    sched.add(r)
    step(sched, {"r": [1]}, r=[7, 3])
    step(sched, {"r": [7, 3, 4]})
    assert r.output_token_ids == [1, 7] and r.output_text == "b"
    assert r.status is RequestStatus.FINISHED_STOPPED and r.stop_reason == 7


def test_max_tokens_truncates_a_multi_token_round() -> None:
    sched = make_scheduler(num_draft_tokens=3)
    r = make_request("r", 3, arrival=0.0, max_tokens=4)
    sched.add(r)
    step(sched, {"r": [1]}, r=[2, 3, 4])
    out = sched.schedule()
    # 3 tokens left to max_tokens: at most 2 drafts are worth verifying.
    assert out.scheduled[0].num_draft_tokens == 2 and out.scheduled[0].token_ids == [1, 2, 3]
    # Tighten max_tokens under the in-flight step: update must still cap the output.
    r.sampling_params.max_tokens = 2
    changed = sched.update(out, {"r": SeqResult("r", [2, 3, 9], 2, [])})
    assert changed == [r] and r.output_token_ids == [1, 2] and r.output_text == "bc"
    assert r.status is RequestStatus.FINISHED_LENGTH


def test_max_model_len_stops_with_length() -> None:
    sched = make_scheduler(max_model_len=6, num_blocks=3)
    r = make_request("r", 4, arrival=0.0, max_tokens=100)
    sched.add(r)
    step(sched)
    step(sched)
    assert r.num_tokens == 6 and r.status is RequestStatus.FINISHED_LENGTH


def test_stop_string_spanning_tokens_cuts_text() -> None:
    sched = make_scheduler(num_draft_tokens=3)
    r = make_request("r", 3, arrival=0.0, max_tokens=20, stop=["cde"])
    sched.add(r)
    step(sched, {"r": [0]}, r=[1, 2, 3])  # "a"
    step(sched, {"r": [1, 2, 3, 4]})  # "bcde": "cde" spans three tokens
    assert r.output_text == "ab" and r.stop_reason == "cde"
    assert r.status is RequestStatus.FINISHED_STOPPED
    # Token ids up to the token that completed the stop string ("e") are kept.
    assert r.output_token_ids == [0, 1, 2, 3, 4]


def test_stop_strings_are_unchecked_before_min_tokens() -> None:
    """min_tokens = 4: "cd" completed by output token 2 does not stop; from token 4 on the
    (new) text is checked again, so the next "cd" (tokens 5 and 6) stops it there."""
    sched = make_scheduler()
    r = make_request("r", 3, arrival=0.0, max_tokens=20, stop=["cd"], min_tokens=4)
    sched.add(r)
    for token in (2, 3, 0, 0):  # "cdaa": the "cd" came before min_tokens
        step(sched, {"r": [token]})
    assert r.status is RequestStatus.RUNNING and r.output_text == "cdaa"
    for token in (2, 3):  # "cdaacd"
        step(sched, {"r": [token]})
    assert r.status is RequestStatus.FINISHED_STOPPED and r.output_text == "cdaa"
    assert r.output_token_ids == [2, 3, 0, 0, 2, 3]


def test_draft_rollback_frees_blocks() -> None:
    sched = make_scheduler(num_draft_tokens=5, block_size_tokens=2, num_blocks=33, max_model_len=32)
    bm = sched.block_manager
    r = make_request("r", 3, arrival=0.0)
    sched.add(r)
    step(sched, {"r": [1]}, r=[2, 3, 4, 5, 6])
    assert r.num_computed_tokens == 3 and len(r.block_ids) == 2
    out = sched.schedule()
    # Verify writes positions 3..8 (1 + 5 drafts) and MTP draft steps 1..4 write 4 lookahead
    # slots: ceil((9 + 4) / 2) = 7 blocks.
    assert len(r.block_ids) == 7 and bm.num_free_blocks == 32 - 7
    kept_block_ids = r.block_ids[:2]
    sched.update(out, {"r": SeqResult("r", [2, 7], 1, [8, 8, 8, 8, 8])})
    # One draft accepted: KV of positions 0..4 valid, so ceil(5 / 2) = 3 blocks remain.
    assert r.num_computed_tokens == 5 and r.num_tokens == 6
    assert len(r.block_ids) == 3 and r.block_ids[:2] == kept_block_ids
    assert bm.num_free_blocks == 32 - 3
    assert r.spec_stats.num_accepted_per_position == [1, 0, 0, 0, 0]


def test_abort_frees_blocks_and_marks_aborted() -> None:
    sched = make_scheduler()
    r = make_request("r", 9, arrival=0.0)
    sched.add(r)
    step(sched)
    assert sched.block_manager.num_free_blocks == 64 - 3
    assert sched.abort("r") is r and sched.abort("r") is None
    assert r.status is RequestStatus.FINISHED_ABORTED and r.finish_reason == "abort"
    assert sched.block_manager.num_free_blocks == 64 and not sched.has_unfinished
    waiting = make_request("w", 2, arrival=1.0)
    sched.add(waiting)
    assert sched.abort("w") is waiting and sched.num_waiting == 0


def test_abort_between_schedule_and_update_is_ignored() -> None:
    sched = make_scheduler()
    r = make_request("r", 3, arrival=0.0)
    sched.add(r)
    out = sched.schedule()
    sched.abort("r")
    assert sched.update(out, {"r": SeqResult("r", [1])}) == []
    assert r.output_token_ids == [] and sched.block_manager.num_free_blocks == 64


def test_rejects_prompts_that_can_never_run() -> None:
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(InvalidRequestError) as err:
        sched.add(make_request("long", 17, arrival=0.0))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError):
        sched.add(make_request("empty", 0, arrival=0.0))
    with pytest.raises(ValueError):  # pool smaller than one max-length request
        make_scheduler(max_model_len=64, num_blocks=16)


def test_max_num_seqs_caps_running() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(make_request(f"r{i}", 2, arrival=float(i)))
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 1


def test_spec_stats_closed_form() -> None:
    stats = SpecDecodeStats()
    for num_drafts, num_accepted in [(3, 3), (3, 1), (3, 0), (2, 2)]:
        stats.observe(num_drafts, num_accepted)
    assert stats.num_rounds == 4
    assert stats.mean_tokens_per_round == pytest.approx((3 + 1 + 0 + 2 + 4) / 4)
    assert stats.acceptance_per_position == pytest.approx([3 / 4, 2 / 4, 1 / 3])
    assert SpecDecodeStats().mean_tokens_per_round == 1.0


def test_mtp_off_means_one_token_per_round() -> None:
    sched = make_scheduler()
    r = make_request("r", 3, arrival=0.0, max_tokens=4)
    sched.add(r)
    for _ in range(4):
        out, _ = step(sched)
        assert all(s.num_draft_tokens == 0 for s in out.scheduled)
    assert r.spec_stats.num_rounds == 3  # the prefill's token is not a verify round
    assert r.spec_stats.mean_tokens_per_round == 1.0


def test_streaming_outputs_hold_back_possible_stop_prefix() -> None:
    sched = make_scheduler()
    r = make_request("r", 3, arrival=0.0, max_tokens=20, stop=["xyz"])
    sched.add(r)
    deltas = []
    for token in [0, 1, 23, 2, 23, 24, 25, 3]:  # "a b x c x y z d"
        _, changed = step(sched, {"r": [token]})
        for req in changed:
            out = make_request_output(req)
            deltas.append((out.new_text, out.finished))
        if r.is_finished:
            break
    assert deltas == [
        ("a", False),
        ("b", False),
        ("", False),  # "x" might start "xyz"
        ("xc", False),
        ("", False),
        ("", False),
        ("", True),  # "xyz" matched: the held-back "xy" is dropped with it
    ]
    assert r.output_text == "abxc" and r.finish_reason == "stop" and r.stop_reason == "xyz"
