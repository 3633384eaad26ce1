"""freeze_startup_heap: start-up garbage is collected first, what is alive is frozen out of later collections."""

from __future__ import annotations

import gc
import weakref

import pytest

from tandem.common.gc_heap import freeze_startup_heap


class Node:
    pass


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # the rest of the session collects as before


def test_garbage_is_collected_and_live_objects_are_frozen(unfrozen):
    garbage = Node()
    garbage.self = garbage  # a cycle: only a collection frees it
    dead = weakref.ref(garbage)
    del garbage
    live = Node()
    before = gc.get_freeze_count()
    frozen = freeze_startup_heap()
    assert dead() is None  # collected, not frozen where it would never be freed
    # Other threads of the test process (engines of earlier tests) may free frozen objects meanwhile: the count only
    # falls after the freeze, never rises without another one.
    assert before < frozen and 0 < gc.get_freeze_count() <= frozen
    assert not any(obj is live for obj in gc.get_objects())  # in the permanent generation: no collection walks it
