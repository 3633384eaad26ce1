"""Pipeline with tensor parallelism (--tp-size 2 --pp-size 2: four processes on gloo, global rank = stage * 2 +
tp_rank): the single-process engine's greedy ids in both event loops with chunked prefill and radix hits, every
page free after; each rank holds a quarter of the layers' weights and KV pool; STOP reaches every rank; a dead rank
of stage 1 makes the worker exit non-zero; `tandem generate` and `tandem worker` run it; what cannot be sharded is
refused as with TP alone."""

from __future__ import annotations

import json
import os
import signal
import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.flags import ConfigError
from tandem.common.model.config import ModelConfig
from tandem.common.model.loader import load_model
from tandem.common.model.parallel.stage_worker import PipeLinks
from tandem.common.model.parallel.stages import PipelineStage
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.common.rpc.helpers import PROMPT, WorkerProcess, cli_in_process, gen_request
from tests.common.scheduler.test_engine_parity import make_prompts, run_engine, shared_prefix_prompts

CASES = {
    "pipelined": dict(event_loop="overlap", chunked_prefill_size=32, page_size=4),
    "normal": dict(event_loop="normal", chunked_prefill_size=48, page_size=8),
}
TP_PP_FLAGS = ("--tp-size", "2", "--pp-size", "2", "--num-threads", "1", "--dist-timeout", "6")


def _two_rounds(vocab: int) -> list[list[int]]:
    """Round 1: three prompts and two sharing a 150-token prefix; round 2: three more and the same two (radix hits)."""
    prompts = [p for p in make_prompts(vocab) if len(p) <= 120][:6]
    shared = shared_prefix_prompts(vocab)[:2]
    return prompts[:3] + shared + prompts[3:] + shared


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(CASES))
def test_tp2_pp2_greedy_matches_single_process_each_rank_holds_a_quarter_and_stop_reaches_every_rank(tiny_llama,
                                                                                                     case):
    """One tp x pp engine per loop checks both the greedy parity and the ranks' shares (they were two tests, each
    starting its own four processes)."""
    batch = _two_rounds(ModelConfig.from_pretrained(tiny_llama).vocab_size)
    overrides = dict(CASES[case], num_threads=1, max_total_tokens=4096)
    reference, _ = run_engine(tiny_llama, batch, overrides, logprobs=True, rounds=2)
    seen = {}

    def inspect(engine: Engine) -> None:
        seen.update(memory=engine.rank_memory, processes=list(engine.pp_launch.processes), pool=engine.kv_pool)

    # run_engine asserts every page and request slot is free again after the flush.
    results, stats = run_engine(tiny_llama, batch, dict(overrides, tp_size=2, pp_size=2), logprobs=True, rounds=2,
                                inspect=inspect)
    for i, (got, want) in enumerate(zip(results, reference)):
        assert got.sequences[0].output_ids == want.sequences[0].output_ids, f"{case}: request {i} diverged"
        diff = max(abs(a - b) for a, b in zip(got.sequences[0].logprobs, want.sequences[0].logprobs))
        assert diff < 1e-4, f"{case}: request {i} logprobs differ by {diff}"
    assert stats["cache_hit_tokens"] >= 2 * 148
    assert all(r.cached_tokens >= 148 for r in results[-2:])
    _assert_quarters_and_stopped(tiny_llama, **seen)


