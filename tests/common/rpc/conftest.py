"""Fixtures for gRPC worker tests: one plain `tandem worker` process for the package (the servicer cases and the
smg gateway in front of it), stubs, a reference engine."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tests.common.rpc.helpers import WorkerProcess


@pytest.fixture(scope="package")
def worker(tiny_llama):
    proc = WorkerProcess(tiny_llama)
    yield proc
    code = proc.stop()
    assert code == 0, "worker did not shut down cleanly:\n" + "".join(proc.log[-40:])


@pytest.fixture(scope="package")
def channel(worker):
    with grpc.insecure_channel(worker.address) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield ch


@pytest.fixture(scope="package")
def stub(channel):
    return pb_grpc.SglangSchedulerStub(channel)


@pytest.fixture(scope="package")
def ref_engine(tiny_llama):
    """The in-process engine with the worker's configuration: the reference for parity checks."""
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=2048, page_size=4, chunked_prefill_size=64,
                          max_context_len=1024)
    with Engine(config) as engine:
        yield engine
