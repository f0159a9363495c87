"""`mtpserve` command line: argument parsing only; the work is in the modules it calls.

mtpserve serve [--model DIR] [--host H] [--port P] [--tp N] [--ep N] [--num-draft-tokens K]
mtpserve generate [--model DIR] --prompt TEXT [--max-tokens N] [--json] ...
mtpserve make-tiny-model DIR [--seed N]
"""

from __future__ import annotations

import argparse
import json
import sys


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="checkpoint directory (default: the project's default model)"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (divides --tp)")
    parser.add_argument(
        "--num-draft-tokens", type=int, default=0, help="MTP draft length k (0 = speculation off)"
    )
    parser.add_argument(
        "--share-topk",
        action="store_true",
        help="draft steps 1..k-1 reuse draft step 0's top-k indices",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of full 64-token blocks an earlier prompt computed (default: on)",
    )
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument(
        "--indexer-numerics",
        default="exact",
        choices=["exact", "fp8"],
        help="exact indexer scores (transformers') or FP8 after a Hadamard rotation (DeepSeek's)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtpserve", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve the OpenAI API on a local Ray")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--address", default="local", help='Ray address; "local" starts a fresh local Ray (default)'
    )
    serve.add_argument(
        "--served-model-name", default=None, help="model id of the API (default: from --model)"
    )
    serve.add_argument("--max-num-seqs", type=int, default=None)
    serve.add_argument("--max-model-len", type=int, default=None)
    # Fractions so that a TP=2 engine, its coordinator and the ingress fit a 2-core laptop.
    serve.add_argument("--actor-num-cpus", type=float, default=0.5)
    serve.add_argument("--replica-num-cpus", type=float, default=0.5)
    serve.add_argument(
        "--colocate",
        action="store_true",
        help="one deployment: the HTTP ingress and the engine in one process (one Ray hop)",
    )

    generate = commands.add_parser("generate", help="one offline completion (no HTTP)")
    _add_engine_args(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
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
    plan.add_argument("--json", action="store_true", help="print one JSON object")

    tiny = commands.add_parser("make-tiny-model", help="write the tiny random test checkpoint")
    tiny.add_argument("out_dir")
    tiny.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from workers.loader import CheckpointError
    from workers.model_config import ModelConfigError

    try:
        return _run(args)
    except (CheckpointError, ModelConfigError) as e:  # the user's checkpoint or options
        parser.exit(2, f"mtpserve: error: {e}\n")


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
            tp_size=args.tp,
            ep_size=args.ep,
            num_draft_tokens=args.num_draft_tokens,
            share_topk=args.share_topk,
            device=args.device,
            indexer_numerics=args.indexer_numerics,
            enable_prefix_caching=args.enable_prefix_caching,
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
        from deploy.app import AppArgs
        from deploy.local_server import serve_until_interrupted
        from workers.model_config import check_checkpoint

        check_checkpoint(args.model, args.tp, args.ep)  # before Ray starts

        engine = {
            "indexer_numerics": args.indexer_numerics,
            "enable_prefix_caching": args.enable_prefix_caching,
        }
        if args.served_model_name is not None:
            engine["served_model_name"] = args.served_model_name
        if args.max_num_seqs is not None:
            engine["max_num_seqs"] = args.max_num_seqs
        if args.max_model_len is not None:
            engine["max_model_len"] = args.max_model_len
        app_args = AppArgs(
            model=args.model,
            tp_size=args.tp,
            ep_size=args.ep,
            num_draft_tokens=args.num_draft_tokens,
            share_topk=args.share_topk,
            device=args.device,
            engine=engine,
            actor_num_cpus=args.actor_num_cpus,
            replica_num_cpus=args.replica_num_cpus,
            ingress_num_cpus=0.25,
            colocate=args.colocate,
        )
        serve_until_interrupted(app_args, args.host, args.port, address=args.address)
        return 0
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
