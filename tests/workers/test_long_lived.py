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


def is_frozen(obj) -> bool:
    """Whether `obj` (one the collector tracks) is in the permanent generation: frozen objects
    are in none of the generations `gc.get_objects()` walks."""
    assert gc.is_tracked(obj)
    return all(o is not obj for o in gc.get_objects())


def test_the_call_freezes_what_is_alive_and_thaws_it_after():
    alive = [[] for _ in range(3)]
    with frozen_for_the_call():
        made_inside = []
        assert all(is_frozen(a) for a in alive)
        assert not is_frozen(made_inside)  # what the call makes is collected as usual
    assert not any(is_frozen(a) for a in alive)
    assert gc.get_freeze_count() == 0


def test_the_call_thaws_when_the_block_raises():
    alive = []
    with pytest.raises(ValueError), frozen_for_the_call():
        assert is_frozen(alive)
        raise ValueError("a step failed")
    assert not is_frozen(alive)
    assert gc.get_freeze_count() == 0


def test_a_process_frozen_for_its_life_stays_frozen():
    """An engine process froze what it built for its life: the call must not thaw that."""
    built = []
    freeze_long_lived("test")
    try:
        with frozen_for_the_call():
            pass
        assert is_frozen(built)
    finally:
        thaw()
    assert not is_frozen(built)


def test_a_librarys_freeze_does_not_leave_the_call_open_to_full_scans():
    """Something froze a few objects before (on the GPU host, something had by the time the
    engine was warm): the call still freezes everything alive."""
    library = []
    gc.freeze()
    engine = []  # made after the library's freeze: not frozen yet
    assert is_frozen(library) and not is_frozen(engine)
    with frozen_for_the_call():
        assert is_frozen(engine)
    assert gc.get_freeze_count() == 0
