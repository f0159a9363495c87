"""`mtpserve` command line: argument parsing only; the work is in the modules it calls.

mtpserve serve [--model DIR] [--host H] [--port P] [--tensor-parallel-size N]
    [--speculative-config '{"method": "mtp", "num_speculative_tokens": K}'] ...
mtpserve generate [--model DIR] --prompt TEXT [--max-tokens N] [--json] ...
mtpserve plan [--model DIR] [--tp N] [--ep N] [--kv-cache-dtype auto|fp8] [--json]
mtpserve make-tiny-model DIR [--seed N]
"""

from __future__ import annotations

import argparse
import json
import sys

from cluster.config import KV_CACHE_DTYPES
from deploy.auth import API_KEY_ENV, api_key_from
from deploy.engine_args import add_engine_args, engine_options

# What `mtpserve --help` says first: for users, the commands they run.
DESCRIPTION = """\
Serve DeepSeek-V3.2-architecture models, with MTP speculative decoding and tensor/expert
parallelism on Ray, behind an OpenAI-compatible HTTP API; or generate from one offline.

  mtpserve serve                                   the built-in default model, at
                                                   http://127.0.0.1:8000/v1
  mtpserve serve --model DIR --tensor-parallel-size 2   a checkpoint, on two GPUs
  mtpserve generate --prompt "def fibonacci(n):"   one completion, no server

Each command's options: mtpserve COMMAND --help.
"""


class EngineArgsError(ValueError):
    pass


