"""Worker death and return, retries on another worker, client disconnects aborting the worker, back-pressure.

Tests whose worker survives share the module's worker (conftest `worker`), each with a router of its own; a test
that kills a worker starts that victim itself."""

from __future__ import annotations

import json
import socket
import threading

import grpc
import openai
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.services.router.conftest import RouterProcess, free_port, readiness, start_worker, wait_until

pytestmark = pytest.mark.e2e


def worker_load(address: str) -> pb.SchedulerLoad:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.SglangSchedulerStub(channel).GetLoads(pb.GetLoadsRequest(), timeout=5).loads[0]


def openai_client(router):
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_worker_down_gives_503_and_its_return_is_served_again(tiny_llama):
    port = free_port()
    worker = start_worker(tiny_llama, port)
    router = RouterProcess("--worker", f"grpc://127.0.0.1:{port}", "--model-path", tiny_llama,
                           "--served-model-name", "tiny")
    try:
        wait_until(lambda: readiness(router) == 200, 60, "readiness")
        client = openai_client(router)
        assert client.completions.create(model="tiny", prompt="a", max_tokens=2).choices
        worker.kill()
        wait_until(lambda: readiness(router) == 503, 20, "readiness to drop")
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt="a", max_tokens=2)
        assert info.value.status_code == 503
        worker = start_worker(tiny_llama, port)
        wait_until(lambda: readiness(router) == 200, 30, "readiness to return")
        assert client.completions.create(model="tiny", prompt="a", max_tokens=2).choices
    finally:
        router.stop()
        worker.stop()


def test_failed_worker_is_retried_on_another(tiny_llama, worker_address):
    victim_port = free_port()
    victim = start_worker(tiny_llama, victim_port)
    router = RouterProcess(f"--worker=grpc://127.0.0.1:{victim_port}", f"--worker=grpc://{worker_address}",
                           "--model-path", tiny_llama, "--served-model-name", "tiny", "--policy", "round_robin",
                           "--health-check-interval-s", "30")  # slow probes: requests find the dead worker first
    try:
        wait_until(lambda: readiness(router) == 200 and b'"healthy": false' not in _readiness_body(router), 60,
                   "both workers healthy")
        victim.kill()
        client = openai_client(router)
        for _ in range(4):  # round robin sends some of these to the dead worker first
            assert len(client.completions.create(model="tiny", prompt="a", max_tokens=3,
                                                 extra_body={"ignore_eos": True}).choices[0].text) > 0
        metrics = _get(router, "/metrics").decode()
        assert 'tandem_router_retries_total{model_name="tiny"} ' in metrics
        assert 'tandem_router_retries_total{model_name="tiny"} 0.0' not in metrics
    finally:
        router.stop()
        victim.stop()


def _get(router, path: str) -> bytes:
    import urllib.request

    with urllib.request.urlopen(router.url + path, timeout=10) as resp:
        return resp.read()


def _readiness_body(router) -> bytes:
    import urllib.error
    import urllib.request

    try:
        return _get(router, "/readiness")
    except urllib.error.HTTPError as e:
        return e.read()


def _stream_then_disconnect(router, body: dict, chunks_before_close: int) -> int:
    """Raw HTTP so the connection can be dropped mid-stream; returns data events seen."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", router.port), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    seen, buffer = 0, b""
    while seen < chunks_before_close:
        data = sock.recv(4096)
        assert data, "the stream ended early"
        buffer += data
        seen = buffer.count(b"data: ")
    sock.close()
    return seen


def test_client_disconnect_aborts_the_request_on_the_worker(tiny_llama, worker, worker_address):
    router = RouterProcess("--worker", f"grpc://{worker_address}", "--model-path", tiny_llama,
                           "--served-model-name", "tiny")
    address, earlier_lines = worker_address, len(worker.log)
    try:
        wait_until(lambda: readiness(router) == 200, 60, "readiness")
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1000, "n": 4, "stream": True,
                "ignore_eos": True}
        _stream_then_disconnect(router, body, 3)
        wait_until(lambda: worker_load(address).num_running_reqs == 0 and worker_load(address).num_waiting_reqs == 0,
                   5, "the worker to abort the request", interval=0.05)
        # It stopped because the router cancelled it, not because it ran to completion.
        wait_until(lambda: any("ended early; aborting" in line for line in worker.log[earlier_lines:]), 5,
                   "the worker's abort")
    finally:
        router.stop()


def test_full_queue_answers_429(tiny_llama, worker_address):
    router = RouterProcess("--worker", f"grpc://{worker_address}", "--model-path", tiny_llama,
                           "--served-model-name", "tiny", "--max-running-requests", "1", "--max-queued-requests", "0")
    try:
        wait_until(lambda: readiness(router) == 200, 60, "readiness")
        client = openai_client(router)
        long_request = threading.Thread(target=lambda: client.completions.create(
            model="tiny", prompt="a", max_tokens=400, extra_body={"ignore_eos": True}))
        long_request.start()
        running = b'tandem_router_running_requests{model_name="tiny"} 1.0'
        wait_until(lambda: running in _get(router, "/metrics"), 10, "a running request")
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt="a", max_tokens=2)
        long_request.join(60)
        assert client.completions.create(model="tiny", prompt="a", max_tokens=2).choices
    finally:
        router.stop()


def test_dns_discovery_tokenizer_from_worker_and_api_key(tiny_llama, worker_address, tmp_path):
    """--worker-dns resolves the name to workers; without --model-path the tokenizer comes over GetTokenizer."""
    port = worker_address.rsplit(":", 1)[1]
    router = RouterProcess("--worker-dns", f"localhost:{port}", "--dns-refresh-s", "1", "--api-key", "sesame",
                           "--tokenizer-cache-dir", str(tmp_path))
    try:
        wait_until(lambda: readiness(router) == 200, 60, "readiness")
        model = json.loads(_get_with_key(router, "/v1/models", "sesame"))["data"][0]["id"]
        with openai.OpenAI(base_url=router.url + "/v1", api_key="sesame", max_retries=0) as client:
            reply = client.completions.create(model=model, prompt="Hello", max_tokens=3,
                                              extra_body={"ignore_eos": True})
            assert reply.usage.completion_tokens == 3
        with openai.OpenAI(base_url=router.url + "/v1", api_key="wrong", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError):
                client.completions.create(model=model, prompt="Hello", max_tokens=3)
        assert any(p.name == "tokenizer.json" for p in tmp_path.rglob("*"))
    finally:
        router.stop()


def _get_with_key(router, path: str, key: str) -> bytes:
    import urllib.request

    request = urllib.request.Request(router.url + path, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return resp.read()
