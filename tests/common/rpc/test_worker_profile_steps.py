"""A served worker's --profile-steps: streams as without it, is freed after each request, and logs the step split
(rows per step, the decode step period against its forward) when it stops; `tandem up` hands the flags to workers."""

from __future__ import annotations

import argparse

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.launcher.up import add_up_args, config_from_args
from tests.common.rpc.helpers import WorkerProcess, gen_request, wait_idle


@pytest.mark.e2e
def test_served_worker_logs_the_step_split_at_stop(tiny_llama):
    worker = WorkerProcess(tiny_llama, "--profile-steps", "--prefill-wait-ms", "2")
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SglangSchedulerStub(channel)
            tokens = [list(r.chunk.token_ids) for r in stub.Generate(gen_request("p", max_new_tokens=6, ignore_eos=True),
                                                                     timeout=60) if r.HasField("chunk")]
            assert sum(len(t) for t in tokens) == 6
            wait_idle(stub)
    finally:
        assert worker.stop() == 0
    log = "".join(worker.log)
    assert "step time split" in log and "step/fwd" in log
    assert "decode at batch 1:" in log  # one stream: every decode step had one row


def test_up_hands_profile_and_prefill_wait_flags_to_every_worker(tiny_llama):
    parser = argparse.ArgumentParser()
    add_up_args(parser)
    config = config_from_args(parser.parse_args(["--model", tiny_llama, "--unified", "1", "--profile-steps",
                                                 "--prefill-wait-ms", "3", "--prefill-wait-max-ms", "20"]))
    flags = config.engine_flags
    assert "--profile-steps" in flags
    assert float(flags[flags.index("--prefill-wait-ms") + 1]) == 3.0
    assert float(flags[flags.index("--prefill-wait-max-ms") + 1]) == 20.0