def _engine_options(args: argparse.Namespace) -> dict:
    try:
        return engine_options(args)
    except ValueError as e:
        raise EngineArgsError(str(e)) from None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mtpserve")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mtpserve",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mtpserve {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the OpenAI API on a local Ray")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on")
    serve.add_argument("--port", type=int, default=8000, help="port of the HTTP API")
    serve.add_argument(
        "--address", default="local", help='Ray address; "local" starts a fresh local Ray (default)'
    )
    serve.add_argument(
        "--served-model-name", default=None, help="model id of the API (default: from --model)"
    )
    serve.add_argument(
        "--api-key",
        default=api_key_from(None),
        help="clients must send it (Authorization: Bearer KEY, the openai client's api_key); "
        f"default: ${API_KEY_ENV} when set",
    )
    # Fractions so that a TP=2 engine, its coordinator and the ingress fit a 2-core laptop.
    serve.add_argument(
        "--actor-num-cpus", type=float, default=0.5, help="CPU request of each worker actor"
    )
    serve.add_argument(
        "--replica-num-cpus", type=float, default=0.5, help="CPU request of the model server"
    )
    serve.add_argument(
        "--access-log",
        action="store_true",
        help="log a line per request (Serve's access log; off: it costs the proxy CPU)",
    )
    serve.add_argument(
        "--colocate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one deployment: the HTTP ingress and the engine in one replica, no Ray hop per "
        "request (default: the faster shape on the 2-core box and on the H200, BENCHMARKS.md); "
        "--no-colocate: the ingress a deployment of its own",
    )

    generate = commands.add_parser("generate", help="one offline completion (no HTTP)")
    add_engine_args(generate)
    generate.add_argument("--prompt", required=True, help="the text to complete")
    generate.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    generate.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0: greedy (default: the checkpoint's generation_config.json, else greedy)",
    )
    generate.add_argument("--seed", type=int, default=None, help="the sampler's seed")
    generate.add_argument("--json", action="store_true", help="print one JSON object")

    plan = commands.add_parser(
        "plan", help="weights and KV cache per rank, from a checkpoint or config.json alone"
    )
    plan.add_argument(
        "--model", default=None, help="checkpoint directory (or one with only config.json)"
    )
    plan.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    plan.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides --tp)")
    plan.add_argument("--gpu-memory-gib", type=float, default=141.0, help="memory of one GPU")
    plan.add_argument("--max-model-len", type=int, default=None, help="default: the config's")
    plan.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the MLA latent cache's dtype (fp8: e4m3 + a scale per 128 values)",
    )
    plan.add_argument(
        "--indexer-numerics",
        choices=("exact", "fp8"),
        default="exact",
        help="fp8 also keeps the indexer's keys in FP8",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")

    tiny = commands.add_parser("make-tiny-model", help="write the tiny random test checkpoint")
    tiny.add_argument("out_dir", help="directory to write the checkpoint to")
    tiny.add_argument("--seed", type=int, default=0, help="the weights' seed")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from cluster.config import ConfigError
    from deploy.local_server import DeployFailedError, DoesNotFitError, PortInUseError
    from kernels.settings import SettingsError, settings
    from workers.loader import CheckpointError
    from workers.model_config import ModelConfigError

    try:
        settings()  # the environment's switches: a value off the list fails here, not in a rank
        return _run(args)
    except KeyboardInterrupt:  # Ctrl-C outside `serve` (which handles its own): no traceback
        print("mtpserve: interrupted", file=sys.stderr)
        return 130
    except (CheckpointError, ModelConfigError, ConfigError, SettingsError) as e:  # inputs
        parser.exit(2, f"mtpserve: error: {e}\n")
    except EngineArgsError as e:
        parser.exit(2, f"mtpserve: error: {e}\n")
    except (PortInUseError, DoesNotFitError, DeployFailedError) as e:
        parser.exit(1, f"mtpserve: error: {e}\n")


def _run(args: argparse.Namespace) -> int:

    if args.command == "make-tiny-model":
        from workers.tiny_model import make_tiny_model

        print(make_tiny_model(args.out_dir, seed=args.seed))
        return 0

    if args.command == "plan":
        from workers.default_model import default_model_path
        from workers.memory_plan import describe, plan_memory

        plan = plan_memory(
            args.model or default_model_path(),
            args.tp,
            args.ep,
            args.gpu_memory_gib,
            args.max_model_len,
            kv_cache_dtype=args.kv_cache_dtype,
            indexer_numerics=args.indexer_numerics,
        )
        print(plan.to_json() if args.json else describe(plan))
        return 0

    if args.command == "generate":
        from deploy.offline import generate_once

        result = generate_once(
            args.model,
            args.prompt,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            **_engine_options(args),
        )
        if args.json:
            print(json.dumps(result))
        else:
            print(result["text"])
            print(
                f"[{len(result['completion_token_ids'])} tokens, "
                f"{result['mean_tokens_per_round']:.2f} tokens/round]",
                file=sys.stderr,
            )
        return 0

    if args.command == "serve":
        from cluster.config import EngineConfig, read_checkpoint, resolve_config
        from deploy.app import AppArgs
        from deploy.local_server import serve_until_interrupted
        from workers.default_model import default_model_path
        from workers.loader import check_checkpoint_files
        from workers.model_config import check_model_config

        engine = _engine_options(args)
        if args.served_model_name is not None:
            engine["served_model_name"] = args.served_model_name
        # The checkpoint against the options before Ray starts (each replica resolves again,
        # on its own node, and logs what it chose).
        config = EngineConfig(model=args.model or default_model_path(), **engine)
        checkpoint = read_checkpoint(config.model)
        check_model_config(checkpoint.model_config, config.tp_size, config.ep_size)
        check_checkpoint_files(config.model)  # a download cut short: said here, not in a replica
        resolve_config(config, checkpoint)
        app_args = AppArgs(
            model=args.model,
            engine=engine,
            actor_num_cpus=args.actor_num_cpus,
            replica_num_cpus=args.replica_num_cpus,
            ingress_num_cpus=0.25,
            colocate=args.colocate,
            api_key=args.api_key,
            access_log=args.access_log,
        )
        return serve_until_interrupted(app_args, args.host, args.port, address=args.address)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
