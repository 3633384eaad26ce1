"""A worker freezes its start-up heap before it serves (common/gc_heap.py): its log says how many objects."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.e2e


def test_the_worker_froze_its_start_up_objects_before_listening(worker):
    log = "".join(worker.log)
    froze = re.search(r"froze (\d+) start-up objects", log)
    assert froze, log[-3000:]
    assert int(froze.group(1)) > 10_000  # torch and the model, not a handful
    assert froze.start() < log.index("worker listening on")  # before it serves, not at exit
