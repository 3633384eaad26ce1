"""A prefill process and a decode process with NIXL between them, driven like the router drives them."""

from __future__ import annotations

import random

import grpc
import pytest

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.services.pd_helpers import PDPair, output_ids

pytestmark = pytest.mark.e2e

MAX_NEW = 10


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(8, 500) for _ in range(120)]
    plain = [[rng.randrange(8, 500) for _ in range(n)] for n in (1, 5, 17, 48, 49, 150, 333)]
    prefixed = [shared + [rng.randrange(8, 500) for _ in range(n)] for n in (3, 30, 77)]
    return plain + prefixed


@pytest.fixture(scope="module")
def expected(tiny_llama):
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=4096, page_size=4, chunked_prefill_size=48,
                          max_context_len=1024)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with Engine(config) as engine:
        results = engine.generate([GenerateRequest(f"e{i}", p, params) for i, p in enumerate(prompts())])
    return [r.sequences[0].output_ids for r in results]


@pytest.mark.parametrize("event_loop", ["overlap", "normal"])
def test_pd_greedy_equals_offline_engine(tiny_llama, expected, event_loop):
    pair = PDPair(tiny_llama, "--event-loop", event_loop)
    try:
        reqs = [pair.request(f"pd{i}", p, max_new_tokens=MAX_NEW, ignore_eos=True, return_logprob=True)
                for i, p in enumerate(prompts())]
        for (p_resp, d_resp), want in zip(pair.run_legs(reqs), expected):
            assert output_ids(d_resp) == want
            assert output_ids(p_resp) == want[:1]  # the prefill leg ends with the first token it handed over
            complete = [r.complete for r in d_resp if r.HasField("complete")][0]
            assert complete.finish_reason == "length"
            assert len(complete.output_logprobs.token_logprobs) == MAX_NEW
        # Second round: shared prefixes now hit the prefill's RadixCache (and the decode's).
        again = [pair.request(f"again{i}", p, max_new_tokens=MAX_NEW, ignore_eos=True)
                 for i, p in enumerate(prompts()[-3:])]
        results = pair.run_legs(again)
        assert [output_ids(d) for _, d in results] == expected[-3:]
        cached = [[r.complete for r in d if r.HasField("complete")][0].cached_tokens for _, d in results]
        assert all(c >= 120 for c in cached)
        pair.wait_both_free()
    finally:
        pair.close()


def test_decode_leg_first_and_prefill_leg_first(tiny_llama, expected):
    """Either leg may arrive first: stagger them both ways."""
    import threading
    import time

    pair = PDPair(tiny_llama)
    try:
        for order in ("decode_first", "prefill_first"):
            req = pair.request(f"order-{order}", prompts()[5], max_new_tokens=MAX_NEW, ignore_eos=True)
            first, second = (pair.d_stub, pair.p_stub) if order == "decode_first" else (pair.p_stub, pair.d_stub)
            out = {}
            t = threading.Thread(target=lambda: out.setdefault("a", list(first.Generate(req, timeout=30))))
            t.start()
            time.sleep(0.5)
            out["b"] = list(second.Generate(req, timeout=30))
            t.join()
            decode_resp = out["a"] if order == "decode_first" else out["b"]
            assert output_ids(decode_resp) == expected[5]
        pair.wait_both_free()
    finally:
        pair.close()


def test_pd_rejects_requests_without_pairing(tiny_llama):
    """The prefill needs a pairing; the decode prefills an unpaired request itself (tests/services/
    test_local_prefill.py) but refuses n > 1 on a paired one."""
    pair = PDPair(tiny_llama)
    try:
        req = pair.request("nopair", [5, 6, 7])
        req.ClearField("disaggregated_params")
        with pytest.raises(grpc.RpcError) as info:
            list(pair.p_stub.Generate(req, timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "disaggregated_params" in info.value.details()
        req = pair.request("n2", [5, 6, 7], n=2)
        with pytest.raises(grpc.RpcError) as info:
            list(pair.d_stub.Generate(req, timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        pair.close()
