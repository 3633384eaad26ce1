"""GenerateStream.Multiplex: many requests on one stream to a real worker, a step's outputs in one message; and
the router using it (and Generate calls with --no-worker-stream), greedy-equal either way."""

from __future__ import annotations

import json
import queue
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.launcher.children import free_port
from tandem.common.proto_gen.tandem import admin_pb2 as apb
from tandem.common.proto_gen.tandem import admin_pb2_grpc as apb_grpc
from tandem.common.proto_gen.tandem import generate_stream_pb2 as spb
from tandem.common.proto_gen.tandem import generate_stream_pb2_grpc as spb_grpc
from tests.services.router.conftest import RouterProcess, readiness, start_worker, wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def worker(tiny_llama):
    port = free_port()
    proc = start_worker(tiny_llama, port)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield proc, channel, port
    channel.close()
    assert proc.stop() == 0


def _request(rid: str, ids: list[int], max_new: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=rid, tokenized=pb.TokenizedInput(input_ids=ids), stream=True,
        sampling_params=pb.SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True))


def _start(tag: int, request: pb.GenerateRequest) -> spb.StreamRequest:
    return spb.StreamRequest(start=spb.Start(tag=tag, request=request.SerializeToString()))


def _output_ids(responses: list[pb.GenerateResponse]) -> list[int]:
    return list(responses[-1].complete.output_ids)


def _idle(channel) -> bool:
    load = pb_grpc.SglangSchedulerStub(channel).GetLoads(pb.GetLoadsRequest(include=["all"]), timeout=5).loads[0]
    return load.num_running_reqs == 0 and load.num_waiting_reqs == 0 and load.num_used_tokens == 0


def test_requests_on_one_stream_equal_their_generate_calls_and_cancel_frees_the_kv(worker):
    proc, channel, _ = worker
    stub = pb_grpc.SglangSchedulerStub(channel)
    requests = {1: _request("a", [5, 6, 7, 8], 8), 2: _request("b", list(range(20, 60)), 24),
                4: _request("long", [9, 10, 11], 900)}
    bad = _request("bad", [5, 6], 4)
    bad.sampling_params.custom_params.update({"seed": "x"})
    outgoing: queue.Queue = queue.Queue()
    for tag, request in requests.items():
        outgoing.put(_start(tag, request))
    outgoing.put(_start(3, bad))
    outgoing.put(_start(1, requests[1]))  # tag 1 is in flight: refused, tag 1 itself goes on
    call = spb_grpc.GenerateStreamStub(channel).Multiplex(iter(outgoing.get, None), timeout=120)
    responses: dict[int, list] = {tag: [] for tag in requests}
    ends: dict[int, list] = {}
    shared_messages = 0
    for batch in call:
        shared_messages += len({item.tag for item in batch.items if item.HasField("response")}) > 1
        for item in batch.items:
            if item.HasField("end"):
                ends.setdefault(item.tag, []).append(item.end)
                continue
            responses[item.tag].append(pb.GenerateResponse.FromString(item.response))
            if item.tag == 4 and len(responses[4]) == 1:
                outgoing.put(spb.StreamRequest(cancel=spb.Cancel(tag=4)))
        if 1 in ends and 2 in ends and 3 in ends and len(ends[1]) == 2:
            outgoing.put(None)  # half-close: the stream ends once nothing is left on it
    assert 4 not in ends  # a cancelled request gets no End
    assert [e.code for e in ends[3]] == [grpc.StatusCode.INVALID_ARGUMENT.value[0]]
    assert "seed" in ends[3][0].details
    duplicate, done = sorted(ends[1], key=lambda e: e.code, reverse=True)
    assert duplicate.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "start.tag" in duplicate.details
    assert done.code == 0 and "tandem-weight-version" in done.trailing_metadata
    assert ends[2][0].code == 0
    assert shared_messages > 0  # one message carried several requests' tokens
    for tag in (1, 2):
        alone = list(stub.Generate(requests[tag], timeout=60))
        assert _output_ids(responses[tag]) == _output_ids(alone)
        streamed = [t for r in responses[tag] if r.HasField("chunk") for t in r.chunk.token_ids]
        assert streamed == _output_ids(alone)
    wait_until(lambda: _idle(channel), 10, "the cancelled request's KV to be freed")
    assert any("request long ended early; aborting" in line for line in proc.log)


def test_a_stream_that_breaks_frees_every_request_on_it(worker):
    proc, channel, _ = worker
    outgoing: queue.Queue = queue.Queue()
    outgoing.put(_start(1, _request("gone-1", [3, 4, 5], 900)))
    outgoing.put(_start(2, _request("gone-2", [6, 7], 900)))
    call = spb_grpc.GenerateStreamStub(channel).Multiplex(iter(outgoing.get, None), timeout=120)
    seen: set[int] = set()
    for batch in call:
        seen |= {item.tag for item in batch.items}
        if seen == {1, 2}:
            break
    call.cancel()  # the router went away
    wait_until(lambda: _idle(channel), 10, "both requests' KV to be freed")
    for rid in ("gone-1", "gone-2"):
        assert any(f"request {rid} ended early; aborting" in line for line in proc.log)


def _workers(router) -> list[dict]:
    with urllib.request.urlopen(router.url + "/readiness", timeout=5) as resp:
        return json.loads(resp.read())["workers"]


def _complete(router, prompt: str, max_tokens: int, stream: bool) -> str:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": stream}).encode()
    request = urllib.request.Request(router.url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        if not stream:
            return json.loads(resp.read())["choices"][0]["text"]
        lines = [line[6:] for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    return "".join(c["choices"][0]["text"] for c in map(json.loads, lines[:-1]) if c["choices"])


def test_router_uses_the_stream_and_generate_calls_alike(worker, tiny_llama):
    _, channel, port = worker
    common = ("--worker", f"grpc://127.0.0.1:{port}", "--model-path", tiny_llama, "--served-model-name", "tiny",
              "--request-timeout-s", "3")
    routers = {"stream": RouterProcess(*common), "calls": RouterProcess(*common, "--no-worker-stream")}
    try:
        for router in routers.values():
            wait_until(lambda r=router: readiness(r) == 200, 60, "readiness")
        assert [_workers(r)[0]["generate_stream"] for r in routers.values()] == [True, False]
        prompts = ["Once upon a time", "The quick brown fox", "In the beginning"]
        texts = {name: [] for name in routers}
        for name, router in routers.items():
            threads = [threading.Thread(target=lambda p=p, s=s: texts[name].append((p, s, _complete(router, p, 12, s))))
                       for p in prompts for s in (True, False)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
        assert sorted(texts["stream"]) == sorted(texts["calls"]) and len(texts["stream"]) == 6
        for p in prompts:  # streamed and whole answers agree
            assert len({text for q, _, text in texts["stream"] if q == p}) == 1
        # --request-timeout-s on the stream: 504, and the worker frees the request.
        admin = apb_grpc.WorkerAdminStub(channel)
        admin.SlowDown(apb.SlowDownRequest(forward_sleep_time=0.05), timeout=10)  # 100 tokens take > 5 s
        try:
            with pytest.raises(urllib.error.HTTPError) as err:
                _complete(routers["stream"], "a long one", 100, False)
        finally:
            admin.SlowDown(apb.SlowDownRequest(forward_sleep_time=0), timeout=10)
        assert err.value.code == 504
        wait_until(lambda: _idle(channel), 10, "the timed-out request's KV to be freed")
    finally:
        for router in routers.values():
            router.stop()
