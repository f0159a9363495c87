"""`mtpserve serve` end to end: the real console script starts its own local Ray, deploys the
app, prints the URL, answers the official `openai` client, and exits 0 on Ctrl-C (SIGINT) with
none of its Ray processes left behind.

Its Ray is kept apart from the test session's: `RAY_TMPDIR` gives it its own temp root, so every
process of that Ray carries the root in its command line and can be found (and, on failure,
stopped) without touching any other Ray on the machine.

Security of the local mode: with `RAY_AUTH_MODE` unset (and no token anywhere) the CLI's Ray
runs with token auth, so a client without the token is refused by its GCS, which listens on
every interface; the HTTP API listens on loopback only.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from conftest import MTPSERVE, free_port, kill_processes_under, processes_under

pytestmark = pytest.mark.timeout(240)

URL_LINE = re.compile(r"mtpserve: serving an OpenAI-compatible API at (http://\S+/v1)")


def _wait_for_url(server: subprocess.Popen, log_path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if match := URL_LINE.search(log_path.read_text(errors="replace")):
            return match.group(1)
        assert server.poll() is None, log_path.read_text(errors="replace")[-4000:]
        time.sleep(0.5)
    raise AssertionError("no URL printed:\n" + log_path.read_text(errors="replace")[-4000:])


@pytest.mark.no_triton
def test_mtpserve_serve_answers_openai_and_stops_cleanly_on_sigint(
    tiny_model_dir, tmp_path, offline_llm
):
    import openai

    from cluster.sampling_params import SamplingParams

    ray_root = tempfile.mkdtemp(prefix="mtpserve-cli-", dir="/tmp")  # short: unix socket paths
    log_path = tmp_path / "serve.log"
    home = tmp_path / "home"  # no ~/.ray/auth_token: the CLI must make its own token
    home.mkdir()
    env = {**os.environ, "RAY_TMPDIR": ray_root, "HOME": str(home)}
    for name in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    port = free_port()
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [
                MTPSERVE,
                "serve",
                "--model",
                tiny_model_dir,
                "--port",
                str(port),
                "--device",
                "cpu",
                "--max-num-seqs",
                "4",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        base_url = _wait_for_url(server, log_path, timeout_s=150)
        assert base_url == f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
        [model] = client.models.list().data
        prompt = "The capital of France is"
        completion = client.completions.create(
            model=model.id, prompt=prompt, max_tokens=8, temperature=0.0
        )
        [reference] = offline_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))
        assert completion.choices[0].text == reference.text
        assert completion.usage.completion_tokens == len(reference.token_ids) == 8
        assert completion.usage.prompt_tokens == len(reference.prompt_token_ids)

        assert processes_under(ray_root), "the CLI's Ray should be running under its own root"
        assert _listen_addresses(port) == {"127.0.0.1"}
        # The ingress replica serves the port itself (Ray Serve's direct ingress), not the proxy.
        assert _listeners(port) == {"ray::ServeRepli"}, _listeners(port)
        # The replica and the engine process it started run at the normal priority, not at
        # Ray's worker niceness (15): deploy.app.ENGINE_PRIORITY_ENV.
        [replica] = _listener_pids(port)
        engines = [pid for pid in _children(replica) if "cluster.engine_process" in _cmdline(pid)]
        assert len(engines) == 1, [_cmdline(pid) for pid in _children(replica)]
        assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in (replica, *engines)] == [0, 0]
        refused = _connect_without_token(_gcs_port(ray_root), env)
        assert refused.returncode != 0 and "token" in refused.stderr.lower(), refused
        server.send_signal(signal.SIGINT)  # what Ctrl-C sends
        returncode = server.wait(timeout=60)
        output = log_path.read_text(errors="replace")
        assert returncode == 0, output[-4000:]
        assert "mtpserve: shutting down" in output
        assert "Traceback" not in output, output[-4000:]
        # Ray's own processes (raylet, GCS, workers, agents) may take a moment after the driver.
        deadline = time.monotonic() + 30
        while (left := processes_under(ray_root)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not left, f"processes of the CLI's Ray left behind: {left}"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
        kill_processes_under(ray_root)  # only this test's Ray, found by its temp root


def _listener_pids(port: int) -> set[int]:
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return {
        int(pid)
        for line in lines.splitlines()
        if line.split()[3].rpartition(":")[2] == str(port)
        for pid in re.findall(r"pid=(\d+)", line)
    }


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    """Live processes whose parent is `pid`."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(proc.name))
    return found


def _listeners(port: int) -> set[str]:
    """The names (15 characters, as the kernel keeps them) of the processes listening on TCP
    `port`."""
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return {
        name
        for line in lines.splitlines()
        if line.split()[3].rpartition(":")[2] == str(port)
        for name in re.findall(r'\("([^"]+)",pid=', line)
    }


