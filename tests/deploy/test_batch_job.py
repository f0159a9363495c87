"""`ray job submit` of the batch job against a Ray head this test starts, interrupted and rerun;
and the job's paths: a relative --output is refused, a relative --input is the uploaded file.

The head is a separate `ray start --head --block` process in its own session (own ports, own
temp dir) so it never touches the test session's Ray; it is stopped by signalling its process
group, never with `ray stop` (which would kill every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BIN_DIR, ray_head

pytestmark = pytest.mark.timeout(420)

PROMPTS = [f"Item {i}: the quick brown fox" for i in range(8)]
MAX_TOKENS = 160  # long enough (~2 s a request on 2 cores) to interrupt the job mid-way


@pytest.fixture(scope="module")
def job_head():
    """A fresh single-node Ray head with the dashboard (job server); yields its HTTP address."""
    with ray_head(num_cpus=2) as head:  # two: a TP=2 job's ranks take one each
        yield head.dashboard_url, head.env


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a torn line from the interrupted writer
    return rows


def _batch(input_path: str, output_path: str, model_dir: str, *options: str) -> list[str]:
    """The job's entrypoint: the batch module on `model_dir`, on CPU."""
    return [
        sys.executable,
        "-m",
        "deploy.batch",
        "--input",
        input_path,
        "--output",
        output_path,
        "--model",
        model_dir,
        "--device",
        "cpu",
        *options,
    ]


def _job(address: str, env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN_DIR / "ray"), "job", *args],
        env={**env, "RAY_ADDRESS": address},
        capture_output=True,
        text=True,
        timeout=300,
        check=check,
    )


@pytest.mark.no_triton
def test_batch_job_resumes_after_interruption(job_head, tiny_model_dir, tmp_path, offline_llm):
    from cluster.sampling_params import SamplingParams

    address, env = job_head
    # The input is uploaded with --working-dir and named relative to it, as the README does.
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    input_path, output_path = job_dir / "prompts.jsonl", tmp_path / "results.jsonl"
    lines = [
        json.dumps(
            {
                "id": f"p{i}",
                "prompt": p,
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
            }
        )
        for i, p in enumerate(PROMPTS)
    ]
    lines.insert(3, "{this is not json")
    input_path.write_text("\n".join(lines) + "\n")
    entrypoint = [
        "--working-dir",
        str(job_dir),
        "--",
        *_batch("prompts.jsonl", str(output_path), tiny_model_dir, "--concurrency", "1"),
    ]

    # Run 1: interrupted (`ray job stop`) once some rows are on disk.
    from ray.job_submission import JobSubmissionClient

    jobs = JobSubmissionClient(address)
    job_id = f"batch-interrupted-{os.getpid()}-{time.monotonic_ns()}"
    _job(address, env, "submit", "--no-wait", "--submission-id", job_id, *entrypoint)
    deadline = time.monotonic() + 240
    while sum(r.get("error") is None for r in _rows(output_path)) < 1:
        assert time.monotonic() < deadline, _job(address, env, "logs", job_id).stdout
        time.sleep(0.05)
    jobs.stop_job(job_id)
    while not jobs.get_job_status(job_id).is_terminal():
        assert time.monotonic() < deadline, "job did not stop"
        time.sleep(0.2)
    done_before = {r["id"] for r in _rows(output_path) if r.get("error") is None}

    # Run 2: to completion; skips what run 1 finished, fails (exit != 0) because of the bad line.
    rerun = _job(address, env, "submit", *entrypoint, check=False)
    logs = rerun.stdout + rerun.stderr
    assert 1 <= len(done_before) < len(PROMPTS), "the interruption came too late to test resuming"
    assert f"{len(done_before)} already done" in logs, logs
    assert "entrypoint command failed with exit code 1" in logs, logs
    # Where it wrote, as an absolute path; the input was found in the job's working directory.
    assert f"results in {output_path} on " in logs, logs
    assert re.search(
        r"batch: reading /\S+/prompts\.jsonl, writing " + re.escape(str(output_path)), logs
    )

    rows = _rows(output_path)
    good = [r for r in rows if r.get("error") is None]
    assert sorted(r["id"] for r in good) == sorted(f"p{i}" for i in range(len(PROMPTS)))
    bad = [r for r in rows if r.get("error") is not None]
    assert bad and {r["id"] for r in bad} == {"line-4"} and "invalid JSON" in bad[0]["error"]

    # Values: every row equals offline greedy decoding of its prompt.
    reference = offline_llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    )
    by_id = {r["id"]: r for r in good}
    for i, out in enumerate(reference):
        assert by_id[f"p{i}"]["completion_token_ids"] == out.token_ids
        assert by_id[f"p{i}"]["text"] == out.text


