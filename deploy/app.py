"""The Serve application: OpenAI ingress -> model server (one engine per replica), and the
metrics hub that both report to (`GET /metrics`, deploy/metrics.py).

`build_app(args)` is the app builder for Serve configs (`import_path: deploy.app:build_app`) and
is what `mtpserve serve` deploys. Resource shape of one model-server replica (STRICT_PACK, so an
engine never straddles nodes):

    bundle 0:          {"CPU": replica_num_cpus + actor_num_cpus}    the replica + coordinator
    bundles 1..ranks:  {"CPU": actor_num_cpus, "GPU": gpus_per_worker} one per TP/EP worker rank

An engine whose one rank runs in the replica's process tree (TP=1's in-process executor) has one
bundle, {"CPU": replica_num_cpus + actor_num_cpus, "GPU": gpus_per_worker}, and the replica asks
for the GPU itself, so that Ray gives it (and the engine process it starts) that GPU alone.
"""

from __future__ import annotations

from typing import Any

import ray
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.config import EngineConfig
from cluster.executor import executor_kind
from cluster.ray_executor import RANK_ENV_VARS
from deploy.ingress import OpenAIIngress
from deploy.limits import IngressLimits
from deploy.metrics import MetricsHub
from deploy.model_server import ModelServer
from deploy.prefix_router import PrefixAffinityRouter

MODEL_SERVER_NAME = "ModelServer"
INGRESS_NAME = "OpenAIIngress"
SERVER_NAME = "OpenAIServer"  # the engine deployment of a colocated app
METRICS_HUB_NAME = "MetricsHub"

# Ray Serve's switches for the replicas' request path, three of the ones its
# RAY_SERVE_THROUGHPUT_OPTIMIZED sets (not its others: replica logs stay on stderr, handles stay
# Ray calls, direct ingress stays where deploy.local_server puts it). A replica then runs our ASGI
# app, and its handles' router, on its own event loop instead of a thread each that every ASGI
# message of every request crossed, and writes its log file in batches (ERROR flushes at once).
# Our code never blocks that loop: model loads, rebuilds and tokenization run on threads.
# Measured (bench_serve, model-less executor, 32 concurrent, 2-core box): the replica's CPU per
# request 1.55 -> 1.09 ms streamed, 1.10 -> 0.94 not streamed. Part of APP_ENV_VARS.
SERVE_REQUEST_PATH_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000",
}
# Ray starts its worker processes at niceness 15 (its `worker_niceness`), below every other
# process of the host: the replicas, the engine process they start and the TP ranks would be
# the first to lose a contended core, to the clients, Ray's own daemons and anything else on the
# node. The engine's step loop is the server's critical path; it runs at the normal priority
# (Ray's job manager does the same for job drivers). The TP ranks get it from the Ray executor
# as well (cluster.ray_executor), whoever creates them.
ENGINE_PRIORITY_ENV = dict(RANK_ENV_VARS)
# What the app's processes get: set where Ray starts (deploy.local_server.start_local_ray) and
# in the Serve configs' runtime_env; a test keeps the configs equal to this.
APP_ENV_VARS = {**SERVE_REQUEST_PATH_ENV, **ENGINE_PRIORITY_ENV}


