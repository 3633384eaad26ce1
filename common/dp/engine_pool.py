"""`DataParallelEngine`: N in-process engine replicas behind one submit, for `tandem generate` and
`tandem bench offline` with --dp-size N.

Offline, the replicas share one process: each is a whole `Engine` (its own model copy, KV pool, RadixCache and
scheduler thread), and torch's kernels release the GIL, so their forward passes overlap. The served worker runs
one process per replica instead (`common/dp/replicas.py`), for a separate GIL and a replica that can die alone.
"""

from __future__ import annotations

import dataclasses
from tandem.common.config import EngineConfig
from tandem.common.flags import ConfigError
from tandem.common.dp.balance import DPBalancer, request_tokens
from tandem.common.dp.replicas import replica_config
from tandem.common.engine import Engine, GenerationResult, RequestHandle
from tandem.common.scheduler.io_struct import GenerateRequest


class DataParallelEngine:
    """Submit, abort and generate like `Engine`; each request runs whole on one replica (its n sequences too)."""

    def __init__(self, config: EngineConfig):
        config.validate()
        if config.pp_size > 1:  # each replica's pipeline would need a process group of its own in this process
            raise ConfigError(f"--dp-size {config.dp_size} with --pp-size {config.pp_size}: in-process replicas of a "
                              "pipeline (tandem generate, tandem bench offline) are not implemented yet; serve them "
                              "with `tandem worker --dp-size N --pp-size M` (one process group per replica process)")
        self.config = config
        self.balancer = DPBalancer(config.dp_size, config.load_balance_method)
        self.engines: list[Engine] = []
        try:
            for rank in range(config.dp_size):
                self.engines.append(Engine(replica_config(config, rank)))
        except BaseException:
            self.shutdown()
            raise
        self.max_context_len = self.engines[0].max_context_len

    def submit(self, req: GenerateRequest) -> RequestHandle:
        params = req.sampling_params
        rank = self.balancer.dispatch(req.rid, params.n, request_tokens(len(req.input_ids), params.n,
                                                                        params.max_new_tokens))
        try:
            handle = self.engines[rank].submit(req)
        except BaseException:
            self.balancer.finish(req.rid)
            raise
        return _CountedHandle(handle, self.balancer)

    def abort(self, rid: str, message: str = "aborted by client") -> None:
        rank = self.balancer.rank_of(rid)
        if rank is not None:
            self.engines[rank].abort(rid, message)

    def generate(self, reqs: list[GenerateRequest]) -> list[GenerationResult]:
        handles = [self.submit(r) for r in reqs]
        return [h.result() for h in handles]

    @property
    def rank_memory(self) -> list:
        """Each replica's memory, numbered by DP rank."""
        return [dataclasses.replace(e.rank_memory[0], rank=rank) for rank, e in enumerate(self.engines)]

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()

    def __enter__(self) -> "DataParallelEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class _CountedHandle:
    """A replica's handle whose result also ends the request's load on the controller."""

    def __init__(self, handle: RequestHandle, balancer: DPBalancer):
        self.handle = handle
        self.rid = handle.rid
        self._balancer = balancer

    def result(self) -> GenerationResult:
        try:
            return self.handle.result()
        finally:
            self._balancer.finish(self.rid)


def open_engine(config: EngineConfig) -> "Engine | DataParallelEngine":
    """The offline engine for `config`: one Engine, or N replicas with --dp-size N."""
    return DataParallelEngine(config) if config.dp_size > 1 else Engine(config)
