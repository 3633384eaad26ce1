"""Greedy parity with HF when decode runs through the compiled graph runner, in both event loops, with no leak."""

from __future__ import annotations

import time

import pytest

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.common.scheduler.hf_reference import hf_greedy

# Different lengths and budgets: the decode batch shrinks 3 -> 2 -> 1, every size padded to the one bucket.
PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23], list(range(30, 70))]
MAX_NEW = [12, 7, 3]


@pytest.mark.parametrize("event_loop", ["normal", "overlap"])
def test_compiled_decode_matches_hf(tiny_llama, event_loop):
    config = EngineConfig(model_path=tiny_llama, dtype="float32", event_loop=event_loop, page_size=4,
                          enable_torch_compile=True, cuda_graph_bs=(4,))
    with Engine(config) as engine:
        assert engine.graph_runner is not None and engine.graph_runner.batch_sizes == [4]
        reqs = [GenerateRequest(f"r{i}", p, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
                for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW))]
        results = engine.generate(reqs)
        assert engine.graph_runner.replays >= max(MAX_NEW) - 1  # every decode step ran the graph
        # The loop drops finished requests from its running batch one iteration after their last output.
        deadline = time.monotonic() + 10
        while not engine.flush_cache():
            assert time.monotonic() < deadline, engine.memory_report()
            time.sleep(0.05)
        memory = engine.memory_report()
    assert [r.sequences[0].output_ids for r in results] == [hf_greedy(tiny_llama, p, n)[0]
                                                             for p, n in zip(PROMPTS, MAX_NEW)]
    assert memory["leaked_tokens"] == 0 and memory["free_tokens"] == memory["total_tokens"], memory
    assert memory["free_req_slots"] == memory["total_req_slots"], memory
