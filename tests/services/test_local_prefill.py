"""Local-prefill fallback, real processes: a decode worker prefills a plain request itself (greedy output equal to
the offline engine's, its prompt cached for later pairs), and a router under `--disagg-policy auto` sends short
prompts there, long ones through the pair, and everything there once the prefill worker is SIGKILLed."""

from __future__ import annotations

import random
import urllib.request

import grpc
import openai
import pytest
from google.protobuf import json_format
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tandem.common.tokenizer import load_tokenizer
from tests.services.pd_helpers import PDPair, output_ids, pd_reference_engine
from tests.services.router.conftest import RouterProcess, readiness, wait_until
from tests.services.stack_helpers import Scrape

pytestmark = pytest.mark.e2e

MAX_NEW = 8
LOCAL_MAX_TOKENS = 32  # the router's --local-prefill-max-tokens
RNG = random.Random(11)
SHARED = [RNG.randrange(8, 500) for _ in range(100)]
SHORT = [[RNG.randrange(8, 500) for _ in range(n)] for n in (3, 17, 30)]
LONG = [[RNG.randrange(8, 500) for _ in range(n)] for n in (60, 150)]  # 150: chunked (--chunked-prefill-size 48)
PREFIXED = [SHARED + [RNG.randrange(8, 500) for _ in range(n)] for n in (5, 9)]


@pytest.fixture(scope="module")
def pair(tiny_llama):
    pd = PDPair(tiny_llama, wait=False)
    yield pd.wait_ready()
    for ch in pd.channels:
        ch.close()
    pd.prefill.stop()  # the last test kills it
    assert pd.decode.stop() == 0, "decode did not stop cleanly:\n" + "".join(pd.decode.log[-40:])


@pytest.fixture(scope="module")
def expected(tiny_llama):
    """prompt (as a tuple) -> the offline engine's greedy output ids."""
    prompts = SHORT + LONG + PREFIXED + [SHARED]
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with pd_reference_engine(tiny_llama) as engine:
        results = engine.generate([GenerateRequest(f"e{i}", p, params) for i, p in enumerate(prompts)])
    return {tuple(p): r.sequences[0].output_ids for p, r in zip(prompts, results)}


def plain_request(rid: str, input_ids: list[int]) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=rid, tokenized=pb.TokenizedInput(input_ids=input_ids), stream=True,
                              sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW,
                                                                ignore_eos=True))


def decode_free(pair: PDPair) -> bool:
    """No request and, after a flush, no KV token held on the decode."""
    flushed = pair.d_stub.FlushCache(common_pb2.FlushCacheRequest()).success
    load = pair.d_stub.GetLoads(pb.GetLoadsRequest(include=["all"])).loads[0]
    return flushed and load.num_running_reqs == 0 and load.num_waiting_reqs == 0 and load.num_used_tokens == 0


def test_decode_worker_prefills_a_plain_request_like_the_offline_engine(pair, expected):
    info = pair.d_stub.GetServerInfo(pb.GetServerInfoRequest())
    assert json_format.MessageToDict(info.scheduler_info)["local_prefill"] is True
    for i, prompt in enumerate(SHORT + LONG + PREFIXED):
        responses = list(pair.d_stub.Generate(plain_request(f"plain-{i}", prompt), timeout=60))
        assert output_ids(responses) == expected[tuple(prompt)], f"prompt of {len(prompt)} tokens"
    # The second prefixed prompt found the first one's pages in the decode's RadixCache.
    complete = [r.complete for r in responses if r.HasField("complete")][0]
    assert complete.cached_tokens >= 100 - 100 % 4
    # A pair's leg after the local prefills: same output, the prefix pages reused on the decode side.
    [(_, decode_leg)] = pair.run_legs([pair.request("paired", SHARED, max_new_tokens=MAX_NEW, ignore_eos=True)])
    assert output_ids(decode_leg) == expected[tuple(SHARED)]
    wait_until(lambda: decode_free(pair), 20, "the decode to hold no request or KV")


def test_a_pair_leg_still_needs_its_bootstrap_server(pair):
    req = plain_request("half-paired", SHORT[0])
    req.disaggregated_params.bootstrap_room = 5  # paired, but naming no bootstrap server
    with pytest.raises(grpc.RpcError) as info:
        list(pair.d_stub.Generate(req, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bootstrap_host" in info.value.details()


@pytest.fixture(scope="module")
def router(pair, tiny_llama):
    proc = RouterProcess("--prefill", f"grpc://{pair.prefill.address},{pair.prefill.bootstrap_port}",
                         "--decode", f"grpc://{pair.decode.address}", "--model-path", tiny_llama,
                         "--served-model-name", "tiny", "--disagg-policy", "auto",
                         "--local-prefill-max-tokens", str(LOCAL_MAX_TOKENS), "--max-retries", "2")
    wait_until(lambda: readiness(proc) == 200, 60, "router readiness")
    yield proc
    assert proc.stop() == 0, "router did not shut down cleanly:\n" + "".join(proc.log[-40:])


def decisions(router: RouterProcess) -> dict[tuple, float]:
    with urllib.request.urlopen(router.url + "/metrics", timeout=10) as resp:
        samples = Scrape(resp.read().decode()).values("tandem_router_disagg_decisions_total")
    return {(labels["decision"], labels["reason"]): value for labels, value in
            ((dict(key), value) for key, value in samples.items())}


def complete_text(client: openai.OpenAI, prompt: list[int]) -> str:
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_NEW, temperature=0,
                                      extra_body={"ignore_eos": True})
    return reply.choices[0].text


def test_auto_prefills_short_prompts_on_the_decode_and_survives_a_prefill_sigkill(router, pair, expected,
                                                                                  tiny_llama):
    tokenizer = load_tokenizer(tiny_llama).tokenizer

    def text(prompt: list[int]) -> str:
        return tokenizer.decode(expected[tuple(prompt)], skip_special_tokens=True)

    with openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        for prompt in SHORT + LONG:
            assert complete_text(client, prompt) == text(prompt)
        counts = decisions(router)
        assert counts.get(("local", "short_prompt")) == len(SHORT)
        assert counts.get(("pair", "long_prompt")) == len(LONG)

        pair.prefill.proc.kill()
        pair.prefill.proc.wait()
        after_kill = LONG + SHORT + LONG
        for prompt in after_kill:  # the first may still try the dead prefill, then is retried locally
            assert complete_text(client, prompt) == text(prompt)
        counts = decisions(router)
        local = sum(v for (decision, _), v in counts.items() if decision == "local")
        assert local >= len(SHORT) + len(after_kill)  # every request since the kill ended prefilled locally
        # A long prompt goes local only for want of a prefill worker.
        assert counts.get(("local", "prefill_unavailable"), 0) >= 2 * len(LONG)
        assert readiness(router) == 200
        wait_until(lambda: readiness(router) == 200, 10, "the router to stay ready")
    # Nothing leaked: no request or KV on the decode, no reservation at the router.
    wait_until(lambda: decode_free(pair), 20, "the decode to hold no request or KV")
    with urllib.request.urlopen(router.url + "/metrics", timeout=10) as resp:
        reserved = Scrape(resp.read().decode()).values("tandem_router_worker_kv_reserved_tokens")
    assert reserved and all(v == 0 for v in reserved.values()), reserved
