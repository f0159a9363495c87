"""One turn of the engine's step loop: admit and abort what callers posted, step, and say which
requests' outputs are due to their callers.

`EngineLoop` is the loop's body, whichever side runs it: a thread of the caller's process
(`cluster.async_engine.AsyncEngine`), or the main loop of the engine's own process
(`cluster.engine_process`). The commands it takes and what it returns are plain data, so they
cross a process boundary as they are.

Pacing (`Pacer`): the loop decides when a request's outputs cross to its caller, so a step costs
the caller work only for the requests that are due. A streamed request gets its first output that
carries text at once (a token that renders as nothing yet, such as part of a character's bytes, or
text held back as the possible start of a stop string, joins the next), then at most one output
(every step since the last one, joined) per stream interval: `stream_chunks_per_s` spread over the
streams in flight (0: one per step); a request that is not streamed gets one output, when it
finishes. The intervals of all streams end on one grid of ticks, so the streams due at a tick cross
in one message, not one message each. When each step's tokens were produced goes with each output
(`time.perf_counter()` stamps: one clock for every process of a host), for latency metrics. Pacing
where the engine runs means that the engine's own process sends a message only when some request is
due, not every step; and since the loop asks before each output is built (`Pacer.wants_output`), a
step builds outputs only for the requests that are due: a request held back gains tokens in the
engine's state alone, and its next output carries all of them.
"""

from __future__ import annotations

import logging
import math
import pickle
import time
from dataclasses import dataclass, field

from cluster.engine import LLMEngine
from cluster.outputs import Delta, JoinedDeltas, JoinedOutputs, RequestOutput
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
    stream: bool = True


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


def next_send_s(now_s: float, interval_s: float) -> float:
    """When a stream that sent at `now_s` is due again: the first tick of the `interval_s` grid
    at least half an interval on (0: at once). Every stream's sends land on the same ticks, so
    a step that passes a tick carries all of them in one message."""
    if interval_s <= 0.0:
        return now_s
    tick = (math.floor(now_s / interval_s) + 1.0) * interval_s
    return tick if tick - now_s >= 0.5 * interval_s else tick + interval_s


def stream_interval_s(num_streams: int, chunks_per_s: float) -> float:
    """The least time between two outputs of one stream when `num_streams` stream at once and
    the engine sends at most `chunks_per_s` stream outputs in all (0: no pacing, one per step)."""
    return num_streams / chunks_per_s if chunks_per_s > 0 else 0.0


# What a turn hands the callers: (request id, the output joined since the last one, the
# (num tokens, perf_counter stamp) of each step it joins). The output is a RequestOutput, or a
# `make_request_delta` tuple from an engine that builds deltas (`LLMEngine.deltas_only`).
Delivery = tuple


@dataclass
class _Paced:
    stream: bool
    pending: JoinedOutputs | JoinedDeltas  # JoinedDeltas: from an engine that builds deltas
    stamps: list[tuple[int, float]] = field(default_factory=list)
    next_send_s: float = 0.0
    text_sent: bool = False  # a stream's first text went: from then on it is paced
    pending_text: bool = False  # `pending` carries text
    num_tokens_seen: int = 0  # the request's output tokens that reached `pace` so far
    num_tokens_stamped: int = 0  # ... and the ones in `stamps` (or sent with earlier stamps)


