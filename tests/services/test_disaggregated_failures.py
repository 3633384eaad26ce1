"""Failure handling between a prefill and a decode worker: each side fails the request with a clear
gRPC status within its timeout and frees every page it held."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.common.rpc.helpers import WorkerProcess, free_port
from tests.services.pd_helpers import PD_FLAGS, PDPair, wait_no_requests_or_kv

pytestmark = pytest.mark.e2e

TIMEOUTS = ("--bootstrap-timeout", "3", "--transfer-timeout", "4")
LONG_PROMPT = [(i * 37) % 480 + 8 for i in range(900)]


@pytest.fixture(scope="module")
def pair(tiny_llama):
    # Tiny chunks make the long prompt's prefill (and so its transfer) take a while.
    pd = PDPair(tiny_llama, *TIMEOUTS, prefill_extra=("--chunked-prefill-size", "4"))
    yield pd
    pd.close()


def failure_kind(err: grpc.RpcError) -> str | None:
    """The kind the worker named in its trailing metadata (common/transfer/failures.py)."""
    return dict(err.trailing_metadata() or ()).get("tandem-failure-kind")


def call(stub, req, timeout=30.0):
    try:
        return list(stub.Generate(req, timeout=timeout)), None
    except grpc.RpcError as e:
        return None, e


def test_prefill_leg_alone_hits_bootstrap_timeout(pair):
    start = time.monotonic()
    out, err = call(pair.p_stub, pair.request("alone-p", [5, 6, 7, 8]))
    assert err is not None and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
    assert "bootstrap timeout" in err.details() and failure_kind(err) == "bootstrap_timeout"
    assert time.monotonic() - start < 10
    pair.wait_both_free()


def test_decode_leg_alone_hits_transfer_timeout(pair):
    out, err = call(pair.d_stub, pair.request("alone-d", [5, 6, 7, 8]))
    assert err is not None and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
    assert "timeout" in err.details() and failure_kind(err) == "transfer_timeout"
    pair.wait_both_free()


def test_decode_pointing_at_no_prefill_fails(pair):
    req = pair.request("nowhere", [5, 6, 7, 8])
    req.disaggregated_params.bootstrap_port = free_port()  # nothing listens there
    start = time.monotonic()
    out, err = call(pair.d_stub, req)
    # Unreachable, not a timeout: UNAVAILABLE with its kind, so a router retries elsewhere and blames the prefill.
    assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, err
    assert failure_kind(err) == "bootstrap_unreachable"
    assert time.monotonic() - start < 12
    pair.wait_both_free()


def test_client_abort_on_decode_leg_reaches_prefill(pair):
    req = pair.request("abort-d", LONG_PROMPT, max_new_tokens=50, ignore_eos=True)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("p", call(pair.p_stub, req)))
    t.start()
    stream = pair.d_stub.Generate(req, timeout=30)
    _wait_transfer_started(pair)
    stream.cancel()  # the client goes away: the decode aborts and tells the prefill
    t.join(30)
    out, err = result["p"]
    assert err is not None and err.code() == grpc.StatusCode.ABORTED, (out, err)
    pair.wait_both_free()


def test_abort_rpc_on_prefill_leg_reaches_decode(pair):
    req = pair.request("abort-p", LONG_PROMPT, max_new_tokens=50, ignore_eos=True)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("d", call(pair.d_stub, req)))
    t.start()
    p_stream = pair.p_stub.Generate(req, timeout=30)
    _wait_transfer_started(pair)
    assert pair.p_stub.Abort(pb.AbortRequest(request_id="abort-p", reason="test")).success
    t.join(30)
    out, err = result["d"]
    assert err is not None and err.code() == grpc.StatusCode.ABORTED, (out, err)
    finals = [r.complete for r in p_stream if r.HasField("complete")]
    assert [c.finish_reason for c in finals] == ["abort"]  # the aborted leg ends with finish_reason abort
    pair.wait_both_free()


def _wait_transfer_started(pair, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        load = pair.d_stub.GetLoads(pb.GetLoadsRequest(include=["all"])).loads[0]
        if load.disaggregation.decode_transfer_queue_reqs > 0:
            return
        time.sleep(0.01)
    raise AssertionError("the transfer never started")


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_peer_killed_mid_transfer(pair, tiny_llama, victim):
    """The victim is a worker of its own; its peer, the survivor, is the module pair's, which must then still serve
    the tests after this one and stop cleanly (one process started per case, not two)."""
    role_flags = ("--bootstrap-port", "0", "--chunked-prefill-size", "4") if victim == "prefill" else ()
    killed = WorkerProcess(tiny_llama, *TIMEOUTS, *role_flags, command=victim, flags=PD_FLAGS)
    pd = PDPair.of(killed, pair.decode) if victim == "prefill" else PDPair.of(pair.prefill, killed)
    survivor_stub = pd.p_stub if victim == "decode" else pd.d_stub
    try:
        req = pd.request(f"kill-{victim}", LONG_PROMPT, max_new_tokens=50, ignore_eos=True)
        result = {}
        threads = [threading.Thread(target=lambda s=s, k=k: result.setdefault(k, call(s, req)))
                   for s, k in ((pd.p_stub, "prefill"), (pd.d_stub, "decode"))]
        for t in threads:
            t.start()
        _wait_transfer_started(pd)
        os.kill(killed.proc.pid, signal.SIGKILL)
        start = time.monotonic()
        survivor = "prefill" if victim == "decode" else "decode"
        threads[0 if survivor == "prefill" else 1].join(15)
        out, err = result[survivor]
        assert err is not None, out
        assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                              grpc.StatusCode.ABORTED), err
        assert time.monotonic() - start < 8  # heartbeat loss (1 s) or the transfer timeout, not forever
        # The survivor freed every page.
        wait_no_requests_or_kv(survivor_stub, 15)
    finally:
        for ch in pd.channels:
            ch.close()
        if killed.proc.poll() is None:
            killed.proc.kill()
            killed.proc.wait()


def test_layout_mismatch_rejected_at_registration(pair, tiny_llama):
    """A decode of its own with another page size, against the module pair's prefill."""
    decode = WorkerProcess(tiny_llama, *TIMEOUTS, "--page-size", "8", command="decode", flags=PD_FLAGS)
    pd = PDPair.of(pair.prefill, decode)
    try:
        req = pd.request("mismatch", [5, 6, 7, 8, 9])
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("p", call(pd.p_stub, req)))
        t.start()
        out, err = call(pd.d_stub, req)
        t.join(15)
        assert err is not None, out
        assert "page_size" in err.details() and "mismatch" in err.details()
        assert failure_kind(err) == "layout_mismatch" and err.code() == grpc.StatusCode.FAILED_PRECONDITION
        pd.wait_both_free()
    finally:
        for ch in pd.channels:
            ch.close()
        assert decode.stop() == 0
