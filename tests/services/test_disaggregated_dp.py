"""`tandem prefill --dp-size 2` and `tandem decode --dp-size 2` with NIXL between their replicas: greedy parity with
the offline engine driven directly, through Tandem's router (cache_aware pins a prefix to one DP rank) and through
smg; requests spread over the ranks; KV events per dp_rank; a killed replica fails its worker fast and the other side
frees every page."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
import urllib.request

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from tests.common.rpc.helpers import WorkerProcess, engine_greedy, http_post, smg_gateway, stop_together
from tests.services.pd_helpers import PD_FLAGS, PDPair, output_ids, pd_reference_engine
from tests.services.router.conftest import RouterProcess, readiness, wait_until

pytestmark = pytest.mark.e2e

TIMEOUTS = ("--bootstrap-timeout", "5", "--transfer-timeout", "6")
PROMPTS = [[8 + (i * 31 + j * 7) % 400 for j in range(5 + 9 * i)] for i in range(6)]
SHARED = [10 + (j * 13) % 300 for j in range(64)]  # 16 pages of 4: a prefix cache_aware can see
LONG_PROMPT = [(i * 37) % 480 + 8 for i in range(600)]


@pytest.fixture(scope="module")
def pair(tiny_llama):
    pd = PDPair(tiny_llama, *TIMEOUTS, "--load-balance-method", "round_robin", "--num-threads", "1",
                prefill_extra=("--dp-size", "2"), decode_extra=("--dp-size", "2"), timeout=240)
    yield pd
    for ch in pd.channels:
        ch.close()
    stop_together((pd.decode, pd.prefill))  # the last test kills replicas: exit codes are checked there


@pytest.fixture(scope="module")
def ref_engine(tiny_llama):
    with pd_reference_engine(tiny_llama) as engine:
        yield engine


def rank_loads(stub) -> list[pb.SchedulerLoad]:
    return list(stub.GetLoads(pb.GetLoadsRequest(include=["all"])).loads)


def wait_all_ranks_free(stubs, timeout: float = 20.0) -> None:
    """Every rank of every worker: nothing running or waiting and, after a flush, no KV token in use."""
    for stub in stubs:
        deadline = time.monotonic() + timeout
        while True:
            flushed = stub.FlushCache(common_pb2.FlushCacheRequest()).success
            loads = rank_loads(stub)
            if flushed and all(x.num_running_reqs == x.num_waiting_reqs == x.num_used_tokens == 0
                               and x.token_usage == 0.0 for x in loads):
                break
            assert time.monotonic() < deadline, f"ranks not free: {loads}"
            time.sleep(0.1)


def test_greedy_parity_spread_and_pinned_ranks(pair, ref_engine):
    wait_all_ranks_free([pair.p_stub, pair.d_stub])
    expected = [engine_greedy(ref_engine, p, 6).sequences[0].output_ids for p in PROMPTS]
    reqs = [pair.request(f"dp{i}", p, max_new_tokens=6) for i, p in enumerate(PROMPTS)]
    assert [output_ids(d) for _, d in pair.run_legs(reqs)] == expected
    # Round robin on both sides: each rank of each worker served (and cached) some of the prompts.
    for stub in (pair.p_stub, pair.d_stub):
        loads = rank_loads(stub)
        assert [x.dp_rank for x in loads] == [0, 1] and all(x.token_usage > 0 for x in loads), loads
    # Pinned legs: the prefill's rank 1 writes into the decode's rank 0 pool (and the other way round).
    wait_all_ranks_free([pair.p_stub, pair.d_stub])
    for p_rank, d_rank in ((1, 0), (0, 1)):
        p_req, d_req = pb.GenerateRequest(), pair.request(f"pin{p_rank}{d_rank}", PROMPTS[3], max_new_tokens=6)
        p_req.CopyFrom(d_req)
        p_req.data_parallel_rank, d_req.data_parallel_rank = p_rank, d_rank
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("p", list(pair.p_stub.Generate(p_req, timeout=60))))
        t.start()
        decoded = list(pair.d_stub.Generate(d_req, timeout=60))
        t.join(60)
        assert output_ids(decoded) == expected[3]
        for stub, rank in ((pair.p_stub, p_rank), (pair.d_stub, d_rank)):
            usage = [x.token_usage for x in rank_loads(stub)]
            assert usage[rank] > 0 and usage[1 - rank] == 0, (stub, usage)
        wait_all_ranks_free([pair.p_stub, pair.d_stub])


def test_the_dp_decode_controller_passes_plain_requests_to_a_replica_that_prefills_them(pair, ref_engine):
    """No disaggregated_params: the controller forwards the request like any other; the replica prefills it
    (local-prefill fallback), and the controller's server info carries the replica's `local_prefill`."""
    wait_all_ranks_free([pair.d_stub])
    info = pair.d_stub.GetServerInfo(pb.GetServerInfoRequest())
    assert info.scheduler_info.fields["local_prefill"].bool_value
    for i, prompt in enumerate(PROMPTS):
        plain = pair.request(f"plain{i}", prompt, max_new_tokens=6)
        plain.ClearField("disaggregated_params")
        assert output_ids(list(pair.d_stub.Generate(plain, timeout=60))) == \
            engine_greedy(ref_engine, prompt, 6).sequences[0].output_ids
    # Round robin: both replicas prefilled some of them.
    assert all(x.token_usage > 0 for x in rank_loads(pair.d_stub))
    wait_all_ranks_free([pair.d_stub])


def test_kv_events_are_tagged_with_their_dp_rank(pair):
    """One subscription to the prefill worker carries both replicas' RadixCache events, each batch with its rank."""
    wait_all_ranks_free([pair.p_stub, pair.d_stub])
    stored: dict[int, int] = {}
    stream = pair.p_stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=0))

    def read() -> None:
        try:
            for batch in stream:
                if any(e.WhichOneof("data") == "stored" for e in batch.events):
                    assert batch.HasField("dp_rank")
                    stored[batch.dp_rank] = stored.get(batch.dp_rank, 0) + 1
        except grpc.RpcError:
            pass  # cancelled below

    reader = threading.Thread(target=read)
    reader.start()
    try:
        time.sleep(0.5)  # subscribed to both replicas
        reqs = [pair.request(f"ev{i}", PROMPTS[4], max_new_tokens=2) for i in range(2)]
        for rank, req in enumerate(reqs):
            req.data_parallel_rank = rank
        pair.run_legs(reqs)
        wait_until(lambda: len(stored) == 2, 20, f"stored events of both ranks (got {stored})")
    finally:
        stream.cancel()
        reader.join(10)
    wait_all_ranks_free([pair.p_stub, pair.d_stub])