def test_tp2_batch_job_runs_its_ranks_on_the_cluster(
    job_head, tiny_model_dir, tmp_path, offline_llm
):
    """A TP=2 job: its driver connects to the cluster that runs it (RAY_ADDRESS; Ray refuses
    num_cpus when connecting, which once failed every TP > 1 job) and its two ranks are actors
    there. The rows equal offline greedy decoding."""
    from cluster.sampling_params import SamplingParams

    address, env = job_head
    prompts = PROMPTS[:3]
    input_path, output_path = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    rows = [
        {"id": f"p{i}", "prompt": p, "max_tokens": 12, "temperature": 0.0}
        for i, p in enumerate(prompts)
    ]
    input_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = _job(
        address,
        env,
        "submit",
        "--",
        *_batch(
            str(input_path),
            str(output_path),
            tiny_model_dir,
            "--tp",
            "2",
            "--num-draft-tokens",
            "0",
        ),
        check=False,
    )
    logs = done.stdout + done.stderr
    assert done.returncode == 0, logs[-4000:]
    by_id = {r["id"]: r for r in _rows(output_path)}
    reference = offline_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12))
    for i, out in enumerate(reference):
        assert by_id[f"p{i}"]["error"] is None, by_id[f"p{i}"]
        assert by_id[f"p{i}"]["completion_token_ids"] == out.token_ids


def test_relative_output_is_refused_with_why(tmp_path):
    """Before any model loads: exit status 2 and a message that says why and what to give."""
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "x"}\n')
    done = subprocess.run(
        [sys.executable, "-m", "deploy.batch", "--input", "prompts.jsonl", "--output", "out.jsonl"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "--output must be an absolute path, got 'out.jsonl'" in done.stderr
    assert "temporary working directory" in done.stderr
    assert f"(here: {tmp_path / 'out.jsonl'})" in done.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    from deploy.batch import resolve_paths

    (tmp_path / "in.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    output = str(tmp_path / "sub" / ".." / "out.jsonl")
    assert resolve_paths("in.jsonl", output) == (
        str(tmp_path / "in.jsonl"),
        str(tmp_path / "out.jsonl"),
    )
    with pytest.raises(ValueError, match="no such file"):
        resolve_paths("missing.jsonl", output)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_paths("in.jsonl", str(tmp_path / "nowhere" / "out.jsonl"))


@pytest.mark.parametrize(
    "options, gpu_here, cluster_gpus, expected",
    [
        ({}, True, 8, "auto"),  # `--entrypoint-num-gpus 1`, or a GPU head: the driver's GPU
        ({}, False, 8, "ray"),  # a CPU head of a GPU cluster: an actor with a GPU
        ({}, False, 0, "auto"),  # no GPU anywhere: the CPU, in this process
        ({"device": "cuda"}, False, 0, "ray"),  # asked for: the autoscaler may add a GPU node
        ({"device": "cpu"}, False, 8, "auto"),  # asked for the CPU: the head's
        ({"tp_size": 2}, False, 8, "auto"),  # TP > 1: actors anyway (the Ray executor)
    ],
)
def test_a_tp1_jobs_rank_goes_where_the_gpus_are(options, gpu_here, cluster_gpus, expected):
    from deploy.batch import rank_executor

    assert rank_executor(options, gpu_here, cluster_gpus) == expected
