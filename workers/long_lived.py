"""A process that serves one engine freezes what it built out of the cyclic garbage collector.

After loading and warm-up a serving process holds ~220k objects the collector tracks (torch,
the model's modules, Triton's state; the tiny model on the CPU), and they live as long as the
process. A full collection scans them all: 106 ms on the 2-core box (`benchmarks/bench_gc.py`,
BENCHMARKS.md session 26), a stall of every request in flight. Python runs one after ten
middle-generation runs once the oldest generation has grown by a quarter: rare (none in a
15 s pass of the offline engine at 16 sequences), but each one is a step 100 ms late.
`gc.freeze()` moves everything alive now to a permanent generation the collector never scans
(a full collection then costs ~0 ms); what the steps allocate later is collected as before.
Only where the process's lifetime is the engine's (its own engine process, a rank's actor):
an engine rebuilt inside a longer-lived process would leave its frozen cycles uncollected.
`thaw` before a normal exit returns the objects, so the process tears them down as usual.

An engine run in its caller's process (`LLM.generate`, a batch job's) cannot freeze for good:
the process may drop the engine and build another. `frozen_for_the_call()` freezes what is
alive when the call starts and thaws it when the call ends: inside the call a full collection
scans only what the call allocated. Without it, the offline engine at 128 sequences (null
executor, 2-core box) ran two full collections of 99-111 ms in each 2.4 s pass
(`benchmarks/bench_gc.py`), and on the GPU hosts one decode step of each such pass took
166-273 ms (BENCHMARKS.md, session 41).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)


# Whether this process froze its objects for its life (`freeze_long_lived`, until `thaw`).
_frozen_for_life = False


def freeze_long_lived(what: str) -> int:
    """Collect, then freeze every object alive now; -> how many are frozen."""
    global _frozen_for_life
    started_s = time.perf_counter()
    gc.collect()
    gc.freeze()
    _frozen_for_life = True
    frozen = gc.get_freeze_count()
    logger.info(
        "%s: %d long-lived objects frozen out of the garbage collector's scans (%.0f ms)",
        what,
        frozen,
        (time.perf_counter() - started_s) * 1e3,
    )
    return frozen


def thaw() -> None:
    """Undo `freeze_long_lived` (before a normal exit, or before dropping what it froze)."""
    global _frozen_for_life
    gc.unfreeze()
    _frozen_for_life = False


@contextlib.contextmanager
def frozen_for_the_call() -> Iterator[None]:
    """Every object alive now out of the collector's scans until the block ends (no collection
    first: `gc.freeze()` and `gc.unfreeze()` only move lists). In a process frozen for its life
    (`freeze_long_lived`) nothing is done. A freeze someone else made before is undone with
    this one at the end: CPython thaws all or nothing, and waiting for it would leave the call
    open to full scans (on the GPU host something had frozen a few objects by the time the
    engine was warm, and the offline engine's 170 ms steps stayed). A freeze is only a hint to
    the collector: their objects are scanned again, nothing else changes."""
    if _frozen_for_life:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
