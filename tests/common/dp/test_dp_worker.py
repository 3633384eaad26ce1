"""`tandem worker --dp-size 2`: one gRPC endpoint over two replica processes — greedy parity with one engine,
both replicas used (GetLoads per DP rank), abort and finish free KV on every rank, with --tls-* every replica
demands a client certificate, the controller runs without torch, a dead replica fails health."""

from __future__ import annotations

import os
import re
import signal
import time

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.tls import blocking_channel
from tests.common.rpc.helpers import WorkerProcess, engine_greedy, gen_request

pytestmark = pytest.mark.e2e

PROMPTS = [[5 + i, 17, 42 + 3 * i, 99, 7, 300 - i, 12, 8][: 4 + i % 5] for i in range(6)]


@pytest.fixture(scope="module")
def dp_worker(tiny_llama, tmp_path_factory):
    """One DP worker for the module, with mutual TLS (its own case checks the replicas demand it too)."""
    from tandem.common.config import TlsConfig
    from tandem.common.launcher.certs import make_deployment_certs

    files = make_deployment_certs(str(tmp_path_factory.mktemp("certs")))
    tls = TlsConfig(files.ca_file, files.cert_file, files.key_file)
    worker = WorkerProcess(tiny_llama, "--dp-size", "2", "--load-balance-method", "round_robin",
                           "--num-threads", "1", "--drain-timeout", "5", "--tls-ca-file", files.ca_file,
                           "--tls-cert-file", files.cert_file, "--tls-key-file", files.key_file, timeout=180)
    worker.tls = tls
    channel = blocking_channel(worker.address, tls)
    yield worker, pb_grpc.SglangSchedulerStub(channel)
    channel.close()
    if worker.proc.poll() is None:
        worker.stop()


def _generate(stub, rid: str, prompt, **sampling) -> list[int]:
    ids = []
    for resp in stub.Generate(gen_request(rid, prompt, **sampling)):
        if resp.HasField("chunk"):
            ids += list(resp.chunk.token_ids)
    return ids


def _wait_idle_all(stub, timeout: float = 20.0) -> pb.GetLoadsResponse:
    deadline = time.monotonic() + timeout
    while True:
        loads = stub.GetLoads(pb.GetLoadsRequest(include=["all"]))
        if all(x.num_running_reqs == x.num_waiting_reqs == x.num_used_tokens == 0 for x in loads.loads):
            return loads
        assert time.monotonic() < deadline, f"replicas not idle: {loads}"
        time.sleep(0.05)


def test_greedy_parity_and_both_ranks_used(dp_worker, tiny_llama):
    worker, stub = dp_worker
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=2048, page_size=4, max_context_len=1024)
    with Engine(config) as engine:
        expected = [engine_greedy(engine, p, 6).sequences[0].output_ids for p in PROMPTS]
    got = [_generate(stub, f"g{i}", p, max_new_tokens=6) for i, p in enumerate(PROMPTS)]
    assert got == expected
    loads = _wait_idle_all(stub)
    assert loads.dp_rank_count == 2 and [x.dp_rank for x in loads.loads] == [0, 1]
    # Round robin: each replica served 3 prompts, so each cached prompt tokens in its own RadixCache.
    assert all(x.token_usage > 0 for x in loads.loads)
    one = stub.GetLoads(pb.GetLoadsRequest(dp_rank=1))
    assert [x.dp_rank for x in one.loads] == [1]
    with pytest.raises(grpc.RpcError) as bad:
        stub.GetLoads(pb.GetLoadsRequest(dp_rank=2))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dp_rank" in bad.value.details()
    info = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert info.server_args["dp_size"] == 2


def test_pinned_rank_n_and_abort_free_kv(dp_worker):
    worker, stub = dp_worker
    assert stub.FlushCache(common_pb2.FlushCacheRequest()).success
    # n = 3 stays on the pinned rank: all three sequences come back from rank 1.
    req = gen_request("n3", PROMPTS[0], max_new_tokens=4, n=3)
    req.data_parallel_rank = 1
    finished = [r for r in stub.Generate(req) if r.HasField("complete")]
    assert len(finished) == 3
    loads = _wait_idle_all(stub)
    assert loads.loads[0].token_usage == 0 and loads.loads[1].token_usage > 0
    # A long request is aborted through the controller, on whichever rank holds it; every rank frees its KV.
    stream = stub.Generate(gen_request("long", PROMPTS[1], max_new_tokens=500, ignore_eos=True))
    first = next(stream)
    assert first.HasField("chunk")
    assert stub.Abort(pb.AbortRequest(request_id="long", reason="test")).message == "abort sent"
    rest = list(stream)
    assert rest[-1].HasField("complete") and rest[-1].complete.finish_reason == "abort"
    assert len(rest[-1].complete.output_ids) < 500
    assert stub.FlushCache(common_pb2.FlushCacheRequest(timeout_s=10)).success
    assert all(x.token_usage == 0 for x in _wait_idle_all(stub).loads)
    assert stub.HealthCheck(pb.HealthCheckRequest()).healthy


