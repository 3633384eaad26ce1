"""The SglangScheduler API of a real `tandem worker` process, called through smg-grpc-proto stubs."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time
import zipfile

import grpc
import pytest
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.common.rpc.helpers import PROMPT, engine_greedy, gen_request, wait_idle

pytestmark = pytest.mark.e2e

# ---- Generate -----------------------------------------------------------------------------------


def test_streaming_generate_matches_in_process_engine(stub, ref_engine):
    responses = list(stub.Generate(gen_request("stream-1", max_new_tokens=12)))
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    completes = [r.complete for r in responses if r.HasField("complete")]
    assert len(completes) == 1 and responses[-1].HasField("complete")
    streamed = [t for c in chunks for t in c.token_ids]
    expected = engine_greedy(ref_engine, PROMPT, 12).sequences[0].output_ids
    assert streamed == expected
    assert list(completes[0].output_ids) == expected
    assert completes[0].finish_reason == "length"
    assert completes[0].prompt_tokens == len(PROMPT) and completes[0].completion_tokens == 12
    assert [c.completion_tokens for c in chunks] == sorted(c.completion_tokens for c in chunks)
    assert all(r.request_id == "stream-1" for r in responses)


def test_non_streaming_generate_sends_only_the_completion(stub, ref_engine):
    prompt = [9, 8, 7, 6, 5, 4, 3]
    responses = list(stub.Generate(gen_request("nostream-1", input_ids=prompt, stream=False, max_new_tokens=10)))
    assert len(responses) == 1 and responses[0].HasField("complete")
    assert list(responses[0].complete.output_ids) == engine_greedy(ref_engine, prompt, 10).sequences[0].output_ids


def test_stop_token_id_ends_with_stop_and_matched_token(stub, ref_engine):
    expected = engine_greedy(ref_engine, PROMPT, 8).sequences[0].output_ids
    stop_at = expected[3]
    (resp,) = stub.Generate(gen_request("stop-1", stream=False, stop_token_ids=[stop_at]))
    first = expected.index(stop_at)
    assert list(resp.complete.output_ids) == expected[:first + 1]
    assert resp.complete.finish_reason == "stop"
    assert resp.complete.HasField("matched_token_id") and resp.complete.matched_token_id == stop_at


def test_n_samples_are_told_apart_by_index(stub):
    custom = struct_pb2.Struct()
    custom.update({"seed": 1234})
    req = gen_request("n-1", temperature=0.9, n=3, max_new_tokens=6, custom_params=custom)
    responses = list(stub.Generate(req))
    completes = {r.complete.index: r.complete for r in responses if r.HasField("complete")}
    assert sorted(completes) == [0, 1, 2]
    for index, done in completes.items():
        streamed = [t for r in responses if r.HasField("chunk") and r.chunk.index == index for t in r.chunk.token_ids]
        assert streamed == list(done.output_ids) and len(done.output_ids) == 6
    again = {r.complete.index: list(r.complete.output_ids) for r in stub.Generate(req) if r.HasField("complete")}
    assert again == {i: list(c.output_ids) for i, c in completes.items()}, "custom_params.seed must fix the samples"


def test_logprobs_match_the_engine(stub, ref_engine):
    req = gen_request("lp-1", max_new_tokens=5)
    req.return_logprob, req.top_logprobs_num, req.logprob_start_len = True, 3, 0
    responses = list(stub.Generate(req))
    ref = engine_greedy(ref_engine, PROMPT, 5, return_logprob=True, top_logprobs_num=3,
                        logprob_start_len=0).sequences[0]
    done = responses[-1].complete
    out = done.output_logprobs
    assert list(out.token_ids) == ref.output_ids == list(done.output_ids)
    assert list(out.token_logprobs) == pytest.approx(ref.logprobs, abs=1e-4)
    assert len(out.top_logprobs) == 5
    for row, ref_row in zip(out.top_logprobs, ref.top_logprobs):
        assert list(row.token_ids) == [t for t, _ in ref_row]
        assert list(row.values) == pytest.approx([v for _, v in ref_row], abs=1e-4)
    first_chunk = responses[0].chunk
    assert first_chunk.HasField("input_logprobs") and not responses[1].chunk.HasField("input_logprobs")
    inp = done.input_logprobs
    assert list(inp.token_ids) == PROMPT
    assert not inp.token_logprobs[0].HasField("value")  # the first prompt token has no logprob
    assert [e.value for e in inp.token_logprobs[1:]] == pytest.approx(ref.input_logprobs[1:], abs=1e-4)
    streamed = [v for r in responses if r.HasField("chunk") for v in r.chunk.output_logprobs.token_logprobs]
    assert streamed == pytest.approx(list(out.token_logprobs))


# ---- abort and cancellation --------------------------------------------------------------------


def test_abort_rpc_ends_the_stream_and_frees_kv(stub):
    stream = stub.Generate(gen_request("abort-1", input_ids=PROMPT * 3, max_new_tokens=900, ignore_eos=True))
    first = next(stream)
    assert first.HasField("chunk")
    assert stub.Abort(pb.AbortRequest(request_id="abort-1", reason="test abort")).success
    rest = list(stream)
    assert rest and rest[-1].HasField("complete") and rest[-1].complete.finish_reason == "abort"
    assert len(rest[-1].complete.output_ids) < 900
    assert stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10)).success
    load = wait_idle(stub)
    assert load.token_usage == 0.0


def test_client_cancellation_aborts_the_request(stub):
    stream = stub.Generate(gen_request("cancel-1", input_ids=PROMPT * 2, max_new_tokens=900, ignore_eos=True))
    next(stream), next(stream)
    stream.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    wait_idle(stub)  # the engine dropped the request: nothing running, no request-held KV
    assert stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10)).success
    assert stub.GetLoads(pb.GetLoadsRequest()).loads[0].token_usage == 0.0


def test_constrained_generate_follows_its_regex_and_json_schema(stub, tiny_llama):
    from tandem.common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama).tokenizer
    regex = gen_request("regex-1", stream=False, max_new_tokens=40)
    regex.sampling_params.regex = r"(alpha|beta)-[0-9]{3}"
    (resp,) = stub.Generate(regex)
    assert resp.complete.finish_reason == "stop"
    assert re.fullmatch(r"(alpha|beta)-[0-9]{3}", tokenizer.decode(list(resp.complete.output_ids)))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    req = gen_request("schema-1", max_new_tokens=400)  # greedy: deterministic; free whitespace is allowed
    req.sampling_params.json_schema = json.dumps(schema)
    responses = list(stub.Generate(req))
    streamed = [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]
    complete = responses[-1].complete
    assert complete.finish_reason == "stop" and streamed == list(complete.output_ids)
    text = tokenizer.decode(streamed, skip_special_tokens=True)
    assert 1 <= json.loads(text)["n"] <= 9, text


def test_embed_equals_the_engine_and_refuses_what_it_cannot_do(stub, ref_engine):
    prompt = list(range(40, 90))
    resp = stub.Embed(pb.EmbedRequest(request_id="emb-1", tokenized=pb.TokenizedInput(input_ids=prompt)))
    want = ref_engine.embed("emb-ref", prompt).result(timeout=60).embedding
    assert resp.embedding_dim == len(want) == 64 and resp.prompt_tokens == len(prompt)
    assert max(abs(a - b) for a, b in zip(resp.embedding, want)) < 1e-5
    for field, request in (("input_ids", pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[]))),
                           ("is_cross_encoder", pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[5]),
                                                                is_cross_encoder=True)),
                           ("token_type_ids", pb.EmbedRequest(tokenized=pb.TokenizedInput(input_ids=[5]),
                                                              token_type_ids=[0]))):
        with pytest.raises(grpc.RpcError) as err:
            stub.Embed(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()


# ---- invalid requests -----------------------------------------------------------------------------


def _invalid_cases():
    bias = gen_request("x")
    bias.sampling_params.logit_bias["abc"] = 1.0
    regex = gen_request("x")
    regex.sampling_params.regex = "a[+"  # unclosed: refused before the request is submitted
    schema = gen_request("x")
    schema.sampling_params.json_schema = '{"type": "object", "required": 7}'
    ebnf = gen_request("x")
    ebnf.sampling_params.ebnf_grammar = "root ::= nothing"
    disagg = gen_request("x")
    disagg.disaggregated_params.bootstrap_host = "127.0.0.1"
    stop = gen_request("x")
    stop.sampling_params.stop.append("\n")
    mm = gen_request("x")
    mm.mm_inputs.image_urls.append("http://example.invalid/a.png")
    lora = gen_request("x")
    lora.lora_id = "adapter-1"
    top = gen_request("x")
    top.return_logprob, top.top_logprobs_num = True, 1000
    custom = gen_request("x")
    custom.sampling_params.custom_params.update({"colour": "blue"})
    cases = [
        ("out_of_vocab", gen_request("x", input_ids=[1, 2, 100000]), "input_ids"),
        ("empty_prompt", gen_request("x", input_ids=[]), "input_ids"),
        ("negative_temperature", gen_request("x", temperature=-1.0), "temperature"),
        ("too_long", gen_request("x", max_new_tokens=5000), "max_new_tokens"),
        ("logit_bias_key", bias, "logit_bias"),
        ("regex", regex, "regex: invalid regular expression"),
        ("json_schema", schema, "json_schema: invalid JSON schema"),
        ("ebnf_grammar", ebnf, 'ebnf: invalid EBNF grammar: EBNF parser error at line 1, column 10: Rule "nothing"'),
        ("disaggregated", disagg, "disaggregated_params"),
        ("stop_strings", stop, "stop"),
        ("multimodal", mm, "mm_inputs"),
        ("lora", lora, "lora_id"),
        ("top_logprobs", top, "top_logprobs_num"),
        ("custom_params", custom, "custom_params"),
        ("infinite_temperature", gen_request("x", temperature=float("inf")), "temperature"),
        ("nan_top_p", gen_request("x", temperature=1.0, top_p=float("nan")), "top_p"),
        ("nan_penalty", gen_request("x", frequency_penalty=float("nan")), "frequency_penalty"),
    ]
    for name, key in (("superscript_two", "\u00b2"), ("arabic_one", "\u0661"), ("negative", "-1"),
                      ("leading_space", " 5")):
        req = gen_request("x")
        req.sampling_params.logit_bias[key] = 1.0
        cases.append((f"logit_bias_key_{name}", req, "logit_bias"))
    nan_bias = gen_request("x")
    nan_bias.sampling_params.logit_bias["5"] = float("nan")
    cases.append(("logit_bias_nan", nan_bias, "logit_bias"))
    for name, seed in (("nan", float("nan")), ("inf", float("inf")), ("fraction", 1.5), ("text", "7")):
        req = gen_request("x")
        req.sampling_params.custom_params.update({"seed": seed})
        cases.append((f"seed_{name}", req, "seed"))
    return cases


@pytest.mark.parametrize("name,request_,field", _invalid_cases(), ids=[c[0] for c in _invalid_cases()])
def test_invalid_request_is_invalid_argument_naming_the_field(stub, name, request_, field):
    request_.request_id = f"invalid-{name}"
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(request_))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


# ---- management ----------------------------------------------------------------------------------


def test_health_model_and_server_info(stub, tiny_llama):
    health = stub.HealthCheck(pb.HealthCheckRequest())
    assert health.healthy and health.message == "ok"
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_path == tiny_llama and info.is_generation
    assert info.served_model_name == os.path.basename(tiny_llama)
    assert info.vocab_size == 512 and info.max_context_length == 1024
    assert list(info.architectures) == ["LlamaForCausalLM"] and list(info.eos_token_ids)
    server = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert server.server_type == "grpc" and server.max_total_num_tokens == 2048
    assert server.scheduler_info["role"] == "unified" and server.server_args["disaggregation_mode"] == "null"
    assert server.server_args["page_size"] == 4 and server.uptime_seconds > 0
    assert server.start_time.seconds > 0


def test_get_loads_reports_the_sections_asked_for(stub):
    core = stub.GetLoads(pb.GetLoadsRequest(include=["core"]))
    assert core.dp_rank_count == 1 and not core.loads[0].HasField("memory")
    load = stub.GetLoads(pb.GetLoadsRequest(include=["core", "memory", "disagg", "queues"])).loads[0]
    assert load.max_total_num_tokens == 2048 and load.max_running_requests > 0
    assert load.memory.token_capacity == 2048 and load.memory.weight_gb > 0
    assert load.disaggregation.mode == "null" and load.HasField("queues")


def test_profiler_writes_a_chrome_trace(stub, tmp_path):
    started = stub.StartProfile(common_pb2.StartProfileRequest(output_dir=str(tmp_path)))
    assert started.success, started.message
    assert not stub.StartProfile(common_pb2.StartProfileRequest()).success  # already running
    list(stub.Generate(gen_request("profiled", stream=False, max_new_tokens=3)))
    stopped = stub.StopProfile(common_pb2.StopProfileRequest())
    assert stopped.success and stopped.message.startswith(str(tmp_path))
    with open(stopped.message) as f:
        assert "traceEvents" in json.load(f)


def test_get_tokenizer_streams_a_checksummed_zip(stub, tiny_llama):
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = set(zf.namelist())
        assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
        with open(os.path.join(tiny_llama, "tokenizer.json"), "rb") as f:
            assert zf.read("tokenizer.json") == f.read()


def test_kv_events_stream_stored_blocks_with_load(stub):
    events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(load_records_before_first_batch=True))
    first = next(events)
    assert first.sequence_number == 0 and first.load.load_only and first.load.max_running_requests > 0
    prompt = list(range(200, 240))
    list(stub.Generate(gen_request("kv-events", input_ids=prompt, stream=False, max_new_tokens=4)))
    deadline = time.monotonic() + 10
    blocks = []
    while not any(list(b.token_ids) == prompt[:4] for b in blocks):  # earlier tests' events may come first
        assert time.monotonic() < deadline, "no BlockStored event for the prompt arrived"
        batch = next(events)
        blocks += [b for e in batch.events if e.HasField("stored") for b in e.stored.blocks]
        if batch.events:
            assert batch.sequence_number > 0 and not batch.load.load_only
    assert all(b.block_size == 4 and len(b.token_ids) == 4 for b in blocks)
    start = next(i for i, b in enumerate(blocks) if list(b.token_ids) == prompt[:4])
    assert [t for b in blocks[start:start + 10] for t in b.token_ids] == prompt
    events.cancel()


def test_grpc_health_service_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "sglang.grpc.scheduler.SglangScheduler"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING
    reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
    (resp,) = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in resp.list_services_response.service}
    assert {"sglang.grpc.scheduler.SglangScheduler", "grpc.health.v1.Health"} <= names
