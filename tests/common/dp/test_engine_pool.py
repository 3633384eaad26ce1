"""`DataParallelEngine` (offline --dp-size): greedy outputs equal one engine's, requests spread, KV freed on every
replica; `to_argv` rebuilds a replica's flags."""

from __future__ import annotations

import dataclasses
import pytest

from tandem.common.config import ConfigError, EngineConfig
from tandem.common.dp.engine_pool import DataParallelEngine
from tandem.common.engine import Engine
from tandem.common.flags import to_argv
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest

PROMPTS = [[5 + i, 17, 42 + 3 * i, 99, 7, 300 - i, 12, 8][: 4 + i % 5] for i in range(8)]


def _config(model: str, **kw) -> EngineConfig:
    return EngineConfig(model_path=model, max_total_tokens=1024, page_size=4, max_context_len=1000, num_threads=1,
                        **kw)


def _requests(max_new: int = 6) -> list[GenerateRequest]:
    return [GenerateRequest(f"p{i}", p, SamplingParams(max_new_tokens=max_new, temperature=0.0))
            for i, p in enumerate(PROMPTS)]


def _free_tokens(engine: Engine) -> int:
    return engine.call(lambda s: s.ops.allocator.available_size() + s.ops.tree_cache.evictable_size())


def test_dp2_greedy_equals_dp1_and_frees_kv(tiny_llama):
    with Engine(_config(tiny_llama)) as one:
        expected = [r.sequences[0].output_ids for r in one.generate(_requests())]
    with DataParallelEngine(_config(tiny_llama, dp_size=2, load_balance_method="round_robin")) as dp:
        full = [_free_tokens(e) for e in dp.engines]
        results = dp.generate(_requests())
        assert [r.sequences[0].output_ids for r in results] == expected
        assert [e.call(lambda s: s.outputs.counters.generation_tokens) for e in dp.engines] == [24, 24]
        # Aborted mid-generation on whichever replica holds it; then every replica has its pool back.
        long = GenerateRequest("long", PROMPTS[0], SamplingParams(max_new_tokens=900, temperature=0.0,
                                                                  ignore_eos=True))
        handle = dp.submit(long)
        outputs = iter(handle.handle)
        assert next(outputs).token_ids  # decoding on its replica
        dp.abort("long")
        rest = list(outputs)
        assert rest[-1].finished and rest[-1].finish_reason.to_dict()["type"] == "abort"
        handle.result()
        assert [_free_tokens(e) for e in dp.engines] == full
        assert dp.balancer.loads[0].requests == dp.balancer.loads[1].requests == 0


def test_n_sequences_stay_on_one_replica(tiny_llama):
    with DataParallelEngine(_config(tiny_llama, dp_size=2, load_balance_method="shortest_queue")) as dp:
        req = GenerateRequest("n3", PROMPTS[1], SamplingParams(max_new_tokens=4, temperature=0.0, n=3))
        result = dp.submit(req).result()
        assert len(result.sequences) == 3
        assert sorted(e.call(lambda s: s.outputs.counters.generation_tokens) for e in dp.engines) == [0, 12]


def test_engine_refuses_dp_and_to_argv_round_trips(tiny_llama):
    with pytest.raises(ConfigError, match="an Engine is one data-parallel replica"):
        Engine(_config(tiny_llama, dp_size=2))
    config = _config(tiny_llama, dp_size=2, cuda_graph_bs=(1, 2), enable_torch_compile=True,
                     lora_paths=["a=/x"], load_balance_method="minimum_tokens")
    argv, env = to_argv(config, "TANDEM_")
    assert argv[argv.index("--cuda-graph-bs") + 1] == "1,2" and "--enable-torch-compile" in argv
    assert argv[argv.index("--lora-paths") + 1] == "a=/x" and "TANDEM_DP_SIZE" in env
    import argparse

    from tandem.common.config import add_engine_args
    from tandem.common.flags import from_flags

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert from_flags(EngineConfig, parser.parse_args(argv)) == dataclasses.replace(config)
