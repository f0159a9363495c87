"""The TP executor's step transports alone, by batch size: a step's round trip to ranks that run
no model.

    python benchmarks/bench_step_transport.py [--ranks 2] [--batches 1,32,128]
        [--transports socket,graph,calls] [--steps 2000] [--json PATH]

Each rank is a real WorkerActor whose worker answers every sequence with one token at once, so a
round trip is the transport and the messages' serialization: a decode step's StepInput (one
token per sequence, its SamplingSpec, no new blocks) pickled to every rank and every rank's
answer read back (rank 0's StepOutput). Columns: median us per round trip by transport, and
pickling the two messages once in this process (dumps and loads of the StepInput and of the
StepOutput), the part of a round trip that grows with the batch. CPU only: no device is used.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def echo_answer(step):
    """What an echo rank answers: per sequence its token count as the token, and its spec's
    num_prompt_tokens as the draft (so a test sees the spec the rank holds)."""
    from workers.batch import SeqResult, StepOutput

    return StepOutput(
        [
            SeqResult(s.request_id, [len(s.token_ids)], 0, [s.sampling.num_prompt_tokens])
            for s in step.seqs
        ]
    )


def _echo_worker(actor) -> None:
    class Echo:
        def execute(self, step):
            return echo_answer(step)

    actor.worker = Echo()


def echo_ranks(ray, count: int) -> list:
    """`count` WorkerActors (real Ray actors, CPU, no model) whose worker is an echo."""
    from workers.worker import bare_worker_spec
    from workers.worker_actor import WorkerActor

    spec = bare_worker_spec(count)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    actor_cls = ray.remote(WorkerActor).options(num_cpus=0, max_concurrency=2)
    ranks = [actor_cls.remote(rank, spec) for rank in range(count)]
    ray.get([r.run.remote(_echo_worker) for r in ranks])
    return ranks


def decode_step(batch: int):
    """A decode step of `batch` greedy requests as the engine sends it (one token each)."""
    from workers.batch import SamplingSpec, SeqWork, StepInput

    return StepInput(
        [
            SeqWork(
                request_id=f"cmpl-{i:032x}-0",
                token_ids=[1000 + i],
                start_position=1024 + i,
                block_ids=[],
                num_draft_tokens=0,
                samples=True,
                sampling=SamplingSpec(num_prompt_tokens=900 + i, min_tokens_masked_ids=(1,)),
                block_table_start=16,
            )
            for i in range(batch)
        ]
    )


def _median_us(run, steps: int) -> float:
    for _ in range(min(steps // 10, 200)):
        run()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def pickling_us(step, answer, steps: int) -> float:
    def run():
        pickle.loads(pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL))
        pickle.loads(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))

    return _median_us(run, steps)


def _transport(ray, name: str, ranks: list):
    """-> (send(step) -> every rank's answer, close() or None), as the executor's transports."""
    from cluster.step_sockets import StepSockets

    if name == "socket":
        sockets = StepSockets.connect(ranks, timeout_s=60)
        return (lambda step: sockets.execute(step, 60)), sockets.close
    if name == "graph":
        from ray.dag import InputNode, MultiOutputNode

        with InputNode() as node:
            dag = MultiOutputNode([r.answer.bind(node) for r in ranks])
        graph = dag.experimental_compile()
        return (lambda step: ray.get(graph.execute(step))), graph.teardown
    if name == "calls":
        return (lambda step: ray.get([r.answer.remote(step) for r in ranks])), None
    raise SystemExit(f"unknown transport {name!r}: socket, graph or calls")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--transports", default="socket,graph,calls")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=max(os.cpu_count() or 2, 2), include_dashboard=False)
    batches = [int(b) for b in args.batches.split(",")]
    transports = args.transports.split(",")
    results: dict[str, dict[int, float]] = {}
    for transport in transports:
        ranks = echo_ranks(ray, args.ranks)
        send, close = _transport(ray, transport, ranks)
        results[transport] = {}
        for batch in batches:
            run = functools.partial(send, decode_step(batch))
            results[transport][batch] = _median_us(run, args.steps)
            print(f"{transport} b={batch}: {results[transport][batch]:.1f} us", flush=True)
        if close is not None:
            close()
        for r in ranks:
            ray.kill(r)
    answers = {b: echo_answer(decode_step(b)) for b in batches}
    pickled = {b: pickling_us(decode_step(b), answers[b], args.steps) for b in batches}
    ray.shutdown()

    print(f"\n{args.ranks} ranks, median us per step's round trip (no model)")
    print("| batch | " + " | ".join(transports) + " | pickling both messages |")
    print("|---" * (len(transports) + 2) + "|")
    for b in batches:
        cells = " | ".join(f"{results[t][b]:.1f}" for t in transports)
        print(f"| {b} | {cells} | {pickled[b]:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "round_trip_us": results, "pickling_us": pickled}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
