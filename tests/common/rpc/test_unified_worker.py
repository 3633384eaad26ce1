"""`tandem worker` process life: SIGTERM drains (health NOT_SERVING, in-flight requests finish, exit 0)."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.common.rpc.helpers import WorkerProcess, gen_request

pytestmark = pytest.mark.e2e


def test_sigterm_drains_in_flight_requests_then_exits(tiny_llama):
    worker = WorkerProcess(tiny_llama, "--served-model-name", "tiny-served")
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SglangSchedulerStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            assert stub.GetModelInfo(pb.GetModelInfoRequest()).served_model_name == "tiny-served"
            stream = stub.Generate(gen_request("drain-1", max_new_tokens=800, ignore_eos=True))
            assert next(stream).HasField("chunk")
            responses: list = []
            reader = threading.Thread(target=lambda: responses.extend(stream))
            reader.start()
            worker.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while health.Check(health_pb2.HealthCheckRequest()).status != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() < deadline, "health did not turn NOT_SERVING on SIGTERM"
                time.sleep(0.02)
            if reader.is_alive():  # still draining: the worker is unhealthy and refuses new work
                assert not stub.HealthCheck(pb.HealthCheckRequest()).healthy
                try:
                    list(stub.Generate(gen_request("drain-late", max_new_tokens=2)))
                except grpc.RpcError as e:
                    assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                else:
                    pytest.fail("a draining worker accepted new work")
            reader.join(60)
            assert responses[-1].HasField("complete")
            assert responses[-1].complete.finish_reason == "length"
            assert responses[-1].complete.completion_tokens == 800
        assert worker.proc.wait(30) == 0, "".join(worker.log[-30:])
    finally:
        worker.stop()