class Pacer:
    """Which outputs are due to their callers (the module docstring says the rule)."""

    def __init__(self, chunks_per_s: float, deltas: bool = False):
        self.chunks_per_s = chunks_per_s
        self._deltas = deltas
        self._requests: dict[str, _Paced] = {}
        self._num_streams = 0

    def add(self, request_id: str, stream: bool) -> None:
        self._requests[request_id] = _Paced(
            stream, JoinedDeltas() if self._deltas else JoinedOutputs()
        )
        self._num_streams += stream

    def _drop(self, request_id: str) -> None:
        paced = self._requests.pop(request_id, None)
        if paced is not None:
            self._num_streams -= paced.stream

    def wants_output(self, request) -> bool:
        """Whether the engine should build `request`'s output at this step (called for each
        request the step changed, `cluster.request.Request`): finished, a stream whose first
        text has not gone yet, or a stream whose interval is over. A request held back keeps
        its tokens in the engine's state (its sent-markers stay), so its next output carries
        them all, as `pace` would have joined them; this step's tokens are stamped here."""
        paced = self._requests.get(request.request_id)
        if paced is None:
            return True  # not paced here: `pace` drops it
        now_s = time.perf_counter()
        num_tokens = len(request.output_token_ids)
        if num_tokens > paced.num_tokens_stamped:
            paced.stamps.append((num_tokens - paced.num_tokens_stamped, now_s))
            paced.num_tokens_stamped = num_tokens
        if request.status.is_finished or (paced.stream and not paced.text_sent):
            return True
        return paced.stream and now_s >= paced.next_send_s

    def pace(self, outputs: list) -> list[Delivery | Refusal]:
        """`outputs` (RequestOutputs or deltas, and refusals) of one turn -> what is due."""
        now_s = time.perf_counter()
        interval_s = stream_interval_s(self._num_streams, self.chunks_per_s)
        due: list[Delivery | Refusal] = []
        for out in outputs:
            if isinstance(out, Refusal):
                self._drop(out.request_id)
                due.append(out)
                continue
            if self._deltas:
                request_id = out[Delta.REQUEST_ID]
                new_token_ids, new_text = out[Delta.NEW_TOKEN_IDS], out[Delta.NEW_TEXT]
                finished = out[Delta.FINISHED]
            else:
                request_id, new_token_ids, new_text, finished = (
                    out.request_id,
                    out.new_token_ids,
                    out.new_text,
                    out.finished,
                )
            paced = self._requests.get(request_id)
            if paced is None:
                continue
            paced.pending.add(out)
            paced.pending_text = paced.pending_text or bool(new_text)
            paced.num_tokens_seen += len(new_token_ids)
            if paced.num_tokens_seen > paced.num_tokens_stamped:  # not seen by wants_output
                paced.stamps.append((paced.num_tokens_seen - paced.num_tokens_stamped, now_s))
                paced.num_tokens_stamped = paced.num_tokens_seen
            if paced.stream and not paced.text_sent:
                send = paced.pending_text  # the first text goes at once
            else:
                send = paced.stream and now_s >= paced.next_send_s
            if not (finished or send):
                continue  # joins a later output
            due.append((request_id, paced.pending.take(), paced.stamps))
            paced.stamps = []
            paced.text_sent = paced.text_sent or paced.pending_text
            paced.pending_text = False
            paced.next_send_s = next_send_s(now_s, interval_s)
            if finished:
                self._drop(request_id)
        return due


class EngineLoop:
    """Owns `engine` between turns. `dead` is set once a step fails (a rank died or hung past
    the step timeout): every request in flight then ended with finish_reason "error", and new
    ones are refused with EngineDeadError until the engine is rebuilt."""

    def __init__(self, engine: LLMEngine, stream_chunks_per_s: float = 0.0):
        self.engine = engine
        self.dead: str | None = None
        self.pacer = Pacer(stream_chunks_per_s, deltas=engine.deltas_only)

    @property
    def busy(self) -> bool:
        """Whether a step has work (else the loop may wait for a command)."""
        return self.engine.has_unfinished and self.dead is None

    def turn(self, commands: list[Add | Abort]) -> tuple[list[Delivery | Refusal], list[str]]:
        """Apply `commands` in order, then step if there is work: -> (what is due to the
        callers, paced: deliveries and refusals; the ids of the requests aborted here, whose
        blocks are free now)."""
        outputs: list[RequestOutput | tuple | Refusal] = []
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
                outputs += self.engine.step(self.pacer.wants_output)
            except Exception as e:  # a failed rank: fail every request, stay up
                logger.exception("engine step failed")
                self.dead = f"{type(e).__name__}: {e}"
                outputs += self.engine.fail_all(f"engine failure: {self.dead}")
        return self.pacer.pace(outputs), aborted

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
            self.pacer.add(command.request_id, command.stream)
        except Exception as e:  # InvalidRequestError and the two above reach the caller
            return Refusal(command.request_id, e)
        return None
