"""One deployment for the whole HTTP path: the OpenAI ingress and the engine in one replica
(`AppArgs.colocate`, what `mtpserve serve` deploys), so a request crosses no Ray hop on the Ray
that `mtpserve serve` starts (the replica serves HTTP itself) and one through Serve's proxy
elsewhere, instead of two, and the engine's outputs reach the SSE writer through an asyncio
queue, not as Ray objects from another replica. The engine's step loop runs in a process of its
own (`AppArgs.engine_process`), so HTTP and the engine do not share a GIL.

The ingress code is the same as in the two-deployment app: it talks to an `InProcessHandle`,
which offers the part of a `DeploymentHandle` the ingress uses (`options(stream=True)`,
`.method.remote(...)` awaited or iterated, `cancel()`), backed by a `ModelServer` in this
process. What the two-deployment shape keeps: the ingress scales apart from the engine, and a
Serve config's several model-server replicas get prefix-aware routing.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

from deploy.ingress import OpenAIIngress
from deploy.limits import IngressLimits
from deploy.model_server import ModelServer


class InProcessStream:
    """A `DeploymentResponseGenerator` stand-in over an async generator of this process."""

    def __init__(self, items: AsyncIterator):
        self._items = items

    def __aiter__(self) -> InProcessStream:
        return self

    async def __anext__(self):
        return await self._items.__anext__()

    def cancel(self) -> None:
        """Close the generator (its `finally` aborts the engine request). A generator still
        running in a task being cancelled closes through that cancellation instead."""
        try:
            closing = self._items.aclose()
        except RuntimeError:
            return
        task = asyncio.ensure_future(closing)
        task.add_done_callback(_ignore_result)


def _ignore_result(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # a generator already running: its own task finishes it


class _InProcessMethod:
    def __init__(self, method, stream: bool):
        self._method, self._stream = method, stream

    def remote(self, *args, **kwargs):
        result = self._method(*args, **kwargs)
        if self._stream:
            return InProcessStream(result)
        if inspect.isawaitable(result):
            return asyncio.ensure_future(result)
        future = asyncio.get_running_loop().create_future()
        future.set_result(result)
        return future


class InProcessHandle:
    """What the ingress uses of a `DeploymentHandle`, calling an object in this process."""

    def __init__(self, target, stream: bool = False):
        self._target, self._stream = target, stream

    def options(self, *, stream: bool = False) -> InProcessHandle:
        return InProcessHandle(self._target, stream)

    def __getattr__(self, name: str) -> _InProcessMethod:
        return _InProcessMethod(getattr(self._target, name), self._stream)


class OpenAIServer(OpenAIIngress):
    """Serve deployment class for `AppArgs.colocate`: the ingress plus its own engine."""

    async def __init__(
        self,
        engine_config: dict,
        stream_chunks_per_s: float | None = None,
        limits: IngressLimits | None = None,
        api_key: str | None = None,
        metrics_hub=None,
        engine_process: bool = True,
    ):
        # Seconds of loading and warm-up: off the event loop, which Serve already runs.
        self._server = await asyncio.to_thread(
            ModelServer, engine_config, stream_chunks_per_s, metrics_hub, engine_process
        )
        # `/metrics` asks the hub, like the two-deployment app: a scrape reaches one replica,
        # and must see all of them.
        await super().__init__(InProcessHandle(self._server), limits, api_key, metrics_hub)

    async def check_health(self) -> None:
        await self._server.check_health()

    async def __del__(self):
        server = getattr(self, "_server", None)  # None: its engine failed to start
        if server is not None:
            await server.__del__()
