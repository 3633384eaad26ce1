"""CPU lists for --cpu-affinity: parsing, the /proc form, splitting, and an Engine config's checks."""

from __future__ import annotations

import os
import threading

import pytest

from tandem.common.config import ConfigError, EngineConfig
from tandem.common.cpu_affinity import format_cpu_list, parse_cpu_list, pin_process, split_cpus


def test_a_cpu_list_parses_and_formats_as_proc_shows_it():
    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cpu_list(" 5, 1-2 ,2") == [1, 2, 5]
    assert format_cpu_list([6, 0, 1, 2, 3]) == "0-3,6"
    assert format_cpu_list([1, 3, 4]) == "1,3-4"
    for bad in ("", "a", "3-1", "1,,2", "-1", "1-"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_split_gives_consecutive_disjoint_slices():
    assert split_cpus([0, 2, 4, 6], [1, 3]) == [[0], [2, 4, 6]]
    with pytest.raises(ValueError, match="cannot give"):
        split_cpus([0, 1], [1, 2])


def test_engine_config_refuses_a_malformed_or_unusable_cpu_list(tiny_llama):
    with pytest.raises(ConfigError, match="--cpu-affinity"):
        EngineConfig(model_path=tiny_llama, cpu_affinity="0-").validate()
    outside = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError, match=f"--cpu-affinity {outside}: CPUs {outside} are not usable"):
        EngineConfig(model_path=tiny_llama, cpu_affinity=str(outside)).validate()
    mine = format_cpu_list(sorted(os.sched_getaffinity(0)))
    assert EngineConfig(model_path=tiny_llama, cpu_affinity=mine).validate().affinity_cpus() == sorted(
        os.sched_getaffinity(0))


def test_pin_process_moves_threads_started_before_it():
    """A thread started before the pin ends up on the pinned CPU too (torch's pool may exist by then)."""
    before = sorted(os.sched_getaffinity(0))
    ready, pinned, seen = threading.Event(), threading.Event(), []

    def early() -> None:
        ready.set()
        pinned.wait()
        seen.append(sorted(os.sched_getaffinity(0)))

    thread = threading.Thread(target=early)
    thread.start()
    ready.wait()
    try:
        pin_process(before[:1])
        pinned.set()
        thread.join()
        assert seen == [before[:1]] and sorted(os.sched_getaffinity(0)) == before[:1]
    finally:
        pin_process(before)
