"""A decode worker whose tensor-parallel ranks span two nodes (`--nnodes 2 --node-rank 0|1 --dist-init-addr H:P`),
run here as two processes on 127.0.0.1: node 1's rank joins node 0's rendezvous and opens its own NIXL agent, the
prefill WRITEs each KV head into the rank holding it, and the output equals the offline engine's. Node 1 exits
non-zero when it loses node 0; a dead node-1 rank fails node 0 fast (exit 1) and the prefill frees every page."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from tests.common.rpc.helpers import REPO_ROOT, engine_greedy, free_port, stop_together
from tests.services.pd_helpers import PD_FLAGS, PDPair, output_ids, pd_reference_engine, wait_no_requests_or_kv

pytestmark = pytest.mark.e2e

RANK_FLAGS = ("--tp-size", "2", "--num-threads", "1", "--dist-timeout", "20")
PROMPTS = [[8 + (i * 23 + j * 5) % 470 for j in range(4 + 17 * i)] for i in range(4)]
LONG_PROMPT = [(i * 37) % 480 + 8 for i in range(600)]


class TwoNodeDecode:
    """Node 1's process (its rank only), then a PD pair whose decode is node 0 (scheduler, rank 0, gRPC)."""

    def __init__(self, tiny_llama: str, *extra: str, prefill_extra: tuple = (), wait: bool = True):
        """wait=False: return once every process is spawned; pair.wait_ready() before using the stubs."""
        nodes = (*RANK_FLAGS, "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}")
        self.node1 = subprocess.Popen([sys.executable, "-m", "tandem.common.cli", "decode", "--model", tiny_llama, *PD_FLAGS,
                                       *nodes, "--node-rank", "1"], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True)
        try:
            self.pair = PDPair(tiny_llama, *extra, prefill_extra=prefill_extra,
                               decode_extra=(*nodes, "--node-rank", "0"), timeout=180, wait=wait)
        except BaseException:
            self.node1.kill()
            raise

    def node1_rank(self) -> int:
        with open(f"/proc/{self.node1.pid}/task/{self.node1.pid}/children") as f:
            (rank,) = f.read().split()
        return int(rank)

    def close(self) -> None:
        for ch in getattr(self.pair, "channels", ()):  # none when it never became ready
            ch.close()
        stop_together((self.pair.decode, self.pair.prefill))
        if self.node1.poll() is None:
            self.node1.kill()
            self.node1.wait()


def test_decode_ranks_on_two_nodes_equal_the_offline_engine_and_node1_exits_without_node0(tiny_llama):
    nodes = TwoNodeDecode(tiny_llama, wait=False)
    pair = nodes.pair
    try:
        with pd_reference_engine(tiny_llama) as engine:  # while the workers load
            expected = [engine_greedy(engine, p, 6).sequences[0].output_ids for p in PROMPTS]
        pair.wait_ready()
        reqs = [pair.request(f"n{i}", p, max_new_tokens=6) for i, p in enumerate(PROMPTS)]
        assert [output_ids(d) for _, d in pair.run_legs(reqs, timeout=120)] == expected
        pair.wait_both_free()
        assert nodes.node1.poll() is None
        pair.decode.proc.kill()  # node 0 gone: node 1's rank fails its next receive
        assert nodes.node1.wait(60) != 0, nodes.node1.stderr.read()
        assert pair.prefill.stop() == 0
    finally:
        nodes.close()


def test_a_dead_node1_rank_fails_node0_and_the_prefill_frees_every_page(tiny_llama):
    """Node 1's rank dies while the prefill WRITEs into both decode ranks: node 0 (no process of its own to watch)
    learns it from its next broadcast or keep-alive, turns NOT_SERVING and exits 1; the prefill fails the room and
    holds no page; node 1's process exits non-zero."""
    nodes = TwoNodeDecode(tiny_llama, "--bootstrap-timeout", "3", "--transfer-timeout", "8",
                          prefill_extra=("--chunked-prefill-size", "4"))
    pair = nodes.pair
    try:
        req = pair.request("kill-node1", LONG_PROMPT, max_new_tokens=40, ignore_eos=True)
        threads, outcome = pair.legs_in_transfer(req, leg_timeout=60, wait_s=60)
        os.kill(nodes.node1_rank(), signal.SIGKILL)
        started = time.monotonic()
        assert pair.decode.proc.wait(60) == 1, "".join(pair.decode.log[-30:])
        assert time.monotonic() - started < 45  # the keep-alive (every 5 s) and the drain, not a hang
        assert "tensor-parallel" in "".join(pair.decode.log)
        assert nodes.node1.wait(30) != 0
        for t in threads:
            t.join(60)
        assert isinstance(outcome["decode"], grpc.RpcError), outcome["decode"]
        wait_no_requests_or_kv(pair.p_stub, 30)
        assert pair.prefill.proc.poll() is None
    finally:
        nodes.close()
