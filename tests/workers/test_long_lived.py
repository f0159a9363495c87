"""workers/long_lived.py: what a call that runs an engine in its caller's process freezes."""

from __future__ import annotations

import gc

import pytest

from workers.long_lived import frozen_for_the_call


@pytest.fixture(autouse=True)
def _thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_call_freezes_what_is_alive_and_thaws_it_after():
    alive = [object() for _ in range(1000)]
    with frozen_for_the_call():
        assert gc.get_freeze_count() >= len(alive)
    assert gc.get_freeze_count() == 0


def test_the_call_thaws_when_the_block_raises():
    with pytest.raises(ValueError), frozen_for_the_call():
        raise ValueError("a step failed")
    assert gc.get_freeze_count() == 0


def test_a_freeze_made_before_is_left_to_whoever_made_it():
    """An engine process froze for its life: the call must not thaw that at its end."""
    gc.freeze()
    before = gc.get_freeze_count()
    with frozen_for_the_call():
        pass
    assert gc.get_freeze_count() == before > 0
