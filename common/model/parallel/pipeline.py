"""Stage 0 of a pipeline-parallel engine: starts the other stages (with --tp-size, every stage's tensor-parallel
ranks), runs the first layers of every micro-batch and sends it down the pipeline, and receives the last stage's
logits for the scheduler to sample. It watches the other ranks: one that dies or stops answering fails the engine
fast instead of leaving anyone in a receive."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import torch

from tandem.common.model.forward_batch import ForwardBatch
from tandem.common.model.config import ModelConfig
from tandem.common.model.parallel import batch_wire
from tandem.common.model.parallel.batch_wire import Command, pack_batch
from tandem.common.model.parallel.dist import TPGroup, destroy_tp_group, free_init_addr, init_mesh, init_tp_group
from tandem.common.model.parallel.layers import TPShard, check_tp_size
from tandem.common.model.parallel.pipe_wire import TAG_LOGITS, Outbox, recv_tensor, send_command, send_forward
from tandem.common.model.parallel.runner import check_started, rank_device
from tandem.common.model.parallel.supervisor import RankSupervisor
from tandem.common.model.parallel.stages import PipelineStage, StageModel, check_pp_size, logit_rows

logger = logging.getLogger(__name__)


@dataclass
class PipelineLaunch:
    """Stage 0's view of the engine's process groups and the other ranks' processes. `group` spans every rank (the
    pipeline's point-to-point messages, the start-up exchanges); with --tp-size T > 1, `tp` is stage 0's
    tensor-parallel group (global ranks 0..T-1) and each stage s is global ranks s*T..s*T+T-1."""

    group: TPGroup
    stage: PipelineStage
    processes: list[subprocess.Popen] = field(default_factory=list)
    tp: Optional[TPGroup] = None
    ep_size: int = 1

    @property
    def tp_size(self) -> int:
        return self.tp.size if self.tp is not None else 1

    @property
    def shard(self) -> Optional[TPShard]:
        """Rank 0's tensor-parallel shard (tp x pp), else None."""
        return TPShard(0, self.tp.size, self.ep_size) if self.tp is not None else None

    def abort(self) -> None:
        """Start-up failed on stage 0: kill the other ranks instead of letting them wait out the timeout."""
        for proc in self.processes:
            proc.kill()
            proc.wait()
        destroy_tp_group()


def spawn_pipeline_ranks(config, init_addr: str) -> list[subprocess.Popen]:
    """Global ranks 1..tp*pp-1 (rank = stage * tp_size + tp_rank): stage 0's other tensor-parallel ranks run the
    follower (batches broadcast by rank 0), every rank of a later stage the stage worker (batches from the same
    tensor-parallel rank of the stage before)."""
    config_json = json.dumps(dataclasses.asdict(config))
    processes = []
    for rank in range(1, config.tp_size * config.pp_size):
        module = "follower" if rank < config.tp_size else "stage_worker"
        processes.append(subprocess.Popen(
            [sys.executable, "-m", f"tandem.common.model.parallel.{module}", "--rank", str(rank),
             "--init-addr", init_addr, "--device", rank_device(config.device, rank), "--config", config_json],
            env=os.environ.copy()))
    return processes


def rank_kind(tp_size: int) -> str:
    """How messages name the other processes: stages of a pipeline, or global ranks of a tp x pp mesh."""
    return "pipeline stage" if tp_size == 1 else "tp x pp rank"


def launch_stage0(config) -> PipelineLaunch:
    """Start the other ranks (each loads its own layers, or its shard of them, meanwhile) and join as rank 0."""
    model_config = ModelConfig.from_pretrained(config.model_path)
    check_pp_size(model_config, config.pp_size)
    if config.tp_size > 1:
        check_tp_size(model_config, config.tp_size)
    init_addr = free_init_addr()
    processes = spawn_pipeline_ranks(config, init_addr)
    alive = lambda: check_started(processes, rank_kind(config.tp_size))  # noqa: E731
    device = torch.device(config.device)
    try:
        if config.tp_size == 1:
            group, tp = init_tp_group(0, config.pp_size, init_addr, config.dist_timeout, device, alive), None
        else:
            mesh = init_mesh(0, config.tp_size, config.pp_size, init_addr, config.dist_timeout, device, alive)
            group, tp = mesh.world, mesh.tp
    except BaseException:
        for p in processes:
            p.kill()
        raise
    return PipelineLaunch(group, PipelineStage(0, config.pp_size), processes, tp, config.ep_size)


