"""Router + one prefill + one decode worker, all real processes: streaming, disconnects, prompt logprobs, death."""

from __future__ import annotations

import grpc
import jinja2
import openai
import pytest

from tandem.common.tokenizer import load_tokenizer
from tandem.common.proto_gen.tandem import router_pb2 as rpb
from tandem.common.proto_gen.tandem import router_pb2_grpc as rpb_grpc
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.services.pd_helpers import PDPair, pd_reference_engine
from tests.services.router.conftest import RouterProcess, readiness, wait_until
from tests.services.router.test_failures import _stream_then_disconnect

pytestmark = pytest.mark.e2e

MESSAGES = [{"role": "user", "content": "tell me about the sea"}]


@pytest.fixture(scope="module")
def pair(tiny_llama):
    pd = PDPair(tiny_llama)
    yield pd
    for ch in pd.channels:
        ch.close()
    pd.decode.stop()  # the last test kills it; its exit code says nothing then
    assert pd.prefill.stop() == 0, "prefill did not stop cleanly:\n" + "".join(pd.prefill.log[-40:])


@pytest.fixture(scope="module")
def router(pair, tiny_llama):
    proc = RouterProcess("--prefill", f"grpc://{pair.prefill.address},{pair.prefill.bootstrap_port}",
                         "--decode", f"grpc://{pair.decode.address}", "--model-path", tiny_llama,
                         "--served-model-name", "tiny", "--max-retries", "1")
    wait_until(lambda: readiness(proc) == 200, 60, "router readiness")
    yield proc
    assert proc.stop() == 0, "router did not shut down cleanly:\n" + "".join(proc.log[-40:])


@pytest.fixture(scope="module")
def client(router):
    with openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def ref_engine(tiny_llama):
    with pd_reference_engine(tiny_llama) as engine:
        yield engine


def test_streaming_chat_equals_the_offline_engine(client, ref_engine, tiny_llama, pair):
    info = load_tokenizer(tiny_llama)
    text = jinja2.Template(info.chat_template).render(messages=MESSAGES, add_generation_prompt=True,
                                                      bos_token=info.bos_token)
    ids = info.tokenizer.encode(text, add_special_tokens=False).ids
    req = GenerateRequest(ref_engine.new_rid(), ids, SamplingParams(max_new_tokens=12, temperature=0.0))
    expected = info.tokenizer.decode(ref_engine.submit(req).result().sequences[0].output_ids,
                                     skip_special_tokens=True)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(ids)
    pair.wait_both_free()


def test_client_disconnect_aborts_both_legs_and_frees_both_pools(router, pair):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 900, "stream": True, "ignore_eos": True}
    _stream_then_disconnect(router, body, 3)
    # Aborted, not run to completion: the decode worker logs the cancelled stream long before 900 tokens.
    wait_until(lambda: any("ended early; aborting" in line for line in pair.decode.log), 10,
               "the decode worker to abort the request")
    pair.wait_both_free(timeout=10)


def test_prompt_logprobs_from_prefill_through_the_grpc_api(router, ref_engine, pair):
    ids = [5, 17, 42, 99, 7, 300, 12, 8, 64, 250, 31, 77]
    req = GenerateRequest(ref_engine.new_rid(), ids, SamplingParams(max_new_tokens=4, temperature=0.0),
                          return_logprob=True, logprob_start_len=0)
    expected = ref_engine.submit(req).result().sequences[0].input_logprobs
    with grpc.insecure_channel(f"127.0.0.1:{router.grpc_port}") as channel:
        responses = list(rpb_grpc.RouterStub(channel).Generate(rpb.GenerateRequest(
            model="tiny", token_ids=rpb.TokenIds(ids=ids), prompt_logprobs=True,
            sampling_params=rpb.SamplingParams(max_tokens=4, temperature=0)), timeout=60))
    usage = responses[-1].usage
    assert usage.prompt_tokens == len(ids) and len(usage.prompt_logprobs) == len(ids)
    assert not usage.prompt_logprobs[0].HasField("logprob")
    got = [p.logprob for p in usage.prompt_logprobs[1:]]
    assert got == pytest.approx([x for x in expected if x is not None], abs=1e-3)
    pair.wait_both_free()


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_logprobs_from_prefill_equal_the_unified_engine(client, ref_engine, pair, max_tokens):
    """lm-eval's loglikelihood request through the pair: the prefill scores the prompt (with its top 2), the
    router puts it ahead of the decode's tokens; max_tokens 0 scores only."""
    ids = [305, 317, 342, 399, 307, 300, 312, 308, 364, 450, 331, 377] * 5  # > a chunk (48): stitched
    req = GenerateRequest(ref_engine.new_rid(), ids, SamplingParams(max_new_tokens=max_tokens, temperature=0.0),
                          return_logprob=True, top_logprobs_num=2, logprob_start_len=0)
    seq = ref_engine.submit(req).result().sequences[0]
    reply = client.completions.create(model="tiny", prompt=[ids], echo=True, logprobs=2, max_tokens=max_tokens,
                                      temperature=0, extra_body={"prompt_logprobs": 2})
    lps = reply.choices[0].logprobs
    assert len(lps.token_logprobs) == len(ids) + max_tokens and lps.token_logprobs[0] is None
    assert lps.token_logprobs[1:len(ids)] == pytest.approx(seq.input_logprobs[1:], abs=1e-4)
    # The alternatives by id (vLLM's prompt_logprobs): OpenAI's top_logprobs are keyed by text, which byte
    # tokens share.
    rows = reply.choices[0].model_extra["prompt_logprobs"]
    for row, want in zip(rows[1:], seq.input_top_logprobs[1:]):
        ranked = sorted((e["rank"], int(t), e["logprob"]) for t, e in row.items() if "rank" in e)
        assert [t for _, t, _ in ranked] == [t for t, _ in want]
        assert [v for _, _, v in ranked] == pytest.approx([v for _, v in want], abs=1e-4)
    pair.wait_both_free()


def test_decode_death_mid_request_errors_and_drops_readiness(client, router, pair):
    stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=900, stream=True,
                                       extra_body={"ignore_eos": True})
    with pytest.raises(openai.APIError):
        for i, _chunk in enumerate(stream):
            if i == 2:
                pair.decode.proc.kill()
    wait_until(lambda: readiness(router) == 503, 20, "router readiness to drop")
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="tiny", prompt="a", max_tokens=2)
    assert info.value.status_code == 503
    # The prefill side lets go of everything it held for the dead pair.
    wait_until(lambda: _prefill_free(pair), 20, "the prefill pool to be free")


def _prefill_free(pair) -> bool:
    from smg_grpc_proto.generated import common_pb2
    from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

    flushed = pair.p_stub.FlushCache(common_pb2.FlushCacheRequest()).success
    load = pair.p_stub.GetLoads(pb.GetLoadsRequest(include=["all"])).loads[0]
    return flushed and load.num_running_reqs == 0 and load.num_waiting_reqs == 0 and load.num_used_tokens == 0
