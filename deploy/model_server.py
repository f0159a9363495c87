"""The model-server deployment: one replica owns one `AsyncEngine` (coordinator plus workers).

Replica lifecycle = engine lifecycle: the engine's workers are created inside the replica's
placement group (bundle 0 for the replica and coordinator, one bundle per Ray worker rank; a TP=1
engine runs in the replica's process tree and its GPU is the replica's own), so Serve
starting, replacing or stopping a replica starts, replaces or stops its whole engine.

Request lifecycle (`generate`):
  1. the ingress calls `generate` through a streaming `DeploymentHandle` for a streamed
     request, `generate_whole` (the same, as one reply) for one that is not;
  2. the engine's outputs go back as `GenerateChunk`s (deltas), paced by the engine's step loop
     (`cluster.engine_loop`): for a streamed request the first with text at once, then at most
     one chunk per stream interval holding every step since the last one; for a non-streamed
     request one chunk, the whole completion;
  3. an engine error is yielded as one `GenerateFailure` and the stream ends;
  4. if the stream is torn down early (the client disconnected, so Serve cancelled the call),
     `finally` aborts the engine request, which frees its KV blocks.

Why chunks are paced: every chunk is a Ray object from this replica to the ingress and an SSE
event to the client, ~1.6 ms of CPU across the processes on the 2-core box (Ray 2.60), while an
engine step of 16 sequences of the tiny model takes ~2.3 ms. One chunk per token per request left
the engine a tenth of its offline tokens/s; bounding the replica's chunks per second bounds that
cost whatever the concurrency.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import os
import time
from collections.abc import AsyncIterator

from ray.serve.exceptions import DeploymentUnavailableError

from cluster.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
)
from cluster.config import EngineConfig
from cluster.outputs import RequestOutput
from cluster.sampling_params import InvalidRequestError
from deploy.messages import GenerateChunk, GenerateFailure, GenerateRequest, ModelInfo
from deploy.metrics import REPORT_PERIOD_S, ReplicaMetrics, current_replica_id

logger = logging.getLogger("ray.serve")

# The replica's streamed-chunk budget when AppArgs.stream_chunks_per_s is None: per core of the
# node, capped. On the 2-core box (16 streams x 32 tokens, colocated, three alternating runs
# each) 100 chunks/s gave 2296 streamed tok/s on average against 1664 with 400.
STREAM_CHUNKS_PER_S_PER_CORE = 50.0
MAX_AUTO_STREAM_CHUNKS_PER_S = 800.0


def resolve_stream_chunks_per_s(chunks_per_s: float | None) -> float:
    if chunks_per_s is not None:
        return chunks_per_s
    cores = os.cpu_count() or 1
    return min(STREAM_CHUNKS_PER_S_PER_CORE * cores, MAX_AUTO_STREAM_CHUNKS_PER_S)


def to_chunk(out: RequestOutput) -> GenerateChunk:
    return GenerateChunk(
        new_token_ids=out.new_token_ids,
        new_text=out.new_text,
        finished=out.finished,
        finish_reason=out.finish_reason if out.finished else None,
        new_logprobs=out.new_logprobs,
        num_cached_tokens=out.num_cached_tokens,
    )


def failure_from_exception(exc: BaseException) -> GenerateFailure:
    """Classify an engine exception for HTTP."""
    if isinstance(exc, InvalidRequestError):
        message = getattr(exc, "message", None) or str(exc)
        return GenerateFailure(400, "invalid_request_error", message, getattr(exc, "param", None))
    if isinstance(exc, EngineOverloadedError):
        return GenerateFailure(503, "overloaded_error", str(exc) or "engine queue is full")
    # Engine failures name actors, hosts and tracebacks: those go to the log, not to clients.
    logger.warning("request failed: %s: %s", type(exc).__name__, exc)
    if isinstance(exc, EngineDeadError):
        message = "the engine's workers failed; it is being rebuilt, retry shortly"
        return GenerateFailure(503, "engine_dead_error", message)
    if isinstance(exc, RequestFailedError):
        return GenerateFailure(500, "internal_error", str(exc))
    return GenerateFailure(500, "internal_error", "internal error (the server log has why)")


def engine_stats_dict(stats) -> dict:
    """The engine's `EngineStats` as a dict, its derived figures included."""
    return {
        **dataclasses.asdict(stats),
        "kv_usage": stats.kv_usage,
        "mean_tokens_per_round": stats.mean_tokens_per_round,
        "acceptance_per_position": stats.acceptance_per_position,
    }


async def _maybe_await(value):
    if inspect.isawaitable(value):
        return await value
    return value


