"""One OpenMP team per engine: the model loads on a short-lived thread, and only the computing thread has threads."""

from __future__ import annotations

import threading

import pytest
import torch

from tandem.common import engine as engine_module
from tandem.common.config import EngineConfig
from tandem.common.cpu_threads import run_on_fresh_thread
from tandem.common.engine import Engine


def test_run_on_fresh_thread_returns_raises_and_ends():
    seen = []

    def work(x):
        seen.append(threading.current_thread())
        return x * 2

    assert run_on_fresh_thread(work, 21) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(KeyError, match="boom"):
        run_on_fresh_thread(lambda: {}["boom"])


@pytest.mark.parametrize("event_loop", ["normal", "overlap"])
def test_engine_loads_off_the_calling_thread_and_computes_on_one(tiny_llama, monkeypatch, event_loop):
    loaded_on = []
    load_model = engine_module.load_model

    def recording_load(*args, **kwargs):
        loaded_on.append(threading.current_thread())
        return load_model(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_model", recording_load)
    config = EngineConfig(model_path=tiny_llama, dtype="float32", event_loop=event_loop, num_threads=2)
    with Engine(config) as engine:
        assert loaded_on and loaded_on[0] is not threading.current_thread() and not loaded_on[0].is_alive()
        scheduler_threads = engine.call(lambda scheduler: torch.get_num_threads())
        if event_loop == "overlap":
            # The model thread computes with every thread; the scheduler thread starts no team of its own.
            assert scheduler_threads == 1
            model = engine.scheduler.runner.overlap.executor.submit(torch.get_num_threads).result()
            assert model == 2
        else:
            assert scheduler_threads == 2
