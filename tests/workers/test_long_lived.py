"""workers/long_lived.py: what a call that runs an engine in its caller's process freezes."""

from __future__ import annotations

import gc

import pytest

from workers.long_lived import freeze_long_lived, frozen_for_the_call, thaw


@pytest.fixture(autouse=True)
def _thawed():
    thaw()  # nothing frozen, and no freeze for life, before and after each test
    yield
    thaw()


def test_the_call_freezes_what_is_alive_and_thaws_it_after():
    alive = [[] for _ in range(1000)]  # lists: tracked by the collector
    with frozen_for_the_call():
        assert gc.get_freeze_count() >= len(alive)
    assert gc.get_freeze_count() == 0


def test_the_call_thaws_when_the_block_raises():
    with pytest.raises(ValueError), frozen_for_the_call():
        raise ValueError("a step failed")
    assert gc.get_freeze_count() == 0


def test_a_process_frozen_for_its_life_stays_frozen():
    """An engine process froze what it built for its life: the call must not thaw that."""
    frozen = freeze_long_lived("test")
    try:
        with frozen_for_the_call():
            pass
        # Still frozen (a thaw moves every one back: 0). A few frozen objects may have died
        # meanwhile by their reference counts, so not exactly `frozen`.
        assert gc.get_freeze_count() > frozen // 2 > 0
    finally:
        thaw()
    assert gc.get_freeze_count() == 0


def test_a_librarys_freeze_does_not_leave_the_call_open_to_full_scans():
    """Something froze a few objects before (on the GPU host, 375 of them by the time the
    engine was warm): the call still freezes everything alive."""
    gc.freeze()
    before = gc.get_freeze_count()
    alive = [[] for _ in range(5000)]  # lists: tracked by the collector (a bare object is not)
    with frozen_for_the_call():
        assert gc.get_freeze_count() >= before + len(alive)
    assert gc.get_freeze_count() == 0
