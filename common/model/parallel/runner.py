"""Rank 0 of a tensor-parallel engine: starts the other ranks, and wraps the model so that every forward its
scheduler runs is first broadcast to them (one scheduler decision per step for all ranks). It watches the other
ranks: one that dies or stops answering fails the engine fast instead of leaving anyone in a collective."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from tandem.common.flags import ConfigError
from tandem.common.model.config import ModelConfig
from tandem.common.model.forward_batch import ForwardBatch
from tandem.common.model.parallel.batch_wire import (Command, WeightSource, gather_acks, gather_bytes, send_batch,
                                                     send_command, send_payload, send_weights)
from tandem.common.model.parallel.dist import TPGroup, destroy_tp_group, free_init_addr, init_tp_group
from tandem.common.model.parallel.experts import check_ep
from tandem.common.model.parallel.layers import TPShard, check_tp_size
from tandem.common.model.parallel.supervisor import RankSupervisor

logger = logging.getLogger(__name__)

# Rank-0-hosted rendezvous waits this long for the other ranks (model loading included) before giving up.


@dataclass
class RankMemory:
    """One rank's memory after start-up: its weights, its KV pool shard, and the process's peak RSS."""

    rank: int
    weight_bytes: int
    kv_pool_bytes: int
    peak_rss_bytes: int


@dataclass
class TPLaunch:
    """Rank 0's group, its shard, and the other ranks' processes on this node."""

    group: TPGroup
    shard: TPShard
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def tp(self) -> TPGroup:
        """The group the shard's collectives run in (the whole group here; one stage's in a PipelineLaunch)."""
        return self.group

    def abort(self) -> None:
        """Start-up failed on rank 0: kill the other ranks instead of letting them wait out the timeout."""
        for proc in self.processes:
            proc.kill()
            proc.wait()
        destroy_tp_group()


def rank_device(device: str, local_rank: int) -> str:
    """The device of local rank `local_rank` on its node: its own GPU on CUDA, the CPU otherwise."""
    return f"cuda:{local_rank}" if device.startswith("cuda") else "cpu"


def spawn_ranks(config, ranks: range, init_addr: str) -> list[subprocess.Popen]:
    """One follower process per rank in `ranks` (this node's), each told the whole engine config as JSON."""
    config_json = json.dumps(dataclasses.asdict(config))
    per_node = config.tp_size // config.nnodes
    return [subprocess.Popen([sys.executable, "-m", "tandem.common.model.parallel.follower", "--rank", str(rank),
                              "--init-addr", init_addr, "--device", rank_device(config.device, rank % per_node),
                              "--config", config_json], env=os.environ.copy())
            for rank in ranks]


def launch_rank0(config) -> TPLaunch:
    """Start this node's other ranks and join the group as rank 0 (the rendezvous waits for every rank). A model
    whose heads cannot be split --tp-size ways is refused first."""
    if config.node_rank != 0:
        raise ConfigError(f"--node-rank {config.node_rank}: only node 0 runs the engine; start the other nodes with "
                          "`tandem worker --node-rank K ...` (they run their ranks only)")
    model_config = ModelConfig.from_pretrained(config.model_path)
    check_tp_size(model_config, config.tp_size)
    check_ep(model_config, config.tp_size, config.ep_size, config.ep_num_redundant_experts)
    init_addr = config.dist_init_addr or free_init_addr()
    per_node = config.tp_size // config.nnodes
    processes = spawn_ranks(config, range(1, per_node), init_addr)
    try:
        group = init_tp_group(0, config.tp_size, init_addr, config.dist_timeout, torch.device(config.device),
                              ranks_alive=lambda: check_started(processes))
    except BaseException:
        for p in processes:
            p.kill()
        raise
    return TPLaunch(group, TPShard(0, config.tp_size, config.ep_size), processes)


def check_started(processes: list[subprocess.Popen], kind: str = "tensor-parallel rank") -> None:
    """Raise when a process this node started (a rank, or a pipeline stage) has exited before the group formed."""
    for index, proc in enumerate(processes, start=1):
        code = proc.poll()
        if code is not None:
            raise RuntimeError(f"{kind} {index} exited with code {code} during start-up")


def run_node_ranks(config) -> int:
    """A node other than 0: run its ranks until node 0 stops them; non-zero when any of them failed."""
    check_tp_size(ModelConfig.from_pretrained(config.model_path), config.tp_size)
    per_node = config.tp_size // config.nnodes
    first = config.node_rank * per_node
    processes = spawn_ranks(config, range(first, first + per_node), config.dist_init_addr)
    codes = [p.wait() for p in processes]
    logger.info("ranks %d..%d exited with %s", first, first + per_node - 1, codes)
    return max(codes, key=abs)


_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)


