"""Tensor parallelism served: `tandem generate --tp-size 2` and `tandem worker --tp-size 2` equal the single-process
engine; a dead rank fails the worker fast (non-zero exit), and the other ranks of a dead rank 0 exit by themselves."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.flags import ConfigError
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.common.rpc.helpers import PROMPT, WorkerProcess, cli_in_process, gen_request

PROMPTS = [PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 1] * 9, [44]]
TP_FLAGS = ("--tp-size", "2", "--num-threads", "1", "--dist-timeout", "6")


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy ids of the single-process engine."""
    params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    with Engine(EngineConfig(model_path=tiny_llama, max_total_tokens=2048)) as engine:
        results = engine.generate([GenerateRequest(f"r{i}", p, params) for i, p in enumerate(PROMPTS)])
    return [r.sequences[0].output_ids for r in results]


@pytest.fixture(scope="module")
def tp2_worker(tiny_llama):
    """One `tandem worker --tp-size 2` for the smg test and then the test that kills its rank 1 (last to use it)."""
    worker = WorkerProcess(tiny_llama, *TP_FLAGS)
    yield worker
    if worker.proc.poll() is None:
        worker.proc.kill()
        worker.proc.wait()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _rank_pids(worker_pid: int) -> list[int]:
    pids = []
    for child in _children(worker_pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"tandem.common.model.parallel.follower" in f.read():
                pids.append(child)
    return pids


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.e2e
def test_generate_cli_tp2_matches_single_process(tiny_llama, reference, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "input_ids": p, "sampling_params": {
        "max_new_tokens": 10, "temperature": 0, "ignore_eos": True}}) + "\n" for i, p in enumerate(PROMPTS)))
    # The entry point's main in this process (its ranks are processes still): no interpreter of its own to start
    assert cli_in_process(["generate", "--model", tiny_llama, "--input", str(src), "--output", str(dst),
                     "--max-total-tokens", "2048", *TP_FLAGS]) == 0
    rows = sorted((json.loads(line) for line in dst.read_text().splitlines()), key=lambda r: r["id"])
    assert [r["output_ids"] for r in rows] == reference


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("smg") is None, reason="the smg gateway (pip install smg) is not installed")
def test_smg_gateway_in_front_of_a_tp2_worker(tp2_worker, tiny_llama, tmp_path):
    from tandem.common.tokenizer import load_tokenizer
    from tests.common.rpc.helpers import http_post, smg_gateway

    tokenizer = load_tokenizer(tiny_llama).tokenizer
    prompt = "the quick brown fox"
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids  # smg adds no special tokens to prompts
    with Engine(EngineConfig(model_path=tiny_llama, max_total_tokens=2048)) as engine:
        expected = engine.generate([GenerateRequest("ref", ids, SamplingParams(max_new_tokens=10, temperature=0.0))])
    with smg_gateway(["--worker-urls", f"grpc://{tp2_worker.address}"], tiny_llama, tmp_path, healthy=1) as base:
        body = {"model": os.path.basename(tiny_llama), "prompt": prompt, "max_tokens": 10, "temperature": 0}
        out = json.loads(http_post(f"{base}/v1/completions", body))
    assert out["choices"][0]["text"] == tokenizer.decode(expected[0].sequences[0].output_ids,
                                                         skip_special_tokens=True)


@pytest.mark.e2e
def test_worker_tp2_serves_then_fails_fast_when_a_rank_dies(tp2_worker, reference):
    """Last user of tp2_worker (it ends it); the smg test ran on it before."""
    worker = tp2_worker
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SglangSchedulerStub(channel)
            for i, (prompt, expected) in enumerate(zip(PROMPTS, reference)):
                responses = list(stub.Generate(gen_request(f"tp-{i}", prompt, max_new_tokens=10, ignore_eos=True)))
                ids = [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]
                assert ids == expected
            info = stub.GetServerInfo(pb.GetServerInfoRequest())
            assert info.server_args["tp_size"] == 2
            (rank1,) = _rank_pids(worker.proc.pid)
            os.kill(rank1, signal.SIGKILL)
            # The worker notices without any request, stops serving and exits non-zero.
            code = worker.proc.wait(30)
        assert code != 0
        assert "tandem unified worker stopped: tensor-parallel" in "".join(worker.log)
    finally:
        if worker.proc.poll() is None:
            worker.proc.kill()


