"""Prefill and decode workers at tensor-parallel sizes of their own: every prefill rank WRITEs its KV heads into the
right decode rank(s) through NIXL, and the decode's greedy output equals the single-process engine's."""

from __future__ import annotations

import os
import random
import signal
import threading

import grpc
import pytest

from tandem.common.config import EngineConfig
from tandem.common.engine import Engine
from tandem.common.sampling.params import SamplingParams
from tandem.common.scheduler.io_struct import GenerateRequest
from tests.common.rpc.helpers import WorkerProcess, stop_together
from tests.services.pd_helpers import PD_FLAGS, PDPair, output_ids, wait_no_requests_or_kv

pytestmark = pytest.mark.e2e

MAX_NEW = 6
TP_FLAGS = ("--num-threads", "1", "--dist-timeout", "20")


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    shared = [rng.randrange(8, 500) for _ in range(60)]
    plain = [[rng.randrange(8, 500) for _ in range(n)] for n in (1, 7, 49, 130)]
    return plain + [shared + [rng.randrange(8, 500) for _ in range(n)] for n in (3, 21)]


@pytest.fixture(scope="module")
def expected(tiny_llama):
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=4096, page_size=4, chunked_prefill_size=48,
                          max_context_len=1024)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with Engine(config) as engine:
        results = engine.generate([GenerateRequest(f"e{i}", p, params) for i, p in enumerate(prompts())])
    return [r.sequences[0].output_ids for r in results]


def tp(size: int) -> tuple:
    return ("--tp-size", str(size), *TP_FLAGS) if size > 1 else ()


@pytest.fixture(scope="module")
def workers(tiny_llama):
    """{(role, tp size): worker} for the parity cases, which pair them: four workers instead of three pairs, all
    loading at once (wait_ready comes with the first pair that uses them). Each stops cleanly at the end."""
    started = {(role, size): WorkerProcess(tiny_llama, *(("--bootstrap-port", "0") if role == "prefill" else ()),
                                           *tp(size), command=role, flags=PD_FLAGS, timeout=180, wait=False)
               for role in ("prefill", "decode") for size in (1, 2)}
    yield started
    codes = dict(zip(started, stop_together(started.values())))
    assert set(codes.values()) == {0}, f"workers did not stop cleanly: {codes}"


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (2, 2)])
def test_pd_at_different_tp_equals_offline_engine(workers, expected, prefill_tp, decode_tp):
    """tiny llama: 2 KV heads. TP 2 shards them (one per rank): (2, 1) writes head slices from both prefill ranks
    into decode rank 0; (1, 2) writes slices of the prefill's one pool into both decode ranks; (2, 2) rank to rank,
    whole pages."""
    pair = PDPair.of(workers["prefill", prefill_tp], workers["decode", decode_tp])
    try:
        reqs = [pair.request(f"tp{i}", p, max_new_tokens=MAX_NEW, ignore_eos=True) for i, p in enumerate(prompts())]
        results = pair.run_legs(reqs, timeout=120)  # a loaded 2-core machine runs 3-4 processes here
        assert [output_ids(d) for _, d in results] == expected
        assert [output_ids(p) for p, _ in results] == [want[:1] for want in expected]
        # Again: the shared prefix now hits both radix caches (the prefill skips pages the decode holds).
        again = pair.run_legs([pair.request(f"again{i}", p, max_new_tokens=MAX_NEW, ignore_eos=True)
                               for i, p in enumerate(prompts()[-2:])])
        assert [output_ids(d) for _, d in again] == expected[-2:]
        pair.wait_both_free()  # flushed too: the next case that pairs one of these starts from empty caches
    finally:
        for ch in pair.channels:
            ch.close()


def _follower_pid(worker_pid: int) -> int:
    with open(f"/proc/{worker_pid}/task/{worker_pid}/children") as f:
        for child in f.read().split():
            with open(f"/proc/{child}/cmdline", "rb") as cmd:
                if b"tandem.common.model.parallel.follower" in cmd.read():
                    return int(child)
    raise AssertionError(f"worker {worker_pid} has no tensor-parallel follower")


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_killed_rank_fails_its_worker_and_the_peer_frees_every_page(tiny_llama, victim):
    """Rank 1 of the TP-2 side dies mid-transfer: that worker exits non-zero (the TP watchdog) without draining what
    its dead engine cannot finish, the other worker fails the request within its heartbeat window and frees every
    page."""
    prefill_tp, decode_tp = (2, 1) if victim == "prefill" else (1, 2)
    pair = PDPair(tiny_llama, "--bootstrap-timeout", "3", "--transfer-timeout", "6",
                  prefill_extra=("--chunked-prefill-size", "4", *tp(prefill_tp)), decode_extra=tp(decode_tp))
    killed, survivor = (pair.prefill, pair.decode) if victim == "prefill" else (pair.decode, pair.prefill)
    survivor_stub = pair.d_stub if victim == "prefill" else pair.p_stub
    try:
        req = pair.request("kill-rank", [(i * 37) % 480 + 8 for i in range(600)], max_new_tokens=40, ignore_eos=True)
        threads, outcome = pair.legs_in_transfer(req, leg_timeout=40, wait_s=30)
        os.kill(_follower_pid(killed.proc.pid), signal.SIGKILL)
        assert killed.proc.wait(30) != 0
        # Its engine is gone: what was in flight is cancelled at once, not drained until its own timeout.
        assert "the engine failed; cancelling" in "".join(killed.log), "".join(killed.log[-30:])
        threads[1 if victim == "prefill" else 0].join(30)
        err = outcome["decode" if victim == "prefill" else "prefill"]
        assert isinstance(err, grpc.RpcError), err
        assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED)
        wait_no_requests_or_kv(survivor_stub, 20)
        assert survivor.proc.poll() is None
    finally:
        for ch in pair.channels:
            ch.close()
        stop_together((pair.prefill, pair.decode))