@pytest.mark.no_triton
def test_mtpserve_serve_refuses_a_port_in_use_before_starting_ray(tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(
            [MTPSERVE, "serve", "--model", tiny_model_dir, "--port", str(port), "--device", "cpu"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 60  # refused up front, not after a failed deployment


@pytest.mark.no_triton
def test_mtpserve_serve_refuses_an_engine_this_machine_cannot_hold(tiny_model_dir, tmp_path):
    """A local Ray has one node and no autoscaler: an engine bigger than the machine would wait
    for ever (Serve only warns). It is an error that says what is short, and nothing is left."""
    ray_root = tempfile.mkdtemp(prefix="r", dir="/tmp")
    cpus = os.cpu_count() or 1
    try:
        started = time.monotonic()
        result = subprocess.run(
            [
                MTPSERVE,
                "serve",
                "--model",
                tiny_model_dir,
                "--device",
                "cpu",
                "--port",
                str(free_port()),
                "--tensor-parallel-size",
                "4",
                "--actor-num-cpus",
                str(cpus),  # four ranks of the machine's every core
            ],
            env={**os.environ, "RAY_TMPDIR": ray_root, "RAY_AUTH_MODE": "disabled"},
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert result.returncode == 1, result.stderr[-3000:]
        needed = 4 * cpus + 0.5 + cpus  # the ranks, the replica and its coordinator
        assert (
            f"the engine (4 ranks) needs {needed:g} CPU on one machine and this one has "
            f"{cpus:g} CPU" in result.stderr
        ), result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        assert time.monotonic() - started < 100  # refused once Ray is up, not never
        assert not processes_under(ray_root)
    finally:
        kill_processes_under(ray_root)


def test_a_replica_that_fails_to_start_is_one_error_line(tiny_model_dir, tmp_path):
    """A checkpoint that passes every check before Ray but fails in the replica (here a tensor
    of the wrong shape): Serve retries the replica and gives up; `mtpserve serve` then ends
    with one `mtpserve: error:` line carrying the replica's own error, exit 1, and nothing of
    its Ray left. The replicas' teardown after a failed start raises nothing of its own."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "bad-shape"
    shutil.copytree(tiny_model_dir, model)
    tensors = load_file(model / "model.safetensors")
    [name, *_] = sorted(k for k in tensors if k.endswith("mlp.gate_proj.weight"))
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    ray_root = tempfile.mkdtemp(prefix="r", dir="/tmp")
    try:
        result = subprocess.run(
            [MTPSERVE, "serve", "--model", str(model), "--device", "cpu"]
            + ["--port", str(free_port())],
            env={**os.environ, "RAY_TMPDIR": ray_root, "RAY_AUTH_MODE": "disabled"},
            capture_output=True,
            text=True,
            timeout=200,
        )
        assert result.returncode == 1, result.stderr[-3000:]
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("mtpserve: error: the server failed to start: "), last
        assert f"CheckpointError: tensor '{name}': shape mismatch" in last, last
        assert "has no attribute" not in result.stderr
        assert not processes_under(ray_root)
    finally:
        kill_processes_under(ray_root)


def _listen_addresses(port: int) -> set[str]:
    """The local addresses something listens on at TCP `port`."""
    lines = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in lines.splitlines():
        address, _, listen_port = line.split()[3].rpartition(":")
        if listen_port == str(port):
            found.add(address.strip("[]"))
    return found


def _gcs_port(ray_root: str) -> int:
    """The port the GCS of the Ray under `ray_root` listens on (chosen at start)."""
    [pid] = [pid for pid, cmdline in processes_under(ray_root) if "gcs_server " in cmdline]
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    ports = [
        line.split()[3].rpartition(":")[2] for line in lines.splitlines() if f"pid={pid}," in line
    ]
    assert ports, f"the GCS (pid {pid}) listens on nothing"
    return int(ports[0])


def _connect_without_token(gcs_port: int, env: dict) -> subprocess.CompletedProcess:
    """A Ray client with auth off and no token trying to join the CLI's cluster."""
    import sys

    code = f"import ray; ray.init(address='127.0.0.1:{gcs_port}'); print(ray.cluster_resources())"
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "RAY_AUTH_MODE": "disabled"},
        capture_output=True,
        text=True,
        timeout=90,
    )


@pytest.mark.timeout(180)
def test_default_model_start_up_lines_echo_and_quiet_ctrl_c(tmp_path):
    """`mtpserve serve` with no options (the default model, CPU): a timed line per start-up
    stage and the URL line last; `echo` gives back the prompt without the BOS token the
    default model's tokenizer adds; Ctrl-C (SIGINT to the whole process group, as a terminal
    sends it, then more of them) exits 0 with nothing on stderr that looks like a crash."""
    import openai

    ray_root = tempfile.mkdtemp(prefix="mtpserve-cli-", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": ray_root, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    port = free_port()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        server = subprocess.Popen(
            [MTPSERVE, "serve", "--port", str(port), "--device", "cpu"],
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
    try:
        base_url = _wait_for_url(server, out_path, timeout_s=150)
        stages = [
            r"mtpserve: starting a local Ray \.\.\.",
            r"mtpserve: Ray started in \d+\.\d s",
            r"mtpserve: loading the default model \(\S+\) on cpu and warming it up \.\.\.",
            r"mtpserve: model loaded and warmed up in \d+\.\d s",
            URL_LINE.pattern + r" \(Ctrl-C to stop\)",
        ]
        lines = out_path.read_text().splitlines()
        assert len(lines) == len(stages), lines
        for pattern, line in zip(stages, lines):
            assert re.fullmatch(pattern, line), (pattern, line)

        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60)
        prompt = "def fibonacci(n):"
        plain, echoed = (
            client.completions.create(
                model="mtpserve-default", prompt=prompt, max_tokens=6, temperature=0.0, echo=echo
            )
            .choices[0]
            .text
            for echo in (False, True)
        )
        assert echoed == prompt + plain  # not "<|bos|>def fibonacci(n):..."

        os.killpg(server.pid, signal.SIGINT)
        for _ in range(50):  # Ctrl-C again and again: a handler inside a handler hung it once
            try:
                os.kill(server.pid, signal.SIGINT)
            except ProcessLookupError:
                break
        returncode = server.wait(timeout=60)
        stdout, stderr = out_path.read_text(), err_path.read_text()
        assert returncode == 0, stdout + stderr[-4000:]
        assert stdout.splitlines()[-2:] == ["mtpserve: shutting down", "mtpserve: stopped"]
        assert "Traceback" not in stderr, stderr[-4000:]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
        kill_processes_under(ray_root)
