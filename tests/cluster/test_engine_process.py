"""The engine in a process of its own (cluster/engine_process.py): what crosses the process
boundary arrives whole, a dead engine process fails its requests and is rebuilt, and a start
that fails says why."""

from __future__ import annotations

import asyncio
import os
import pickle
import re
import signal
import socket
import struct
import threading
import time
from multiprocessing.connection import Connection

import pytest

from cluster.async_engine import AsyncEngine, EngineDeadError
from cluster.config import EngineConfig
from cluster.engine_process import EngineStartError, _Writer, runs_in_own_process
from cluster.sampling_params import InvalidRequestError, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [300, 4, 99], [17] * 40]


def _config(model: str, **kw) -> EngineConfig:
    return EngineConfig(model=model, num_draft_tokens=0, dtype="float32", **kw)


async def _run(engine: AsyncEngine, prompt, params, stream: bool, request_id=None):
    return [o async for o in engine.generate(prompt, params, request_id, stream=stream)]


def _all(engine: AsyncEngine, jobs) -> list[list]:
    async def run():
        return await asyncio.gather(*(_run(engine, *job) for job in jobs))

    return asyncio.run(run())


def _logprob_keys(logprobs) -> list:
    return [(e["token_id"], [t for t, _ in e["top"]]) for e in logprobs]


def _logprob_values(logprobs) -> list[float]:
    return [v for e in logprobs for v in (e["logprob"], *(lp for _, lp in e["top"]))]


@pytest.fixture
def process_engine(tiny_model_dir):
    engine = AsyncEngine(_config(tiny_model_dir), stream_chunks_per_s=200.0, own_process=True)
    assert engine.own_process and engine.pid != os.getpid()
    yield engine
    asyncio.run(engine.shutdown())


def test_outputs_equal_the_thread_modes_field_by_field(tiny_model_dir, process_engine):
    # Sampled with a seed, with logprobs and a stop string: every cumulative field rebuilt
    # from the deltas must be what the engine on a thread builds itself.
    jobs = []
    for i, prompt in enumerate(PROMPTS):
        for stream in (True, False):
            params = SamplingParams(
                max_tokens=24, temperature=0.8, seed=7 + i, logprobs=2, stop=["e"]
            )
            jobs.append((prompt, params, stream, f"r{i}-{stream}"))
    thread_engine = AsyncEngine(_config(tiny_model_dir), stream_chunks_per_s=200.0)
    try:
        expected = _all(thread_engine, jobs)
    finally:
        asyncio.run(thread_engine.shutdown())
    got = _all(process_engine, jobs)
    for want, have in zip(expected, got):
        last_want, last_have = want[-1], have[-1]
        for name in (
            "prompt_token_ids",
            "token_ids",
            "text",
            "finish_reason",
            "stop_reason",
            "num_prompt_tokens",
            "error",
        ):
            assert getattr(last_have, name) == getattr(last_want, name), name
        # Logprob values to fp32 rounding: the two runs batch the requests as they arrive, and
        # a step's batch composition moves the last bits of its logits.
        assert _logprob_keys(last_have.logprobs) == _logprob_keys(last_want.logprobs)
        assert _logprob_values(last_have.logprobs) == pytest.approx(
            _logprob_values(last_want.logprobs), abs=1e-5
        )
        # The deltas add up to the whole, whatever the pacing joined.
        assert [t for o in have for t in o.new_token_ids] == last_have.token_ids
        assert "".join(o.new_text for o in have) == last_have.text
        assert [e for o in have for e in o.new_logprobs] == last_have.logprobs
    assert any(o[-1].finish_reason == "stop" for o in got)  # the stop string was exercised
    stats = process_engine.stats()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
    assert sum(stats.num_finished.values()) == len(jobs)