class PipelineRunner(RankSupervisor):
    """Stage 0's model as the scheduler sees it. `launch(fb)` runs stage 0's layers and sends the micro-batch on,
    returning at once; `collect()` waits for the oldest launched micro-batch's logits (the stages run micro-batches
    in launch order, so logits come back in that order). Calling it (`runner(fb)`, the normal loop) does both: one
    micro-batch in flight. Only stage 0 samples: the other stages never need token ids, since each micro-batch's
    input ids enter the pipeline at stage 0.

    Threads: launch/collect on the scheduler thread; a keep-alive thread sends KEEPALIVE down an idle pipeline
    (stages wait in a receive bounded by --dist-timeout); a watchdog records a stage process that exited."""

    def __init__(self, model: StageModel, launch: PipelineLaunch, timeout_s: float, vocab_size: int):
        self.model = model
        self.attn_backend = model.attn_backend
        self.launch_info = launch
        self.group = launch.group.cpu_group
        self.tp = launch.tp  # stage 0's tensor-parallel group (tp x pp): each batch is broadcast to it first
        self.next = launch.tp_size  # stage 1's tensor-parallel rank 0
        self.last = launch.group.size - launch.tp_size  # the last stage's tensor-parallel rank 0 returns logits
        self.vocab_size = vocab_size
        self.device = next(model.parameters()).device
        self.timeout_s = timeout_s
        self._outbox = Outbox(self.group, timeout_s)
        self._in_flight: deque[int] = deque()  # logits rows of each launched micro-batch, oldest first
        # Its _lock sends one message at a time down the pipeline.
        super().__init__(rank_kind(launch.tp_size), "pp", launch.processes, timeout_s)

    def __call__(self, fb: ForwardBatch) -> torch.Tensor:
        self.launch(fb)
        return self.collect()

    def launch(self, fb: ForwardBatch) -> None:
        """Stage 0's layers for `fb` (its attention already planned), then the batch and hidden states to stage 1.
        With tp x pp the batch goes to stage 0's other tensor-parallel ranks first; each of them sends its (equal,
        all-reduced) hidden states to the same tensor-parallel rank of stage 1."""
        with self._lock:
            self._check()
            try:
                header, payload = pack_batch(fb)
                if self.tp is not None:
                    self.tp.broadcast_cpu(header)
                    self.tp.broadcast_cpu(payload)
                hidden = self.model(fb)
                send_forward(self._outbox, self.next, header, payload, hidden)
            except Exception as e:
                self._fail(f"pipeline launch failed ({type(e).__name__}: {e})")
                raise
            self._in_flight.append(logit_rows(fb))
            self._last_sent = time.monotonic()

    def collect(self) -> torch.Tensor:
        """float32 logits of the oldest micro-batch in flight, on this stage's device."""
        self._check()
        rows = self._in_flight[0]
        try:
            logits = recv_tensor(self.group, (rows, self.vocab_size), torch.float32, self.last, TAG_LOGITS,
                                 self.timeout_s)
            with self._lock:
                self._outbox.reap()
        except Exception as e:
            self._fail(f"pipeline stage {self.last} did not return logits ({type(e).__name__}: {e})")
            raise
        self._in_flight.popleft()
        return logits.to(self.device)

    def _check(self) -> None:
        if self.fatal is not None:
            raise RuntimeError(self.fatal)

    def _send_keepalive(self) -> None:
        if self.tp is not None:  # stage 0's other ranks pass it on to their own successors
            batch_wire.send_command(self.tp, Command.KEEPALIVE)
        send_command(self._outbox, self.next, Command.KEEPALIVE)

    def _send_stop(self) -> None:
        if self.tp is not None:
            batch_wire.send_command(self.tp, Command.STOP)
        send_command(self._outbox, self.next, Command.STOP)
        self._outbox.flush()

    def close(self) -> None:
        """Stop the other stages (STOP down the pipeline when they are alive, else kill) and leave the group."""
        self._stop_processes(destroy_tp_group)
