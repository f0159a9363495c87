"""Each TP=1 replica's engine runs on the GPU Ray gave that replica, not on the node's first GPU.

Ray sets CUDA_VISIBLE_DEVICES only in an actor that asks for GPUs. A TP=1 engine runs in its
replica's process tree (the engine process the replica starts), so the replica must ask for the
GPU itself: with the GPU reserved in a bundle nobody runs in, every TP=1 replica of a node saw
every GPU and took the first one.

In a child process with a Ray of its own that reports two GPUs (Ray's resources are what it is
told; the engines run on CPU): two replicas, and the CUDA_VISIBLE_DEVICES that each replica's
engine process runs with, read from /proc.
"""

from __future__ import annotations

import json

import pytest
from conftest import SMALL_CPU, free_port

from tests.child_process import marked_line, run_child

pytestmark = pytest.mark.timeout(300)

CHILD = """
import json, sys
from pathlib import Path

import ray
from ray import serve

from deploy.app import build_app

model_dir, port, small_cpu = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": port})
args = {
    "model": model_dir,
    "device": "cpu",
    "num_draft_tokens": 0,
    "gpus_per_worker": 1.0,
    "num_replicas": 2,
    "replica_num_cpus": small_cpu,
    "actor_num_cpus": small_cpu,
    "ingress_num_cpus": small_cpu,
    "engine": {"max_num_seqs": 2, "num_kv_blocks": 32},
}
serve.run(build_app(args), name="gpus", route_prefix="/")  # returns once both are ready


def read(pid, name):
    return (Path("/proc") / str(pid) / name).read_bytes()


procs = {}
for entry in Path("/proc").iterdir():
    if entry.name.isdigit():
        try:
            cmdline = read(entry.name, "cmdline").replace(b"\\0", b" ").decode()
            ppid = int(read(entry.name, "stat").decode().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        procs[int(entry.name)] = (cmdline, ppid)
servers = "ray::ServeReplica:gpus:ModelServer"
replicas = {pid for pid, (cmd, _) in procs.items() if cmd.startswith(servers)}
engines = {}
for pid, (cmd, ppid) in procs.items():
    if ppid in replicas and "cluster.engine_process" in cmd:
        env = dict(
            v.split(b"=", 1) for v in read(pid, "environ").split(b"\\0") if b"=" in v
        )
        engines[pid] = (env.get(b"CUDA_VISIBLE_DEVICES") or b"").decode() or None
print("RESULT", json.dumps({"replicas": len(replicas), "engines": list(engines.values())}))
serve.shutdown()
ray.shutdown()
"""


def test_each_tp1_replica_engine_sees_only_the_gpu_ray_gave_it(tiny_model_dir):
    done = run_child(CHILD, tiny_model_dir, str(free_port()), str(SMALL_CPU), timeout_s=240)
    result = json.loads(marked_line(done, "RESULT"))
    assert result["replicas"] == 2
    # One engine process per replica, each on one GPU of its own.
    assert sorted(result["engines"], key=str) == ["0", "1"], result