class ModelServer:
    """Serve deployment class; `deploy.app.build_app` wraps it with `serve.deployment`.
    `metrics_hub`: the app's `deploy.metrics.MetricsHub` handle, which this replica's metrics
    are pushed to (None: kept here only)."""

    def __init__(
        self,
        engine_config: dict,
        stream_chunks_per_s: float | None = None,
        metrics_hub=None,
        engine_process: bool = True,
    ):
        if engine_config.get("model") is None:
            from workers.default_model import default_model_path

            engine_config = {**engine_config, "model": default_model_path()}
        self._config = EngineConfig.from_dict(engine_config)
        started = time.perf_counter()
        self._stream_chunks_per_s = resolve_stream_chunks_per_s(stream_chunks_per_s)
        # The engine's step loop in a process of its own (where its executor allows): this
        # replica's threads and the engine never wait for one interpreter lock.
        self._engine = AsyncEngine(
            self._config, self._stream_chunks_per_s, own_process=engine_process
        )
        warm_up = self._engine.warm_up
        # Serve marks the replica ready only after __init__ returns: the engine is warm by then.
        logger.info(
            "engine for %s ready in %.1f s, of which warm-up %.1f s (%d CUDA graphs) (%s)",
            self._engine.model_name,
            time.perf_counter() - started,
            warm_up.seconds,
            warm_up.num_graphs,
            self._engine.resolved_config,  # the draft length and context chosen
        )
        self._metrics = ReplicaMetrics(self._engine.model_name)
        self._metrics_hub = metrics_hub
        self._replica_id = current_replica_id()
        self._stats_task: asyncio.Task | None = None
        self._first_report: asyncio.Future | None = None  # done once the first report went
        self._health_lock = asyncio.Lock()  # one probe (and rebuild) at a time
        logger.info(
            "streamed chunks: at most %.0f per second; engine step loop %s",
            self._stream_chunks_per_s,
            f"in process {self._engine.pid}" if self._engine.own_process else "on a thread",
        )

    async def model_info(self) -> ModelInfo:
        """What the ingress asks first, while it starts: the replica's first metrics report (a
        handle's first call sets up Serve's router, tens of ms on this loop) is sent here, so
        that it does not land on the first request after the app said it was ready."""
        self._ensure_stats_loop()
        try:
            await asyncio.wait_for(asyncio.shield(self._first_report), timeout=5.0)
        except asyncio.TimeoutError:
            pass  # the hub is slow to start: the report goes later, the info now
        return ModelInfo(
            model_name=self._engine.model_name,
            max_model_len=self._engine.max_model_len,
            model_dir=self._config.model,
            sampling_defaults=self._engine.sampling_defaults,
        )

    def engine_stats(self) -> dict:
        return engine_stats_dict(self._engine.stats())

    async def generate(
        self, request: GenerateRequest
    ) -> AsyncIterator[GenerateChunk | GenerateFailure]:
        self._ensure_stats_loop()
        outputs = self._engine.generate(
            request.prompt_token_ids,
            request.params,
            request.request_id,
            stream=request.stream,
            timings=self._metrics,
        )
        arrived_s = time.perf_counter()
        finished = False
        admitted = False  # the engine took it (a refusal raises before any output)
        try:
            async for out in outputs:
                admitted = True
                finished = out.finished
                if finished and out.finish_reason == "error":
                    yield failure_from_exception(
                        (EngineDeadError if self._engine.is_dead else RequestFailedError)(
                            out.error or "engine failure"
                        )
                    )
                    return
                yield to_chunk(out)
                if finished:
                    return
        except (
            InvalidRequestError,
            EngineOverloadedError,
            EngineDeadError,
            RequestFailedError,
        ) as exc:
            finished = True
            yield failure_from_exception(exc)
        except Exception as exc:  # report, don't crash the replica
            finished = True
            logger.exception("request %s failed", request.request_id)
            yield failure_from_exception(exc)
        finally:
            if admitted or not finished:  # not refused: finished, failed or aborted
                self._metrics.e2e_request_latency_s.observe(time.perf_counter() - arrived_s)
            if not finished:
                # Cancelled mid-stream (client went away): free the request's KV blocks now.
                await self._engine.abort(request.request_id)
            await outputs.aclose()

    async def generate_whole(self, request: GenerateRequest) -> GenerateChunk | GenerateFailure:
        """A request not streamed, as one call: the whole completion or its failure. Cancelled
        (the client went away), `generate`'s cleanup aborts the engine request."""
        last = None
        async for item in self.generate(request):  # noqa: B007 (not streamed: one item)
            last = item
        return last

    async def check_health(self) -> None:
        """Serve's health probe: probes every worker; a dead engine is rebuilt once, and if that
        fails too the exception tells Serve to replace the replica. The rebuild (loading and
        warming a model) runs off the event loop: meanwhile requests get a 503 that says so, and
        a second probe waits for this one's rebuild instead of starting another."""
        self._ensure_stats_loop()
        async with self._health_lock:
            try:
                await self._engine.check_health()
            except EngineDeadError:
                logger.warning("engine dead; restarting it")
                started = time.perf_counter()
                await asyncio.to_thread(self._engine.restart)
                logger.info("engine restarted in %.1f s", time.perf_counter() - started)
                await self._engine.check_health()

    async def probe(self) -> dict:
        """What `GET /health` reports: the worker probe, then the engine's stats."""
        await self._engine.check_health()
        return self.engine_stats()

    async def __del__(self):
        # A replica whose engine failed to start has neither (Serve still calls this).
        if getattr(self, "_stats_task", None) is not None:
            self._stats_task.cancel()
        if hasattr(self, "_engine"):
            await _maybe_await(self._engine.shutdown())

    def metrics_report(self):
        """This replica's metrics now (`deploy.metrics.MetricsReport`)."""
        self._metrics.update(self.engine_stats())
        return self._metrics.report(self._replica_id)

    def _ensure_stats_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._first_report is None:
            self._first_report = loop.create_future()
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = loop.create_task(self._stats_loop())

    async def _stats_loop(self) -> None:
        """Push this replica's metrics to the app's hub, cumulative, every REPORT_PERIOD_S."""
        failing = False
        while True:
            try:
                report = self.metrics_report()
                if self._metrics_hub is not None:
                    await self._metrics_hub.report.remote(report)
                failing = False
            except DeploymentUnavailableError:  # the app is being deleted: the hub went first
                logger.debug("metrics hub unavailable", exc_info=True)
            except Exception:  # metrics must never take the replica down
                if not failing:  # once per outage, not once a second
                    logger.warning("metrics report failed", exc_info=True)
                failing = True
            if not self._first_report.done():
                self._first_report.set_result(None)
            await asyncio.sleep(REPORT_PERIOD_S)