def test_a_refusal_crosses_with_its_param(process_engine):
    with pytest.raises(InvalidRequestError) as err:
        asyncio.run(_run(process_engine, PROMPTS[0], SamplingParams(max_tokens=-1), True))
    assert err.value.param == "max_tokens"
    # The engine goes on serving. (Sampled at the default temperature 1.0: without ignore_eos
    # the end-of-sequence token is drawn now and then and the length would vary.)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    outs = asyncio.run(_run(process_engine, PROMPTS[0], params, False))
    assert outs[-1].finished and len(outs[-1].token_ids) == 3


def test_a_killed_engine_process_fails_its_requests_and_restart_serves(process_engine):
    async def run():
        stream = process_engine.generate(
            PROMPTS[0], SamplingParams(max_tokens=2000, ignore_eos=True), "victim"
        )
        first = await stream.__anext__()
        assert not first.finished
        os.kill(process_engine.pid, signal.SIGKILL)
        return [o async for o in stream]

    with pytest.raises(EngineDeadError):
        asyncio.run(run())
    assert process_engine.is_dead
    with pytest.raises(EngineDeadError):  # refused at once, not hung
        asyncio.run(_run(process_engine, PROMPTS[0], SamplingParams(max_tokens=2), False))
    with pytest.raises(EngineDeadError):
        asyncio.run(process_engine.check_health())
    old_pid = process_engine.pid
    process_engine.restart()
    assert process_engine.pid != old_pid and not process_engine.is_dead
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = asyncio.run(_run(process_engine, PROMPTS[1], params, True))
    assert outs[-1].finished and len(outs[-1].token_ids) == 4
    asyncio.run(process_engine.check_health())


def test_a_failed_start_raises_the_engine_processes_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngineStartError) as err:
        AsyncEngine(_config(str(tmp_path)), own_process=True)
    assert "Traceback" in str(err.value)  # the engine process's own account of it


def test_which_executors_run_in_an_engine_process(tiny_model_dir):
    assert runs_in_own_process(_config(tiny_model_dir))  # TP=1, in-process executor
    assert runs_in_own_process(_config(tiny_model_dir, executor="a.module:Executor"))
    # Ray ranks: stepped over their sockets from the engine process (for "auto", where every
    # rank is on this node: known once they are placed); the other transports need Ray there.
    assert runs_in_own_process(_config(tiny_model_dir, executor="ray"))
    assert runs_in_own_process(_config(tiny_model_dir, tp_size=2))
    assert runs_in_own_process(_config(tiny_model_dir, tp_size=2, step_transport="socket"))
    for transport in ("graph", "calls"):
        assert not runs_in_own_process(_config(tiny_model_dir, tp_size=2, step_transport=transport))


