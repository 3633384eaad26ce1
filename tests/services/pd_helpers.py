"""A prefill and a decode worker as real processes, and a client that plays the router (both legs)."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.common.rpc.helpers import WorkerProcess, stop_together

PD_FLAGS = ("--max-total-tokens", "4096", "--page-size", "4", "--chunked-prefill-size", "48",
            "--max-context-len", "1024", "--heartbeat-interval", "0.2", "--heartbeat-max-missed", "5")


@contextlib.contextmanager
def pd_reference_engine(model_dir: str):
    """The in-process engine with the PD workers' configuration (PD_FLAGS): what their greedy output must equal."""
    from tandem.common.config import EngineConfig
    from tandem.common.engine import Engine

    config = EngineConfig(model_path=model_dir, max_total_tokens=4096, page_size=4, chunked_prefill_size=48,
                          max_context_len=1024)
    with Engine(config) as engine:
        yield engine


class PDPair:
    """`tandem prefill` + `tandem decode` on 127.0.0.1 with their stubs."""

    def __init__(self, model_dir: str, *extra: str, prefill_extra: tuple = (), decode_extra: tuple = (),
                 tls=None, timeout: float = 90.0, wait: bool = True):
        """tls: a TlsConfig; both workers then serve mutual TLS (and the bootstrap hop too), and so do the stubs.
        wait=False: return once both are spawned (build the reference meanwhile), then call wait_ready()."""
        self.tls = tls
        tls_flags = ("--tls-ca-file", tls.tls_ca_file, "--tls-cert-file", tls.tls_cert_file,
                     "--tls-key-file", tls.tls_key_file) if tls is not None else ()
        # Both load at once (one core each), not one after the other; sharing a loaded machine, either may take up
        # to twice what it takes alone, so the pair's deadline is twice `timeout`.
        self.deadline = time.monotonic() + 2 * timeout
        self.prefill = WorkerProcess(model_dir, "--bootstrap-port", "0", *extra, *tls_flags, *prefill_extra,
                                     command="prefill", flags=PD_FLAGS, timeout=timeout, wait=False)
        self.decode = WorkerProcess(model_dir, *extra, *tls_flags, *decode_extra, command="decode", flags=PD_FLAGS,
                                    timeout=timeout, wait=False)
        if wait:
            self.wait_ready()

    @classmethod
    def of(cls, prefill: WorkerProcess, decode: WorkerProcess, tls=None) -> "PDPair":
        """A pair of workers already started, one of them shared with another pair, say (a kill test then starts
        only its victim); it owns its channels, not the workers."""
        pair = cls.__new__(cls)
        pair.tls, pair.prefill, pair.decode = tls, prefill, decode
        pair.deadline = time.monotonic() + 2 * max(prefill.timeout, decode.timeout)
        return pair.wait_ready()

    def wait_ready(self) -> "PDPair":
        """Until both workers listen, with their channels and stubs (both are killed if either fails to start)."""
        from tandem.common.tls import blocking_channel

        try:
            for worker in (self.prefill, self.decode):
                worker.wait_ready(max(1.0, self.deadline - time.monotonic()))
        except BaseException:
            for worker in (self.prefill, self.decode):
                if worker.proc.poll() is None:
                    worker.proc.kill()
            raise
        self.channels = [blocking_channel(w.address, self.tls) for w in (self.prefill, self.decode)]
        for ch in self.channels:
            grpc.channel_ready_future(ch).result(timeout=30)
        self.p_stub, self.d_stub = (pb_grpc.SglangSchedulerStub(ch) for ch in self.channels)
        return self

    def request(self, rid: str, input_ids: list[int], room: int | None = None, return_logprob: bool = False,
                **sampling) -> pb.GenerateRequest:
        params = dict(temperature=0.0, max_new_tokens=8, top_p=1.0, top_k=-1, repetition_penalty=1.0)
        params.update(sampling)
        room = random.randrange(0, 2**31) if room is None else room
        return pb.GenerateRequest(
            request_id=rid, tokenized=pb.TokenizedInput(input_ids=input_ids),
            sampling_params=pb.SamplingParams(**params), stream=True, return_logprob=return_logprob,
            disaggregated_params=pb.DisaggregatedParams(bootstrap_host="127.0.0.1",
                                                        bootstrap_port=self.prefill.bootstrap_port,
                                                        bootstrap_room=room))

    def run_legs(self, requests: list[pb.GenerateRequest], timeout: float = 60.0, metadata=()):
        """Send every request to both workers at once (with the same call metadata); return [(prefill responses,
        decode responses)]."""
        def leg(stub, req):
            return list(stub.Generate(req, timeout=timeout, metadata=metadata))
        with ThreadPoolExecutor(max_workers=2 * len(requests)) as pool:
            futures = [(pool.submit(leg, self.p_stub, r), pool.submit(leg, self.d_stub, r)) for r in requests]
            return [(p.result(), d.result()) for p, d in futures]

    def legs_in_transfer(self, req: pb.GenerateRequest, leg_timeout: float, wait_s: float):
        """Start both legs of `req` on threads and return once the decode is receiving its KV:
        (threads [prefill, decode], outcome {"prefill"|"decode": responses or the RpcError})."""
        outcome: dict[str, object] = {}

        def leg(stub, key):
            try:
                outcome[key] = list(stub.Generate(req, timeout=leg_timeout))
            except grpc.RpcError as e:
                outcome[key] = e
        threads = [threading.Thread(target=leg, args=(s, k)) for s, k in ((self.p_stub, "prefill"),
                                                                          (self.d_stub, "decode"))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + wait_s
        while self.d_stub.GetLoads(pb.GetLoadsRequest(include=["all"])).loads[0] \
                .disaggregation.decode_transfer_queue_reqs == 0:
            assert time.monotonic() < deadline, "the transfer never started"
            time.sleep(0.01)
        return threads, outcome

    def wait_both_free(self, timeout: float = 20.0) -> None:
        """Every request gone from every queue, and after a cache flush no KV token in use."""
        for stub in (self.p_stub, self.d_stub):
            deadline = time.monotonic() + timeout
            while True:
                flushed = stub.FlushCache(common_pb2.FlushCacheRequest()).success
                load = stub.GetLoads(pb.GetLoadsRequest(include=["all"])).loads[0]
                if flushed and load.num_running_reqs == 0 and load.num_waiting_reqs == 0 \
                        and load.num_used_tokens == 0 and load.token_usage == 0.0:
                    break
                assert time.monotonic() < deadline, f"worker not free: {load}"
                time.sleep(0.1)

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        codes = stop_together((self.decode, self.prefill))
        assert codes == [0, 0], "workers did not stop cleanly"


def wait_no_requests_or_kv(stub, timeout: float) -> None:
    """A surviving worker: no request running or waiting and no KV token in use (no flush: a failed request's
    pages must have been freed, not cached)."""
    deadline = time.monotonic() + timeout
    while True:
        load = stub.GetLoads(pb.GetLoadsRequest(include=["all"])).loads[0]
        if load.num_running_reqs == 0 and load.num_waiting_reqs == 0 and load.num_used_tokens == 0:
            return
        assert time.monotonic() < deadline, load
        time.sleep(0.1)


def output_ids(responses) -> list[int]:
    complete = [r.complete for r in responses if r.HasField("complete")]
    assert len(complete) == 1
    return list(complete[0].output_ids)