def share_pool_sizes(group: TPGroup, page_size: int, dtype: torch.dtype,
                     sizes: Optional[list[int]] = None) -> list[int]:
    """Rank 0's KV pool tokens and req_to_token shape (`sizes`), to every rank (their pools match slot for slot).
    Every rank then checks that all ranks' page size and KV dtype are rank 0's: on another node they come from that
    node's own flags, and pools that differ would make every attention read and KV transfer wrong."""
    sizes_t = torch.tensor(sizes if sizes is not None else [0, 0, 0], dtype=torch.int64)
    dist.broadcast(sizes_t, src=0, group=group.setup_group)
    own = torch.tensor([page_size, _POOL_DTYPES.index(dtype) if dtype in _POOL_DTYPES else -1], dtype=torch.int64)
    every = [torch.zeros(2, dtype=torch.int64) for _ in range(group.size)]
    dist.all_gather(every, own, group=group.setup_group)
    shapes = [tuple(t.tolist()) for t in every]
    for rank, shape in enumerate(shapes):
        if shape != shapes[0]:
            raise RuntimeError(f"tensor-parallel rank {rank} has --page-size {shape[0]} and KV dtype "
                               f"{_dtype_name(shape[1])}, rank 0 --page-size {shapes[0][0]} and "
                               f"{_dtype_name(shapes[0][1])}: start every node with the same engine flags")
    return sizes_t.tolist()


def _dtype_name(code: int) -> str:
    return str(_POOL_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_POOL_DTYPES) else "another dtype"


