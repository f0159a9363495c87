"""A TP=2 app over real HTTP, as deploy/serve.yaml runs one (on CPU here: two gloo ranks as Ray
actors in the replica's placement group, MTP k = 2 across them): the official client's text
equals the offline engine's greedy text; a rank killed mid-request is an OpenAI-shaped error to
its caller; Serve's health probe rebuilds the engine and the app serves the same text again."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import app_args

pytestmark = pytest.mark.timeout(420)

PROMPT = [5, 9, 13, 17, 21, 25, 29, 33]  # token ids: no tokenizer in the comparison
MAX_TOKENS = 12


def _rank_pids(ray) -> list[int]:
    """The live TP ranks' processes (this package's only multi-rank engine is this test's)."""
    from ray._private.state import actors

    return sorted(
        info["Pid"]
        for info in actors().values()
        if info["ActorClassName"] == "WorkerActor" and info["State"] == "ALIVE"
    )


def test_tp2_app_serves_fails_a_killed_rank_and_recovers(ray_session, serve_url, tiny_model_dir):
    import openai
    from ray import serve

    from cluster.llm import LLM
    from cluster.sampling_params import SamplingParams
    from deploy.app import build_app

    args = app_args(tiny_model_dir, num_draft_tokens=2, tp_size=2, dtype="float32")
    args["engine"].update(max_num_seqs=4, num_kv_blocks=64, step_timeout_s=30.0)
    serve.run(build_app(args), name="tp2", route_prefix="/tp2")
    client = openai.OpenAI(
        base_url=f"{serve_url}/tp2/v1", api_key="unused", max_retries=0, timeout=120
    )
    try:
        reference = LLM(tiny_model_dir, num_draft_tokens=0, dtype="float32", device="cpu")
        expected = reference.generate(
            [PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        )[0].text
        del reference
        model = client.models.list().data[0].id

        def complete(max_tokens: int = MAX_TOKENS) -> str:
            return (
                client.completions.create(
                    model=model,
                    prompt=PROMPT,
                    max_tokens=max_tokens,
                    temperature=0.0,
                    extra_body={"ignore_eos": True},
                )
                .choices[0]
                .text
            )

        assert complete() == expected
        pids = _rank_pids(ray_session)
        assert len(pids) == 2  # the replica's two ranks

        # A long request in flight when a rank dies gets an error, not a hang or a 200.
        outcome = {}

        def long_request():
            try:
                outcome["text"] = complete(max_tokens=3000)
            except openai.APIStatusError as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(2.0)  # well inside its 3000 tokens (~0.1 s a step here)
        os.kill(pids[1], signal.SIGKILL)
        thread.join(timeout=120)
        assert not thread.is_alive()
        assert "error" in outcome, outcome
        assert outcome["error"].status_code == 503
        assert outcome["error"].body["type"] == "engine_dead_error"
        assert "WorkerActor" not in str(outcome["error"].body)  # no actor names to clients

        # Serve's health probe (every 10 s) rebuilds the engine with new ranks; then the same text.
        deadline = time.monotonic() + 180
        while True:
            try:
                text = complete()
                break
            except openai.APIStatusError as exc:
                assert exc.status_code == 503, exc
                assert time.monotonic() < deadline, "the engine was not rebuilt"
                time.sleep(1.0)
        assert text == expected
        new_pids = _rank_pids(ray_session)
        assert len(new_pids) == 2 and pids[1] not in new_pids
    finally:
        serve.delete("tp2")