def test_the_engine_process_ends_when_its_caller_is_killed(tiny_model_dir):
    # A replica killed outright (OOM, SIGKILL) must not leave its engine holding the device.
    import subprocess
    import sys
    import time

    script = (
        "import sys, time\n"
        "from cluster.async_engine import AsyncEngine\n"
        "from cluster.config import EngineConfig\n"
        f"e = AsyncEngine(EngineConfig(model={tiny_model_dir!r}, num_draft_tokens=0, "
        "dtype='float32'), own_process=True)\n"
        "print(e.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    caller = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        engine_pid = int(caller.stdout.readline())
        os.kill(engine_pid, 0)  # alive
        caller.kill()
        caller.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:  # gone, or a zombie nobody reaped yet
                with open(f"/proc/{engine_pid}/stat") as stat:
                    if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                        return
            except FileNotFoundError:
                return
            time.sleep(0.1)
        pytest.fail(f"engine process {engine_pid} outlived its caller")
    finally:
        caller.kill()


def test_readable_says_when_a_message_or_the_peers_end_waits():
    """The engine process's check for commands: nothing yet, a message, then the caller gone
    (the step loop must then read EOF and end, not spin)."""
    import socket
    from multiprocessing.connection import Connection

    from cluster.engine_process import Readable

    mine, theirs = socket.socketpair()
    conn, peer = Connection(mine.detach()), Connection(theirs.detach())
    readable = Readable(conn)
    assert not readable(0.0)
    assert not readable(0.01)  # waits, then says no
    peer.send(("command", 1))
    assert readable(0.0) and conn.recv() == ("command", 1)
    assert not readable(0.0)
    peer.close()
    assert readable(0.0)
    with pytest.raises(EOFError):
        conn.recv()
    conn.close()


def test_the_engine_process_freezes_what_it_built_and_exits_quietly(tiny_model_dir, capfd):
    """Its objects alive after warm-up leave the collector's scans (workers/long_lived.py: a full
    collection of them costs ~100 ms, a stall of every request in flight); it serves as before;
    and at shutdown they are returned, so its exit tears them down without the native
    extensions' leak reports a frozen heap at exit prints."""
    engine = AsyncEngine(_config(tiny_model_dir), own_process=True)
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        [outputs] = _all(engine, [(PROMPTS[0], params, False)])
        assert outputs[-1].finished and len(outputs[-1].token_ids) == 6
    finally:
        asyncio.run(engine.shutdown())
    err = capfd.readouterr().err
    frozen = re.search(r"engine process: (\d+) long-lived objects frozen", err)
    assert frozen and int(frozen.group(1)) > 10_000, err[-2000:]
    assert "leaked" not in err


@pytest.fixture
def writer_and_reader():
    """A `_Writer` on one end of a socket pair (its thread not started) and a Connection
    reading the other end; both closed after the test, the writer's thread stopped."""
    ours, theirs = socket.socketpair()
    writer, reader = _Writer(ours), Connection(theirs.detach())
    yield writer, reader
    writer.stop()
    writer.close()
    reader.close()


def test_the_writer_sends_a_small_message_at_once_without_its_thread(writer_and_reader):
    writer, reader = writer_and_reader
    writer.send(("command", "small"))
    assert reader.poll(5) and reader.recv() == ("command", "small")


def test_the_writer_keeps_the_order_when_the_socket_is_full():
    # A message larger than the socket's buffer goes partly at once and the rest waits for the
    # thread; a small one sent next must wait behind it even when the socket has room again
    # (written at once it would land inside the big one's bytes).
    ours, theirs = socket.socketpair()
    writer = _Writer(ours)  # thread not started: what is queued stays queued until start()
    big = ("command", bytes(range(256)) * 8192)  # 2 MiB
    writer.send(big)
    received = theirs.recv(65536)  # room in the socket again; the big one's rest still queued
    writer.send(("command", "small"))
    writer.start()
    messages = []
    while len(messages) < 2:  # Connection's framing: a 4-byte big-endian length, the pickle
        while len(received) < 4 or len(received) < 4 + struct.unpack("!i", received[:4])[0]:
            received += theirs.recv(1 << 20)
        size = struct.unpack("!i", received[:4])[0]
        messages.append(pickle.loads(received[4 : 4 + size]))
        received = received[4 + size :]
    assert messages == [big, ("command", "small")] and received == b""
    writer.stop()
    writer.close()
    theirs.close()


def test_the_writer_carries_large_messages_whole_to_a_reading_connection(writer_and_reader):
    writer, reader = writer_and_reader
    writer.start()
    big = bytes(range(256)) * 8192  # 2 MiB, more than the socket's buffer
    messages = [("command", i, big if i % 10 == 3 else b"") for i in range(60)]
    received = []

    def read():
        for _ in messages:
            received.append(reader.recv())
            time.sleep(0.001)

    reading = threading.Thread(target=read, daemon=True)
    reading.start()
    for message in messages:
        writer.send(message)
    reading.join(timeout=60)
    assert received == messages


def test_the_writer_says_the_peer_is_gone(writer_and_reader):
    writer, reader = writer_and_reader
    writer.start()
    reader.close()
    with pytest.raises(BrokenPipeError):
        for _ in range(100):  # the first write may still land in the buffer
            writer.send(("command", "after"))
            time.sleep(0.01)


def test_the_frame_reader_returns_whole_messages_only_and_never_waits():
    """What the callers' event loop reads the engine process with: Connection's framing read
    back from whatever part of it has arrived, a message split over many reads, and the peer's
    end read as EOF only after every whole message before it."""
    from cluster.engine_process import FrameReader

    ours, theirs = socket.socketpair()
    reader = FrameReader(ours.fileno())
    ours.close()  # the reader holds a descriptor of its own
    assert reader.read() == []  # nothing yet: returns at once
    small, big = ("step", [1, 2, 3]), ("step", bytes(range(256)) * 8192)  # 2 MiB: many reads
    frames = b""
    for message in (small, big, ("probe", "t", None)):
        payload = pickle.dumps(message)
        frames += struct.pack("!i", len(payload)) + payload
    theirs.sendall(frames[:2])  # not even a whole length
    assert reader.read() == []
    theirs.sendall(frames[2:40])
    assert reader.read() == [small]
    got = []
    writing = threading.Thread(target=theirs.sendall, args=(frames[40:],), daemon=True)
    writing.start()
    deadline = time.monotonic() + 30
    while len(got) < 2 and time.monotonic() < deadline:
        got += reader.read()
    writing.join(timeout=30)
    assert got == [big, ("probe", "t", None)]
    payload = pickle.dumps("last")
    theirs.sendall(struct.pack("!i", len(payload)) + payload)
    theirs.close()
    time.sleep(0.05)
    assert reader.read() == ["last"]  # the message before the end first
    with pytest.raises(EOFError):
        reader.read()
    reader.close()


def test_callers_on_two_event_loops_at_once_get_their_outputs(process_engine):
    """One loop reads the engine process's messages; a caller on another running loop (a
    thread of its own) gets its outputs through that loop, and goes on getting them when that
    loop ends first: here the short request's loop ends while the long one streams."""
    results: dict[str, list] = {}
    errors: list[BaseException] = []
    started = threading.Barrier(2)

    def run(name: str, max_tokens: int, stream: bool) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

        async def go():
            started.wait(timeout=30)  # both loops running before either posts
            return await _run(process_engine, PROMPTS[0], params, stream, f"loop-{name}")

        try:
            results[name] = asyncio.run(go())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    for first, second in ((True, False), (False, True)):  # streamed or not, on either side
        results.clear()
        threads = [
            threading.Thread(target=run, args=("short", 2, first), daemon=True),
            threading.Thread(target=run, args=("long", 200, second), daemon=True),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads), "a caller never got its end"
        assert not errors and set(results) == {"short", "long"}
        short, long = results["short"][-1], results["long"][-1]
        assert short.finished and len(short.token_ids) == 2
        assert long.finished and len(long.token_ids) == 200
        assert long.token_ids[:2] == short.token_ids  # greedy, one prompt
    # Later calls on a loop of their own (the ones above are closed) are read there.
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = asyncio.run(_run(process_engine, PROMPTS[1], params, False))
    assert outs[-1].finished and len(outs[-1].token_ids) == 12


def test_restart_on_one_running_loop_reads_the_new_process(process_engine):
    """As a Serve replica restarts its engine: on one event loop that keeps running, the rebuild
    on a thread while the old process is still alive; the loop then reads the new process, and
    the old one's end fails nobody."""
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    async def run():
        before = await _run(process_engine, PROMPTS[2], params, True)
        old_pid = process_engine.pid
        await asyncio.to_thread(process_engine.restart)
        assert process_engine.pid != old_pid
        after = await _run(process_engine, PROMPTS[2], params, False)
        again = await _run(process_engine, PROMPTS[2], params, True)
        await process_engine.check_health()
        return before, after, again

    # Bounded: a loop that never reads the new process would wait for its outputs forever.
    before, after, again = asyncio.run(asyncio.wait_for(run(), timeout=120))
    assert not process_engine.is_dead
    assert before[-1].token_ids == after[-1].token_ids == again[-1].token_ids
    assert len(after[-1].token_ids) == 5
