"""Tokens/s and latency of the offline engine and of the real Serve HTTP path, in one run.

    python benchmarks/bench_serve.py [--model DIR | --default-model] [--tp 1] [--num-draft-tokens 0]
        [--overlap-steps auto|on|off]
        [--concurrency 1,8,32,128] [--max-tokens 128] [--prompt-len 32] [--rounds 2]
        [--paths offline,stream,full] [--client auto|httpx|aiohttp] [--device auto] [--no-colocate]
        [--repeat 1] [--[no-]interleave] [--bracket] [--executor MODULE:CLASS] [--pin-engines]
        [--dtype auto|bfloat16|float32] [--json PATH]

Same checkpoint, device and engine settings for every path (the tiny random checkpoint unless
told otherwise). Each concurrency level is `concurrency` closed-loop clients sending greedy
completions of exactly `--max-tokens` tokens (ignore_eos) on token-id prompts, `max(rounds x
concurrency, --min-requests)` requests in all:

  offline  `LLMEngine.step()` driven in a child process with no Ray in it (TP = 1; TP > 1 in
           this one), a new request added the moment one finishes
           (what `LLM.generate` runs, with the clients' closed loop and no transport at all),
           building a request's output at its first token and at its end only, as the served
           step loop builds only the outputs it sends (so no inter-token latency offline);
  stream   `POST /v1/completions` with `stream: true` through Serve's HTTP proxy, the ingress and
           the model server (what `mtpserve serve` deploys), over real HTTP on loopback;
  full     the same, not streamed.

Both engines stay up and each level runs offline, streamed and full back to back
(`--interleave`), so a machine's drifting speed moves the paths together: on the H200 machine the
offline engine alone measured 20.5k and 38k tok/s at 32 concurrent in two runs of one tree, a
minute apart. With `--tp` above 1 (the two engines would need twice the GPUs), or
`--no-interleave`, the offline engine runs first and is shut down before the Serve app starts
(one engine on the device at a time; a model too large for two copies needs this). `--repeat`
passes over the levels again; ratios pair each row with the offline row of its pass.
`--bracket` (interleaved only) runs each level's offline engine again after its HTTP paths (the
`offline-after` row, whose "x offline" is after / before: the drift within the level), and the
served rows' ratios are then to the mean of the two, which cancels a drift that is steady over
the level (the H100 hosts of session 41 moved a step's time up to 1.6x between passes). Each path
gets one untimed burst first (warm-up). Columns: output tokens/s over the level's wall time, its
ratio to offline at the same concurrency, time to first token (stream: first text chunk;
offline: first step output with a token) and inter-token latency (served: gap between a request's
consecutive outputs that carried text; an MTP round's tokens, and a paced stream's steps, arrive
together) at p50/p99, and request latency p50. A second table says where the CPU went: each
process's CPU milliseconds per request during the level (Linux), the replica, the engine process,
Serve's proxy and controller, Ray's core, the clients, this bench, the offline engine's.
A third table sets the clients' mean TTFT and latency per request beside the replica's own
(from its /metrics histograms over the level: from the handler's call into the engine to the
first token and to the end), so what HTTP, Serve and the handler add shows apart from the
engine. A fourth counts the engine's steps over each level (`EngineStats.num_steps`), those that
carried a prompt, output tokens per step, a step's mean time and the share of the level the
engine spent inside steps (`EngineStats.step_time_s`): a request's time outside the engine
(HTTP, Serve, the handler, between one request's end and its client's next) shows as steps run
with fewer requests than the offline engine's, or as time the engine had no step to run; work
that slows the engine's own process shows as longer steps. The last line says whether every
prompt's text was the same on every path (greedy).
The clients run in processes of their own (`--no-client-process`: in this one) with `aiohttp`
(Ray's own dependency), else `httpx`: `--client-processes` of them (default: half the machine's
cores, at most 8; one on a 2-core box), each with its share of a level's clients and requests, so
that the clients' own event loops do not hold the server back (a client process spends ~0.5-1 ms
of CPU per request; when requests of one length end together, 128 of them in one process wait
~70 ms for it).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.load_test import (
    TEMPERATURE_ENV,
    _free_port,
    bench_temperature,
    completion_body,
    make_prompts,
    model_vocab_size,
    percentile,
)


@dataclass
class LevelResult:
    """One path at one concurrency level."""

    path: str  # "offline" | "offline-after" (--bracket) | "stream" | "full"
    concurrency: int
    repeat: int = 0  # which pass over the levels (--repeat)
    num_requests: int = 0
    num_errors: int = 0
    num_output_tokens: int = 0
    wall_s: float = 0.0
    started_s: float = 0.0  # time.perf_counter() at the level's start (one clock for a host)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    texts: dict[int, str] = field(default_factory=dict)  # prompt index -> a completion's text
    mismatched_prompts: set[int] = field(default_factory=set)  # prompts with differing texts
    first_errors: list[str] = field(default_factory=list)
    slowest_step_s: float | None = None  # offline: the longest `engine.step()` call
    slowest_step_outputs: int = 0  # and how many requests it returned outputs for
    cpu_s: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds in the level
    # HTTP: the replica's own means over the level (its /metrics histograms): time from the
    # handler's call into the engine to the first token, and to the request's end
    replica_ttft_mean_s: float | None = None
    replica_e2e_mean_s: float | None = None
    # The engine's steps over the level, those that carried a prompt, and the wall time inside
    # them (None: not read)
    num_steps: int | None = None
    num_prefill_steps: int | None = None
    step_time_s: float | None = None
    prefill_step_time_s: float | None = None  # of it, in the steps that carried a prompt

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s else 0.0

    def record_text(self, prompt_index: int, text: str) -> None:
        previous = self.texts.setdefault(prompt_index, text)
        if previous != text:
            self.mismatched_prompts.add(prompt_index)

    def record_error(self, message: str) -> None:
        self.num_errors += 1
        if len(self.first_errors) < 3:
            self.first_errors.append(message)

    def summary(self) -> dict:
        def q(values: list[float], p: float) -> float | None:
            return percentile(values, p) if values else None

        return {
            "path": self.path,
            "concurrency": self.concurrency,
            "repeat": self.repeat,
            "num_requests": self.num_requests,
            "num_errors": self.num_errors,
            "num_output_tokens": self.num_output_tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "ttft_p50_s": q(self.ttft_s, 50),
            "ttft_p99_s": q(self.ttft_s, 99),
            "itl_p50_s": q(self.itl_s, 50),
            "itl_p99_s": q(self.itl_s, 99),
            "latency_p50_s": q(self.latency_s, 50),
            "ttft_mean_s": sum(self.ttft_s) / len(self.ttft_s) if self.ttft_s else None,
            "latency_mean_s": sum(self.latency_s) / len(self.latency_s) if self.latency_s else None,
            "replica_ttft_mean_s": self.replica_ttft_mean_s,
            "replica_e2e_mean_s": self.replica_e2e_mean_s,
            "num_steps": self.num_steps,
            "num_prefill_steps": self.num_prefill_steps,
            "step_time_s": self.step_time_s,
            "prefill_step_time_s": self.prefill_step_time_s,
            "first_errors": self.first_errors,
            "slowest_step_s": self.slowest_step_s,
            "slowest_step_outputs": self.slowest_step_outputs,
            "cpu_ms_per_request": {
                name: 1e3 * cpu / self.num_requests for name, cpu in self.cpu_s.items()
            }
            if self.num_requests
            else {},
        }


def num_requests_for(concurrency: int, rounds: int, min_requests: int) -> int:
    return max(rounds * concurrency, min_requests)


# --- where the CPU goes ----------------------------------------------------------------------

# Processes by what their command line says (Ray names its workers `ray::<actor>`).
_PROCESS_LABELS = (
    ("ServeReplica", "replica"),
    ("cluster.engine_process", "engine process"),
    ("ProxyActor", "Serve proxy"),
    ("ServeController", "Serve controller"),
    ("ray::", "other Ray workers"),
    ("raylet", "Ray core"),
    ("gcs_server", "Ray core"),
)


def _process_label(cmdline: str) -> str | None:
    for needle, name in _PROCESS_LABELS:
        if needle in cmdline:
            if name == "replica":  # ray::ServeReplica:<app>:<deployment>
                return f"replica {cmdline.split()[0].rsplit(':', 1)[-1].split('.')[0]}"
            return name
    return None


def _cmdlines() -> dict[int, str]:
    """This machine's processes' command lines (Linux /proc; empty elsewhere)."""
    found = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found[pid] = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
    return found


def _core_siblings(cpu: int) -> set[int]:
    """`cpu` and the hardware threads that share its core."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            text = f.read().strip()
    except OSError:
        return {cpu}
    siblings = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        siblings.update(range(int(low), int(high or low) + 1))
    return siblings


