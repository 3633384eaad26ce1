"""Prefill and decode workers whose data-parallel replicas are tensor-parallel groups (`--dp-size N --tp-size T`):
every rank of every replica registers its own NIXL agent, each prefill replica WRITEs from its own ranks into the
decode replica's ranks; greedy output through the router equals the offline engine's, both DP ranks serve, and
no page stays taken on any replica. A killed rank of a decode replica ends that decode worker (exit 1) and the
prefill frees every page."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.common.rpc.helpers import engine_greedy, http_post, stop_together
from tests.services.pd_helpers import PDPair, pd_reference_engine
from tests.services.router.conftest import RouterProcess, readiness, wait_until
from tests.services.test_disaggregated_dp import rank_loads, wait_all_ranks_free

pytestmark = pytest.mark.e2e

RANK_FLAGS = ("--num-threads", "1", "--dist-timeout", "20")
TIMEOUTS = ("--bootstrap-timeout", "5", "--transfer-timeout", "8")
PROMPTS = [[8 + (i * 29 + j * 11) % 450 for j in range(6 + 13 * i)] for i in range(4)]
LONG_PROMPT = [(i * 37) % 480 + 8 for i in range(600)]
MAX_NEW = 6


def shape(dp: int, tp: int) -> tuple:
    return ("--dp-size", str(dp), "--tp-size", str(tp), "--load-balance-method", "round_robin", *RANK_FLAGS)


def start_pair(tiny_llama: str, prefill: tuple[int, int], decode: tuple[int, int]) -> PDPair:
    return PDPair(tiny_llama, *TIMEOUTS, prefill_extra=shape(*prefill), decode_extra=shape(*decode), timeout=300)


@pytest.fixture(scope="module")
def expected(tiny_llama):
    with pd_reference_engine(tiny_llama) as engine:
        return [engine_greedy(engine, p, MAX_NEW).sequences[0].output_ids for p in PROMPTS]


def close_pair(pair: PDPair) -> None:
    for ch in pair.channels:
        ch.close()
    stop_together((pair.decode, pair.prefill))  # exit codes: checked by the callers


def check_through_router(pair: PDPair, tiny_llama: str, expected: list[list[int]]) -> None:
    """Every prompt through the router (round robin everywhere: each DP controller alternates its replicas) equals
    the offline engine; every replica of a DP worker served some; then no page is taken on any replica."""
    from tandem.common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama).tokenizer
    wait_all_ranks_free([pair.p_stub, pair.d_stub])
    router = RouterProcess("--prefill", f"grpc://{pair.prefill.address},{pair.prefill.bootstrap_port}",
                           "--decode", f"grpc://{pair.decode.address}", "--model-path", tiny_llama,
                           "--prefill-policy", "round_robin", "--decode-policy", "round_robin")
    try:
        wait_until(lambda: readiness(router) == 200, 60, "router readiness")
        for prompt, want in zip(PROMPTS, expected):
            body = {"model": os.path.basename(tiny_llama), "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0}
            out = json.loads(http_post(f"{router.url}/v1/completions", body))
            assert out["usage"]["completion_tokens"] == len(want)
            assert out["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)
    finally:
        assert router.stop() == 0, "router did not shut down cleanly:\n" + "".join(router.log[-40:])
    for stub in (pair.p_stub, pair.d_stub):
        loads = rank_loads(stub)
        if len(loads) > 1:  # a DP worker: round robin reached every replica (each cached some prompts)
            assert all(x.token_usage > 0 for x in loads), loads
    wait_all_ranks_free([pair.p_stub, pair.d_stub])


def test_prefill_dp2_tp1_to_decode_dp1_tp2_through_router(tiny_llama, expected):
    """Each prefill replica (one rank, both KV heads) WRITEs head slices into both ranks of the one decode."""
    pair = start_pair(tiny_llama, (2, 1), (1, 2))
    try:
        check_through_router(pair, tiny_llama, expected)
    finally:
        close_pair(pair)
    assert (pair.decode.proc.returncode, pair.prefill.proc.returncode) == (0, 0)


def test_prefill_dp2_tp2_to_decode_dp1_tp1_through_router(tiny_llama, expected):
    """Each prefill replica's two ranks WRITE their head into the decode's one pool and report to their own rank
    0, which alone notifies the decode (one accepted agent per replica)."""
    pair = start_pair(tiny_llama, (2, 2), (1, 1))
    try:
        check_through_router(pair, tiny_llama, expected)
    finally:
        close_pair(pair)
    assert (pair.decode.proc.returncode, pair.prefill.proc.returncode) == (0, 0)


@pytest.fixture(scope="module")
def dp_tp_pair(tiny_llama):
    """A TP-2 prefill and a decode of two TP-2 replicas: 2 + 2 x 2 ranks, each with its own NIXL agent."""
    pair = start_pair(tiny_llama, (1, 2), (2, 2))
    yield pair
    close_pair(pair)  # the last test kills a decode rank: exit codes are checked there


def test_prefill_dp1_tp2_to_decode_dp2_tp2_through_router(dp_tp_pair, tiny_llama, expected):
    """Rank to rank, whole pages, into whichever decode replica the controller chose; the second round hits the
    radix caches of both sides."""
    check_through_router(dp_tp_pair, tiny_llama, expected)
    # Pinned: the same prompt decoded by each replica in turn (the prefill skips pages a replica holds).
    for d_rank in (0, 1):
        req = dp_tp_pair.request(f"pin{d_rank}", PROMPTS[2], max_new_tokens=MAX_NEW)
        d_req = pb.GenerateRequest()
        d_req.CopyFrom(req)
        d_req.data_parallel_rank = d_rank
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("p", list(dp_tp_pair.p_stub.Generate(req, timeout=60))))
        t.start()
        decoded = list(dp_tp_pair.d_stub.Generate(d_req, timeout=60))
        t.join(60)
        assert [c.complete.output_ids for c in decoded if c.HasField("complete")] == [expected[2]]
    wait_all_ranks_free([dp_tp_pair.p_stub, dp_tp_pair.d_stub])


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def _follower_of_replica(worker_pid: int, replica: int) -> int:
    """Rank 1 of DP replica `replica` (replicas start in rank order: the worker's children; each replica's only
    child is its follower rank)."""
    (follower,) = _children(_children(worker_pid)[replica])
    with open(f"/proc/{follower}/cmdline", "rb") as f:
        assert b"tandem.common.model.parallel.follower" in f.read()
    return follower


def test_killed_rank_of_a_decode_replica_ends_the_decode_and_the_prefill_frees_pages(dp_tp_pair):
    """Last (it ends the decode). Rank 1 of decode replica 0 dies while the prefill WRITEs into that replica: the
    replica's TP watchdog fails it, the DP controller exits 1, and the prefill (the decode's heartbeats gone, or a
    WRITE failed) fails the room and holds no page."""
    pair = dp_tp_pair
    wait_all_ranks_free([pair.p_stub, pair.d_stub])
    req = pair.request("kill-rank", LONG_PROMPT, max_new_tokens=400, ignore_eos=True)
    d_req = pb.GenerateRequest()
    d_req.CopyFrom(req)
    d_req.data_parallel_rank = 0
    errors: dict[str, BaseException] = {}

    def leg(stub, r, key):
        try:
            list(stub.Generate(r, timeout=90))
        except grpc.RpcError as e:
            errors[key] = e
    threads = [threading.Thread(target=leg, args=(pair.p_stub, req, "prefill")),
               threading.Thread(target=leg, args=(pair.d_stub, d_req, "decode"))]
    for t in threads:
        t.start()
    wait_until(lambda: rank_loads(pair.d_stub)[0].disaggregation.decode_transfer_queue_reqs > 0, 60,
               "decode replica 0 receiving KV", interval=0.01)
    os.kill(_follower_of_replica(pair.decode.proc.pid, 0), signal.SIGKILL)
    start = time.monotonic()
    for t in threads:
        t.join(60)
    assert "decode" in errors and time.monotonic() - start < 30, errors
    assert pair.decode.proc.wait(30) == 1, "".join(pair.decode.log[-30:])
    deadline = time.monotonic() + 30
    while True:
        load = rank_loads(pair.p_stub)[0]
        if load.num_running_reqs == load.num_waiting_reqs == load.num_used_tokens == 0:
            break
        assert time.monotonic() < deadline, load
        time.sleep(0.1)
    assert pair.prefill.proc.poll() is None