def gather_memory(group: TPGroup, memory: RankMemory) -> list[RankMemory]:
    """Every rank's memory after start-up, in rank order, on every rank."""
    mine = torch.tensor([memory.weight_bytes, memory.kv_pool_bytes, memory.peak_rss_bytes], dtype=torch.int64)
    every = [torch.zeros(3, dtype=torch.int64) for _ in range(group.size)]
    dist.all_gather(every, mine, group=group.setup_group)
    return [RankMemory(r, *t.tolist()) for r, t in enumerate(every)]


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class TPModelRunner(RankSupervisor):
    """Rank 0's model as the ModelWorker sees it: calling it broadcasts the batch, then runs rank 0's shard (the
    other ranks run theirs in the same collectives). Only rank 0 samples; the other ranks never need the ids,
    because every step's input ids come from rank 0's broadcast, so all ranks always run the same tokens."""

    def __init__(self, model, launch: TPLaunch, timeout_s: float):
        self.model = model
        self.attn_backend = model.attn_backend
        self.launch = launch
        self.group = launch.group
        super().__init__("tensor-parallel rank", "tp", launch.processes, timeout_s)

    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        with self._lock:
            if self.fatal is not None:
                raise RuntimeError(self.fatal)
            try:
                send_batch(self.group, fb)
                logits = self.model(fb)
            except Exception as e:
                self._fail(f"tensor-parallel forward failed ({type(e).__name__}: {e})")
                raise
            self._last_sent = time.monotonic()
            return logits

    def update_weights(self, source: WeightSource, payload: bytes, apply_own: Callable[[], None]) -> dict[int, str]:
        """Between two batches: every other rank stages the update (reads or cuts its slices, checks them) and
        answers; only when all answered ok do all apply it (rank 0 via `apply_own`), else all drop it. Returns the
        refusals by rank (empty: applied everywhere). A rank that does not answer within --dist-timeout fails the
        engine, as a stuck forward would."""
        with self._lock:
            if self.fatal is not None:
                raise RuntimeError(self.fatal)
            try:
                send_weights(self.group, source, payload)
                refusals = self._rank_errors()
                if refusals:
                    send_command(self.group, Command.WEIGHTS_DROP)
                else:
                    send_command(self.group, Command.WEIGHTS_COMMIT)
                    apply_own()
                    failed = self._rank_errors()
                    if failed:
                        raise RuntimeError(f"ranks {sorted(failed)} failed to apply a checked update: {failed}")
            except Exception as e:
                self._fail(f"tensor-parallel weight update failed ({type(e).__name__}: {e})")
                raise
            self._last_sent = time.monotonic()
            return refusals

    def control_memory(self, command: Command, tags_mask: int, apply_own: Callable[[], None]) -> None:
        """Between two batches: every rank releases (or restores) the tagged memory, rank 0 via `apply_own`. A rank
        that cannot fails the engine: the ranks would no longer hold the same state."""
        with self._lock:
            if self.fatal is not None:
                raise RuntimeError(self.fatal)
            try:
                send_command(self.group, command, tags_mask)
                apply_own()
                failed = self._rank_errors()
                if failed:
                    raise RuntimeError(f"ranks {sorted(failed)} could not {command.name.lower()}: {failed}")
            except Exception as e:
                self._fail(f"tensor-parallel {command.name.lower()} failed ({type(e).__name__}: {e})")
                raise
            self._last_sent = time.monotonic()

    def move_experts(self, placement: bytes, apply_own: Callable[[], None]) -> None:
        """Between two batches: every rank rearranges its experts for the new placement (EPLB), exchanging expert
        weights point to point; rank 0 via `apply_own`. A rank that cannot fails the engine (the ranks would no
        longer agree on where the experts are)."""
        def move() -> None:
            send_payload(self.group, Command.EXPERTS_MOVE, placement)
            apply_own()
            failed = self._rank_errors()
            if failed:
                raise RuntimeError(f"ranks {sorted(failed)} could not move their experts: {failed}")
        self._exchange("expert move", move)

    def setup_kv_agents(self, setup: bytes, own_pool: bytes) -> list[bytes]:
        """A prefill/decode worker's start-up: every other rank opens its own NIXL agent over its pool shard
        (`setup`: a RankAgentSetup). Returns every rank's RankPool bytes in rank order (rank 0's is `own_pool`)."""
        return self._exchange("KV transfer set-up", lambda: (send_payload(self.group, Command.KV_SETUP, setup),
                                                              gather_bytes(self.group, own_pool))[1])

    def send_kv_command(self, command: bytes) -> None:
        """A RankCommand (serialized) to every other rank, after the forwards sent before it: a prefill rank WRITEs
        a chunk's pages only once the forward that filled them ran."""
        self._exchange("KV transfer command", lambda: send_payload(self.group, Command.KV_COMMAND, command))

    def _exchange(self, what: str, call: Callable[[], object]):
        with self._lock:
            if self.fatal is not None:
                raise RuntimeError(self.fatal)
            try:
                result = call()
            except Exception as e:
                self._fail(f"tensor-parallel {what} failed ({type(e).__name__}: {e})")
                raise
            self._last_sent = time.monotonic()
            return result

    def _rank_errors(self) -> dict[int, str]:
        """Every rank's acknowledgement of the last command: the ranks that answered with an error."""
        return {rank: err for rank, err in enumerate(gather_acks(self.group, None)) if err is not None}

    def _send_keepalive(self) -> None:
        send_command(self.group, Command.KEEPALIVE)

    def _send_stop(self) -> None:
        send_command(self.group, Command.STOP)

    def close(self) -> None:
        """Stop the other ranks (a STOP command when they are alive, else kill) and leave the group."""
        self._stop_processes(destroy_tp_group)