def _router_snapshot(router) -> list[dict]:
    with urllib.request.urlopen(router.url + "/readiness", timeout=5) as resp:
        return json.loads(resp.read())["workers"]


def test_router_cache_aware_pins_a_prefix_to_one_rank(pair, tiny_llama, ref_engine):
    from tandem.common.tokenizer import load_tokenizer

    """The router sees the prefill as two caches: the first request of a prefix lands on one rank (the controller
    alternates unpinned requests, so staying there is the router's pin), later ones follow its cached blocks there;
    every output equals the engine's."""
    tokenizer = load_tokenizer(tiny_llama).tokenizer
    wait_all_ranks_free([pair.p_stub, pair.d_stub])
    router = RouterProcess("--prefill", f"grpc://{pair.prefill.address},{pair.prefill.bootstrap_port}",
                           "--decode", f"grpc://{pair.decode.address}", "--model-path", tiny_llama,
                           "--prefill-policy", "cache_aware", "--decode-policy", "round_robin")
    try:
        wait_until(lambda: readiness(router) == 200, 60, "router readiness")
        wait_until(lambda: all(len(w["dp_ranks"]) == 2 for w in _router_snapshot(router)), 20, "DP ranks seen")
        prompts = [SHARED + [400 + i, 401 + i, 402 + i] for i in range(4)]
        for i, prompt in enumerate(prompts):
            body = {"model": os.path.basename(tiny_llama), "prompt": prompt, "max_tokens": 5, "temperature": 0}
            out = json.loads(http_post(f"{router.url}/v1/completions", body))
            want = engine_greedy(ref_engine, prompt, 5).sequences[0].output_ids
            assert out["choices"][0]["text"] == tokenizer.decode(want, skip_special_tokens=True)
            if i == 0:  # the router knows rank r holds the prefix before the next request is routed
                wait_until(lambda: any(r["cached_blocks"] for w in _router_snapshot(router) if w["role"] == "prefill"
                                       for r in w["dp_ranks"]), 20, "the prefix's KV events")
            else:
                assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(SHARED), out["usage"]
        usage = [x.token_usage for x in rank_loads(pair.p_stub)]
        assert sum(u > 0 for u in usage) == 1, usage  # every request of the prefix went to one prefill rank
    finally:
        assert router.stop() == 0, "router did not shut down cleanly:\n" + "".join(router.log[-40:])
    wait_all_ranks_free([pair.p_stub, pair.d_stub])


