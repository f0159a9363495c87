"""The model-server deployment: one replica owns one `AsyncEngine` (coordinator plus workers).

Replica lifecycle = engine lifecycle: the engine's workers are created inside the replica's
placement group (bundle 0 for the replica and coordinator, one bundle per worker rank), so Serve
starting, replacing or stopping a replica starts, replaces or stops its whole engine.

Request lifecycle (`generate`):
  1. the ingress calls `generate` through a streaming `DeploymentHandle`;
  2. each `RequestOutput` from the engine is yielded as it comes;
  3. an engine error is yielded as one `GenerateFailure` and the stream ends;
  4. if the stream is torn down early (the client disconnected, so Serve cancelled the call),
     `finally` aborts the engine request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import time
from collections.abc import AsyncIterator

from cluster.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
)
from cluster.config import EngineConfig
from cluster.outputs import RequestOutput
from cluster.sampling_params import InvalidRequestError
from deploy.messages import GenerateFailure, GenerateRequest, ModelInfo
from deploy.metrics import EngineMetrics

logger = logging.getLogger("ray.serve")

# How often the replica copies engine gauges (queue depth, running, KV usage) to Prometheus.
STATS_PERIOD_S = 1.0


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
    """The engine's `EngineStats` as a dict, with `kv_usage` (0..1) derived when absent."""
    out = dataclasses.asdict(stats)
    if "kv_usage" not in out:
        total = out.get("num_total_blocks") or 0
        out["kv_usage"] = (1.0 - out["num_free_blocks"] / total) if total else 0.0
    return out


async def _maybe_await(value):
    if inspect.isawaitable(value):
        return await value
    return value


class ModelServer:
    """Serve deployment class; `deploy.app.build_app` wraps it with `serve.deployment`."""

    def __init__(self, engine_config: dict):
        if engine_config.get("model") is None:
            from workers.default_model import default_model_path

            engine_config = {**engine_config, "model": default_model_path()}
        self._config = EngineConfig.from_dict(engine_config)
        started = time.perf_counter()
        self._engine = AsyncEngine(self._config)
        logger.info(
            "engine for %s ready in %.1f s (%s)",
            self._engine.model_name,
            time.perf_counter() - started,
            self._config,
        )
        self._metrics = EngineMetrics(self._engine.model_name)
        self._stats_task: asyncio.Task | None = None

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model_name=self._engine.model_name,
            max_model_len=self._engine.max_model_len,
            model_dir=self._config.model,
        )

    def engine_stats(self) -> dict:
        return engine_stats_dict(self._engine.stats())

    async def generate(
        self, request: GenerateRequest
    ) -> AsyncIterator[RequestOutput | GenerateFailure]:
        self._ensure_stats_loop()
        outputs = self._engine.generate(
            request.prompt_token_ids, request.params, request.request_id
        )
        arrived_s = time.perf_counter()
        first_token_s: float | None = None
        finished = False
        counted_prompt = False
        try:
            async for out in outputs:
                if not counted_prompt:  # the engine accepted it (a refusal raises instead)
                    counted_prompt = True
                    self._metrics.num_prompt_tokens.inc(len(request.prompt_token_ids))
                if out.finished and out.finish_reason == "error":
                    finished = True
                    yield failure_from_exception(
                        (EngineDeadError if self._engine.is_dead else RequestFailedError)(
                            out.error or "engine failure"
                        )
                    )
                    return
                if out.new_token_ids:
                    self._metrics.num_generation_tokens.inc(len(out.new_token_ids))
                    if first_token_s is None:
                        first_token_s = time.perf_counter()
                        self._metrics.time_to_first_token_s.observe(first_token_s - arrived_s)
                if out.finished:
                    finished = True
                    self._record_finished(out, first_token_s)
                yield out
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
            if not finished:
                # Cancelled mid-stream (client went away): free the request's KV blocks now.
                await self._engine.abort(request.request_id)
            await outputs.aclose()

    async def check_health(self) -> None:
        """Serve's health probe: probes every worker; a dead engine is rebuilt once, and if that
        fails too the exception tells Serve to replace the replica."""
        self._ensure_stats_loop()
        try:
            await self._engine.check_health()
        except EngineDeadError:
            logger.warning("engine dead; restarting it")
            await _maybe_await(self._engine.restart())
            await self._engine.check_health()

    async def probe(self) -> dict:
        """What `GET /health` reports: the worker probe, then the engine's stats."""
        await self._engine.check_health()
        return self.engine_stats()

    async def __del__(self):
        if self._stats_task is not None:
            self._stats_task.cancel()
        await _maybe_await(self._engine.shutdown())

    def _record_finished(self, out: RequestOutput, first_token_s: float | None) -> None:
        self._metrics.num_finished.inc(tags={"finish_reason": out.finish_reason or "unknown"})
        num_tokens = len(out.token_ids)
        if first_token_s is not None and num_tokens > 1:
            tpot_s = (time.perf_counter() - first_token_s) / (num_tokens - 1)
            self._metrics.time_per_output_token_s.observe(tpot_s)
        if out.spec is not None and out.spec.mean_tokens_per_round:
            self._metrics.mtp_accepted_length.observe(out.spec.mean_tokens_per_round)

    def _ensure_stats_loop(self) -> None:
        if self._stats_task is None or self._stats_task.done():
            self._stats_task = asyncio.get_running_loop().create_task(self._stats_loop())

    async def _stats_loop(self) -> None:
        while True:
            try:
                self._metrics.record_engine_stats(self.engine_stats())
            except Exception:  # metrics must never take the replica down
                logger.exception("engine stats failed")
            await asyncio.sleep(STATS_PERIOD_S)