def both_legs(pair: PDPair, req) -> dict:
    """Run one request's prefill and decode legs at once: {"prefill"|"decode": its responses, or its RpcError}."""
    outcome = {}

    def leg(stub, key):
        try:
            outcome[key] = list(stub.Generate(req, timeout=30))
        except grpc.RpcError as e:
            outcome[key] = e
    prefill_leg = threading.Thread(target=leg, args=(pair.p_stub, "prefill"))
    prefill_leg.start()
    leg(pair.d_stub, "decode")
    prefill_leg.join(30)
    return outcome


def test_decode_ranks_the_prefill_cannot_write_are_refused_at_registration(tiny_llama):
    """A decode at TP 2 whose pages hold 8 tokens, a prefill at TP 2 with 4: the registration is refused with
    FAILED_PRECONDITION naming the field and the decode rank; both legs fail and no page stays taken."""
    pair = PDPair(tiny_llama, "--bootstrap-timeout", "3", prefill_extra=tp(2), decode_extra=("--page-size", "8", *tp(2)))
    try:
        req = pair.request("refused", [5, 6, 7, 8, 9])
        outcome = both_legs(pair, req)
        err = outcome["decode"]
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
        assert "KV layout mismatch: page_size is 8 on decode (decode rank 0) but 4 on prefill" in err.details()
        assert dict(err.trailing_metadata())["tandem-failure-kind"] == "layout_mismatch"
        assert isinstance(outcome["prefill"], grpc.RpcError)  # its room never got a destination
        pair.wait_both_free()
    finally:
        pair.close()


@pytest.mark.parametrize("kv_name", ["fp8", "bfloat16"])
def test_narrow_kv_at_different_tp_equals_offline_engine_on_the_same_kv(tiny_llama, kv_name):
    """--kv-cache-dtype fp8 (or bfloat16 under the float32 model) on both sides, prefill TP 2 (head slices) into
    decode TP 1: the FP8 or bf16 bytes travel as they are (half of a 16-bit or float32 pool's), and the decode's greedy
    output equals the single-process engine's on the same KV cache. The decode's log names an FP8 pool's dtype and
    its scales."""
    fp8 = ("--kv-cache-dtype", kv_name)
    pair = PDPair(tiny_llama, *fp8, prefill_extra=tp(2), wait=False)
    config = EngineConfig(model_path=tiny_llama, max_total_tokens=4096, page_size=4, chunked_prefill_size=48,
                          max_context_len=1024, kv_cache_dtype=kv_name)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    with Engine(config) as engine:
        reference = [r.sequences[0].output_ids
                     for r in engine.generate([GenerateRequest(f"e{i}", p, params) for i, p in enumerate(prompts())])]
    try:
        pair.wait_ready()
        reqs = [pair.request(f"fp8-{i}", p, max_new_tokens=MAX_NEW, ignore_eos=True) for i, p in enumerate(prompts())]
        results = pair.run_legs(reqs, timeout=120)
        assert [output_ids(d) for _, d in results] == reference
        assert kv_name != "fp8" or "KV cache fp8 (float8_e4m3fn)" in "".join(pair.decode.log)
        pair.wait_both_free()
    finally:
        pair.close()


def test_fp8_prefill_and_auto_decode_are_refused_naming_both_dtypes(tiny_llama):
    pair = PDPair(tiny_llama, "--bootstrap-timeout", "3", prefill_extra=("--kv-cache-dtype", "fp8", *tp(2)))
    try:
        req = pair.request("refused-fp8", [5, 6, 7, 8, 9])
        outcome = both_legs(pair, req)
        err = outcome["decode"]
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
        assert "KV layout mismatch: dtype is 'float32' on decode but 'float8_e4m3fn' on prefill" in err.details()
        assert isinstance(outcome["prefill"], grpc.RpcError)
        pair.wait_both_free()
    finally:
        pair.close()
