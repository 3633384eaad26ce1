"""Pipeline parallelism served: `tandem generate --pp-size 2` and `tandem worker --pp-size 2` equal the
single-process engine; a dead stage makes the worker exit non-zero; `tandem up` refuses a pipelined prefill/decode."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.common.rpc.helpers import PROMPT, WorkerProcess, cli_in_process, gen_request

pytestmark = pytest.mark.e2e

PROMPTS = [PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 1] * 9, [44]]
PP_FLAGS = ("--pp-size", "2", "--num-threads", "1", "--dist-timeout", "6")


@pytest.fixture(scope="module")
def reference(tiny_llama):
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    with Engine(EngineConfig(model_path=tiny_llama, max_total_tokens=2048)) as engine:
        results = engine.generate([GenerateRequest(f"r{i}", p, params) for i, p in enumerate(PROMPTS)])
    return [r.sequences[0].output_ids for r in results]


def _stage_pids(worker_pid: int) -> list[int]:
    with open(f"/proc/{worker_pid}/task/{worker_pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    pids = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"tandem.common.model.parallel.stage_worker" in f.read():
                pids.append(child)
    return pids


def test_generate_cli_pp2_matches_single_process(tiny_llama, reference, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "input_ids": p, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}) + "\n" for i, p in enumerate(PROMPTS)))
    # The entry point's main in this process (its ranks are processes still): no interpreter of its own to start
    assert cli_in_process(["generate", "--model", tiny_llama, "--input", str(src), "--output", str(dst),
                     "--max-total-tokens", "2048", *PP_FLAGS]) == 0
    rows = sorted((json.loads(line) for line in dst.read_text().splitlines()), key=lambda r: r["id"])
    assert [r["output_ids"] for r in rows] == reference


def test_worker_pp2_serves_then_fails_fast_when_a_stage_dies(tiny_llama, reference):
    worker = WorkerProcess(tiny_llama, *PP_FLAGS)
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SglangSchedulerStub(channel)
            for i, (prompt, expected) in enumerate(zip(PROMPTS, reference)):
                responses = list(stub.Generate(gen_request(f"pp-{i}", prompt, max_new_tokens=10, ignore_eos=True)))
                assert [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids] == expected
            (stage1,) = _stage_pids(worker.proc.pid)
            os.kill(stage1, signal.SIGKILL)
            code = worker.proc.wait(30)  # noticed without any request: stops serving, exits non-zero
        assert code != 0
        assert "tandem unified worker stopped: pipeline stage 1 exited" in "".join(worker.log)
    finally:
        if worker.proc.poll() is None:
            worker.proc.kill()


def test_up_refuses_pipelined_prefill_and_decode(tiny_llama):
    proc = subprocess.run([sys.executable, "-m", "tandem.common.cli", "up", "--model", tiny_llama, "--pp-size", "2"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--pp-size 2 needs --unified K: pipeline parallelism on prefill/decode workers" in proc.stderr
