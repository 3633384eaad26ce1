"""EngineConfig.profile_steps (a worker's --profile-steps): the engine times its steps from the first one and logs
the split when it stops; off, nothing is wrapped."""

from __future__ import annotations

import logging

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest


def _generate(engine: Engine, n: int, max_new: int) -> list:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    return engine.generate([GenerateRequest(f"r{i}", [5 + i, 6, 7, 8], params) for i in range(n)])


def test_profile_steps_times_every_step_and_logs_the_split_at_stop(tiny_llama, caplog):
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=1024, page_size=4, profile_steps=True)
    with caplog.at_level(logging.WARNING, logger="tandem.common.engine"):
        with Engine(config) as engine:
            results = _generate(engine, 3, 6)
            report = engine.step_profiler.report()
    assert [r.completion_tokens for r in results] == [6, 6, 6]
    decode = report["decode"]
    # 3 prompts prefilled together, then 5 decode steps of 3 rows each (the overlap loop may launch a sixth
    # before it learns that the fifth ended them).
    assert decode["steps"] in (5, 6) and decode["rows_per_step"] == 3
    assert report["extend"]["steps"] >= 1 and report["extend"]["rows_per_step"] >= 1
    assert decode["step_ms"] > 0 and decode["step_over_forward"] >= 0.99  # a period holds its step's forward
    (at_three,) = decode["by_batch_size"].values()
    assert list(decode["by_batch_size"]) == [3] and at_three["steps"] == decode["steps"]
    assert at_three["step_ms"] > 0 and at_three["forward_ms"] > 0
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "step time split" in logged and "step/fwd" in logged and "decode at batch 3:" in logged


def test_profile_steps_off_wraps_nothing(tiny_llama):
    with Engine(EngineConfig(model_path=tiny_llama, max_total_tokens=1024, page_size=4)) as engine:
        assert engine.step_profiler is None
        assert "timed" not in engine.worker.forward.__qualname__
        assert [r.completion_tokens for r in _generate(engine, 1, 3)] == [3]