def _pin(pid: int, cpus: set[int], main_thread_only: bool = False) -> None:
    """Every thread of `pid` (or its main thread only) onto `cpus`."""
    try:
        tids = [pid] if main_thread_only else [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # gone meanwhile
            pass


def engine_cpus_for(cpus: set[int], siblings_of, num_engines: int):
    """-> (one CPU per engine, each on a core none of the others' CPUs share; the CPUs left for
    everything else), or None when fewer than two would be left. `siblings_of(cpu)`: the CPUs
    of `cpu`'s core."""
    engine_cpus, reserved = [], set()
    for _ in range(num_engines):
        free = sorted(cpus - reserved)
        if not free:
            return None
        engine_cpus.append(free[-1])
        reserved |= siblings_of(free[-1])
    rest = cpus - reserved
    return (engine_cpus, rest) if len(rest) >= 2 else None


def pin_engines(client_pids: list[int], offline_pid: int | None) -> str:
    """`--pin-engines`: the served engine's process, and the offline engine's (`offline_pid`:
    its process, or this process's main thread when it runs here) when it runs beside it, each
    on a core of its own (with its hardware-thread siblings left idle); every other serving
    process, the clients and this process's other threads on the remaining CPUs. An experiment:
    whether the engines' host-bound steps move with where the scheduler puts them next to the
    HTTP side's processes. -> what was done."""
    if not hasattr(os, "sched_setaffinity"):
        return "--pin-engines: no CPU affinity on this platform; nothing pinned"
    cpus = set(os.sched_getaffinity(0))
    chosen = engine_cpus_for(cpus, _core_siblings, 1 if offline_pid is None else 2)
    if chosen is None:
        return f"--pin-engines: {len(cpus)} CPUs are too few; nothing pinned"
    engine_cpus, rest = chosen
    others = set(client_pids)
    engines = []
    for pid, cmdline in _cmdlines().items():
        label = _process_label(cmdline)
        if label == "engine process":
            engines.append(pid)
        elif label is not None and pid not in (os.getpid(), offline_pid):
            others.add(pid)
    if len(engines) != 1:
        return f"--pin-engines: {len(engines)} engine processes found; nothing pinned"
    for pid in others:
        _pin(pid, rest)
    _pin(engines[0], {engine_cpus[0]})
    _pin(os.getpid(), rest)
    pinned = f"served engine process {engines[0]} on CPU {engine_cpus[0]}"
    if offline_pid == os.getpid():
        _pin(os.getpid(), {engine_cpus[1]}, main_thread_only=True)
        pinned += f", offline engine (this process's main thread) on CPU {engine_cpus[1]}"
    elif offline_pid is not None:
        _pin(offline_pid, {engine_cpus[1]})
        pinned += f", offline engine process {offline_pid} on CPU {engine_cpus[1]}"
    return (
        f"pinned: {pinned}; {len(others)} other serving and client processes and this "
        f"process's other threads on CPUs {sorted(rest)} (the engines' core siblings idle)"
    )


def process_cpu_s(named: dict[int, str] | None = None) -> dict[str, float]:
    """CPU seconds (user + system) so far of this machine's serving processes, summed per label:
    each Serve replica by its deployment, the engine process, Ray's own; `named` pids (this
    bench, its clients) under their own label. Linux /proc; empty elsewhere."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    totals: dict[str, float] = {}
    for pid, cmdline in _cmdlines().items():
        label = (named or {}).get(pid) or _process_label(cmdline)
        if label is None:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        cpu = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
        totals[label] = totals.get(label, 0.0) + cpu
    return totals


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0) > 0}


def cpu_table(rows: list[dict]) -> str:
    """CPU milliseconds per request in each process, per row (one column per process)."""
    names = sorted({n for r in rows for n in r["cpu_ms_per_request"]})
    if not names:
        return ""
    lines = [
        "| path | concurrency | pass | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for r in rows:
        cells = [f"{r['cpu_ms_per_request'].get(n, 0.0):.2f}" for n in names]
        lines.append(
            f"| {r['path']} | {r['concurrency']} | {r['repeat'] + 1} | " + " | ".join(cells) + " |"
        )
    return "CPU ms per request, by process:\n" + "\n".join(lines)


# --- offline ---------------------------------------------------------------------------------


def run_offline(engine, prompts, concurrency: int, num_requests: int, max_tokens: int):
    """`concurrency` requests in flight on an `LLMEngine`, refilled as they finish."""
    from cluster.sampling_params import SamplingParams
    from workers.long_lived import frozen_for_the_call

    params = SamplingParams(max_tokens=max_tokens, temperature=bench_temperature(), ignore_eos=True)
    result = LevelResult("offline", concurrency)
    to_send = deque(range(num_requests))
    added_s: dict[str, float] = {}
    prompt_of: dict[str, int] = {}
    started = time.perf_counter()
    # As `LLM.generate` does: what was alive before the level out of the collector's full
    # scans while it runs (workers.long_lived.frozen_for_the_call).
    with frozen_for_the_call():
        while to_send or engine.has_unfinished:
            while to_send and len(added_s) < concurrency:
                index = to_send.popleft()
                request_id = f"offline-{concurrency}-{index}"
                prompt_of[request_id] = index % len(prompts)
                added_s[request_id] = time.perf_counter()
                engine.add_request(prompts[prompt_of[request_id]], params, request_id)
                result.num_requests += 1
            step_started = time.perf_counter()
            outputs = engine.step(_first_or_last)
            now = time.perf_counter()
            if result.slowest_step_s is None or now - step_started > result.slowest_step_s:
                result.slowest_step_s = now - step_started
                result.slowest_step_outputs = len(outputs)
            for out in outputs:
                rid = out.request_id
                # The request's first tokens: every token so far is new (`_first_or_last`).
                if out.new_token_ids and len(out.new_token_ids) == len(out.token_ids):
                    result.ttft_s.append(now - added_s[rid])
                if out.finished:
                    result.num_output_tokens += len(out.token_ids)
                    result.latency_s.append(now - added_s.pop(rid))
                    result.record_text(prompt_of.pop(rid), out.text)
    result.wall_s = time.perf_counter() - started
    return result


def _first_or_last(request) -> bool:
    """The offline level's outputs: a request's first (its time to first token) and its last,
    and none between, as `LLM.generate` and the served step loop build only what they send
    (`Pacer.wants_output`). So its inter-token latency is not measured."""
    return request.is_finished or request.num_sent_tokens == 0


# --- HTTP clients ----------------------------------------------------------------------------


class HttpxClient:
    def __init__(self, base_url: str, concurrency: int):
        import httpx

        limits = httpx.Limits(
            max_connections=concurrency + 4, max_keepalive_connections=concurrency
        )
        self._http = httpx.AsyncClient(
            base_url=base_url, timeout=httpx.Timeout(600, connect=30), limits=limits
        )

    async def get_json(self, path: str) -> dict:
        return (await self._http.get(path)).json()

    async def post_json(self, path: str, body: dict) -> tuple[int, dict]:
        response = await self._http.post(path, json=body)
        return response.status_code, response.json()

    async def post_lines(self, path: str, body: dict):
        async with self._http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]}")
            async for line in response.aiter_lines():
                yield line

    async def close(self) -> None:
        await self._http.aclose()


class AiohttpClient:
    def __init__(self, base_url: str, concurrency: int):
        import aiohttp

        self._base = base_url
        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=concurrency + 4),
            timeout=aiohttp.ClientTimeout(total=600, connect=30),
        )

    async def get_json(self, path: str) -> dict:
        async with self._http.get(self._base + path) as response:
            return await response.json()

    async def post_json(self, path: str, body: dict) -> tuple[int, dict]:
        async with self._http.post(self._base + path, json=body) as response:
            return response.status, await response.json()

    async def post_lines(self, path: str, body: dict):
        async with self._http.post(self._base + path, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:200]}")
            async for raw in response.content:
                yield raw.decode().rstrip("\r\n")

    async def close(self) -> None:
        await self._http.close()


def client_class(name: str):
    if name == "auto":  # aiohttp (Ray's own dependency): httpx's pool, not the server, held
        try:  # 128 streams back on the 2-core box (TTFT p99 6 s against 0.3 s with aiohttp)
            import aiohttp  # noqa: F401

            name = "aiohttp"
        except ImportError:
            name = "httpx"
    return {"httpx": HttpxClient, "aiohttp": AiohttpClient}[name]


# --- HTTP paths ------------------------------------------------------------------------------


async def one_streamed(http, model: str, prompt: list[int], max_tokens: int, result: LevelResult):
    """-> (ttft_s, [gap_s], latency_s, completion tokens, text) of one streamed completion."""
    body = completion_body(model, prompt, max_tokens, stream=True)
    sent = time.perf_counter()
    chunk_s: list[float] = []
    text: list[str] = []
    usage = None
    async for line in http.post_lines("/v1/completions", body):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        if "error" in chunk:
            raise RuntimeError(f"error event: {chunk['error']}")
        if chunk.get("choices") and chunk["choices"][0]["text"]:
            chunk_s.append(time.perf_counter())
            text.append(chunk["choices"][0]["text"])
        if chunk.get("usage"):
            usage = chunk["usage"]
    done = time.perf_counter()
    if not chunk_s or usage is None:
        raise RuntimeError("stream ended without text or without usage")
    gaps = [b - a for a, b in zip(chunk_s, chunk_s[1:])]
    return chunk_s[0] - sent, gaps, done - sent, usage["completion_tokens"], "".join(text)


async def one_full(http, model: str, prompt: list[int], max_tokens: int, result: LevelResult):
    body = completion_body(model, prompt, max_tokens, stream=False)
    sent = time.perf_counter()
    status, reply = await http.post_json("/v1/completions", body)
    done = time.perf_counter()
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {str(reply)[:200]}")
    text = reply["choices"][0]["text"]
    return None, [], done - sent, reply["usage"]["completion_tokens"], text


async def run_http(
    client_cls,
    url,
    model,
    prompts,
    path: str,
    concurrency: int,
    num_requests: int,
    max_tokens,
    warm_client: bool = False,
    first_index: int = 0,
) -> LevelResult:
    """`warm_client`: one GET /v1/models first, untimed, so that the client's own first use (its
    connection, its library's first request) is not counted against the server. Requests are
    numbered from `first_index` (request i sends prompt i mod len(prompts))."""
    one = one_streamed if path == "stream" else one_full
    result = LevelResult(path, concurrency)
    http = client_cls(url, concurrency)
    if warm_client:
        await http.get_json("/v1/models")
    next_index = iter(range(first_index, first_index + num_requests))

    async def client() -> None:
        for index in next_index:
            prompt_index = index % len(prompts)
            result.num_requests += 1
            try:
                ttft_s, gaps, latency_s, num_tokens, text = await one(
                    http, model, prompts[prompt_index], max_tokens, result
                )
            except Exception as exc:  # noqa: BLE001 - every failure is counted
                result.record_error(f"{type(exc).__name__}: {exc}")
                continue
            if num_tokens != max_tokens:
                result.record_error(f"{num_tokens} tokens, expected {max_tokens}")
                continue
            result.num_output_tokens += num_tokens
            if ttft_s is not None:
                result.ttft_s.append(ttft_s)
            result.itl_s.extend(gaps)
            result.latency_s.append(latency_s)
            result.record_text(prompt_index, text)

    started = result.started_s = time.perf_counter()
    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        result.wall_s = time.perf_counter() - started
        await http.close()
    return result


# --- the run ---------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f}"


OFFLINE_PATHS = ("offline", "offline-after")


def offline_bases(rows: list[dict]) -> dict[tuple[int, int], dict]:
    """(concurrency, pass) -> what the served rows of that level are compared with: the offline
    row, or with `--bracket` the mean of it and the `offline-after` row (tok/s, TTFT p50)."""
    before = {(r["concurrency"], r["repeat"]): r for r in rows if r["path"] == "offline"}
    after = {(r["concurrency"], r["repeat"]): r for r in rows if r["path"] == "offline-after"}
    bases = {}
    for key, first in before.items():
        pair = [first] + ([after[key]] if key in after else [])
        ttfts = [r["ttft_p50_s"] for r in pair if r["ttft_p50_s"] is not None]
        bases[key] = {
            "tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in pair),
            "ttft_p50_s": statistics.fmean(ttfts) if ttfts else None,
        }
    return bases


def table(rows: list[dict]) -> str:
    bases = offline_bases(rows)
    # What each row's "x offline" divides by: an offline row's own level's first offline row
    # (offline: 1.00; offline-after: after / before), a served row its level's base.
    first = {(r["concurrency"], r["repeat"]): r for r in rows if r["path"] == "offline"}
    header = (
        "| path | concurrency | pass | requests | tok/s | x offline | TTFT p50 / p99 (ms) "
        "| ITL p50 / p99 (ms) | latency p50 (ms) | errors |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        key = (r["concurrency"], r["repeat"])
        base = (first if r["path"] in OFFLINE_PATHS else bases).get(key)
        ratio = (
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}"
            if base and base["tokens_per_s"]
            else "-"
        )
        lines.append(
            f"| {r['path']} | {r['concurrency']} | {r['repeat'] + 1} | {r['num_requests']} "
            f"| {r['tokens_per_s']:.0f} "
            f"| {ratio} | {_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p99_s'])} "
            f"| {_ms(r['itl_p50_s'])} / {_ms(r['itl_p99_s'])} | {_ms(r['latency_p50_s'])} "
            f"| {r['num_errors']} |"
        )
    return "\n".join(lines)


def passes_table(rows: list[dict]) -> str:
    """Over the passes of a `--repeat` run: per path and level, the median of each pass's ratio
    to the offline engine measured next to it (interleaved, the same minute), and of the TTFT
    p50 over the offline engine's in that pass. One pass on a noisy host cannot rank a path
    against the engine; the median of passes measured back to back can."""
    offline = offline_bases(rows)
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        if r["path"] not in OFFLINE_PATHS and (r["concurrency"], r["repeat"]) in offline:
            groups.setdefault((r["path"], r["concurrency"]), []).append(r)
    if not groups or max(len(g) for g in groups.values()) < 2:
        return ""
    lines = [
        "| path | concurrency | passes | x offline: median (min-max) "
        "| TTFT p50 over offline's: median (ms) |",
        "|---|---|---|---|---|",
    ]
    for (path, c), group in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ratios, gaps = [], []
        for r in group:
            base = offline[(c, r["repeat"])]
            ratios.append(r["tokens_per_s"] / base["tokens_per_s"])
            if r["ttft_p50_s"] is not None and base["ttft_p50_s"] is not None:
                gaps.append(r["ttft_p50_s"] - base["ttft_p50_s"])
        gap = _ms(statistics.median(gaps)) if gaps else "-"
        lines.append(
            f"| {path} | {c} | {len(group)} | {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f}) | {gap} |"
        )
    return "\n".join(lines)


def where_time_goes_table(rows: list[dict]) -> str:
    """Means per request: what the clients measured against what the replica saw from its call
    into the engine (the difference is HTTP, Serve and the handler before the call, and the
    delivery back to the client after the token)."""
    lines = [
        "| path | concurrency | pass | TTFT mean, client / replica (ms) "
        "| latency mean, client / replica (ms) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["path"] in OFFLINE_PATHS or r.get("replica_e2e_mean_s") is None:
            continue
        lines.append(
            f"| {r['path']} | {r['concurrency']} | {r['repeat'] + 1} "
            f"| {_ms(r['ttft_mean_s'])} / {_ms(r['replica_ttft_mean_s'])} "
            f"| {_ms(r['latency_mean_s'])} / {_ms(r['replica_e2e_mean_s'])} |"
        )
    return "\n".join(lines)


def step_figures(
    num_steps: int, step_time_s: float | None, wall_s: float | None
) -> tuple[str, str]:
    """(a step's mean time in ms, the share of the wall time spent inside steps), "-" where the
    engine did not count its step time."""
    if step_time_s is None:
        return "-", "-"
    return f"{step_time_s / num_steps * 1e3:.2f}", f"{step_time_s / wall_s:.0%}" if wall_s else "-"


def steps_table(rows: list[dict]) -> str:
    """The engine's steps per level: how many, how many carried a prompt, tokens per step, a
    step's mean time (and apart: a step that carried a prompt, one that did not), and the share
    of the level's wall time spent inside steps."""
    lines = [
        "| path | concurrency | pass | steps | with a prompt | output tokens per step "
        "| mean step (ms) | with a prompt / without (ms) | engine busy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        steps, prefills = r.get("num_steps"), r.get("num_prefill_steps")
        if not steps:
            continue
        mean_step, busy = step_figures(steps, r.get("step_time_s"), r.get("wall_s"))
        lines.append(
            f"| {r['path']} | {r['concurrency']} | {r['repeat'] + 1} | {steps} "
            f"| {prefills} ({prefills / steps:.0%}) | {r['num_output_tokens'] / steps:.1f} "
            f"| {mean_step} | {_split_step_ms(r)} | {busy} |"
        )
    return "Engine steps:\n" + "\n".join(lines)


def _split_step_ms(r: dict) -> str:
    """A prompt-carrying step's mean ms / a decode-only step's, "-" where not counted."""
    total, prefill = r.get("step_time_s"), r.get("prefill_step_time_s")
    steps, prefills = r["num_steps"], r["num_prefill_steps"]
    if total is None or prefill is None:
        return "-"
    with_prompt = f"{prefill / prefills * 1e3:.2f}" if prefills else "-"
    without = f"{(total - prefill) / (steps - prefills) * 1e3:.2f}" if steps > prefills else "-"
    return f"{with_prompt} / {without}"


def step_counts(stats: dict | None) -> tuple[int, int, float | None, float | None] | None:
    """(num_steps, num_prefill_steps, step_time_s, prefill_step_time_s) of an engine's stats
    (`EngineStats` as a dict; a time None from a server that does not count it)."""
    if not stats or "num_steps" not in stats:
        return None

    def seconds(name: str) -> float | None:
        value = stats.get(name)
        return None if value is None else float(value)

    return (
        int(stats["num_steps"]),
        int(stats["num_prefill_steps"]),
        seconds("step_time_s"),
        seconds("prefill_step_time_s"),
    )


def steps_between(before, after, row: LevelResult) -> None:
    if before is not None and after is not None:
        row.num_steps = after[0] - before[0]
        row.num_prefill_steps = after[1] - before[1]
        if before[2] is not None and after[2] is not None:
            row.step_time_s = after[2] - before[2]
        if before[3] is not None and after[3] is not None:
            row.prefill_step_time_s = after[3] - before[3]


def first_requests_line(name: str, row: LevelResult) -> str:
    """One line for the ten first requests: their latencies' ratio and the engine's steps over
    them (the steps table's mean step and busy share), so a slow first ten shows whether the
    engine's steps or the time around them were slow."""
    ms = [s * 1e3 for s in row.latency_s]
    line = f"  {name} first request {ms[0]:.1f} ms, tenth {ms[-1]:.1f} ms (x{ms[0] / ms[-1]:.2f})"
    if row.num_steps:
        mean_step, busy = step_figures(row.num_steps, row.step_time_s, row.wall_s)
        line += f"; {row.num_steps} steps, mean step {mean_step} ms, engine busy {busy}"
    return line


def served_step_counts(url: str) -> tuple[int, int, float | None, float | None] | None:
    """`step_counts` of the replica's engine, from /health (one replica: what the bench
    deploys; the engine process sends its stats whenever a request ends)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/health", timeout=30) as reply:
            return step_counts(json.loads(reply.read()).get("engine"))
    except (OSError, ValueError):
        return None


def replica_histograms(url: str) -> dict[str, float]:
    """`histogram_totals` of the server's /metrics, read after the replicas' last reports are
    in (they report every REPORT_PERIOD_S); empty if unreadable."""
    import urllib.request

    from deploy.metrics import REPORT_PERIOD_S

    time.sleep(REPORT_PERIOD_S + 0.3)
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
            return histogram_totals(reply.read().decode())
    except OSError:
        return {}


def histogram_totals(text: str) -> dict[str, float]:
    """The latency histograms' sums and counts in a Prometheus exposition, summed over the
    replicas: {"ttft_sum": s, "ttft_count": n, "e2e_sum": s, "e2e_count": n}."""
    from prometheus_client.parser import text_string_to_metric_families

    from deploy.metrics import PREFIX

    names = {}
    for what, metric in (
        ("ttft", "time_to_first_token_seconds"),
        ("e2e", "e2e_request_latency_seconds"),
    ):
        for part in ("sum", "count"):
            names[f"{PREFIX}{metric}_{part}"] = f"{what}_{part}"
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                key = names[sample.name]
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def _mean_between(before: dict, after: dict, what: str) -> float | None:
    count = after.get(f"{what}_count", 0.0) - before.get(f"{what}_count", 0.0)
    if count <= 0:
        return None
    return (after[f"{what}_sum"] - before.get(f"{what}_sum", 0.0)) / count


def _commit() -> str:
    """GIT_COMMIT when set (a copied tree may carry a stale .git), else git's HEAD."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tiny checkpoint)")
    ap.add_argument("--default-model", action="store_true", help="the shipped default model")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--num-draft-tokens", type=int, default=0)
    ap.add_argument(
        "--overlap-steps",
        default=None,
        choices=["auto", "on", "off"],
        help="EngineConfig.overlap_steps for both engines (default: the engine's)",
    )
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument(
        "--dtype",
        default=None,
        choices=["auto", "bfloat16", "float32"],
        help="EngineConfig.dtype for both engines (default: the engine's; float32 on the GPU "
        "tells batch-dependent bf16 numerics from a defect where texts differ across paths)",
    )
    ap.add_argument("--concurrency", default="1,8,32,128", help="comma-separated levels")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="every request's temperature, offline and over HTTP (0: greedy; texts are then "
        "not compared)",
    )
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="requests per client at each level")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--paths", default="offline,stream,full")
    ap.add_argument("--client", default="auto", choices=["auto", "httpx", "aiohttp"])
    ap.add_argument(
        "--client-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the HTTP clients in processes of their own (default), not in the bench's",
    )
    ap.add_argument(
        "--client-processes",
        type=int,
        default=None,
        help="how many client processes share a level's clients (default: half the cores, "
        "at most 8)",
    )
    ap.add_argument("--url", default=None, help="a server already serving the model (no deploy)")
    ap.add_argument("--actor-num-cpus", type=float, default=0.25)
    ap.add_argument(
        "--executor",
        default=None,
        help="the engine's executor on every path, e.g. benchmarks.null_executor:NullExecutor "
        "(no model: what the serving path alone carries)",
    )
    ap.add_argument(
        "--colocate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one deployment, ingress and engine together (default, as `mtpserve serve`); "
        "--no-colocate: the ingress and the model server apart",
    )
    ap.add_argument(
        "--stream-chunks-per-s",
        type=float,
        default=None,
        help="the model server's streamed chunk budget (default: AppArgs')",
    )
    ap.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the engine's step loop in a process of its own, or on a thread of its replica "
        "(default: AppArgs')",
    )
    ap.add_argument(
        "--proxy",
        action="store_true",
        help="HTTP through Serve's proxy even where the ingress replica can serve it directly",
    )
    ap.add_argument(
        "--pin-engines",
        action="store_true",
        help="an experiment: once the server is up, the served engine's process and the "
        "offline engine each on a core of their own, every other serving process and the "
        "clients on the rest (Linux; needs 4 CPUs or more, and 2 more for each engine's "
        "hardware-thread siblings)",
    )
    ap.add_argument("--repeat", type=int, default=1, help="passes over the levels")
    ap.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the offline engine beside the server and measure each level on every path "
        "back to back (default: on, except with --tp above 1; off: one engine on the device at "
        "a time)",
    )
    ap.add_argument(
        "--bracket",
        action="store_true",
        help="interleaved: each level's offline engine again after its HTTP paths; served "
        "ratios to the mean of the two (a steady drift over the level cancels)",
    )
    ap.add_argument("--json", default=None, help="write the rows and the run's facts here")
    args = ap.parse_args(argv)
    os.environ[TEMPERATURE_ENV] = str(args.temperature)  # read by the clients, spawned or not

    from workers.default_model import default_model_path, tiny_model_path

    model = args.model or (default_model_path() if args.default_model else tiny_model_path())
    levels = [int(c) for c in args.concurrency.split(",")]
    paths = args.paths.split(",")
    prompts = make_prompts(model_vocab_size(model), 64, args.prompt_len)
    engine_options = {
        "model": model,
        "tp_size": args.tp,
        "num_draft_tokens": args.num_draft_tokens,
        "device": args.device,
        "max_num_seqs": max(levels),
        "max_queued_requests": max(256, 2 * max(levels)),
        "actor_num_cpus": args.actor_num_cpus,
        **({"executor": args.executor} if args.executor else {}),
        **({"overlap_steps": args.overlap_steps} if args.overlap_steps else {}),
        **({"dtype": args.dtype} if args.dtype else {}),
    }
    print(
        f"bench_serve: model={model} tp={args.tp} k={args.num_draft_tokens} "
        f"device={args.device} levels={levels} max_tokens={args.max_tokens} "
        f"temperature={args.temperature} "
        f"prompt_len={args.prompt_len}",
        flush=True,
    )
    from deploy.local_server import deploy, serves_directly, shutdown, start_local_ray

    port = _free_port()
    direct = not (args.url or args.proxy) and serves_directly(_app_args(args, engine_options))
    if args.url is None:
        start_local_ray("local", direct_port=port if direct else None)
        shape = "one deployment" if args.colocate else "ingress + model server"
        via = "the ingress replica directly" if direct else "Serve's proxy"
        print(f"bench_serve: HTTP: {shape}, served by {via}", flush=True)
    http_paths = [p for p in paths if p in ("stream", "full")]
    interleave = args.interleave if args.interleave is not None else args.tp == 1
    rows: list[LevelResult] = []
    first_ms: list[float] = []
    offline_first_ms: list[float] = []
    engine = server = None
    pools = _client_pools(args) if http_paths else []
    try:
        if "offline" in paths:
            engine, offline_first_ms = _offline_engine(model, engine_options, prompts, levels, args)
        if interleave:  # both up at once; per level: offline, then each HTTP path
            if http_paths:
                server, first_ms = _serve(
                    engine_options, prompts, levels, http_paths, args, deploy, port, direct, pools
                )
                if args.pin_engines:
                    offline_pid = engine.pid if engine is not None else None
                    print(pin_engines(server.client_pids, offline_pid), flush=True)
            for repeat in range(args.repeat):
                for c in levels:
                    if engine is not None:
                        rows.append(_offline_level(engine, prompts, c, repeat, args))
                    rows += [_http_level(server, prompts, p, c, repeat, args) for p in http_paths]
                    if engine is not None and args.bracket and http_paths:
                        rows.append(_offline_level(engine, prompts, c, repeat, args, after=True))
        else:  # the offline engine's levels, its shutdown, then the server's
            for repeat in range(args.repeat if engine is not None else 0):
                rows += [_offline_level(engine, prompts, c, repeat, args) for c in levels]
            if engine is not None:
                engine.shutdown()
                engine = None
            if http_paths:
                server, first_ms = _serve(
                    engine_options, prompts, levels, http_paths, args, deploy, port, direct, pools
                )
                if args.pin_engines:
                    print(pin_engines(server.client_pids, None), flush=True)
            for repeat in range(args.repeat):
                for p in http_paths:
                    rows += [_http_level(server, prompts, p, c, repeat, args) for c in levels]
    finally:
        if engine is not None:
            engine.shutdown()
        for pool in pools:
            pool.shutdown()
        if args.url is None:
            shutdown()

    summaries = [r.summary() for r in rows]
    print(table(summaries))
    medians = passes_table(summaries)
    if medians:
        print(medians)
    print(cpu_table(summaries))
    print(where_time_goes_table(summaries))
    print(steps_table(summaries))
    texts = _text_agreement(rows)
    print(texts)
    for name, latencies in (("served", first_ms), ("offline", offline_first_ms)):
        if latencies:
            print(
                f"first request after ready, {name}: "
                + ", ".join(f"{ms:.1f}" for ms in latencies)
                + " ms (1st..10th, one at a time)"
            )
    if args.json:
        facts = {
            "command": " ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": _commit(),
            "device": _device_name(args.device),
            "model": model,
            "args": vars(args),
            "texts": texts,
            "first_requests_ms": first_ms,
            "offline_first_requests_ms": offline_first_ms,
        }
        with open(args.json, "w") as f:
            json.dump({**facts, "rows": summaries}, f, indent=1)
    return 0 if all(r.num_errors == 0 for r in rows) else 1


