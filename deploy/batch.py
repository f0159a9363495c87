"""Offline batch inference: `python -m deploy.batch --input prompts.jsonl --output results.jsonl`.

Run it on a cluster with
    ray job submit --address http://HEAD:8265 --working-dir . -- \
        python -m deploy.batch --input prompts.jsonl --output /shared/results.jsonl

Paths are paths on the node that runs the job (the head node under `ray job submit`). `--output`
must be absolute: a job runs in a temporary working directory that Ray deletes later, and the
submitter's directory is not knowable there (it may be another machine), so a relative output
would land where no one finds it. `--input` may be relative: it is resolved against the working
directory, which is where `--working-dir` uploads the submitter's files. Both are printed as
absolute paths, with the host, when the job starts and ends.

Input: one JSON object per line, `{"id": ..., "prompt": "..."}` or `{"id": ..., "messages":
[...]}` (the chat template applied, or DeepSeek-V3.2's own encoding for a checkpoint without one;
`tools` and `chat_template_kwargs` as over HTTP), optionally with the sampling fields of
`SAMPLING_FIELDS` (`logit_bias` maps token ids, as strings or integers, to biases). A line
without an id gets `line-<n>` (1-based). Any other key makes the row an error, as does a bad
value: each row is validated on its own and fails alone (a request that fails inside an engine
step too). The output is the model's raw text (reasoning and DSML tool calls are not parsed here).

Output: one JSON object per request, appended as each finishes:
`{"id", "text", "completion_token_ids", "num_prompt_tokens", "finish_reason", "error": null}`, or
`{"id", "error": "..."}` when the line was bad or the request failed.

Resumable: ids whose last row succeeded are skipped, so a rerun after an interruption only does
what is left (failed rows are retried). Exit status 1 if any request of this run failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import uuid
from collections.abc import Iterator
from typing import Any

from deploy.engine_args import add_engine_args, engine_options

SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
)
ROW_FIELDS = ("id", "prompt", "messages", "tools", "chat_template_kwargs", *SAMPLING_FIELDS)
DEFAULT_MAX_TOKENS = 64


def read_done_ids(output_path: str) -> set[str]:
    """Ids whose last row in `output_path` has no error. A torn last line (the writer was
    killed mid-line) is ignored."""
    status: dict[str, bool] = {}
    if not os.path.exists(output_path):
        return set()
    with open(output_path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "id" in row:
                status[str(row["id"])] = row.get("error") is None
    return {row_id for row_id, ok in status.items() if ok}


def read_requests(input_path: str) -> Iterator[tuple[str, dict[str, Any] | None, str | None]]:
    """Yields (id, request, error): a bad line gives (id, None, why)."""
    with open(input_path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            fallback_id = f"line-{line_number}"
            try:
                request = json.loads(line)
            except json.JSONDecodeError as exc:
                yield fallback_id, None, f"line {line_number}: invalid JSON: {exc}"
                continue
            if not isinstance(request, dict):
                yield fallback_id, None, f"line {line_number}: expected a JSON object"
                continue
            request_id = str(request.get("id", fallback_id))
            unknown = sorted(set(request) - set(ROW_FIELDS))
            if unknown:
                yield request_id, None, f"line {line_number}: unknown fields {unknown}"
                continue
            if ("prompt" in request) == ("messages" in request):
                yield request_id, None, f"line {line_number}: need exactly one of prompt/messages"
                continue
            yield request_id, request, None


def _prompt_token_ids(request: dict[str, Any], tokenizer) -> list[int]:
    if "messages" in request:
        kwargs = request.get("chat_template_kwargs") or {}
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(
                request["messages"],
                tools=request.get("tools"),
                tokenize=False,
                add_generation_prompt=True,
                **kwargs,
            )
        else:  # a DeepSeek-V3.2 checkpoint without a template: its own encoding
            from deploy.chat_dsv32 import encode_messages

            thinking = bool(kwargs.get("thinking", kwargs.get("enable_thinking", False)))
            text = encode_messages(
                request["messages"], thinking=thinking, tools=request.get("tools")
            )
        return tokenizer.encode(text, add_special_tokens=False)
    prompt = request["prompt"]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    raise ValueError("prompt must be a string or a list of token ids")


def _token_keyed(bias: dict) -> dict:
    """JSON object keys are strings: "42" -> 42 (validation refuses anything else)."""
    return {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in bias.items()}


class BatchRunner:
    def __init__(self, engine, output_path: str, concurrency: int):
        self._engine = engine
        self._output = open(output_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in run
        self._slots = asyncio.Semaphore(concurrency)
        self.num_failed = 0
        self.num_succeeded = 0

    def _write(self, row: dict[str, Any]) -> None:
        self._output.write(json.dumps(row) + "\n")
        self._output.flush()  # a row on disk is a row a rerun skips
        if row.get("error") is None:
            self.num_succeeded += 1
        else:
            self.num_failed += 1

    async def run_one(self, request_id: str, request: dict[str, Any]) -> None:
        from cluster.sampling_params import SamplingParams

        async with self._slots:
            try:
                kwargs = {k: request[k] for k in SAMPLING_FIELDS if k in request}
                if isinstance(kwargs.get("logit_bias"), dict):
                    kwargs["logit_bias"] = _token_keyed(kwargs["logit_bias"])
                kwargs.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
                # The checkpoint's sampling defaults where the row leaves a field out.
                params = SamplingParams(**{**self._engine.sampling_defaults, **kwargs})
                params.validate()
                prompt_ids = _prompt_token_ids(request, self._engine.tokenizer)
                last = None
                async for last in self._engine.generate(  # noqa: B007 (one: the whole row)
                    prompt_ids, params, f"batch-{uuid.uuid4().hex}", stream=False
                ):
                    pass
                self._write(
                    {
                        "id": request_id,
                        "text": last.text,
                        "completion_token_ids": list(last.token_ids),
                        "num_prompt_tokens": last.num_prompt_tokens,
                        "finish_reason": last.finish_reason,
                        "error": None,
                    }
                )
            except Exception as exc:  # noqa: BLE001 - record it; the job goes on
                self._write({"id": request_id, "error": f"{type(exc).__name__}: {exc}"})

    def close(self) -> None:
        self._output.close()


async def run_batch(
    input_path: str, output_path: str, engine, concurrency: int, progress: bool = True
) -> BatchRunner:
    from tqdm import tqdm

    _terminate_torn_line(output_path)
    done = read_done_ids(output_path)
    runner = BatchRunner(engine, output_path, concurrency)
    todo, skipped = [], 0
    for request_id, request, error in read_requests(input_path):
        if request_id in done:
            skipped += 1
        elif error is not None:
            runner._write({"id": request_id, "error": error})
        else:
            todo.append((request_id, request))
    print(
        f"batch: {skipped} already done, {len(todo)} to run, {runner.num_failed} bad lines",
        file=sys.stderr,
        flush=True,
    )
    bar = tqdm(total=len(todo), desc="batch", unit="req", disable=not progress, file=sys.stderr)

    async def tracked(request_id, request):
        await runner.run_one(request_id, request)
        bar.update(1)

    try:
        await asyncio.gather(*(tracked(i, r) for i, r in todo))
    finally:
        bar.close()
        runner.close()
    return runner


def _terminate_torn_line(output_path: str) -> None:
    """If a killed writer left a line without its newline, end it so appends start clean."""
    if not os.path.exists(output_path) or os.path.getsize(output_path) == 0:
        return
    with open(output_path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) != b"\n":
            f.write(b"\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.batch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--input",
        required=True,
        help="JSONL of requests, one per line (relative: to the job's working directory)",
    )
    parser.add_argument(
        "--output",
        required=True,
        help="JSONL of results, an absolute path on the node that runs the job (resumed if it "
        "exists)",
    )
    add_engine_args(parser)
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def resolve_paths(input_path: str, output_path: str) -> tuple[str, str]:
    """-> (input, output) as absolute paths; ValueError with the reason for a relative output,
    a missing input or an output directory that does not exist (the module docstring says why
    the two are treated differently)."""
    if not os.path.isabs(output_path):
        raise ValueError(
            f"--output must be an absolute path, got {output_path!r}: under `ray job submit` the "
            "job runs in a temporary working directory that Ray deletes, so a relative path would "
            f"land there (here: {os.path.join(os.getcwd(), output_path)}). Give a path on the "
            'node that runs the job, e.g. --output "$PWD/results.jsonl" for a local Ray or a '
            "shared filesystem for a cluster."
        )
    output_path = os.path.normpath(output_path)
    if not os.path.isdir(os.path.dirname(output_path)):
        raise ValueError(
            f"--output {output_path}: the directory {os.path.dirname(output_path)} does not exist "
            f"on {socket.gethostname()}"
        )
    input_path = os.path.abspath(input_path)
    if not os.path.isfile(input_path):
        raise ValueError(f"--input {input_path}: no such file on {socket.gethostname()}")
    return input_path, output_path


def rank_executor(options: dict[str, Any], gpu_here: bool, cluster_gpus: float) -> str:
    """The executor of a job's engine: "auto" (the engine's default: a TP=1 rank in this
    process, TP > 1 ranks as Ray actors) or "ray" (a TP=1 rank as an actor that holds one of
    the cluster's GPUs).

    A job's driver runs on the head node, which on a GPU cluster often has no GPU
    (deploy/cluster-launcher.yaml's has none). There a TP=1 engine in this process would run
    the model on the head's CPU (device auto) or fail (device cuda). So when this process sees
    no GPU but the model is to run on one (device cuda, or auto on a cluster with GPUs), the
    rank becomes a Ray actor asking for a GPU, which the autoscaler adds a node for if none is
    free. `ray job submit --entrypoint-num-gpus 1` puts the driver itself on a GPU instead.
    TP > 1 ranks are actors anyway."""
    if options.get("tp_size", 1) != 1 or gpu_here:
        return "auto"
    device = options.get("device", "auto")
    wants_gpu = device == "cuda" or (device == "auto" and cluster_gpus > 0)
    return "ray" if wants_gpu else "auto"


def _place_rank(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with the executor `rank_executor` picks, under a Ray job (RAY_ADDRESS set)."""
    if options.get("tp_size", 1) != 1 or options.get("device") == "cpu":
        return options
    if not os.environ.get("RAY_ADDRESS"):
        return options  # not on a cluster: this machine's GPU or CPU, as `mtpserve generate`
    import ray
    import torch

    gpu_here = torch.cuda.is_available()
    cluster_gpus = 0.0
    if not gpu_here:
        ray.init(log_to_driver=True)  # the job's cluster (RAY_ADDRESS)
        cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
    if rank_executor(options, gpu_here, cluster_gpus) == "auto":
        return options
    print(
        f"batch: no GPU on {socket.gethostname()} (the job's driver); the engine's rank runs "
        f"as a Ray actor with a GPU of the cluster ({cluster_gpus:g} GPUs there now)",
        file=sys.stderr,
        flush=True,
    )
    return {**options, "executor": "ray", "device": "cuda"}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = engine_options(args)
        args.input, args.output = resolve_paths(args.input, args.output)
    except ValueError as e:
        parser.error(str(e))
    host = socket.gethostname()
    print(
        f"batch: reading {args.input}, writing {args.output} on {host}", file=sys.stderr, flush=True
    )

    from cluster.async_engine import AsyncEngine
    from cluster.config import EngineConfig

    model = args.model
    if model is None:
        from workers.default_model import default_model_path

        model = default_model_path()
    options = _place_rank(options)
    config = EngineConfig(model=model, max_queued_requests=max(256, args.concurrency), **options)

    async def run() -> BatchRunner:
        engine = AsyncEngine(config)
        try:
            return await run_batch(
                args.input, args.output, engine, args.concurrency, progress=not args.no_progress
            )
        finally:
            await engine.shutdown()

    runner = asyncio.run(run())
    print(
        f"batch: {runner.num_succeeded} succeeded, {runner.num_failed} failed; "
        f"results in {args.output} on {host}",
        file=sys.stderr,
        flush=True,
    )
    return 1 if runner.num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
