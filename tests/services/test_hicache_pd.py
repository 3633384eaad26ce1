"""HiCache on a PD prefill worker: a device pool far smaller than the workload's prefixes forces demotion and
load-back through host memory and storage; the decode's greedy ids equal the in-process engine's (no hierarchy),
and the legs report cached tokens from the lower tiers. Nothing is left in use afterwards."""

from __future__ import annotations

import pytest

from tests.common.scheduler.test_hicache_engine import workload
from tests.services.pd_helpers import PDPair, output_ids, pd_reference_engine

pytestmark = pytest.mark.e2e


def test_pd_prefill_with_a_tiny_device_pool_loads_back_and_matches_the_reference(tiny_llama, tmp_path):
    prefill_flags = ("--max-total-tokens", "128", "--enable-hierarchical-cache", "--hicache-ratio", "1.5",
                     "--hicache-storage-backend", "file", "--hicache-storage-dir", str(tmp_path),
                     "--hicache-storage-prefetch-policy", "wait_complete")
    pair = PDPair(tiny_llama, prefill_extra=prefill_flags, wait=False)
    try:
        prompts = workload()
        with pd_reference_engine(tiny_llama) as engine:
            from tandem.common.sampling.params import SamplingParams
            from tandem.common.scheduler.io_struct import GenerateRequest

            expected = [engine.submit(GenerateRequest(f"ref{i}", ids, SamplingParams(max_new_tokens=8,
                                                                                      temperature=0.0)))
                        .result().sequences[0].output_ids for i, ids in enumerate(prompts)]
        pair.wait_ready()
        cached = []
        for i, ids in enumerate(prompts):  # one at a time: each turn's pages must move before the next
            (_, decode_responses), = pair.run_legs([pair.request(f"r{i}", ids)])
            assert output_ids(decode_responses) == expected[i], f"request {i}"
            cached.append(next(r.complete.cached_tokens for r in decode_responses if r.HasField("complete")))
        # Every second-turn request reused its 40-token prefix, though the 128-token device pool holds two of the six:
        # the others came back from host memory and storage.
        assert all(c >= 40 for c in cached[6:]), cached
        assert any(tmp_path.iterdir())
        pair.wait_both_free()  # FlushCache (every tier) until no KV is in use
        assert not any(tmp_path.iterdir())
    finally:
        pair.close()