class _OfflineHere:
    """The offline engine in this process: TP > 1, whose Ray ranks need this process's Ray."""

    def __init__(self, engine):
        self.engine = engine
        self.pid = os.getpid()

    def run(self, prompts, concurrency: int, num_requests: int, max_tokens: int) -> LevelResult:
        return run_offline(self.engine, prompts, concurrency, num_requests, max_tokens)

    def stats(self) -> dict:
        return dataclasses.asdict(self.engine.stats())

    def shutdown(self) -> None:
        self.engine.shutdown()
        gc.collect()
        _empty_device_cache()


class _OfflineProcess:
    """The offline engine (TP = 1) in a child process of its own, as `LLM.generate` runs in a
    user's script: no Ray driver and no Serve handle in its process. In this one (the bench is
    the Ray driver of the served app, whose threads take the interpreter lock) it ran slower:
    on the 2-core box (null executor, 0.3 ms steps, 32 requests of 128 tokens) 24-27k tok/s
    with the app up against 31-36k without it (BENCHMARKS.md, session 38)."""

    def __init__(self, model: str, config: dict):
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # no copy of this process's Ray or CUDA
        self._conn, theirs = context.Pipe()
        self._process = context.Process(
            target=_offline_main, args=(theirs, model, config), name="offline-engine"
        )
        self._process.start()
        theirs.close()
        self.pid = self._process.pid
        self._call("ready")

    def _call(self, *command):
        if command[0] != "ready":
            self._conn.send(command)
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"the offline engine exited ({self._process.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"the offline engine failed:\n{value}")
        return value

    def run(self, prompts, concurrency: int, num_requests: int, max_tokens: int) -> LevelResult:
        return self._call("run", prompts, concurrency, num_requests, max_tokens)

    def stats(self) -> dict:
        return self._call("stats")

    def shutdown(self) -> None:
        try:
            self._call("stop")
        finally:
            self._process.join(timeout=60)
            if self._process.is_alive():
                self._process.kill()
            self._conn.close()