@pytest.mark.e2e
def test_ranks_of_a_killed_rank0_exit_by_themselves(tiny_llama):
    worker = WorkerProcess(tiny_llama, *TP_FLAGS)
    try:
        (rank1,) = _rank_pids(worker.proc.pid)
        worker.proc.kill()
        worker.proc.wait(10)
        deadline = time.monotonic() + 20  # within --dist-timeout (6 s) of its last collective, and usually at once
        while not _gone(rank1):
            assert time.monotonic() < deadline, "rank 1 is still waiting for a dead rank 0"
            time.sleep(0.1)
    finally:
        if worker.proc.poll() is None:
            worker.proc.kill()


def test_tensor_and_pipeline_parallelism_over_nodes_is_a_start_up_error(tiny_llama):
    assert EngineConfig(model_path=tiny_llama, tp_size=2, pp_size=2).validate().pp_size == 2  # one node: built
    with pytest.raises(ConfigError, match="--pp-size 2 with --nnodes 2: a pipeline's ranks spanning nodes"):
        EngineConfig(model_path=tiny_llama, tp_size=2, pp_size=2, nnodes=2, dist_init_addr="127.0.0.1:1").validate()


@pytest.mark.e2e
def test_two_nodes_node0_serves_and_node1_runs_its_rank(tiny_llama, reference):
    """--nnodes 2 on one host: node 1 runs rank 1 only (with node 0's engine flags); node 0 serves; stopping node 0
    stops node 1 cleanly."""
    from tests.common.rpc.helpers import REPO_ROOT, WORKER_FLAGS, free_port

    multi = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}", "--num-threads", "1"]
    node1 = subprocess.Popen([sys.executable, "-m", "tandem.common.cli", "worker", "--model", tiny_llama, *WORKER_FLAGS,
                              *multi, "--node-rank", "1"], cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    worker = WorkerProcess(tiny_llama, *multi, "--node-rank", "0", timeout=180)
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SglangSchedulerStub(channel)
            responses = list(stub.Generate(gen_request("n0", PROMPTS[1], max_new_tokens=10, ignore_eos=True)))
            assert [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids] == reference[1]
        assert worker.stop() == 0
        assert node1.wait(30) == 0, node1.stderr.read()
    finally:
        for proc in (worker.proc, node1):
            if proc.poll() is None:
                proc.kill()


@pytest.mark.e2e
def test_nodes_started_with_different_page_sizes_fail_with_the_reason(tiny_llama):
    """Node 1's ranks build their pools from node 1's own flags: a --page-size that differs from node 0's fails
    start-up on both nodes, naming the rank and both values, instead of serving from mismatched pools."""
    from tests.common.rpc.helpers import REPO_ROOT, free_port

    multi = ["--model", tiny_llama, "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}",
             "--num-threads", "1"]
    node1 = subprocess.Popen([sys.executable, "-m", "tandem.common.cli", "worker", *multi, "--node-rank", "1",
                              "--page-size", "8"], cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        node0 = subprocess.run([sys.executable, "-m", "tandem.common.cli", "worker", *multi, "--node-rank", "0", "--port",
                                "0", "--page-size", "16"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
        want = "tensor-parallel rank 1 has --page-size 8 and KV dtype float32, rank 0 --page-size 16 and float32"
        assert node0.returncode != 0 and want in node0.stderr, node0.stderr[-2000:]
        assert node1.wait(60) != 0
        assert want in node1.stderr.read()
    finally:
        if node1.poll() is None:
            node1.kill()


@pytest.mark.e2e
def test_a_rank_that_dies_during_start_up_fails_rank_0_at_once(tiny_llama, monkeypatch):
    """Rank 0 waits in the rendezvous for its ranks; one that exits first (a bad install, out of memory) is reported
    now, not after the start-up timeout."""
    from tandem.common.model.parallel import runner

    monkeypatch.setattr(runner, "spawn_ranks", lambda config, ranks, addr: [
        subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"]) for _ in ranks])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 exited with code 3 during start-up"):
        Engine(EngineConfig(model_path=tiny_llama, tp_size=2))
    assert time.monotonic() - started < 60  # the start-up timeout is 600 s
