"""Steps that overlap (`EngineConfig.overlap_steps`): a rank launches the next step's greedy
decodes before this step's tokens are read, and the next step takes the rows it matches.
Whatever happens between two steps (arrivals, aborts, stop tokens, length limits, block
boundaries, preemption, sampled and logprobs requests beside greedy ones), every request's
output is exactly the output without overlap. On CPU the launch is not asynchronous, but it is
the same code: "on" runs it here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.config import EngineConfig, lookahead_slots
from cluster.engine import LLMEngine
from cluster.sampling_params import SamplingParams
from tests.preemptions import record_preemptions


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def _engine(tiny_model_dir, overlap: str, **kw) -> LLMEngine:
    options = dict(device="cpu", dtype="float32", num_draft_tokens=0, block_size_tokens=16)
    return LLMEngine(EngineConfig(tiny_model_dir, overlap_steps=overlap, **{**options, **kw}))


def _script(stop_token: int | None = None) -> dict[int, list]:
    """Step number -> what happens before that step: ("add", name, prompt, params) or
    ("abort", name)."""
    stop = [stop_token] if stop_token is not None else []
    return {
        0: [
            ("add", "a", list(range(5, 25)), _greedy(40)),
            ("add", "b", [7, 8, 9], _greedy(9)),
            ("add", "c", list(range(100, 131)), _greedy(30)),
        ],
        3: [("add", "d", [300, 301, 302, 303], _greedy(25, stop_token_ids=stop))],
        5: [
            ("add", "e", [11, 12, 13, 14, 15, 16], SamplingParams(max_tokens=20, seed=7)),
            ("add", "f", [40, 41, 42], _greedy(18, logprobs=2)),
        ],
        8: [("abort", "c"), ("add", "g", [21, 22], _greedy(35, repetition_penalty=1.3))],
        12: [("add", "h", list(range(200, 215)), _greedy(22))],
    }


def _same(outputs: dict[str, tuple], reference: dict[str, tuple]) -> bool:
    """Tokens, finish reasons and logprobs' tokens exactly; logprob values to 1e-4: a row's
    logits move by float rounding with the batch it runs in, as they do without overlap when
    an arrival changes a step's batch."""
    assert outputs.keys() == reference.keys()
    for name, (tokens, reason, tops, values) in outputs.items():
        assert (tokens, reason, tops) == reference[name][:3], name
        assert values == pytest.approx(reference[name][3], abs=1e-4), name
    return True


def _run(engine: LLMEngine, script: dict[int, list]) -> dict[str, tuple]:
    ids, final, step = {}, {}, 0
    while step <= max(script) or engine.has_unfinished:
        for event in script.get(step, []):
            if event[0] == "add":
                ids[event[1]] = engine.add_request(event[2], event[3])
            else:
                out = engine.abort(ids[event[1]])
                final[out.request_id] = out
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
    return {
        name: (
            list(final[rid].token_ids),
            final[rid].finish_reason,
            [(e["token_id"], [t for t, _ in e["top"]]) for e in final[rid].logprobs or []],
            [e["logprob"] for e in final[rid].logprobs or []],
        )
        for name, rid in ids.items()
    }


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return _run(_engine(tiny_model_dir, "off"), _script())


def test_outputs_identical_with_overlap(tiny_model_dir, reference):
    engine = _engine(tiny_model_dir, "on")
    assert _same(_run(engine, _script()), reference)
    runner = engine.executor.worker.runner
    # Every decode of a plain greedy request (every token after its first) came from a step
    # launched ahead: block boundaries, arrivals and finishes included.
    assert runner.num_rows_reused == sum(len(reference[name][0]) - 1 for name in "abcdh")
    assert runner.num_rows_ahead >= runner.num_rows_reused
    assert engine.stats().num_free_blocks == engine.stats().num_total_blocks


def _sampled_script() -> dict[int, list]:
    """Seeded sampling requests only (temperature, top-k, top-p, logprobs, penalties),
    arriving at different steps."""
    settings = [
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=20),
        dict(temperature=1.2, top_p=0.8, logprobs=3),
        dict(temperature=0.9, presence_penalty=0.5, frequency_penalty=0.3),
        dict(temperature=1.0, repetition_penalty=1.2, top_k=50, top_p=0.9),
    ]
    return {
        step: [
            (
                "add",
                f"s{step}{j}",
                list(range(10 + 7 * step + j, 30 + 7 * step + 3 * j)),
                SamplingParams(max_tokens=14 + 3 * j, seed=100 * step + j, ignore_eos=True, **kw),
            )
            for j, kw in enumerate(settings)
            if (j + step) % 2 == 0
        ]
        for step in (0, 2, 5)
    }


def test_sampled_requests_identical_with_overlap(tiny_model_dir):
    """Sampling requests only (their steps launch nothing ahead: a draw is read before the
    next step could be fed): every output is the output without overlap."""
    off = _run(_engine(tiny_model_dir, "off"), _sampled_script())
    assert _same(_run(_engine(tiny_model_dir, "on"), _sampled_script()), off)


def test_stop_token_mid_batch(tiny_model_dir, reference):
    """A request that stops on a token while others go on: its row launched ahead is wasted,
    the others' are taken."""
    tokens = reference["d"][0]
    stop = tokens[5]
    off = _run(_engine(tiny_model_dir, "off"), _script(stop))
    on = _run(_engine(tiny_model_dir, "on"), _script(stop))
    assert _same(on, off)
    assert off["d"][1] == "stop" and len(off["d"][0]) < len(tokens)


def test_outputs_identical_under_preemption(tiny_model_dir, reference):
    # 9 usable blocks of 16 tokens for up to 6 requests of up to 70 tokens: preempted and
    # recomputed over and over, with decodes launched ahead in blocks that are then freed.
    engine = _engine(tiny_model_dir, "on", num_kv_blocks=10, max_model_len=96)
    preemptions = record_preemptions(SimpleNamespace(engine=engine))
    assert _same(_run(engine, _script()), reference)
    assert preemptions
    assert engine.executor.worker.runner.num_rows_reused > 0


def test_the_next_decodes_slot_is_owned():
    """Without MTP a request owns one slot past its tokens (where the decode launched ahead
    writes); with MTP, the k - 1 draft slots as before; none when overlap is off."""
    assert lookahead_slots(0, "auto") == lookahead_slots(0, "on") == 1
    assert lookahead_slots(0, "off") == 0
    assert lookahead_slots(3, "auto") == lookahead_slots(3) == 2


def test_overlap_steps_is_checked():
    from cluster.config import ConfigError

    with pytest.raises(ConfigError, match="overlap_steps"):
        EngineConfig("m", overlap_steps="sometimes")


@pytest.mark.gpu
@pytest.mark.parametrize("script", [_script, _sampled_script], ids=["mixed", "sampled"])
def test_gpu_outputs_identical_with_overlap(tiny_model_dir, script):
    """On CUDA ("auto" turns it on), with decode and sampler graphs: the next step's decodes
    replay their graph while the engine updates, and every output is the output without
    overlap."""
    cuda = dict(device="cuda", block_size_tokens=16)
    reference = _run(_engine(tiny_model_dir, "off", **cuda), script())
    engine = _engine(tiny_model_dir, "auto", **cuda)
    assert _same(_run(engine, script()), reference)
    runner = engine.executor.worker.runner
    assert runner.graphs is not None and runner.overlap
    plain = [v for k, v in reference.items() if k in "abcdh"]  # the plain greedy requests
    assert runner.num_rows_reused == sum(len(tokens) - 1 for tokens, *_ in plain)
