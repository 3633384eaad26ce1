"""A prefill and a decode worker as real processes, and a client that plays the router (both legs)."""

from __future__ import annotations

import contextlib
import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

from tests.common.rpc.helpers import WorkerProcess

PD_FLAGS = ("--max-total-tokens", "4096", "--page-size", "4", "--chunked-prefill-size", "48",
            "--max-context-len", "1024", "--heartbeat-interval", "0.2", "--heartbeat-max-missed", "5")


@contextlib.contextmanager
def pd_reference_engine(model_dir: str):
    """The in-process engine with the PD workers' configuration (PD_FLAGS): what their greedy output must equal."""
    from common.config import EngineConfig
    from common.engine import Engine

    config = EngineConfig(model_path=model_dir, max_total_tokens=4096, page_size=4, chunked_prefill_size=48,
                          max_context_len=1024)
    with Engine(config) as engine:
        yield engine


class PDPair:
    """`tandem prefill` + `tandem decode` on 127.0.0.1 with their stubs."""

    def __init__(self, model_dir: str, *extra: str, prefill_extra: tuple = (), decode_extra: tuple = (),
                 tls=None, timeout: float = 90.0):
        """tls: a TlsConfig; both workers then serve mutual TLS (and the bootstrap hop too), and so do the stubs."""
        from common.tls import blocking_channel

        tls_flags = ("--tls-ca-file", tls.tls_ca_file, "--tls-cert-file", tls.tls_cert_file,
                     "--tls-key-file", tls.tls_key_file) if tls is not None else ()
        self.prefill = WorkerProcess(model_dir, "--bootstrap-port", "0", *extra, *tls_flags, *prefill_extra,
                                     command="prefill", flags=PD_FLAGS, timeout=timeout)
        self.decode = WorkerProcess(model_dir, *extra, *tls_flags, *decode_extra, command="decode", flags=PD_FLAGS,
                                    timeout=timeout)
        self.channels = [blocking_channel(w.address, tls) for w in (self.prefill, self.decode)]
        for ch in self.channels:
            grpc.channel_ready_future(ch).result(timeout=30)
        self.p_stub, self.d_stub = (pb_grpc.SglangSchedulerStub(ch) for ch in self.channels)

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

    def run_legs(self, requests: list[pb.GenerateRequest], timeout: float = 60.0):
        """Send every request to both workers at once; return [(prefill responses, decode responses)]."""
        def leg(stub, req):
            return list(stub.Generate(req, timeout=timeout))
        with ThreadPoolExecutor(max_workers=2 * len(requests)) as pool:
            futures = [(pool.submit(leg, self.p_stub, r), pool.submit(leg, self.d_stub, r)) for r in requests]
            return [(p.result(), d.result()) for p, d in futures]

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
        codes = [w.stop() for w in (self.decode, self.prefill)]
        assert codes == [0, 0], "workers did not stop cleanly"


def output_ids(responses) -> list[int]:
    complete = [r.complete for r in responses if r.HasField("complete")]
    assert len(complete) == 1
    return list(complete[0].output_ids)