@pytest.mark.skipif(shutil.which("smg") is None, reason="the smg gateway (pip install smg) is not installed")
def test_smg_drives_the_dp_pair(pair, tiny_llama, ref_engine, tmp_path):
    """smg knows one bootstrap port per prefill (the proxy's) and sets no DP rank: the controllers place legs."""
    from tandem.common.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama).tokenizer
    workers = ["--pd-disaggregation", "--prefill", f"grpc://{pair.prefill.address}", str(pair.prefill.bootstrap_port),
               "--decode", f"grpc://{pair.decode.address}"]
    with smg_gateway(workers, tiny_llama, tmp_path, healthy=2) as base:
        for prompt in ("the quick brown fox", "a sea of words", "one more"):
            ids = tokenizer.encode(prompt, add_special_tokens=False).ids
            expected = engine_greedy(ref_engine, ids, 8).sequences[0].output_ids
            body = {"model": os.path.basename(tiny_llama), "prompt": prompt, "max_tokens": 8, "temperature": 0}
            out = json.loads(http_post(f"{base}/v1/completions", body))
            assert out["usage"]["completion_tokens"] == len(expected)
            # smg holds back a trailing incomplete UTF-8 sequence; the tokens before it must be the engine's.
            text = tokenizer.decode(expected, skip_special_tokens=True).rstrip("\ufffd")
            assert out["choices"][0]["text"].rstrip("\ufffd") == text
    wait_all_ranks_free([pair.p_stub, pair.d_stub])


def _replica_pids(parent: int) -> list[int]:
    with open(f"/proc/{parent}/task/{parent}/children") as f:
        return [int(p) for p in f.read().split()]


def _kill_one_replica(worker: WorkerProcess) -> None:
    """SIGKILL replica 0 (replicas start in rank order, so the worker's first child)."""
    os.kill(_replica_pids(worker.proc.pid)[0], signal.SIGKILL)


def _wait_ranks_idle(stub, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while any(x.num_running_reqs or x.num_waiting_reqs or x.num_used_tokens for x in rank_loads(stub)):
        assert time.monotonic() < deadline, rank_loads(stub)
        time.sleep(0.1)


def _leg_in_background(stub, req, errors: dict, name: str) -> threading.Thread:
    def leg() -> None:
        try:
            list(stub.Generate(req, timeout=60))
        except grpc.RpcError as e:
            errors[name] = e

    thread = threading.Thread(target=leg)
    thread.start()
    return thread


def test_killed_replicas_fail_their_worker_and_the_peer_frees_pages(pair, tiny_llama):
    """Last (it ends both workers). A decode replica killed while decoding: the request fails at once, the decode
    worker exits 1, the prefill holds nothing. Then a fresh decode whose leg waits for KV from the DP prefill, and a
    prefill replica killed: the prefill exits 1 (its bootstrap proxy with it), the decode's heartbeats fail, the
    request fails and every page is freed."""
    from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

    errors: dict[str, grpc.RpcError] = {}
    req = pair.request("kill-decode", LONG_PROMPT, max_new_tokens=400, ignore_eos=True)
    decode_req = pb.GenerateRequest()
    decode_req.CopyFrom(req)
    decode_req.data_parallel_rank = 0  # the replica killed below: the first child of the decode worker
    threads = [_leg_in_background(pair.p_stub, req, errors, "prefill"),
               _leg_in_background(pair.d_stub, decode_req, errors, "decode")]
    wait_until(lambda: any(x.num_running_reqs for x in rank_loads(pair.d_stub)), 30, "the decode leg running")
    _kill_one_replica(pair.decode)
    start = time.monotonic()
    for t in threads:
        t.join(30)
    assert "decode" in errors and time.monotonic() - start < 10, errors
    assert pair.decode.proc.wait(30) == 1, "".join(pair.decode.log[-30:])
    assert "data-parallel replica" in "".join(pair.decode.log)
    _wait_ranks_idle(pair.p_stub)

    decode = WorkerProcess(tiny_llama, *TIMEOUTS, command="decode", flags=PD_FLAGS)
    try:
        with grpc.insecure_channel(decode.address) as channel:
            stub = pb_grpc.SglangSchedulerStub(channel)
            errors.clear()
            # Only the decode leg: it registers with the proxy and holds pages for KV that never comes.
            thread = _leg_in_background(stub, pair.request("kill-prefill", LONG_PROMPT, max_new_tokens=8),
                                        errors, "decode")
            wait_until(lambda: rank_loads(stub)[0].num_used_tokens > 0, 30, "the decode holding pages")
            _kill_one_replica(pair.prefill)
            start = time.monotonic()
            thread.join(30)
            assert errors["decode"].code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED), errors
            assert time.monotonic() - start < 5  # heartbeats (0.2 s x 5), not the 6 s transfer timeout
            assert pair.prefill.proc.wait(30) == 1, "".join(pair.prefill.log[-30:])
            _wait_ranks_idle(stub)
    finally:
        assert decode.stop() == 0