def _offline_main(conn, model: str, config: dict) -> None:
    """The child's side of `_OfflineProcess`: build the engine, then run what is asked."""
    import traceback

    from cluster.config import EngineConfig
    from cluster.engine import LLMEngine

    try:
        engine = LLMEngine(EngineConfig(model=model, **config))
    except BaseException:  # noqa: BLE001 - the parent raises it
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ok", None))
    try:
        while True:
            command = conn.recv()
            try:
                if command[0] == "stop":
                    conn.send(("ok", None))
                    return
                if command[0] == "stats":
                    conn.send(("ok", dataclasses.asdict(engine.stats())))
                else:  # ("run", prompts, concurrency, num_requests, max_tokens)
                    conn.send(("ok", run_offline(engine, *command[1:])))
            except Exception:  # noqa: BLE001 - the parent raises it
                conn.send(("failed", traceback.format_exc()))
    finally:
        engine.shutdown()


def _offline_engine(model, engine_options, prompts, levels, args):
    config = {k: v for k, v in engine_options.items() if k != "model"}
    if args.tp > 1:
        from cluster.config import EngineConfig
        from cluster.engine import LLMEngine

        config["executor"] = "ray"
        offline = _OfflineHere(LLMEngine(EngineConfig(model=model, **config)))
    else:
        offline = _OfflineProcess(model, config)
    # The engine's own first requests after it is built, one at a time as the server's are
    # timed: what a slow first request owes to the device or the engine rather than the server.
    steps_before = step_counts(offline.stats())
    first = offline.run(prompts, 1, 10, args.max_tokens)
    steps_between(steps_before, step_counts(offline.stats()), first)
    first_ms = [s * 1e3 for s in first.latency_s]
    print(first_requests_line("offline", first), flush=True)
    offline.run(prompts, max(levels), max(levels), min(args.max_tokens, 8))  # warm-up
    return offline, first_ms