def test_runtime_control_reaches_every_replica(dp_worker, tiny_llama, tmp_path):
    """WorkerAdmin on a DP worker: an update from disk lands on both replicas under one version (greedy output of
    both equals the engine on the new checkpoint), a bad path changes nothing, distributed updates are refused."""
    from tandem.common.model.create import create_model
    from tandem.common.proto_gen.tandem import admin_pb2 as apb
    from tandem.common.proto_gen.tandem import admin_pb2_grpc as apb_grpc

    worker, stub = dp_worker
    other = create_model(str(tmp_path / "other"), preset="tiny", seed=7)
    config = EngineConfig(model_path=other, max_total_tokens=2048, page_size=4, max_context_len=1024)
    with Engine(config) as engine:
        expected = [engine_greedy(engine, p, 5).sequences[0].output_ids for p in PROMPTS[:4]]
    with blocking_channel(worker.address, worker.tls) as channel:
        admin = apb_grpc.WorkerAdminStub(channel)
        bad = admin.UpdateWeightsFromDisk(apb.UpdateWeightsFromDiskRequest(model_path=str(tmp_path / "none")))
        assert not bad.success and "data-parallel replica 0" in bad.message
        reply = admin.UpdateWeightsFromDisk(apb.UpdateWeightsFromDiskRequest(model_path=other))
        assert reply.success and reply.weight_version == other, reply.message
        # Round robin: consecutive requests alternate replicas, so both serve the new weights.
        assert [_generate(stub, f"w{i}", p, max_new_tokens=5) for i, p in enumerate(PROMPTS[:4])] == expected
        with pytest.raises(grpc.RpcError) as refused:
            admin.InitWeightsUpdateGroup(apb.InitWeightsUpdateGroupRequest(group_name="g"))
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED and "--dp-size" in refused.value.details()
        back = admin.UpdateWeightsFromDisk(apb.UpdateWeightsFromDiskRequest(model_path=tiny_llama))
        assert back.success, back.message
    _wait_idle_all(stub)


def test_replicas_demand_mutual_tls_when_the_worker_does(dp_worker):
    """Loopback is reachable by any local process: with --tls-* every replica demands a client certificate too,
    and the controller presents its own."""
    worker, stub = dp_worker  # the module's worker runs with --tls-*; its stub presents a client certificate
    line = next(x for x in worker.log if "data-parallel" in x and "listening" in x)
    replica_ports = [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", line.split("(", 1)[1])]
    assert len(replica_ports) == 2, line
    assert _generate(stub, "tls", PROMPTS[0], max_new_tokens=3)
    for address in (worker.address, *(f"127.0.0.1:{port}" for port in replica_ports)):
        with grpc.insecure_channel(address) as plain:
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.SglangSchedulerStub(plain).GetLoads(pb.GetLoadsRequest(), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    _wait_idle_all(stub)


def test_the_controller_runs_without_torch_and_its_replicas_with_it(dp_worker):
    """The controller only routes: after serving the module's requests and admin calls, it has never loaded torch
    (no libtorch mapped: seconds of CPU at every DP start), while each replica has."""
    worker, stub = dp_worker
    assert _generate(stub, "notorch", PROMPTS[0], max_new_tokens=3)
    with open(f"/proc/{worker.proc.pid}/task/{worker.proc.pid}/children") as f:
        replicas = [int(pid) for pid in f.read().split()]
    assert len(replicas) == 2
    assert not _maps_libtorch(worker.proc.pid)
    assert all(_maps_libtorch(pid) for pid in replicas)
    _wait_idle_all(stub)


def _maps_libtorch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "libtorch" in f.read()


def test_the_controller_passes_a_resumed_request_on_to_its_replica(dp_worker):
    """tandem-resumed-output-tokens reaches the replica: a min_new_tokens continuation counts its resumed tokens
    (so it equals the rest of the original), and a bad value is the replica's INVALID_ARGUMENT naming the key."""
    from tandem.common.rpc.resume import RESUMED_OUTPUT_TOKENS_KEY, resume_metadata

    _, stub = dp_worker
    prompt, stops = PROMPTS[2], list(range(0, 200, 2))  # half the vocabulary stops it once min_new_tokens allows
    original = _generate(stub, "resume-a", prompt, max_new_tokens=30, min_new_tokens=10, stop_token_ids=stops)
    assert 10 <= len(original) < 30, original
    k = 5
    request = gen_request("resume-b", prompt + original[:k], max_new_tokens=30 - k, min_new_tokens=10,
                          stop_token_ids=stops)
    continued = []
    for resp in stub.Generate(request, metadata=resume_metadata(k)):
        if resp.HasField("chunk"):
            continued += list(resp.chunk.token_ids)
    assert continued == original[k:]
    with pytest.raises(grpc.RpcError) as bad:
        list(stub.Generate(gen_request("resume-c", prompt, max_new_tokens=4), metadata=resume_metadata(len(prompt))))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and RESUMED_OUTPUT_TOKENS_KEY in bad.value.details()
    _wait_idle_all(stub)


# Last in this module: it kills the module's worker.
def test_killed_replica_makes_health_not_serving(dp_worker):
    """Last in this module (it ends the worker). One long request per replica (round robin sends consecutive
    requests to different replicas); killing a replica fails its request, health turns NOT_SERVING while the
    survivor's request drains (--drain-timeout 5), and the worker exits 1."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    worker, _ = dp_worker
    channel = blocking_channel(worker.address, worker.tls)
    try:
        stub, health = pb_grpc.SglangSchedulerStub(channel), health_pb2_grpc.HealthStub(channel)
        streams = [stub.Generate(gen_request(f"long{i}", PROMPTS[i], max_new_tokens=800, ignore_eos=True))
                   for i in range(2)]
        assert all(next(s).HasField("chunk") for s in streams)
        os.kill(_replica_pid(worker.proc.pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while health.Check(health_pb2.HealthCheckRequest(service="")).status != \
                health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "health still SERVING after a replica died"
            time.sleep(0.05)
        assert not stub.HealthCheck(pb.HealthCheckRequest()).healthy
        assert worker.proc.wait(30) == 1
        assert "data-parallel replica" in "".join(worker.log)
    finally:
        channel.close()
        if worker.proc.poll() is None:
            worker.proc.kill()


def _replica_pid(parent: int) -> int:
    """One replica process: a child of the worker process."""
    with open(f"/proc/{parent}/task/{parent}/children") as f:
        return int(f.read().split()[0])