class AppArgs(BaseModel):
    """Arguments of `build_app`; the `args:` block of a Serve config."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="checkpoint dir; None = default_model_path()")
    # Engine options named here for Serve configs' convenience; None (like any `EngineConfig`
    # field left out of `engine`) is EngineConfig's default, which lives there alone.
    tp_size: int | None = Field(None, ge=1)
    ep_size: int | None = Field(None, ge=1)
    num_draft_tokens: int | None = Field(None, ge=0)
    share_topk: bool | None = None
    device: str | None = None
    # Other `EngineConfig` fields (max_num_seqs, max_model_len, num_kv_blocks,
    # max_queued_requests, executor, ...), passed through unchanged.
    engine: dict[str, Any] = Field(default_factory=dict)
    # Resources. Fractions let a TP=2 engine plus coordinator fit a 2-core CI box.
    replica_num_cpus: float = Field(1.0, ge=0)
    actor_num_cpus: float = Field(1.0, ge=0)
    gpus_per_worker: float | None = Field(
        None, ge=0, description="None: 1 if the cluster has GPUs and device is not cpu, else 0"
    )
    ingress_num_cpus: float = Field(1.0, ge=0)
    # Serve routing: the engine queues and batches, so the replica takes many requests at once;
    # past max_ongoing_requests Serve queues in the caller (and autoscaling sees the backlog).
    model_server_max_ongoing_requests: int = Field(256, ge=1)
    ingress_max_ongoing_requests: int = Field(1024, ge=1)
    num_replicas: int = Field(1, ge=1)
    # Send a request to the replica that was sent the longest prefix of its tokens (its prefix
    # cache likely holds them): deploy/prefix_router.py. Off: Serve's power of two choices.
    prefix_aware_routing: bool = True
    # What one HTTP request may take (deploy.limits.IngressLimits holds the defaults).
    max_request_body_bytes: int = Field(IngressLimits.max_request_body_bytes, ge=1)
    max_sequences_per_request: int = Field(IngressLimits.max_sequences_per_request, ge=1)
    max_live_sequences_per_request: int = Field(IngressLimits.max_live_sequences_per_request, ge=1)
    max_inline_tokenize_chars: int = Field(IngressLimits.max_inline_tokenize_chars, ge=0)
    autoscaling_config: dict[str, Any] | None = None
    # Streamed chunks per second a model-server replica sends in all (a stream's chunks are
    # spaced by streams / this; 0: one chunk per engine step; None: 50 per core of the node, at
    # most 800). See deploy/model_server.py.
    stream_chunks_per_s: float | None = Field(None, ge=0)
    # The engine's step loop in a process of its own (True), or on a thread of the replica's
    # process. TP > 1 ranks are stepped from that process over their sockets; ranks on other
    # nodes (no socket) keep the loop on a thread (cluster/engine_process.py says why).
    engine_process: bool = True
    # One log line per request in each replica (Serve's access log).
    access_log: bool = False
    # One deployment: the ingress with the engine in its process (deploy/openai_server.py);
    # a request crosses one Ray hop, not two. Ingress fields other than max_ongoing_requests
    # are unused then, and so is prefix_aware_routing (Serve's proxy routes HTTP requests
    # before any token is known).
    colocate: bool = False
    # Clients must send `Authorization: Bearer <api_key>` (deploy/auth.py); None: no key.
    api_key: str | None = None

    @model_validator(mode="after")
    def _one_value_per_option(self) -> AppArgs:
        for name in APP_ENGINE_FIELDS:
            mine, theirs = getattr(self, name), self.engine.get(name)
            if mine is not None and theirs is not None and mine != theirs:
                raise ValueError(f"{name}={mine} contradicts engine.{name}={theirs}")
        return self

    def engine_option(self, name: str) -> Any:
        """An engine option as the engine will see it: set here, in `engine`, or its default."""
        value = self.engine_options().get(name)
        return EngineConfig.default(name) if value is None else value

    def engine_options(self) -> dict[str, Any]:
        """The EngineConfig fields set, here or in `engine` (model excluded)."""
        named = {n: getattr(self, n) for n in APP_ENGINE_FIELDS if getattr(self, n) is not None}
        return {"actor_num_cpus": self.actor_num_cpus, **named, **self.engine}

    @property
    def num_worker_ranks(self) -> int:
        return max(self.engine_option("tp_size"), self.engine_option("ep_size"))


# Engine options AppArgs names as its own fields (besides those it also uses for resources).
APP_ENGINE_FIELDS = ("tp_size", "ep_size", "num_draft_tokens", "share_topk", "device")


def engine_config_dict(args: AppArgs) -> dict[str, Any]:
    """`model` stays None for the default model: each replica resolves it on its own node."""
    return {"model": args.model, **args.engine_options()}


def _gpus_per_worker(args: AppArgs) -> float:
    if args.gpus_per_worker is not None:
        return args.gpus_per_worker
    if args.engine_option("device") == "cpu":
        return 0.0
    # The builder runs inside the cluster (serve run/deploy, or the CLI's driver).
    return 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0 else 0.0


def engine_in_replica(args: AppArgs) -> bool:
    """Whether the engine's one rank runs in the replica's own process tree (the in-process
    executor of TP=1, or an executor class of one's own): the replica then holds the GPU.

    Ray sets CUDA_VISIBLE_DEVICES only in an actor that asks for GPUs; one that asks for none
    sees every GPU of its node, and the engine process it starts takes the first. A TP=1 engine
    whose GPU was reserved in a bundle of its own would then run on the node's GPU 0, with every
    other TP=1 replica of that node."""
    kind = executor_kind(args.engine_option("executor"), args.engine_option("tp_size"))
    return kind != "ray"


def placement_bundles(args: AppArgs) -> list[dict[str, float]]:
    """Bundle 0 holds the replica and its coordinator (and, for an engine in the replica, its
    GPU); a Ray executor's ranks get one bundle each after it."""
    gpus = {"GPU": g} if (g := _gpus_per_worker(args)) > 0 else {}
    head_bundle = {"CPU": args.replica_num_cpus + args.actor_num_cpus}
    if engine_in_replica(args):
        return [{**head_bundle, **gpus}]
    worker_bundle = {"CPU": args.actor_num_cpus, **gpus}
    return [head_bundle] + [dict(worker_bundle) for _ in range(args.num_worker_ranks)]


def replica_actor_options(args: AppArgs) -> dict[str, float]:
    """The engine replica's own resources (inside bundle 0): its CPU, and the GPU of an engine
    that runs in its process tree (Ray then sets CUDA_VISIBLE_DEVICES to that GPU)."""
    options = {"num_cpus": args.replica_num_cpus}
    if engine_in_replica(args) and (gpus := _gpus_per_worker(args)) > 0:
        options["num_gpus"] = gpus
    return options


def _engine_replica_options(args: AppArgs) -> dict[str, Any]:
    """Serve options of the deployment that owns an engine (the model server, or the colocated
    server): its workers in the replica's placement group, slow loads, graceful drains."""
    return dict(
        ray_actor_options=replica_actor_options(args),
        placement_group_bundles=placement_bundles(args),
        placement_group_strategy="STRICT_PACK",
        health_check_period_s=10,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=20,
        logging_config={"enable_access_log": args.access_log},
    )


def build_app(args: dict[str, Any] | AppArgs | None = None) -> Application:
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args or {})
    scaling: dict[str, Any] = (
        {"autoscaling_config": args.autoscaling_config}
        if args.autoscaling_config
        else {"num_replicas": args.num_replicas}
    )
    # Every engine replica pushes its metrics here; `GET /metrics` renders them all
    # (deploy/metrics.py says why). Tiny and idle: no CPU reserved.
    metrics_hub = (
        serve.deployment(MetricsHub)
        .options(
            name=METRICS_HUB_NAME,
            num_replicas=1,
            max_ongoing_requests=1000,
            ray_actor_options={"num_cpus": 0},
            logging_config={"enable_access_log": False},
            # Nothing to drain (a lost report is resent within a second): stop at once.
            graceful_shutdown_wait_loop_s=0.1,
            graceful_shutdown_timeout_s=0.5,
        )
        .bind()
    )
    if args.colocate:
        from deploy.openai_server import OpenAIServer

        server = serve.deployment(OpenAIServer).options(
            name=SERVER_NAME,
            max_ongoing_requests=args.ingress_max_ongoing_requests,
            **_engine_replica_options(args),
            **scaling,
        )
        return server.bind(
            engine_config_dict(args),
            args.stream_chunks_per_s,
            ingress_limits(args),
            args.api_key,
            metrics_hub,
            engine_process=args.engine_process,
        )
    routing: dict[str, Any] = {}
    if args.prefix_aware_routing:
        routing["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter,
            request_router_kwargs={
                "block_size_tokens": args.engine_option("block_size_tokens"),
            },
        )
    model_server = serve.deployment(ModelServer).options(
        name=MODEL_SERVER_NAME,
        max_ongoing_requests=args.model_server_max_ongoing_requests,
        **_engine_replica_options(args),
        **scaling,
        **routing,
    )
    ingress = serve.deployment(OpenAIIngress).options(
        name=INGRESS_NAME,
        max_ongoing_requests=args.ingress_max_ongoing_requests,
        ray_actor_options={"num_cpus": args.ingress_num_cpus},
        logging_config={"enable_access_log": args.access_log},
    )
    return ingress.bind(
        model_server.bind(
            engine_config_dict(args),
            args.stream_chunks_per_s,
            metrics_hub,
            engine_process=args.engine_process,
        ),
        ingress_limits(args),
        args.api_key,
        metrics_hub,
    )


def ingress_limits(args: AppArgs) -> IngressLimits:
    return IngressLimits(
        max_request_body_bytes=args.max_request_body_bytes,
        max_sequences_per_request=args.max_sequences_per_request,
        max_live_sequences_per_request=args.max_live_sequences_per_request,
        max_inline_tokenize_chars=args.max_inline_tokenize_chars,
    )