def _offline_level(offline, prompts, c: int, repeat: int, args, after: bool = False) -> LevelResult:
    n = num_requests_for(c, args.rounds, args.min_requests)
    named = {offline.pid: "bench (offline engine)"}
    before = process_cpu_s(named)
    steps_before = step_counts(offline.stats())
    row = offline.run(prompts, c, n, args.max_tokens)
    row.cpu_s = cpu_used(before, process_cpu_s(named))
    steps_between(steps_before, step_counts(offline.stats()), row)
    row.repeat = repeat
    if after:
        row.path = "offline-after"
    print(
        f"  {row.path} c={c}: {row.tokens_per_s:.0f} tok/s, slowest step "
        f"{_ms(row.slowest_step_s)} ms ({row.slowest_step_outputs} outputs)",
        flush=True,
    )
    return row


def _run_http_sync(*args, **kwargs) -> LevelResult:
    return asyncio.run(run_http(*args, **kwargs))


def client_shares(concurrency: int, num_requests: int, num_processes: int) -> list[tuple]:
    """A level spread over client processes: (clients, requests, first request index) for each
    process that gets a client. Clients as even as they go; requests in proportion to clients,
    each process its own run of request indices, so every request is sent once."""
    k = max(1, min(num_processes, concurrency))
    shares, clients_before = [], 0
    for i in range(k):
        clients = concurrency // k + (i < concurrency % k)
        first = num_requests * clients_before // concurrency
        clients_before += clients
        shares.append((clients, num_requests * clients_before // concurrency - first, first))
    return shares


def merge_levels(parts: list[LevelResult]) -> LevelResult:
    """One level's result from its client processes' results: counts summed, samples pooled,
    texts compared across processes, the wall time from the first start to the last end."""
    merged = LevelResult(parts[0].path, sum(p.concurrency for p in parts))
    for p in parts:
        merged.num_requests += p.num_requests
        merged.num_errors += p.num_errors
        merged.num_output_tokens += p.num_output_tokens
        merged.ttft_s += p.ttft_s
        merged.itl_s += p.itl_s
        merged.latency_s += p.latency_s
        merged.first_errors = (merged.first_errors + p.first_errors)[:3]
        merged.mismatched_prompts |= p.mismatched_prompts
        for index, text in p.texts.items():
            merged.record_text(index, text)
    merged.started_s = min(p.started_s for p in parts)
    merged.wall_s = max(p.started_s + p.wall_s for p in parts) - merged.started_s
    return merged


@dataclass
class _Server:
    """Where the HTTP clients run: `pools`, processes of their own, one pool each (empty: this
    process)."""

    client_cls: type
    url: str
    model: str
    pools: list = field(default_factory=list)
    client_pids: list[int] = field(default_factory=list)  # the clients' processes

    def __post_init__(self):
        self.client_pids = [pool.submit(os.getpid).result() for pool in self.pools]

    def run(self, prompts, path, concurrency, num_requests, max_tokens, **kwargs) -> LevelResult:
        call = (self.client_cls, self.url, self.model, prompts, path)
        if not self.pools:
            return _run_http_sync(*call, concurrency, num_requests, max_tokens, **kwargs)
        futures = [
            pool.submit(_run_http_sync, *call, c, n, max_tokens, first_index=first, **kwargs)
            for pool, (c, n, first) in zip(
                self.pools, client_shares(concurrency, num_requests, len(self.pools))
            )
        ]
        return merge_levels([f.result() for f in futures])


def _app_args(args, engine_options):
    """The app the script deploys: the engine options of the offline run, the same resources."""
    from deploy.app import AppArgs

    pacing = {}  # only what was asked for: the script also runs against older commits
    if args.stream_chunks_per_s is not None:
        pacing["stream_chunks_per_s"] = args.stream_chunks_per_s
    if args.colocate:
        pacing["colocate"] = True
    if args.engine_process is not None:
        pacing["engine_process"] = args.engine_process
    engine = {
        k: v
        for k, v in engine_options.items()
        if k not in ("model", "tp_size", "num_draft_tokens", "device", "actor_num_cpus")
    }
    return AppArgs(
        model=engine_options["model"],
        tp_size=args.tp,
        num_draft_tokens=args.num_draft_tokens,
        device=args.device,
        engine=engine,
        actor_num_cpus=args.actor_num_cpus,
        replica_num_cpus=args.actor_num_cpus,
        ingress_num_cpus=args.actor_num_cpus,
        **pacing,
    )


def _serve(engine_options, prompts, levels, paths, args, deploy, port, direct, pools):
    """Deploy (unless --url), time the ten first requests, warm each path up:
    -> (_Server, first request latencies in ms)."""
    if args.url is None:
        url = deploy(_app_args(args, engine_options), "127.0.0.1", port, direct=direct)
    else:
        url = args.url.rstrip("/").removesuffix("/v1")
    server = _Server(client_class(args.client), url, _served_model(url), pools)
    # The first requests after the server said it was ready, one at a time, before any warm-up
    # of the server's completion path (the client's connection is made first, untimed):
    # compilation or graph capture left for them shows as a slow first one.
    steps_before = served_step_counts(url)
    first = server.run(prompts, "full", 1, 10, args.max_tokens, warm_client=True)
    steps_between(steps_before, served_step_counts(url), first)
    first_ms = [s * 1e3 for s in first.latency_s]
    if len(first_ms) == 10:
        print(first_requests_line("served", first), flush=True)
    top = max(levels)
    for path in paths:  # warm-up
        server.run(prompts, path, top, top, min(args.max_tokens, 8))
    return server, first_ms


def num_client_processes(requested: int | None, num_cpus: int | None) -> int:
    """`--client-processes`, or by default half the machine's cores, at most 8 (one on 2)."""
    if requested is not None:
        return max(1, requested)
    return max(1, min(8, (num_cpus or 1) // 2))


def _client_pools(args) -> list:
    """The clients' own processes (none: --no-client-process). Clients sharing the bench's
    process share its interpreter with what the offline run left: on the H200 their event loop
    lagged 60-80 ms at every turn at 128 concurrent, and the server's figures carried it. A
    user's clients are processes of their own too, and more than one."""
    if not args.client_process:
        return []
    import concurrent.futures
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    return [
        concurrent.futures.ProcessPoolExecutor(1, context)
        for _ in range(num_client_processes(args.client_processes, os.cpu_count()))
    ]


def _http_level(server: _Server, prompts, path: str, c: int, repeat: int, args) -> LevelResult:
    n = num_requests_for(c, args.rounds, args.min_requests)
    named = {os.getpid(): "bench"}
    for pid in server.client_pids:
        named[pid] = "clients"
    histograms = replica_histograms(server.url)
    steps_before = served_step_counts(server.url)
    before = process_cpu_s(named)
    row = server.run(prompts, path, c, n, args.max_tokens)
    row.cpu_s = cpu_used(before, process_cpu_s(named))
    after = replica_histograms(server.url)
    steps_between(steps_before, served_step_counts(server.url), row)
    row.replica_ttft_mean_s = _mean_between(histograms, after, "ttft")
    row.replica_e2e_mean_s = _mean_between(histograms, after, "e2e")
    row.repeat = repeat
    print(f"  {path} c={c}: {row.tokens_per_s:.0f} tok/s", flush=True)
    if row.first_errors:
        print("   errors:", *row.first_errors, sep="\n    ", flush=True)
    return row


def _served_model(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as reply:
        return json.loads(reply.read())["data"][0]["id"]


def _text_agreement(rows: list[LevelResult]) -> str:
    """Greedy text per prompt must be one text across paths, levels and repeats."""
    if bench_temperature() > 0:
        return "texts: not compared (sampled requests)"
    texts: dict[int, set[str]] = {}
    for r in rows:
        for index, text in r.texts.items():
            texts.setdefault(index, set()).add(text)
        for index in r.mismatched_prompts:
            texts.setdefault(index, set()).add(f"<differs within {r.path} c={r.concurrency}>")
    differing = sorted(i for i, t in texts.items() if len(t) > 1)
    if not differing:
        return f"texts: every path gave each of {len(texts)} prompts the same text"
    return f"texts: {len(differing)} of {len(texts)} prompts differ across paths: {differing[:10]}"


def _device_name(device: str) -> str:
    import torch

    if device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def _empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