def _assert_quarters_and_stopped(tiny_llama: str, memory, processes, pool) -> None:
    # A STOP, not the kill that follows a timeout, ended ranks 1..3.
    assert [p.returncode for p in processes] == [0, 0, 0]
    assert [m.rank for m in memory] == [0, 1, 2, 3]
    _, whole = load_model(tiny_llama)
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    # Ranks 0, 1: halves of the embedding and layer 0; ranks 2, 3: halves of layer 1, the LM head, and the norms.
    assert memory[0].weight_bytes == memory[1].weight_bytes and memory[2].weight_bytes == memory[3].weight_bytes
    norms = sum(p.numel() * p.element_size() for n, p in whole.named_parameters() if "norm" in n)
    assert sum(m.weight_bytes for m in memory) == whole_bytes + norms  # every rank of a stage holds its norms
    # One layer and one of the two KV heads each: a quarter of one process's pool at the same page count.
    config = ModelConfig.from_pretrained(tiny_llama)
    assert (config.num_layers, config.num_kv_heads, pool.num_layers, pool.num_kv_heads) == (2, 2, 1, 1)
    whole_pool = 2 * 2 * (pool.size + pool.page_size) * 2 * config.head_dim * 4  # K and V, layers, rows, heads, fp32
    assert [m.kv_pool_bytes for m in memory] == [whole_pool // 4] * 4


def test_rank_links_follow_sglang_numbering():
    """tp 2 x pp 3: rank r receives from r - 2, sends to r + 2; only the last stage's tp rank 0 returns logits."""
    assert PipeLinks.of(3, 2, PipelineStage(1, 3)) == PipeLinks(1, 5, False)
    assert PipeLinks.of(4, 2, PipelineStage(2, 3)) == PipeLinks(2, None, True)
    assert PipeLinks.of(5, 2, PipelineStage(2, 3)) == PipeLinks(3, None, False)
    assert PipeLinks.of(1, 1, PipelineStage(1, 2)) == PipeLinks(0, None, True)  # pp alone: ranks are stages


def test_heads_that_do_not_split_are_refused_as_with_tp_alone(tiny_llama):
    with pytest.raises(ConfigError, match="--tp-size 3 cannot shard this model: num_attention_heads"):
        Engine(EngineConfig(model_path=tiny_llama, tp_size=3, pp_size=2))
    with pytest.raises(ConfigError, match="--pp-size 3 cannot split this model: it has 2 layers"):
        Engine(EngineConfig(model_path=tiny_llama, tp_size=2, pp_size=3))
    with pytest.raises(ConfigError, match="a pipeline's ranks spanning nodes are not implemented yet"):
        EngineConfig(model_path=tiny_llama, tp_size=2, pp_size=2, nnodes=2, dist_init_addr="127.0.0.1:1").validate()


@pytest.mark.e2e
def test_generate_cli_tp2_pp2_matches_single_process(tiny_llama, tmp_path):
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 1] * 9]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"id": i, "input_ids": p, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}) + "\n" for i, p in enumerate(prompts)))
    params = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    with Engine(EngineConfig(model_path=tiny_llama, max_total_tokens=2048)) as engine:
        reference = [r.sequences[0].output_ids for r in
                     engine.generate([GenerateRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])]
    # The entry point's main in this process (its other three ranks are processes): no interpreter of its own
    assert cli_in_process(["generate", "--model", tiny_llama, "--input", str(src), "--output", str(dst),
                     "--max-total-tokens", "2048", *TP_PP_FLAGS]) == 0
    rows = sorted((json.loads(line) for line in dst.read_text().splitlines()), key=lambda r: r["id"])
    assert [r["output_ids"] for r in rows] == reference


def _rank_pids(worker_pid: int) -> dict[int, int]:
    """Global rank -> pid of the worker's rank processes (from their command lines)."""
    with open(f"/proc/{worker_pid}/task/{worker_pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    ranks = {}
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if b"--rank" in argv:
            ranks[int(argv[argv.index(b"--rank") + 1])] = child
    return ranks


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True


@pytest.mark.e2e
def test_worker_tp2_pp2_serves_then_exits_non_zero_when_a_stage1_rank_dies(tiny_llama):
    worker = WorkerProcess(tiny_llama, *TP_PP_FLAGS, timeout=180)
    try:
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.SglangSchedulerStub(channel)
            responses = list(stub.Generate(gen_request("tp-pp", PROMPT, max_new_tokens=6, ignore_eos=True)))
            assert sum(len(r.chunk.token_ids) for r in responses if r.HasField("chunk")) == 6
            ranks = _rank_pids(worker.proc.pid)
            assert sorted(ranks) == [1, 2, 3]
            os.kill(ranks[3], signal.SIGKILL)  # stage 1's tensor-parallel rank 1
            code = worker.proc.wait(30)  # noticed without any request: stops serving, exits non-zero
        assert code != 0
        assert "tandem unified worker stopped: tp x pp rank 3 exited" in "".join(worker.log)
        deadline = time.monotonic() + 15  # nobody is left waiting in a collective
        while not all(_gone(pid) for pid in ranks.values()):
            assert time.monotonic() < deadline, "a rank outlived its worker"
            time.sleep(0.1)
    finally:
        if worker.proc.poll() is None:
            worker.proc.kill()
