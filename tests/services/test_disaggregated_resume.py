"""A resumed request across prefill/decode (request migration, worker side): both legs carry
tandem-resumed-output-tokens; the prefill replays the resumed tokens through its matcher before it samples the first
new token, the decode replays them before it accepts that token, and a seeded, JSON-schema-constrained, penalised
continuation equals the rest of the original, which equals the unified engine's output; legs that disagree on
the count fail on the decode."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf import struct_pb2

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.rpc.resume import RESUMED_OUTPUT_TOKENS_KEY, resume_metadata
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.services.pd_helpers import PDPair, output_ids

pytestmark = pytest.mark.e2e

PROMPT = [5, 40, 41, 97, 12, 300, 7]
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "eel"]},
                                           "name": {"type": "string", "maxLength": 6},
                                           "id": {"type": "integer", "minimum": 0, "maximum": 9999}},
          "required": ["kind", "name", "id"], "additionalProperties": False}
SAMPLING = dict(temperature=1.0, top_p=0.9, max_new_tokens=120, frequency_penalty=0.4, min_new_tokens=4)
SEED = 2024


def unified(model_dir: str) -> list[int]:
    config = EngineConfig(model_path=model_dir, max_total_tokens=4096, page_size=4, max_context_len=1024,
                          constrained_json_disable_any_whitespace=True)
    params = SamplingParams(**SAMPLING, seed=SEED, json_schema=json.dumps(SCHEMA))
    with Engine(config) as engine:
        return engine.generate([GenerateRequest("ref", PROMPT, params)])[0].sequences[0].output_ids


def test_pd_resumed_constrained_seeded_request_continues_exactly(tiny_llama):
    pair = PDPair(tiny_llama, "--constrained-json-disable-any-whitespace", prefill_extra=("--event-loop", "overlap"),
                  decode_extra=("--event-loop", "normal"), wait=False)
    try:
        want = unified(tiny_llama)
        pair.wait_ready()
        seed = struct_pb2.Struct()
        seed.update({"seed": SEED})

        def request(rid: str, ids: list[int], max_new: int):
            return pair.request(rid, ids, **{**SAMPLING, "max_new_tokens": max_new}, custom_params=seed,
                                json_schema=json.dumps(SCHEMA))

        (_, d_resp), = pair.run_legs([request("orig", PROMPT, SAMPLING["max_new_tokens"])])
        original = output_ids(d_resp)
        assert original == want and len(original) >= 6
        for k in (2, len(original) // 2):
            resumed = request(f"resumed-{k}", PROMPT + original[:k], SAMPLING["max_new_tokens"] - k)
            (p_resp, d_resp), = pair.run_legs([resumed], metadata=resume_metadata(k))
            assert output_ids(p_resp) == original[k:k + 1]  # sampled on the prefill after its replay
            assert output_ids(d_resp) == original[k:]
        refused = request("refused", PROMPT + [original[-1]], 8)  # the stop token before the object opened
        for stub in (pair.p_stub, pair.d_stub):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(refused, timeout=30, metadata=resume_metadata(1)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert RESUMED_OUTPUT_TOKENS_KEY in err.value.details()
        one_leg = request("one-leg", PROMPT + original[:2], SAMPLING["max_new_tokens"] - 2)
        with ThreadPoolExecutor(max_workers=2) as pool:  # the metadata on the prefill's leg only
            prefill = pool.submit(lambda: list(pair.p_stub.Generate(one_leg, timeout=60, metadata=resume_metadata(2))))
            decode = pool.submit(lambda: list(pair.d_stub.Generate(one_leg, timeout=60)))
            with pytest.raises(grpc.RpcError) as err:
                decode.result()
            assert output_ids(prefill.result()) == original[2:3]
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert RESUMED_OUTPUT_TOKENS_KEY in err.value.details() and "both legs" in err.value.details()
        pair.wait_both_free()
    finally:
        pair.close()
