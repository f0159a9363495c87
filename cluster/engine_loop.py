"""One turn of the engine's step loop: admit and abort what callers posted, then step.

`EngineLoop` is the loop's body, whichever side runs it: a thread of the caller's process
(`cluster.async_engine.AsyncEngine`), or the main loop of the engine's own process
(`cluster.engine_process`). The commands it takes and the refusals it returns are plain data, so
they cross a process boundary as they are.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass

from cluster.engine import LLMEngine
from cluster.outputs import RequestOutput
from cluster.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The workers failed; the engine must be restarted."""


class RequestFailedError(RuntimeError):
    """This request failed inside a step; the engine and every other request go on."""


class EngineOverloadedError(RuntimeError):
    """More requests are queued than max_queued_requests."""


@dataclass(frozen=True)
class Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Refusal:
    """The loop refused a request at admission; its caller's stream raises `error`."""

    request_id: str
    error: Exception


def portable(error: Exception) -> Exception:
    """`error` if it survives pickling (our own errors do), else a RuntimeError saying it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - whatever an exception's own pickling raises
        return RuntimeError(f"{type(error).__name__}: {error}")


class EngineLoop:
    """Owns `engine` between turns. `dead` is set once a step fails (a rank died or hung past
    the step timeout): every request in flight then ended with finish_reason "error", and new
    ones are refused with EngineDeadError until the engine is rebuilt."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.dead: str | None = None

    @property
    def busy(self) -> bool:
        """Whether a step has work (else the loop may wait for a command)."""
        return self.engine.has_unfinished and self.dead is None

    def turn(self, commands: list[Add | Abort]) -> tuple[list[RequestOutput | Refusal], list[str]]:
        """Apply `commands` in order, then step if there is work: -> (the outputs and
        refusals, the ids of the requests aborted here, whose blocks are free now)."""
        outputs: list[RequestOutput | Refusal] = []
        aborted: list[str] = []
        for command in commands:
            if isinstance(command, Abort):
                out = self.engine.abort(command.request_id)
                if out is not None:
                    outputs.append(out)
                aborted.append(command.request_id)
            else:
                refusal = self._admit(command)
                if refusal is not None:
                    outputs.append(refusal)
        if self.busy:
            try:
                outputs += self.engine.step()
            except Exception as e:  # a failed rank: fail every request, stay up
                logger.exception("engine step failed")
                self.dead = f"{type(e).__name__}: {e}"
                outputs += self.engine.fail_all(f"engine failure: {self.dead}")
        return outputs, aborted

    def _admit(self, command: Add) -> Refusal | None:
        try:
            if self.dead is not None:
                raise EngineDeadError(self.dead)
            num_waiting = self.engine.scheduler.num_waiting
            if num_waiting >= self.engine.config.max_queued_requests:
                raise EngineOverloadedError(
                    f"{num_waiting} requests queued (max_queued_requests="
                    f"{self.engine.config.max_queued_requests})"
                )
            self.engine.add_request(command.prompt_token_ids, command.params, command.request_id)
        except Exception as e:  # InvalidRequestError and the two above reach the caller
            return Refusal(command.request_id, e)
        return None
